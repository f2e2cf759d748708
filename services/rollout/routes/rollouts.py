"""`/v1/rollouts`: submit a job (202), read its progress, cancel it."""

from __future__ import annotations

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
    try:
        jobs = await run_in_threadpool(service.intake.build, body, job_id, verifiers)
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
        raise _refuse(404, f"no rollout job {job_id!r}", "unknown_job")
    counts = dict.fromkeys(PHASES, 0)
    trainer: dict[str, int] = {}
    errors: dict[str, str] = {}
    for key, value in raw.items():
        if key.startswith("info:phase:"):
            counts[value] = counts.get(value, 0) + 1
        elif key.startswith("info:error:") and len(errors) < MAX_ERRORS_SHOWN:
            errors[key.removeprefix("info:error:")] = value
        elif not key.startswith("info:") and value.lstrip("-").isdigit():
            trainer[key] = int(value)
    groups = int(raw["info:groups"])
    queued = groups - sum(counts[p] for p in PHASES)
    cancel_requested = buf.job_cancelled(job_id)
    finished = counts["buffered"] + counts["failed"] + counts["cancelled"]
    if finished == groups:
        state = "cancelled" if cancel_requested and counts["cancelled"] else "done"
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
        other={k: v for k, v in trainer.items() if k not in TRAINER_FIELDS},
        errors=errors,
    )
