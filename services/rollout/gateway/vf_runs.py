"""verifiers runs through the gateway (docs/architecture.md §12): `vf-eval`, unmodified, with its
client's base URL at `/v1/runs/{run}/v1`, and its groups buffered with verifiers' own rewards.

    POST /v1/runs/{run}/v1/chat/completions   OpenAI body; the rollout is `X-Session-ID`
    POST /v1/runs/{run}/groups                 {group_id, rollouts: [{trace_id, reward | error}]}

verifiers' eval client sends each rollout's trace id as `X-Session-ID` on every model call of
that rollout, and nothing that says which task (group) the rollout belongs to: that is known
only from its `traces.jsonl` afterwards. So a rollout's calls are recorded as one session,
`{run}.t.{trace}`, created on its first call in a holding group of its own that never completes
by itself (buffer/gathering.py), and `asyncrl verifiers` (services/ops/vf_eval.py), reading the
traces as they are written, names each group's rollouts with their rewards. Then the group
takes its admission slot (the scheduler's rule, as the gateway's other groups), its sessions
are gathered into the group `{run}.g.{group}`, closed with verifiers' rewards and put.

A group with a failed rollout (verifiers' error, a rollout that made no call here, or fewer
rollouts named than the run's `num_rollouts`) fails whole: its sessions are dropped and every rollout of it counted
(`asyncrl_rollout_vf_rollouts_failed_total`), never trained on with a reward verifiers did not
give. The same request again answers as the first (a retried close buffers nothing twice).

Not guaranteed: admission is taken when the group is named, after its rollouts ran, so a full
buffer holds back the group's put, not `vf-eval`'s generation (the tokens' staleness is in the
group's `min_version` all the same). A rollout whose session idles past
`gateway_session_ttl_s` before its group is named expires (counted as an expired gateway group)
and its group then fails as `no_session`.
"""

from __future__ import annotations

import asyncio
import logging
import re

from asyncrl.buffer.gathering import drop_holding, gather, open_holding
from asyncrl.proto.gateway import ID_PATTERN, SessionReward
from asyncrl.proto.vf_runs import MAX_RUN_ID_CHARS, MAX_TRACE_ID_CHARS, VfGroupClosed, VfGroupRequest
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.gateway.chat import Gateway, GatewayError
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

_ID = re.compile(ID_PATTERN)
# GATHER's refusals: the reason a group fails, counted per rollout.
REFUSALS = {
    "unknown": ("no_session", "made no model call through this run (or its session expired)"),
    "empty": ("no_session", "made no model call through this run"),
    "taken": ("session_taken", "is closed or in another group already"),
}


def session_id(run: str, trace_id: str) -> str:
    """The gateway session of one verifiers rollout."""
    return f"{run}.t.{trace_id}"


def group_id(run: str, key: str) -> str:
    return f"{run}.g.{key}"


def check_run(run: str) -> None:
    if not (_ID.match(run) and len(run) <= MAX_RUN_ID_CHARS):
        raise GatewayError(
            400,
            f"run id {run[:128]!r} must match {ID_PATTERN}, at most {MAX_RUN_ID_CHARS} chars",
            "invalid_run_id",
        )


async def ensure_rollout(gateway: Gateway, run: str, trace_id: str | None) -> str:
    """The session of the rollout `trace_id` (verifiers' `X-Session-ID`), opened on its first call."""
    check_run(run)
    if trace_id is None:
        raise GatewayError(
            400,
            "a verifiers run needs each call's rollout in X-Session-ID (verifiers sends it)",
            "no_trace_id",
        )
    if not (_ID.match(trace_id) and len(trace_id) <= MAX_TRACE_ID_CHARS):
        raise GatewayError(
            400, f"X-Session-ID {trace_id[:128]!r} must match {ID_PATTERN}, at most {MAX_TRACE_ID_CHARS} chars",
            "invalid_session_id",
        )  # fmt: skip
    sid = session_id(run, trace_id)
    known = await asyncio.to_thread(gateway.store.session, sid)
    if not known and await asyncio.to_thread(open_holding, gateway.store, sid) == "ok":
        m.GATEWAY_SESSIONS.labels("opened").inc()
    return sid


