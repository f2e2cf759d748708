"""The rollout scheduler: claim group jobs → wait for admission → generate the group on one
engine (partial rollouts across weight updates) → score → write to the buffer → ack.

    for each claimed job (up to `max_active_groups` at once; dead replicas' jobs recovered):
        cancelled?                     → release, end the job `cancelled`
        try_admit until not `full`     (each `full` counted)
        `duplicate` (already put)      → end the job `buffered`
        engine = least-loaded healthy engine (the whole group stays on it)
        generate the group_size samples in one batched /generate; the samples aborted by a
            weight update are resubmitted together as prompt + tokens so far with the remaining
            budget; every token keeps the engine's `weight_version` of the segment that sampled it
        engine failed                  → requeue: same slot, another engine, after a backoff; the
                                         samples go on from their last received segment
        engine refused (4xx)           → release, end the job `failed`
        score the samples (one reward batch per group)
        put the group (idempotent), end the job `buffered`

Each group's state (`proto.states.GroupState`) is reported in its job's record (`GET
/v1/rollouts/{id}` counts them; written every PHASE_FLUSH_S in one pipeline). Jobs in progress
are heartbeated; a job of a dead replica (idle past `recover_idle_s`) is recovered. On shutdown,
unfinished groups are left pending for a restart (`Jobs.resume_own`) or another replica: no job
is ended that was not finished.

A group's samples are made through the `GroupSampler` it is given for its engine: one batch for
a one-turn job, each turn of each episode for an episode job (`EpisodeRunner`, which sees only
that sampler and the environments). docs/architecture.md §4–§5 has the why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import redis

from asyncrl.buffer import AdmissionControl, Buffer, ClaimedJob, GroupReport, Groups, Jobs, PolicyVersions
from asyncrl.proto import Group, GroupJob, RewardStatus, Samples
from asyncrl.proto.lineage import merge
from asyncrl.proto.rewards import RewardResult, RewardSpec
from asyncrl.proto.states import Admission, GroupState
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import (
    EngineClient,
    EngineEndpoint,
    EngineFailure,
    EngineRejected,
)
from asyncrl.services.rollout.clients.environments import EnvClient, EnvironmentFailed
from asyncrl.services.rollout.clients.openenv import OpenEnvClient
from asyncrl.services.rollout.clients.rewards import RewardClient
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.rollout.engine_updates import WeightSync
from asyncrl.services.rollout.groups.episodes import EpisodeRunner
from asyncrl.services.rollout.groups.sampler import GroupSampler
from asyncrl.services.rollout.segments import Draft, sample_text
from asyncrl.services.runtime.coalescer import GroupCommit
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.runtime.retry import Retryable, with_retries

log = logging.getLogger(__name__)

INTERNAL_RETRY_S = 5.0  # pause before a group that hit an internal error starts again
PHASE_FLUSH_S = 0.05  # phase records are written in one pipeline per this interval
UNSCORED_DETAIL_CHARS = 300  # of the reward error quoted in an unscored group's job record


@dataclass
class Active:
    claimed: ClaimedJob
    stage: str = "claimed"  # claimed | admission | generating | scoring | writing
    task: asyncio.Task | None = None
    cancel_reason: str | None = None
    engine: EngineEndpoint | None = None
    rids: set[str] = field(default_factory=set)


class GroupScheduler:
    def __init__(
        self,
        settings: RolloutSettings,
        buf: Buffer,
        engines: EngineClient,
        rewards: RewardClient,
        weights: WeightSync,
        tokenizer,
        context_length: int,
        envs: EnvClient | None = None,
        openenv: OpenEnvClient | None = None,
    ):
        self.settings = settings
        # The buffer's parts, on the process's one connection; used only on the `_redis` thread
        # (`jobs` holds this replica's claims).
        self.jobs = Jobs(buf, consumer=f"rollout-{settings.replica}")
        self.groups, self.admission, self.versions = Groups(buf), AdmissionControl(buf), PolicyVersions(buf)
        self.engines, self.rewards, self.weights, self.envs = engines, rewards, weights, envs
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.episodes = EpisodeRunner(
            envs,
            tokenizer,
            context_length=context_length,
            default_max_new_tokens=settings.default_max_new_tokens,
            initial_weight_version=settings.initial_weight_version,
            openenv=openenv,
        )
        self.active: dict[str, Active] = {}
        self._redis = ThreadPoolExecutor(1, thread_name_prefix="rollout-buffer")
        self._wake = asyncio.Event()
        # Groups waiting for admission, in claim order; `_admissions` asks for all of them at once.
        self._admission_queue: deque[tuple[GroupJob, asyncio.Future]] = deque()
        self._admission_wake = asyncio.Event()
        weights.listeners.append(self._on_version)  # a new version may open admission: ask at once
        weights.moving.append(self._admission_wake.set)  # ... as soon as it is announced (see there)
        # Scored groups are put, and their jobs ended, together with every group that finished
        # while the previous write ran: one fsync per batch on a Redis that fsyncs every write.
        self._writes = GroupCommit(
            partial(self._db, self._put_many), split_on=ValueError, on_batch=m.BUFFER_WRITE_GROUPS.observe
        )
        self._stopping = False
        self._phases: dict[str, GroupReport] = {}  # group_id -> its state, not yet written

    async def _db(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._redis, partial(fn, *args, **kwargs))

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        background = [
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self.engines.probe_unhealthy()),
            asyncio.create_task(self._write_phases()),
            asyncio.create_task(self._admissions()),
        ]
        try:
            for c in await self._db(self.jobs.resume_own):
                self._start(c, "resumed")
            next_recover = time.monotonic() + self.settings.recover_interval_s
            while True:
                claimed: list[tuple[ClaimedJob, str]] = []
                free = self.settings.max_active_groups - len(self.active)
                if free > 0 and time.monotonic() >= next_recover:
                    idle_ms = int(self.settings.recover_idle_s * 1000)
                    claimed += [(c, "recovered") for c in await self._db(self.jobs.recover, idle_ms)]
                    next_recover = time.monotonic() + self.settings.recover_interval_s
                if free - len(claimed) > 0:
                    claimed += [(c, "new") for c in await self._db(self.jobs.claim, free - len(claimed), 0)]
                for c, source in claimed:
                    self._start(c, source)
                if not claimed:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), self.settings.claim_poll_s)
                    except TimeoutError:
                        pass
        finally:
            self._stopping = True
            for t in background:
                t.cancel()
            tasks = [a.task for a in self.active.values() if a.task]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, *background, self._writes.aclose(), return_exceptions=True)
            try:
                if self._phases:  # the last `generating` / `scoring` records
                    await self._db(self.jobs.report, list(self._phases.values()))
            except redis.RedisError as exc:
                log_event(log, "phase records lost at shutdown", logging.WARNING, error=str(exc))
            finally:
                self._redis.shutdown(wait=True)

    def _start(self, c: ClaimedJob, source: str) -> None:
        gid = c.job.group_id
        if (
            self._stopping or gid in self.active
        ):  # e.g. recovered while we still work on it: keep the one we have
            return
        m.GROUPS_CLAIMED.labels(source).inc()
        a = Active(c)
        self.active[gid] = a
        m.ACTIVE_GROUPS.set(len(self.active))
        a.task = asyncio.create_task(self._group(a), name=f"group-{gid}")

    async def _group(self, a: Active) -> None:
        job = a.claimed.job
        try:
            a.stage = "admission"
            admission, submit_version = await self._admit(job)
            if admission is None:
                return await self._close(a, GroupState.cancelled)
            if admission is Admission.duplicate:
                return await self._close(a, GroupState.buffered, duplicate=True)
            a.stage = "generating"
            self._phase(job, GroupState.generating)
            drafts = await self._generate(a, episodes=bool(job.episode))
            a.stage = "scoring"
            self._phase(job, GroupState.scoring)
            samples = await self._score(job, drafts)
            a.stage = "writing"
            lineage: dict[int, int] = {}
            for d in drafts:
                merge(lineage, d.lineage)
            group = Group.build(
                group_id=job.group_id,
                job_id=job.job_id,
                prompt_tokens=job.prompt_tokens,
                reward_spec=job.reward_spec,
                samples=samples,
                submit_version=submit_version,
                lineage=lineage,
            )
            new, version = await self._writes.submit((group, self._buffered_phase(job, samples)))
            m.STALENESS_AT_WRITE.observe(max(version - group.min_version, 0))
            await self._close(a, GroupState.buffered, settled=True, duplicate=not new)
        except (EngineRejected, ValueError) as exc:
            # The request or what came back for it is wrong (the records and the HTTP bodies
            # refuse bad values with ValueError): retrying cannot help. Counted, recorded in
            # the job (`GET /v1/rollouts/{id}` shows the reason), slot given back.
            log_event(log, "group failed", logging.ERROR, group_id=job.group_id, error=str(exc)[:2000])
            await self._close(a, GroupState.failed, error=f"{type(exc).__name__}: {exc}")
        except (EngineFailure, EnvironmentFailed, OSError, redis.RedisError) as exc:
            # Not the group's fault (an engine aborting forever, a Redis hiccup): keep the
            # claim and the admission slot and start the group again.
            m.GROUPS_REQUEUED.labels("internal").inc()
            log_event(
                log,
                "group restarted after an error",
                logging.ERROR,
                group_id=job.group_id,
                error=f"{type(exc).__name__}: {exc}",
            )
            asyncio.get_running_loop().call_later(INTERNAL_RETRY_S, self._start, a.claimed, "retry")
        except Exception as exc:  # a bug: fail this group visibly rather than leave its job stuck
            log.exception("group %s crashed the scheduler", job.group_id)
            await self._close(a, GroupState.failed, error=f"internal error: {type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            if a.cancel_reason != "job_cancelled":
                raise  # shutdown: leave the job pending for a restart or another replica
            await asyncio.gather(*(self.engines.abort(a.engine, rid) for rid in a.rids if a.engine))
            await self._close(a, GroupState.cancelled)
        finally:
            self.active.pop(job.group_id, None)
            m.ACTIVE_GROUPS.set(len(self.active))
            self._wake.set()

    async def _admit(self, job: GroupJob) -> tuple[Admission | None, int]:
        """(admission, policy version at admission); None for a cancelled job. Groups queue
        for admission in claim order and `_admissions` asks for the whole queue in one call, so
        a batch of claimed groups costs one round trip, and a full buffer one per poll interval."""
        t0 = time.monotonic()
        answer: asyncio.Future[tuple[Admission | None, int]] = asyncio.get_running_loop().create_future()
        self._admission_queue.append((job, answer))
        self._admission_wake.set()
        entry = await answer  # (a cancelled caller's entry is skipped by `_admissions`)
        m.ADMISSION_WAIT_SECONDS.observe(time.monotonic() - t0)
        if entry[0] is not None and entry[0].go:
            m.GROUPS_ADMITTED.inc()
        return entry

    async def _admissions(self) -> None:
        """Run forever: answer the queued groups in order until the first `full`; while the
        head is `full`, ask again every `admission_poll_s` or as soon as a new version is served."""
        while True:
            await self._admission_wake.wait()
            self._admission_wake.clear()
            while self._admission_queue:
                queued = [(job, answer) for job, answer in self._admission_queue if not answer.done()]
                self._admission_queue = deque(queued)
                if not queued:
                    break
                try:
                    answers, version = await self._db(self._try_enter, [job for job, _ in queued])
                except Exception as exc:  # noqa: BLE001 — handed to the waiting groups: `_group` owns the policy
                    for _, answer in queued:
                        if not answer.done():
                            answer.set_exception(exc)
                    self._admission_queue.clear()  # (every entry here was in `queued`, or came later)
                    break
                full = False
                for (_, answer), admission in zip(queued, answers):
                    if admission is Admission.full:
                        full = True
                        break
                    self._admission_queue.popleft()  # the queue's head is this entry (others were appended)
                    if not answer.done():
                        answer.set_result(
                            (admission, version if admission is not None and admission.go else 0)
                        )
                if full:
                    m.ADMISSION_WAITS.inc()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._admission_wake.wait(), self.settings.admission_poll_s)
                    self._admission_wake.clear()

    async def _on_version(self, version: int) -> None:
        self._admission_wake.set()

    # The buffer calls a group makes at one point run together on the Redis thread, for every
    # group at that point at once: one hop there and back, one round trip per kind of call.
    def _try_enter(self, jobs: list[GroupJob]) -> tuple[list[Admission | None], int]:
        """Each job's admission (None: its job was cancelled), and the policy version."""
        job_ids = list(dict.fromkeys(job.job_id for job in jobs))
        flags = self.jobs.buf.pipeline(
            lambda pipe: [pipe.sismember(self.jobs.keys.cancelled, j) for j in job_ids]
        )
        cancelled = {j for j, flag in zip(job_ids, flags) if flag}
        asking = [job for job in jobs if job.job_id not in cancelled]
        answers = iter(self.admission.try_admit_many([job.group_id for job in asking]))
        out = [None if job.job_id in cancelled else next(answers) for job in jobs]
        return out, self.versions.version() if any(a is not None and a.go for a in out) else 0

    # A group's last state is reported when its job ends, in the same call, and after the put: a
    # crash between put and end re-runs the job, which finds its group put (`duplicate`).
    def _put_many(self, items: list[tuple[Group, GroupReport]]) -> list[tuple[bool, int]]:
        # One round trip, in this order (one fsync on a Redis that fsyncs every write).
        new, _, version = self.jobs.buf.pipeline_parts(
            self.groups.put_part([group for group, _ in items]),
            self.jobs.end_part([final for _, final in items]),
            self.versions.version_part(),
        )
        return [(n, version) for n in new]

    def _settle(self, final: GroupReport) -> None:
        if final.state in (GroupState.failed, GroupState.cancelled):
            self.admission.release(final.group_id)
        self.jobs.end(final)

    async def _close(
        self, a: Active, state: GroupState, error: str = "", settled: bool = False, duplicate: bool = False
    ) -> None:
        """The group leaves this service: `buffered` (in the buffer; `duplicate`: put before),
        `failed`, `cancelled`. `settled`: the put already ended the job."""
        if not settled:
            await self._db(self._settle, self._final_phase(a.claimed.job, state, error))
        m.GROUPS_FINISHED.labels("duplicate" if duplicate else state.value).inc()

    def _phase(self, job: GroupJob, state: GroupState) -> None:
        """Report an intermediate state (`GET /v1/rollouts/{id}` counts them); `_write_phases`
        writes them within PHASE_FLUSH_S, all groups' in one pipeline."""
        self._phases[job.group_id] = GroupReport(job.job_id, job.group_id, state)

    def _final_phase(self, job: GroupJob, state: GroupState, error: str = "") -> GroupReport:
        """A group's last state, reported when its job ends; any batched state of the group not
        yet written is dropped, so it cannot land after the last one."""
        self._phases.pop(job.group_id, None)
        return GroupReport(job.job_id, job.group_id, state, error)

    def _buffered_phase(self, job: GroupJob, samples: Samples) -> GroupReport:
        """`_final_phase` of a scored group, with what its rewards say: its samples by reward
        status when any was not `scored`, and for a group with no scored sample at all (it
        teaches the trainer nothing) an error, counted; `GET /v1/rollouts/{id}` reads a job
        whose every group is such as `failed`."""
        counts: dict[str, int] = {}
        for status in samples.reward_status:
            key = status.value if status is not None else "none"
            counts[key] = counts.get(key, 0) + 1
        if set(counts) <= {RewardStatus.scored.value}:
            return self._final_phase(job, GroupState.buffered)
        error = ""
        if RewardStatus.scored.value not in counts:
            m.GROUPS_UNSCORED.inc()
            first = samples.reward_details[0]
            why = str(first.get("error") or first.get("reason") or "")[:UNSCORED_DETAIL_CHARS]
            error = f"no sample scored ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))})"
            error += f": {why}" if why else ""
        final = self._final_phase(job, GroupState.buffered, error)
        final.unscored = counts
        return final

    async def _write_phases(self) -> None:
        while True:
            await asyncio.sleep(PHASE_FLUSH_S)
            if not self._phases:
                continue
            batch, self._phases = self._phases, {}
            try:
                await self._db(self.jobs.report, list(batch.values()))
            except Exception as exc:  # noqa: BLE001 — never let the writer die: keep them for the next round
                # (groups that finished since reported their last state; newer reports win)
                self._phases = {**{g: r for g, r in batch.items() if g in self.active}, **self._phases}
                log_event(
                    log,
                    "phase records not written; retrying",
                    logging.WARNING,
                    error=f"{type(exc).__name__}: {exc}",
                )

    async def _heartbeat(self) -> None:
        """Keep our jobs from looking dead; stop groups of cancelled jobs before they are scored."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await self._db(self.jobs.touch, [a.claimed.entry_id for a in self.active.values()])
            for job_id in {a.claimed.job.job_id for a in self.active.values()}:
                if not await self._db(self.jobs.cancelled, job_id):
                    continue
                for a in list(self.active.values()):
                    if a.claimed.job.job_id == job_id and a.stage in ("admission", "generating") and a.task:
                        a.cancel_reason = "job_cancelled"
                        a.task.cancel()

    # --- generation -----------------------------------------------------------------------

    async def _generate(self, a: Active, episodes: bool = False) -> list[Draft]:
        """All samples of the group on one engine (as episodes with an environment when the job
        asks); on engine failure, the group goes on on the least-loaded healthy engine after a
        backoff, for as long as it takes: a one-turn group's samples from their last received
        segment (`_samples`), an episode group from the start (an environment's state cannot be
        resumed)."""
        job = a.claimed.job
        drafts: list[Draft] = []  # a one-turn group's samples, kept across engines

        async def on_an_engine(attempt: int) -> list[Draft]:
            a.engine = await self.engines.pick()
            t0 = time.monotonic()
            try:
                sampler = GroupSampler(
                    self.engines,
                    a.engine,
                    self.weights,
                    group_id=job.group_id,
                    rids=a.rids,
                    max_resubmits=self.settings.max_resubmits,
                    context_length=self.context_length,
                    initial_version=self.settings.initial_weight_version,
                )
                done = await (
                    self.episodes.run(job, sampler) if episodes else self._samples(job, sampler, drafts)
                )
            except EngineFailure as exc:
                m.GROUPS_REQUEUED.labels("engine").inc()
                log_event(
                    log,
                    "group requeued after an engine failure",
                    logging.WARNING,
                    group_id=job.group_id,
                    engine=a.engine.url,
                    attempt=attempt + 1,
                    error=str(exc),
                )
                raise Retryable(str(exc)) from exc
            seconds = time.monotonic() - t0
            tokens = sum(len(d.tokens) for d in done)
            m.GENERATION_SECONDS.observe(seconds)
            m.GENERATED_TOKENS.inc(tokens)
            m.TOKENS_PER_SECOND.set(tokens / seconds if seconds > 0 else 0.0)
            return done

        return await with_retries(
            on_an_engine,
            math.inf,
            first_s=2 * self.settings.engine_backoff_s,
            max_s=self.settings.requeue_backoff_max_s,
        )

    async def _samples(self, job: GroupJob, sampler: GroupSampler, drafts: list[Draft]) -> list[Draft]:
        """The group's completions in one batched request; after a weight-update abort, the
        aborted samples' remainders (prompt + their tokens so far) go again as one batch.
        `drafts` are the samples as an engine that failed left them (empty at first): the
        unfinished ones go on from their last received segment. Tokens of a request that failed
        never arrived, so what is kept is exactly what was received, with its versions."""
        params = dict(job.sampling_params)
        budget = int(params.get("max_new_tokens", self.settings.default_max_new_tokens))
        prompt = job.prompt_tokens.tolist()
        if not drafts:
            now = time.time()
            drafts += [Draft(i, submitted=now) for i in range(job.group_size)]
        pending = [d for d in drafts if d.finished is None]
        resumed = sum(1 for d in pending if d.segments)
        if resumed:
            m.FAILOVER_RESUMES.inc(resumed)
        # (segments numbered on from the ones already made: a job's sampling_seed is not reused)
        first = max((d.segments for d in pending), default=0)
        await sampler.generate([prompt] * len(pending), pending, [budget] * len(pending), params, first)
        for d in drafts:
            d.text = sample_text(self.tokenizer, d, params)
        return drafts

    # --- scoring --------------------------------------------------------------------------

    async def _score(self, job: GroupJob, drafts: list[Draft]) -> Samples:
        """The group's samples, scored, built column-wise (`Samples`) in one checked record:
        no `Sample` per draft."""
        judged = [d for d in drafts if d.env_reward is not None]  # an environment gave the reward
        results = {
            d.index: RewardResult(
                id=str(d.index), reward=d.env_reward, status=RewardStatus.scored, details=d.details
            )
            for d in judged
        }
        if len(judged) < len(drafts):
            spec = RewardSpec.model_construct(**job.reward_spec)  # checked at submission (intake)
            unjudged = [d for d in drafts if d.env_reward is None]
            for d, r in zip(
                unjudged, await self.rewards.score_group(spec, job.prompt_text, [d.text for d in unjudged])
            ):
                results[d.index] = r
        results = [results[d.index] for d in drafts]
        scored_at = time.time()
        n = len(drafts)
        episodes = any(d.loss_mask is not None for d in drafts)
        return Samples(
            lengths=[len(d.tokens) for d in drafts],
            completion_ids=[t for d in drafts for t in d.tokens],
            behavior_logprobs=[lp for d in drafts for lp in d.logprobs],
            versions=[v for d in drafts for v in d.versions],
            prompt_id=[job.prompt_id] * n,
            finish_reason=[d.finish_reason for d in drafts],
            truncated=[d.finish_reason == "length" for d in drafts],
            text=[d.text for d in drafts],
            reward=[r.reward for r in results],
            reward_status=[r.status for r in results],
            reward_details=[r.details for r in results],
            submitted=[d.submitted for d in drafts],
            first_token=[d.first_token for d in drafts],
            finished=[d.finished for d in drafts],
            scored=[scored_at] * n,
            loss_mask=[
                x for d in drafts for x in (d.loss_mask if d.loss_mask is not None else [1] * len(d.tokens))
            ]
            if episodes
            else [],
            turn_starts=[d.turn_starts for d in drafts] if episodes else [],
            turn_rewards=[d.turn_rewards for d in drafts]
            if episodes and any(d.turn_rewards for d in drafts)
            else [],
        )
