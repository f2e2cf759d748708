"""`/v1/rollouts`: submit a job (202), read its progress, cancel it.

A submission is refused before anything is queued or generated (each refusal counted in
`asyncrl_rollout_requests_rejected_total{reason}`): a body that does not validate (422
`invalid_body`), a verifier the reward service does not serve (400 `unknown_verifier`), spec
arguments the verifier's own model refuses (422 `invalid_reward_spec`, naming the prompt and
the field), sampling params the engine refuses (400 `unsupported_sampling_params`, for the
reference engine), limits (400: context length, max_new_tokens cap, vocabulary), a reused
idempotency key (409 `conflict`), an unreachable reward service (503). See `intake.py`.

A job's state: `queued` → `running` → `done` | `failed` (no group gave a scored sample: all
refused by the engine, or all unscored) | `cancelling` → `cancelled`.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from proto.rollout import RolloutAccepted, RolloutProgress, RolloutRequest
from services.rollout import metrics as m
from services.rollout.deps import ServiceDep
from services.rollout.intake import BadRequest, body_hash, job_id_for
from services.rollout.reward_client import VerifiersUnavailable
from services.rollout.routes.errors import ERRORS
from services.rollout.routes.errors import refuse as _refuse
from services.rollout.service import RolloutService

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"])

TRAINER_FIELDS = ("acked", "dropped", "withheld", "zero_spread")
MAX_ERRORS_SHOWN = 10
PHASES = ("generating", "scoring", "buffered", "failed", "cancelled")


@router.post("", status_code=202, response_model=RolloutAccepted, responses=ERRORS)
async def submit(body: RolloutRequest, service: ServiceDep) -> RolloutAccepted:
    buf = service.api_buf
    job_id = job_id_for(service.settings.run, body)
    digest = body_hash(body)
    known = await run_in_threadpool(buf.job_progress, job_id)
    duplicate = "info:body_hash" in known
    if duplicate and known["info:body_hash"] != digest:
        raise _refuse(
            409, f"idempotency key {body.idempotency_key!r} was used for a different request", "conflict"
        )
    try:
        verifiers = await service.rewards.verifiers()
    except VerifiersUnavailable as exc:
        raise _refuse(503, str(exc), "reward_unavailable") from exc
    engine_kind = await service.engine_kind()
    try:
        jobs = await run_in_threadpool(service.intake.build, body, job_id, verifiers, engine_kind)
    except BadRequest as exc:
        raise _refuse(exc.status, str(exc), exc.reason) from exc

    def enqueue() -> int:
        if not duplicate:
            buf.set_job_info(job_id, groups=len(jobs), created_at=time.time(), body_hash=digest)
        # Re-enqueueing a replayed request is a no-op per group, and completes a submission
        # that was interrupted half-way.
        return buf.enqueue_jobs(jobs)

    new = await run_in_threadpool(enqueue)
    if not duplicate:
        m.JOBS_SUBMITTED.inc()
    m.GROUPS_SUBMITTED.inc(new)
    return RolloutAccepted(job_id=job_id, groups=len(jobs), duplicate=duplicate)


@router.get("/{job_id}", response_model=RolloutProgress, responses=ERRORS)
async def progress(job_id: str, service: ServiceDep) -> RolloutProgress:
    return await run_in_threadpool(_progress, service, job_id)


@router.delete("/{job_id}", response_model=RolloutProgress, responses=ERRORS)
async def cancel(job_id: str, service: ServiceDep) -> RolloutProgress:
    def run() -> RolloutProgress:
        _progress(service, job_id)  # 404 for an unknown job
        service.api_buf.cancel_job(job_id)
        m.JOBS_CANCELLED.inc()
        return _progress(service, job_id)

    return await run_in_threadpool(run)


def _progress(service: RolloutService, job_id: str) -> RolloutProgress:
    buf = service.api_buf
    raw = buf.job_progress(job_id)
    if "info:groups" not in raw:
        raise _refuse(404, f"no rollout job {job_id[:80]!r}", "unknown_job")
    counts = dict.fromkeys(PHASES, 0)
    trainer: dict[str, int] = {}
    errors: dict[str, str] = {}
    unscored, unscored_samples = 0, {}
    for key, value in raw.items():
        if key.startswith("info:phase:"):
            counts[value] = counts.get(value, 0) + 1
        elif key.startswith("info:error:") and len(errors) < MAX_ERRORS_SHOWN:
            errors[key.removeprefix("info:error:")] = value
        elif key.startswith("info:unscored:"):
            statuses = _statuses(value)
            unscored += bool(statuses) and statuses.get("scored", 0) == 0
            for status, n in statuses.items():
                if status != "scored":
                    unscored_samples[status] = unscored_samples.get(status, 0) + n
        elif not key.startswith("info:") and value.lstrip("-").isdigit():
            trainer[key] = int(value)
    groups = int(raw["info:groups"])
    queued = groups - sum(counts[p] for p in PHASES)
    cancel_requested = buf.job_cancelled(job_id)
    finished = counts["buffered"] + counts["failed"] + counts["cancelled"]
    if finished == groups:
        if cancel_requested and counts["cancelled"]:
            state = "cancelled"
        else:  # `failed` when not one group gave the trainer a reward to learn from
            state = "done" if counts["buffered"] - unscored > 0 else "failed"
    elif cancel_requested:
        state = "cancelling"
    else:
        state = "queued" if queued == groups else "running"
    consumed = sum(trainer.get(k, 0) for k in TRAINER_FIELDS) + sum(
        v for k, v in trainer.items() if k not in TRAINER_FIELDS
    )
    return RolloutProgress(
        job_id=job_id,
        state=state,
        groups=groups,
        queued=queued,
        **counts,
        trained=trainer.get("acked", 0),
        dropped=trainer.get("dropped", 0),
        withheld=trainer.get("withheld", 0),
        zero_spread=trainer.get("zero_spread", 0),
        in_buffer=max(counts["buffered"] - consumed, 0),
        created_at=float(raw.get("info:created_at", 0.0)),
        cancel_requested=cancel_requested,
        unscored=unscored,
        unscored_samples=unscored_samples,
        other={k: v for k, v in trainer.items() if k not in TRAINER_FIELDS},
        errors=errors,
    )


def _statuses(value: str) -> dict[str, int]:
    """An `unscored:<gid>` record (samples by reward status, JSON); {} if unreadable."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    return {str(k): v for k, v in parsed.items() if isinstance(v, int) and not isinstance(v, bool)}
