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
