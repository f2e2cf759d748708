"""`asyncrl verifiers`' own parts (services/ops/vf_eval.py): what it adds to the user's `vf-eval`
command, what it refuses to override, and how it reads a `traces.jsonl` that is still growing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.services.ops.vf_eval import (
    Pending,
    TraceTail,
    group_key,
    merge,
    parse_args,
    trace_key,
    vf_command,
)


def episode(key: str, trace_id: str, ok: bool = True, score: float = 1.0) -> str:
    trace = {"id": trace_id, "ok": ok, "rewards": {"r": {"score": score, "weight": 2.0}}}
    errors = [] if ok else [{"message": "upstream 400"}]
    return json.dumps({"task": {"key": key}, "ok": ok, "errors": errors, "traces": [trace]})


def test_the_command_gets_only_the_gateway_and_output_flags(monkeypatch):
    monkeypatch.delenv("ASYNCRL_API_TOKEN", raising=False)
    args, command = parse_args(["--gateway", "http://gw:1", "--run", "r1", "--", "vf-eval", "env", "-r", "4"])
    assert (args.gateway, args.run, command) == ("http://gw:1", "r1", ["vf-eval", "env", "-r", "4"])
    assert vf_command(command, "http://gw:1/v1/runs/r1/v1", Path("out"), "r1") == [
        "vf-eval", "env", "-r", "4",
        "--client.base-url", "http://gw:1/v1/runs/r1/v1", "--output-dir", "out", "--run.dir", "r1",
    ]  # fmt: skip
    monkeypatch.setenv("ASYNCRL_API_TOKEN", "t" * 32)
    assert vf_command(["vf-eval"], "u", Path("o"), "r")[-2:] == ["--client.api-key-var", "ASYNCRL_API_TOKEN"]


@pytest.mark.parametrize("flag", ["--client.base-url=http://elsewhere", "-o", "--run.dir"])
def test_a_flag_the_wrapper_sets_is_refused_in_the_command(flag):
    with pytest.raises(SystemExit, match=f"sets {flag.split('=')[0]} itself"):
        parse_args(["--gateway", "http://gw:1", "--", "vf-eval", "env", flag, "x"])


def test_a_half_written_line_waits_for_the_next_read(tmp_path):
    path = tmp_path / "traces.jsonl"
    tail = TraceTail(path)
    assert tail.new_lines() == []  # not written yet
    path.write_text(episode("k", "a") + "\n" + episode("k", "b")[:10])
    assert tail.new_lines() == [episode("k", "a")]
    with path.open("a") as f:
        f.write(episode("k", "b")[10:] + "\n")
    assert tail.new_lines() == [episode("k", "b")]
    assert (tail.new_lines(), tail.lines) == ([], 2)


def test_rollouts_gather_by_task_across_reads_failed_ones_included():
    pending: dict[str, Pending] = {}
    unreadable: list = []
    merge(pending, unreadable, [episode("k1", "a", score=0.5), episode("k2", "c")])
    merge(pending, unreadable, [episode("k1", "b", ok=False), "not json"], first_line=3)
    assert {k: v.rollouts for k, v in pending.items()} == {
        "k1": [("a", 1.0, None), ("b", None, "rollout failed in verifiers: upstream 400")],
        "k2": [("c", 2.0, None)],
    }
    assert [where for where, _ in unreadable] == ["line 4"]


def test_ids_the_gateway_would_refuse_are_hashed_stably():
    assert group_key("a" * 64) == "a" * 64
    assert group_key("task with spaces") == group_key("task with spaces") != "task with spaces"
    assert len(group_key("x" * 65)) == 32
    assert trace_key("line 3").startswith("unreadable-") and trace_key("abc") == "abc"
