"""The rollout service's settings (`services/rollout/config.py`): URL lists and the bounds between fields."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from asyncrl.services.rollout.config import RolloutSettings


def test_settings_parse_engine_url_lists(tok_dir):
    s = RolloutSettings(tokenizer=tok_dir, engine_urls="http://a:1, http://b:2/")
    assert s.engine_url_list == ["http://a:1", "http://b:2"] and s.admin_url_list == s.engine_url_list
    s = RolloutSettings(
        tokenizer=tok_dir, engine_urls=json.dumps(["http://r:3"]), engine_admin_urls="http://w:4"
    )
    assert (s.engine_url_list, s.admin_url_list) == (["http://r:3"], ["http://w:4"])
    with pytest.raises(ValidationError, match="http"):
        RolloutSettings(tokenizer=tok_dir, engine_urls="a:1")
    with pytest.raises(ValidationError, match="recover_idle_s / 3"):
        RolloutSettings(tokenizer=tok_dir, heartbeat_s=5, recover_idle_s=10)


def test_a_router_url_is_the_generation_url_and_the_workers_join_it(tok_dir):
    """With a router_url the rollout generates through the router unless told otherwise, and
    only the listed workers take weight updates (the router takes none): maybe none at start."""
    s = RolloutSettings(tokenizer=tok_dir, router_url="http://r:9/")
    assert (s.router_url, s.engine_url_list, s.admin_url_list) == ("http://r:9", ["http://r:9"], [])
    s = RolloutSettings(
        tokenizer=tok_dir, router_url="http://r:9", engine_urls="http://g:1", engine_admin_urls="http://w:2"
    )
    assert (s.engine_url_list, s.admin_url_list) == (["http://g:1"], ["http://w:2"])
    with pytest.raises(ValidationError, match="one URL"):
        RolloutSettings(tokenizer=tok_dir, router_url="http://r:9,http://r:10")
    with pytest.raises(ValidationError, match="http"):
        RolloutSettings(tokenizer=tok_dir, router_url="r:9")
    with pytest.raises(ValidationError, match="not one of its own workers"):
        RolloutSettings(
            tokenizer=tok_dir, router_url="http://r:9", engine_admin_urls="http://w:2,http://r:9/"
        )


def test_openenv_servers_come_from_the_toml_table(tok_dir, tmp_path):
    from asyncrl.services.runtime.config import load_settings

    config = tmp_path / "rollout.toml"
    config.write_text(
        f'[rollout]\ntokenizer = "{tok_dir}"\n'
        '[rollout.openenv.counter]\nurl = "ws://127.0.0.1:8000/"\nmax_sessions = 4\n'
        '[rollout.openenv.echo]\nurl = "http://127.0.0.1:8001"\njudges = false\n'
    )
    s = load_settings(RolloutSettings, ["--config", str(config)], prog="rollout", section="rollout")
    counter, echo = s.openenv["counter"], s.openenv["echo"]
    assert (counter.url, counter.websocket, counter.http_url, counter.max_sessions) == (
        "ws://127.0.0.1:8000", True, "http://127.0.0.1:8000", 4)  # fmt: skip
    assert (echo.websocket, echo.http_url, echo.judges) == (False, "http://127.0.0.1:8001", False)
    with pytest.raises(ValidationError, match="ws\\(s\\):// or http\\(s\\)://"):
        RolloutSettings(tokenizer=tok_dir, openenv={"x": {"url": "file:///etc/passwd"}})
    with pytest.raises(ValidationError, match="a tool name"):
        RolloutSettings(tokenizer=tok_dir, openenv={"no spaces": {"url": "ws://h:1"}})


def test_automatic_evaluation_sets_by_name(tok_dir, tmp_path, monkeypatch):
    """`eval_file` (named `eval_name`) and `[rollout.eval_sets]` are evaluated together at every
    `eval_every` versions, each under its own name; the TOML table and the env's JSON agree."""
    from asyncrl.services.runtime.config import load_settings

    config = tmp_path / "rollout.toml"
    config.write_text(
        f'[rollout]\ntokenizer = "{tok_dir}"\neval_file = "/d/easy.jsonl"\neval_every = 10\n'
        '[rollout.eval_sets]\nheldout-hard = "/d/hard.jsonl"\n'
    )
    s = load_settings(RolloutSettings, ["--config", str(config)], prog="rollout", section="rollout")
    assert s.auto_eval_files == {"heldout": "/d/easy.jsonl", "heldout-hard": "/d/hard.jsonl"}
    monkeypatch.setenv("ASYNCRL_ROLLOUT_EVAL_SETS", '{"words": "/d/words.jsonl"}')
    s = RolloutSettings(tokenizer=tok_dir, eval_every=5)
    assert s.auto_eval_files == {"words": "/d/words.jsonl"}  # eval_sets alone is enough
    monkeypatch.delenv("ASYNCRL_ROLLOUT_EVAL_SETS")
    with pytest.raises(ValidationError, match="eval_file \\(or eval_sets\\) and eval_every > 0"):
        RolloutSettings(tokenizer=tok_dir, eval_sets={"hard": "/d/hard.jsonl"})  # no eval_every
    with pytest.raises(ValidationError, match="eval_file \\(or eval_sets\\) and eval_every > 0"):
        RolloutSettings(tokenizer=tok_dir, eval_every=5)  # nothing to evaluate
    with pytest.raises(ValidationError, match="the name of eval_file's evaluations"):
        RolloutSettings(
            tokenizer=tok_dir, eval_file="/d/a.jsonl", eval_every=5, eval_sets={"heldout": "/d/b.jsonl"}
        )
    with pytest.raises(ValidationError, match="Prometheus label"):
        RolloutSettings(tokenizer=tok_dir, eval_every=5, eval_sets={"no spaces": "/d/b.jsonl"})