async def close_group(gateway: Gateway, run: str, body: VfGroupRequest) -> VfGroupClosed:
    """Buffer the group with verifiers' rewards, or fail it whole (module docstring)."""
    check_run(run)
    gid = group_id(run, body.group_id)
    traces = [r.trace_id for r in body.rollouts]
    if len(set(traces)) != len(traces):
        raise GatewayError(400, f"group {body.group_id!r} names a rollout twice", "duplicate_rollout")
    sids = [session_id(run, t) for t in traces]
    errors = [(r.trace_id, r.error) for r in body.rollouts if r.error is not None]
    if errors:
        trace, error = errors[0]
        return await _fail(
            gateway,
            body.group_id,
            gid,
            sids,
            "verifiers_error",
            len(errors),
            f"rollout {trace} failed in verifiers: {error}",
        )
    missing = (body.num_rollouts or len(sids)) - len(sids)
    if missing:
        why = f"{len(sids)} of the run's {body.num_rollouts} rollouts per task were named"
        if missing < 0:
            raise GatewayError(400, f"group {body.group_id!r}: {why}", "group_size")
        m.VF_ROLLOUTS_FAILED.labels("missing").inc(missing)
        return await _fail(gateway, body.group_id, gid, sids, "group_failed", 0, why)
    state = await asyncio.to_thread(gateway.store.session, sids[0])
    if state.get("group_id") != gid:  # not gathered by an earlier request: take a slot and gather
        try:
            submit_version = await gateway.admit(gid)
        except GatewayError as exc:
            if exc.reason != "group_complete":
                raise
            m.VF_GROUPS.labels("duplicate").inc()  # put long ago: its sessions have expired since
            return VfGroupClosed(group_id=body.group_id, group="duplicate")
        answer = await asyncio.to_thread(
            gather, gateway.store, gid, sids, submit_version, body.prompt_id or ""
        )
        if answer[0] in REFUSALS:
            reason, why = REFUSALS[answer[0]]
            await asyncio.to_thread(gateway.admission.release, gid)
            return await _fail(
                gateway,
                body.group_id,
                gid,
                sids,
                reason,
                1,
                f"rollout {answer[1].rsplit('.t.', 1)[-1]} {why}",
            )
        if answer[0] == "exists" and answer[1] == "put":
            m.VF_GROUPS.labels("duplicate").inc()
            return VfGroupClosed(group_id=body.group_id, group="duplicate")
    return VfGroupClosed(group_id=body.group_id, group=await _close_all(gateway, gid, sids, body))


async def _close_all(gateway: Gateway, gid: str, sids: list[str], body: VfGroupRequest) -> str:
    """Close each gathered session with its reward; the close that completes the group puts it.
    Sessions closed by an earlier request are skipped."""
    outcome = "open"
    for sid, rollout in zip(sids, body.rollouts):
        try:
            closed = await gateway.close_session(sid, SessionReward(reward=rollout.reward))
        except GatewayError as exc:
            if exc.reason != "session_closed":
                raise
            continue
        outcome = closed.group
    if outcome == "open":  # every session was closed by an earlier request, which put the group
        outcome = "duplicate"
    m.VF_GROUPS.labels(outcome).inc()
    log_event(log, "verifiers group closed", group_id=gid, rollouts=len(sids), group=outcome)
    return outcome


async def _fail(
    gateway: Gateway, key: str, gid: str, sids: list[str], reason: str, failed: int, why: str
) -> VfGroupClosed:
    """Drop every session of the group still waiting (their calls are discarded) and count each
    rollout: `failed` of them under `reason`, the rest as the siblings of a failed group."""
    dropped = 0
    for sid in sids:
        dropped += await asyncio.to_thread(drop_holding, gateway.store, sid)
    if failed:
        m.VF_ROLLOUTS_FAILED.labels(reason).inc(failed)
    if len(sids) > failed:
        m.VF_ROLLOUTS_FAILED.labels("group_failed").inc(len(sids) - failed)
    m.VF_GROUPS.labels("failed").inc()
    log_event(log, "verifiers group failed", logging.WARNING, group_id=gid, reason=why, dropped=dropped)
    return VfGroupClosed(group_id=key, group="failed", reason=why, dropped=dropped)
