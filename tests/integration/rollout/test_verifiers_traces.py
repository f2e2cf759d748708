"""A `vf-eval` run's saved episodes, written by the real verifiers 0.4.0 (its own `Episode`,
`Trace`, `Reward` models and `write_episode`, in a venv of its own), read back as the gateway's
groups with exactly the totals verifiers' `Trace.reward` gives (services/rollout/gateway/verifiers.py).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from thirdparty import thirdparty_venv

from asyncrl.services.rollout.gateway.verifiers import read_traces

# Two tasks × two rollouts with rubric rewards of different weights, and one rollout that
# errored (verifiers marks its episode not ok): that one must come back as failed, not scored.
# vf-eval itself stamps no `group` (its runner plans num_rollouts per task and never builds a
# GroupInfo), so task t-b's episodes have none and group by the task's key; t-a's carry one.
WRITER = r"""
import json, sys
from pathlib import Path
from verifiers.v1.episode import Episode, GroupInfo
from verifiers.v1.trace import AgentInfo, Error, Reward, Trace, TraceTask
from verifiers.v1.utils.trace_store import write_episode

out, expected = Path(sys.argv[1]), {}
plan = [("t-a", 1.0, 0.25, True), ("t-a", 0.0, 1.0, True), ("t-b", 0.5, 0.75, True),
        ("t-b", 1.0, 0.0, True), ("t-b", 1.0, 1.0, False)]
for key, correct, style, ok in plan:
    task = TraceTask(type="QA", data={}, key=key)
    rewards = {"correct": Reward(score=correct, weight=2.0), "style": Reward(score=style)}
    trace = Trace(task=task, agent=AgentInfo(config={}), rewards=rewards, ok=ok)
    errors = [] if ok else [Error(type="ModelError", message="upstream 500")]
    group = "grp-" + key if key == "t-a" else None
    write_episode(out, Episode(task=task, group=group and GroupInfo(id=group), ok=ok,
                               errors=errors, traces=[trace]))
    expected[trace.id] = {"group": group or key, "reward": trace.reward, "ok": ok}
print(json.dumps(expected))
"""


# `make test-extended` (.ci/run's second stage): builds verifiers' venv
@pytest.mark.extended
def test_episodes_become_groups_with_verifiers_rewards(tmp_path):
    python = thirdparty_venv("verifiers", ["verifiers==0.4.0"])
    run = subprocess.run(
        [str(python), "-c", WRITER, str(tmp_path)], capture_output=True, text=True, timeout=120, check=True
    )
    expected = json.loads(run.stdout.strip().splitlines()[-1])

    traces = read_traces((tmp_path / "traces.jsonl").read_text().splitlines())

    got = {r.trace_id: (g.key, r.reward) for g in traces.groups for r in g.rollouts}
    want = {tid: (e["group"], e["reward"]) for tid, e in expected.items() if e["ok"]}
    assert got == want
    assert sorted(r for _, r in got.values()) == [1.0, 1.75, 2.0, 2.25]  # 2·correct + style
    assert [(g.key, len(g.rollouts)) for g in traces.groups] == [("grp-t-a", 2), ("t-b", 2)]
    [bad] = [tid for tid, e in expected.items() if not e["ok"]]
    assert traces.failed == [(bad, "rollout failed in verifiers: upstream 500")]
    # ... and in its own group's failures, so the group it belongs to fails whole.
    assert [g.failed for g in traces.groups] == [[], [(bad, "rollout failed in verifiers: upstream 500")]]


def test_unreadable_lines_are_failed_with_why():
    lines = ['{"id": "e1", "task": {}, "traces": []}', "not json", "", '{"task": {"key": "k"}}']
    traces = read_traces(lines)
    assert traces.groups == []
    assert [where for where, _ in traces.failed] == ["line 1", "line 2", "line 4"]
    assert "neither key nor hash" in traces.failed[0][1]
