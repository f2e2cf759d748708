"""`/v1/rollouts`: submit a job (202), read its progress, cancel it.

A submission is refused before anything is queued or generated (each refusal counted in
`asyncrl_rollout_requests_rejected_total{reason}`): a body that does not validate (422
`invalid_body`), a verifier the reward service does not serve (400 `unknown_verifier`), spec
arguments the verifier's own model refuses (422 `invalid_reward_spec`, naming the prompt and
the field), sampling params the engine refuses (400 `unsupported_sampling_params`, for the
reference engine), limits (400: context length, max_new_tokens cap, vocabulary), a reused
idempotency key (409 `conflict`), an unreachable reward service (503). See `intake.py`.

A job's state (`proto.states.JobState`): `queued` → `running` → `done` | `failed` (no group
gave a scored sample: all refused by the engine, or all unscored) | `cancelling` → `cancelled`;
it is worked out from the job's record (`buffer.Jobs.progress`), which counts its groups by
`GroupState`.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from asyncrl.proto.rollout import RolloutAccepted, RolloutProgress, RolloutRequest
from asyncrl.proto.states import JOB_ENDS, GroupState, JobState
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.environments import EnvironmentFailed
from asyncrl.services.rollout.clients.rewards import VerifiersUnavailable
from asyncrl.services.rollout.deps import ServiceDep
from asyncrl.services.rollout.groups.openenv import ActionTool
from asyncrl.services.rollout.intake import BadRequest, body_hash, job_id_for
from asyncrl.services.rollout.routes.errors import ERRORS
from asyncrl.services.rollout.routes.errors import refuse as _refuse
from asyncrl.services.rollout.service import RolloutService

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"])

# Where the rollout reports a group (a group with no report is still `queued`).
ROLLOUT_STATES = (
    GroupState.generating,
    GroupState.scoring,
    GroupState.buffered,
    GroupState.failed,
    GroupState.cancelled,
)
# How buffered groups left the buffer, each a field of the answer; any other exit goes to `other`.
TRAINER_EXITS = (
    GroupState.trained,
    GroupState.dropped,
    GroupState.withheld,
    GroupState.zero_spread,
    GroupState.dead_lettered,
)
MAX_ERRORS_SHOWN = 10


@router.post("", status_code=202, response_model=RolloutAccepted, responses=ERRORS)
async def submit(body: RolloutRequest, service: ServiceDep) -> RolloutAccepted:
    jobs = service.jobs
    job_id = job_id_for(service.settings.run, body)
    digest = body_hash(body)
    known = await run_in_threadpool(jobs.progress, job_id)
    duplicate = known is not None
    if duplicate and known.body_hash != digest:
        raise _refuse(
            409, f"idempotency key {body.idempotency_key!r} was used for a different request", "conflict"
        )
    try:
        verifiers = await service.rewards.verifiers()
    except VerifiersUnavailable as exc:
        raise _refuse(503, str(exc), "reward_unavailable") from exc
    engine_kind = await service.engine_kind()
    tools = await _check_episode(service, body) if body.episode is not None else None
    try:
        group_jobs = await run_in_threadpool(
            service.intake.build, body, job_id, verifiers, engine_kind, tools
        )
    except BadRequest as exc:
        raise _refuse(exc.status, str(exc), exc.reason) from exc

    def enqueue() -> int:
        if not duplicate:
            jobs.describe(job_id, groups=len(group_jobs), body_hash=digest)
        # Re-enqueueing a replayed request is a no-op per group, and completes a submission
        # that was interrupted half-way.
        return jobs.enqueue(group_jobs)

    new = await run_in_threadpool(enqueue)
    if not duplicate:
        m.JOBS_SUBMITTED.inc()
    m.GROUPS_SUBMITTED.inc(new)
    return RolloutAccepted(job_id=job_id, groups=len(group_jobs), duplicate=duplicate)


async def _check_episode(service: RolloutService, body: RolloutRequest) -> list[dict] | None:
    """The job's environment is served, and something judges its episodes (the environment,
    or a reward_spec for every prompt); its tools for the chat template (none without tools)."""
    episode = body.episode
    if episode.kind == "openenv":
        return await _check_openenv(service, body)
    try:
        listing = await service.envs.environments()
    except EnvironmentFailed as exc:
        raise _refuse(503, str(exc), "environments_unavailable") from exc
    info = listing.environments.get(episode.environment)
    if info is None:
        raise _refuse(
            400,
            f"unknown environment {episode.environment!r}; served: {sorted(listing.environments)}",
            "unknown_environment",
        )
    if not info.judges and body.reward_spec is None and any(p.reward_spec is None for p in body.prompts):
        raise _refuse(
            400,
            f"environment {episode.environment!r} does not judge answers: give a reward_spec",
            "invalid_input",
        )
    return info.tools if episode.tools else None


async def _check_openenv(service: RolloutService, body: RolloutRequest) -> list[dict] | None:
    """The job names a configured OpenEnv server (never an address: the job cannot make this
    service connect anywhere else) whose schema can be read; its action as the tool."""
    name, servers = body.episode.environment, service.openenv.servers
    if name not in servers:
        raise _refuse(
            400, f"unknown OpenEnv server {name!r}; configured: {sorted(servers)}", "unknown_environment"
        )
    if (
        not servers[name].judges
        and body.reward_spec is None
        and any(p.reward_spec is None for p in body.prompts)
    ):
        raise _refuse(
            400, f"OpenEnv server {name!r} does not judge answers: give a reward_spec", "invalid_input"
        )
    try:
        schema = await service.openenv.schema(name)
    except EnvironmentFailed as exc:
        raise _refuse(503, str(exc), "environments_unavailable") from exc
    return [ActionTool.of(name, schema, servers[name].description).openai()] if body.episode.tools else None


@router.get("/{job_id}", response_model=RolloutProgress, responses=ERRORS)
async def progress(job_id: str, service: ServiceDep) -> RolloutProgress:
    return await run_in_threadpool(_progress, service, job_id)


@router.delete("/{job_id}", response_model=RolloutProgress, responses=ERRORS)
async def cancel(job_id: str, service: ServiceDep) -> RolloutProgress:
    def run() -> RolloutProgress:
        _progress(service, job_id)  # 404 for an unknown job
        service.jobs.cancel(job_id)
        m.JOBS_CANCELLED.inc()
        return _progress(service, job_id)

    return await run_in_threadpool(run)


def _progress(service: RolloutService, job_id: str) -> RolloutProgress:
    job = service.jobs.progress(job_id)
    if job is None:
        raise _refuse(404, f"no rollout job {job_id[:80]!r}", "unknown_job")
    counts = dict.fromkeys(ROLLOUT_STATES, 0)
    for state in job.states.values():
        counts[state] = counts.get(state, 0) + 1
    unscored, unscored_samples = 0, {}
    for statuses in job.unscored.values():
        unscored += bool(statuses) and statuses.get("scored", 0) == 0
        for status, n in statuses.items():
            if status != "scored":
                unscored_samples[status] = unscored_samples.get(status, 0) + n
    queued = job.groups - sum(counts[s] for s in ROLLOUT_STATES)
    buffered, cancelled = counts[GroupState.buffered], counts[GroupState.cancelled]
    if sum(counts[s] for s in JOB_ENDS) == job.groups:
        if job.cancel_requested and cancelled:
            state = JobState.cancelled
        else:  # `failed` when not one group gave the trainer a reward to learn from
            state = JobState.done if buffered - unscored > 0 else JobState.failed
    elif job.cancel_requested:
        state = JobState.cancelling
    else:
        state = JobState.queued if queued == job.groups else JobState.running
    return RolloutProgress(
        job_id=job_id,
        state=state,
        groups=job.groups,
        queued=queued,
        **{s.value: counts[s] for s in ROLLOUT_STATES},
        **{s.value: job.exits.get(s, 0) for s in TRAINER_EXITS if s != GroupState.trained},
        trained=job.exits.get(GroupState.trained, 0) + job.stepped,  # from its step on
        checkpointed=job.exits.get(GroupState.trained, 0),
        in_buffer=max(buffered - sum(job.exits.values()) - job.stepped, 0),
        created_at=job.created_at,
        cancel_requested=job.cancel_requested,
        unscored=unscored,
        unscored_samples=unscored_samples,
        other={s.value: n for s, n in job.exits.items() if s not in TRAINER_EXITS},
        errors=dict(list(job.errors.items())[:MAX_ERRORS_SHOWN]),
    )
