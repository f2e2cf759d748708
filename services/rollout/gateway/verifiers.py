"""What a `vf-eval` run (verifiers 0.4.0) scored, read back from its `traces.jsonl`, as the
gateway's groups and rewards.

verifiers' eval client sends each rollout's trace id as `X-Session-ID` on every model call of
that rollout (verifiers/v1/clients/client.py, `SESSION_ID_HEADER`), and `vf-eval` writes one
JSON trace per rollout to `<output_dir>/<run.dir>/traces.jsonl` (v1/utils/trace_store.py).
Each line is an `Episode` (v1/episode.py): its `group.id` (the rollouts of one task), its `task`
(`key`, else content `hash`), `ok`, and its agents' `traces`; a trace holds its `id` (the same
trace id), its `rewards` (`{name: {score, weight}}` or null) and `ok`. verifiers'
own total is `Trace.reward` = the sum of `score * weight` over the non-null rewards, so the
trace id keys a rollout's calls to one sample, the group id puts the `num_rollouts` rollouts of
one task into one group, and the reward is exactly the number verifiers computed.

Plain JSON lines: nothing here unpickles or imports verifiers. A trace that is not ok (the
rollout errored) or cannot be read is returned as `failed`, with why, for the caller to count
and to abandon its session rather than train on a reward verifiers never gave.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VfRollout:
    """One rollout: its trace id (the session's external key) and verifiers' total reward."""

    trace_id: str
    reward: float


@dataclass
class VfGroup:
    """The rollouts of one group (one task), in the order `vf-eval` wrote them, and those of
    its rollouts that failed (trace id, why): a group with any fails whole."""

    key: str
    rollouts: list[VfRollout] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class VfTraces:
    """A run's traces split into groups by task, and the rollouts left out with why."""

    groups: list[VfGroup]
    failed: list[tuple[str, str]]  # (trace id or line number, reason)


def trace_reward(rewards: dict) -> float:
    """verifiers' `Trace.reward`: the sum of `score * weight` (weight 1 by default), null skipped."""
    total = 0.0
    for name, reward in rewards.items():
        if reward is None:
            continue
        if not isinstance(reward, dict) or not isinstance(reward.get("score"), int | float):
            raise ValueError(f"reward {name!r} has no numeric score: {reward!r}")
        weight = reward.get("weight", 1.0)
        if not isinstance(weight, int | float):
            raise ValueError(f"reward {name!r} has a non-numeric weight: {weight!r}")
        total += float(reward["score"]) * float(weight)
    return total


def _group_key(episode: dict) -> str:
    """The episode's group: `vf-eval`'s `group.id` when it grouped, else the task's key/hash."""
    group = episode.get("group") or {}
    task = episode["task"]
    key = group.get("id") or task.get("key") or task.get("hash")
    if not key:
        raise ValueError("the episode has no group id and its task neither key nor hash")
    return str(key)


def _failure(record: dict) -> str | None:
    if record.get("ok", False):
        return None
    errors = record.get("errors") or []
    return f"rollout failed in verifiers: {errors[-1].get('message', 'error') if errors else 'not ok'}"


def read_traces(lines: Iterable[str], first_line: int = 1) -> VfTraces:
    """Group a `traces.jsonl`'s episodes; every trace lands in its group's `rollouts` or in
    `failed` (and, when its episode named its group, in that group's `failed` too). Lines are
    numbered from `first_line` (a file read in pieces)."""
    groups: dict[str, VfGroup] = {}
    failed: list[tuple[str, str]] = []
    for number, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            episode = json.loads(line)
            key = _group_key(episode)
            traces = episode["traces"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            failed.append((f"line {number}", f"unreadable episode: {type(exc).__name__}: {exc}"))
            continue
        broken = _failure(episode)
        for trace in traces:
            where = str(trace.get("id", f"line {number}")) if isinstance(trace, dict) else f"line {number}"
            try:
                reason = broken or _failure(trace)
                if reason is None:
                    reward = trace_reward(trace.get("rewards") or {})
            except (ValueError, TypeError, AttributeError) as exc:
                reason = f"unreadable trace: {type(exc).__name__}: {exc}"
            group = groups.setdefault(key, VfGroup(key))
            if reason is not None:
                failed.append((where, reason))
                group.failed.append((where, reason))
                continue
            group.rollouts.append(VfRollout(where, reward))
    return VfTraces(list(groups.values()), failed)
