"""Evaluations, a job type of their own: a held-out prompt set generated at one pinned weight
version, scored, summarized, stored per version in Redis (`buffer.evals`) and exported as
gauges labelled by version.

    an evaluation reaches this replica: claimed from the queue (a POST, or one whose replica
    died: its lease ran out), or created here as the engines reach version v (automatic)
        pin one engine under WeightSync's lock: its weight updates wait until we are done
            (LoRA: the pin holds the version's adapter loaded; its requests name it)
        version = what the pinned engine serves (exactly v for an automatic evaluation)
        generate the prompts CHUNK at a time (one /generate each), score each chunk (one
            reward batch); any aborted item, or one whose tokens carry another version,
            fails the evaluation
        store summary + items, set the gauges, release the pin (the engine catches up)

Guarantees: an evaluation never touches the replay buffer (no admission slot, no group, no
job); its items are never aborted and resubmitted: an aborted or off-version item fails the
evaluation with the reason instead. Automatic evaluations are created once per (name,
version) across replicas (the id is a hash of `auto-<name>-v<version>`) and started by the
replica that created them, pinned before its weight-update lock is released. Every failure
is stored with its reason (`state: failed`, `error`).

Limits: with `distributed` weights (the trainer broadcasts) or several rollout replicas
driving the same engines' updates, nothing defers the update: the evaluation runs checked,
not pinned, and fails if the version changes under it. An automatic evaluation whose replica
died is recovered only while an engine still serves its version; otherwise it fails saying
so. Versions the engines skip (a newer one arrived first) are not evaluated.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis
from pydantic import ValidationError

from asyncrl.buffer.evals import ClaimedEval, EvalStore
from asyncrl.proto.evals import CORRECT_REWARD, EvalItem, EvalPrompt, EvalRequest, EvalSummary, EvalTask
from asyncrl.proto.records import RewardStatus
from asyncrl.proto.rewards import RewardItem, RewardSpec
from asyncrl.proto.rollout import RolloutPrompt
from asyncrl.proto.sglang import SamplingParams, lora_not_loaded
from asyncrl.proto.states import JobState
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import (
    EngineClient,
    EngineFailure,
    EngineRejected,
    Generation,
)
from asyncrl.services.rollout.clients.rewards import RewardClient
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.rollout.engine_updates import Pin, VersionNotServed, WeightSync, policy_version
from asyncrl.services.rollout.intake import MAX_REPORTED, BadRequest, Intake
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

CHUNK = 64  # prompts per /generate request and per reward batch
CHUNKS_IN_FLIGHT = 2  # one chunk generates while the one before it is scored
MAX_ATTEMPTS = 3  # claims of one evaluation (its replicas died) before it is failed


class EvalFailed(Exception):
    """The evaluation cannot give a truthful result; the message says why."""


class _Lost(Exception):
    """Another replica holds the evaluation now (our lease ran out)."""


@dataclass
class _Run:
    """An evaluation as far as this attempt got: a failure keeps the version it ran at."""

    summary: EvalSummary
    items: list[EvalItem] = field(default_factory=list)


# --- building an evaluation ---------------------------------------------------------------------


def eval_id_for(run: str, key: str | None, source: str = "api") -> str:
    """Deterministic for an idempotency key; automatic and API keys never collide."""
    if key is None:
        return f"e{uuid.uuid4().hex[:20]}"
    return "e" + hashlib.sha256(f"{run}\0{source}\0{key}".encode()).hexdigest()[:20]


def body_hash(body: EvalRequest) -> str:
    """What an idempotency key promises stays the same: the body without the key."""
    return hashlib.sha256(body.model_dump_json(exclude={"idempotency_key"}).encode()).hexdigest()[:32]


def sampling_params(settings: RolloutSettings, requested: SamplingParams | dict | None) -> dict:
    """Greedy (temperature 0) with `eval_max_new_tokens`, under what the request sets."""
    if isinstance(requested, SamplingParams):
        requested = requested.model_dump(exclude_unset=True, exclude_none=True)
    default_tokens = settings.eval_max_new_tokens or settings.default_max_new_tokens
    params = {"temperature": 0.0, "max_new_tokens": default_tokens, **(requested or {})}
    if not 1 <= params["max_new_tokens"] <= settings.max_new_tokens_cap:
        raise BadRequest(
            f"max_new_tokens {params['max_new_tokens']} is not in [1, the cap {settings.max_new_tokens_cap}]"
        )
    return params


def build_task(
    intake: Intake,
    prompts: list[RolloutPrompt],
    default_spec: RewardSpec | None,
    params: dict,
    name: str,
    verifiers: frozenset[str] | None = None,
) -> EvalTask:
    """Tokenize and check the prompts (a `BadRequest` names what is wrong)."""
    out, too_long, unknown = [], [], set()
    for i, prompt in enumerate(prompts):
        ids, text = intake.tokenize(prompt)
        if not ids:
            raise BadRequest(f"prompt {i} is empty after tokenization")
        if len(ids) >= intake.context_length:
            too_long.append(f"prompt {i} has {len(ids)} tokens")
        spec: RewardSpec = prompt.reward_spec or default_spec  # type: ignore[assignment]
        if verifiers is not None and spec.verifier not in verifiers:
            unknown.add(spec.verifier)
        out.append(
            EvalPrompt(
                prompt_id=prompt.prompt_id or f"{name}-{i}",
                prompt_tokens=ids,
                prompt_text=text,
                reward_spec=spec,
            )
        )
    if too_long:
        raise BadRequest(
            f"{len(too_long)} prompts do not fit the context length {intake.context_length}: "
            f"{'; '.join(too_long[:MAX_REPORTED])}"
        )
    if unknown:
        raise BadRequest(
            f"unknown verifier(s) {sorted(unknown)}; the reward service serves {sorted(verifiers or ())}",
            reason="unknown_verifier",
        )
    return EvalTask(prompts=out, sampling_params=params)


def load_eval_file(path: str) -> list[RolloutPrompt]:
    """The prompts of a JSONL file (one RolloutPrompt with a reward_spec a line; blank lines skipped)."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = RolloutPrompt.model_validate_json(line)
        except ValidationError as exc:
            raise ValueError(f"{path}:{n}: not a prompt: {exc.errors()[0]['msg']}") from None
        if prompt.reward_spec is None:
            raise ValueError(f"{path}:{n}: an evaluation prompt needs a reward_spec")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def new_summary(eval_id: str, name: str, source: str, task: EvalTask, digest: str = "") -> EvalSummary:
    return EvalSummary(
        eval_id=eval_id,
        name=name,
        source=source,
        state=JobState.queued,
        prompts=len(task.prompts),
        target_version=task.target_version,
        sampling_params=task.sampling_params,
        created_at=time.time(),
        body_hash=digest,
    )


def summarize(items: list[EvalItem]) -> dict:
    """The summary's figures of `items` (proto/evals.py defines each): accuracy over all items
    (unscored count as wrong); formatted, format_rate and formatted_accuracy from the verifiers'
    format verdicts (None when no item has one); mean_reward over the scored items (None if
    none); mean_length over all items."""
    scored = [i for i in items if i.reward_status is RewardStatus.scored and i.reward is not None]
    correct = [i for i in scored if i.reward >= CORRECT_REWARD]
    formatted = [i for i in items if i.formatted]
    out = {
        "accuracy": len(correct) / len(items),
        "formatted": None,
        "format_rate": None,
        "formatted_accuracy": None,
        "mean_reward": sum(i.reward for i in scored) / len(scored) if scored else None,
        "mean_length": sum(i.completion_tokens for i in items) / len(items),
        "correct": len(correct),
        "scored": len(scored),
        "statuses": dict(Counter(i.reward_status.value for i in items)),
    }
    if any(i.formatted is not None for i in items):
        formatless = sum(1 for i in scored if i.formatted is None)  # their verifier has no format
        out["formatted"] = len(formatted)
        out["format_rate"] = len(formatted) / (len(items) - formatless)
        if formatted:
            out["formatted_accuracy"] = sum(1 for i in correct if i.formatted) / len(formatted)
    return out


# --- running evaluations ------------------------------------------------------------------------


class Evaluator:
    """This replica's evaluation runner: claims queued (or abandoned) evaluations, starts the
    automatic ones as WeightSync reaches their version, and heartbeats its leases."""

    def __init__(
        self,
        settings: RolloutSettings,
        store: EvalStore,
        engines: EngineClient,
        rewards: RewardClient,
        weights: WeightSync,
        tokenizer,
        auto: dict[str, EvalTask] | None = None,
    ):
        self.settings, self.store = settings, store
        self.engines, self.rewards, self.weights = engines, rewards, weights
        self.tokenizer = tokenizer
        self.auto = (auto or {}) if settings.eval_every else {}  # name -> task, evaluated every eval_every
        self.owner = f"rollout-{settings.replica}"
        self.running: dict[str, asyncio.Task] = {}
        self._lost: set[str] = set()
        weights.listeners.append(self.on_version)

    async def run(self) -> None:
        """Forever: heartbeat, and claim an evaluation whenever fewer than `eval_concurrency` run."""
        await self._restore_gauges()
        next_beat = time.monotonic()
        try:
            while True:
                claimed = None
                try:
                    if time.monotonic() >= next_beat:
                        await self._heartbeat()
                        next_beat = time.monotonic() + self.settings.heartbeat_s
                    if len(self.running) < self.settings.eval_concurrency:
                        claimed = await asyncio.to_thread(
                            self.store.claim, self.owner, self.settings.recover_idle_s
                        )
                except redis.RedisError as exc:  # Redis is away: the next poll tries again
                    m.EVAL_REDIS_ERRORS.inc()
                    log_event(log, "evaluation queue unreachable", logging.WARNING, error=str(exc))
                if claimed is not None:
                    self._launch(claimed, None)
                else:
                    await asyncio.sleep(self.settings.claim_poll_s)
        finally:
            tasks = list(self.running.values())
            for t in tasks:  # shutdown: their leases run out and another replica starts them over
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def on_version(self, version: int) -> None:
        """WeightSync listener, called under its lock as the engines first reach `version`:
        create the automatic evaluations due at it (each once across replicas) and pin them now."""
        if not self.auto or version % self.settings.eval_every:
            return
        for name, task in self.auto.items():
            await self._auto_eval(name, task, version)

    async def _auto_eval(self, name: str, task: EvalTask, version: int) -> None:
        eval_id = eval_id_for(self.settings.run, f"auto-{name}-v{version}", "auto")
        task = task.model_copy(update={"target_version": version})
        summary = new_summary(eval_id, name, "auto", task)
        try:
            created = await asyncio.to_thread(
                self.store.create, summary, task, self.owner, self.settings.recover_idle_s
            )
        except redis.RedisError as exc:
            m.AUTO_EVALS.labels("error").inc()
            log_event(
                log,
                "automatic evaluation not created",
                logging.ERROR,
                name=name,
                version=version,
                error=str(exc),
            )
            return
        m.AUTO_EVALS.labels("created" if created else "exists").inc()
        if not created:
            return
        m.EVALS_SUBMITTED.labels("auto").inc()
        try:
            pin = self.weights.pin_locked(version)
        except VersionNotServed:
            pin = None  # cannot happen right after the update; if it does, the run says why
        self._launch(ClaimedEval(summary, task, attempts=1), pin)

    def _launch(self, claimed: ClaimedEval, pin: Pin | None) -> None:
        eval_id = claimed.summary.eval_id
        if eval_id in self.running:  # our own lease ran out and we claimed it again: keep the run we have
            if pin is not None:
                self.weights.unpin(pin)
            return
        self.running[eval_id] = asyncio.create_task(self._evaluate(claimed, pin), name=f"eval-{eval_id}")
        m.EVALS_RUNNING.set(len(self.running))

    async def _heartbeat(self) -> None:
        lost = await asyncio.to_thread(
            self.store.touch, self.owner, list(self.running), self.settings.recover_idle_s
        )
        for eval_id in lost:
            if eval_id in self.running:  # another replica holds it now: stop ours, it would not be stored
                self._lost.add(eval_id)
                self.running[eval_id].cancel()

    async def _evaluate(self, claimed: ClaimedEval, pin: Pin | None) -> None:
        eval_id = claimed.summary.eval_id
        run = _Run(
            claimed.summary.model_copy(
                update={"attempts": claimed.attempts, "replica": self.settings.replica}
            )
        )
        t0 = time.monotonic()
        try:
            try:
                await self._attempt(run, claimed, pin)
            except (EvalFailed, VersionNotServed, EngineFailure, EngineRejected) as exc:
                run.summary = _failed(run.summary, f"{type(exc).__name__}: {exc}")
            except (_Lost, redis.RedisError):
                raise
            except Exception as exc:  # a bug: fail it visibly rather than retry it forever
                log.exception("evaluation %s crashed", eval_id)
                run.summary = _failed(run.summary, f"internal error: {type(exc).__name__}: {exc}")
            await self._finish(run, t0)
        except _Lost:
            m.EVALS_FINISHED.labels("lost").inc()
        except redis.RedisError as exc:  # nothing stored: the lease runs out and it starts over
            m.EVAL_REDIS_ERRORS.inc()
            log_event(log, "evaluation interrupted by Redis", logging.ERROR, eval_id=eval_id, error=str(exc))
        except asyncio.CancelledError:
            if eval_id not in self._lost:
                raise  # shutdown: left to the lease
            m.EVALS_FINISHED.labels("lost").inc()
        finally:
            self._lost.discard(eval_id)
            self.running.pop(eval_id, None)
            m.EVALS_RUNNING.set(len(self.running))

    async def _attempt(self, run: _Run, claimed: ClaimedEval, pin: Pin | None) -> None:
        """Pin, record `running` with the version, generate and score: `run` holds the outcome."""
        task = claimed.task
        try:
            if task is None:
                raise EvalFailed(claimed.problem)
            if claimed.attempts > MAX_ATTEMPTS:
                raise EvalFailed(f"abandoned after {claimed.attempts - 1} attempts whose replicas stopped")
            if pin is None:
                pin = await self.weights.pin(task.target_version)
            version = await self._start_version(pin, task.target_version)
            run.summary = run.summary.model_copy(
                update={
                    "state": JobState.running,
                    "version": version,
                    "engine": pin.engine.url,
                    "started_at": time.time(),
                    "pinned": self.weights.method != "distributed",
                }
            )
            if not await asyncio.to_thread(self.store.set_running, self.owner, run.summary):
                raise _Lost()
            run.items = await self._items(task, pin, version)
            outcome = {"state": JobState.done, "finished_at": time.time(), **summarize(run.items)}
            run.summary = run.summary.model_copy(update=outcome)
        finally:
            if pin is not None:
                self.weights.unpin(pin)

    async def _start_version(self, pin: Pin, target: int | None) -> int:
        """The version the pinned engine serves, as it reports it (the pin keeps it there); with
        LoRA the version of the pinned adapter (the engine reports its base's)."""
        if pin.adapter is not None:
            if target is not None and pin.version != target:
                raise EvalFailed(
                    f"version {target} is not served any more ({pin.engine.url} holds {pin.version})"
                )
            assert pin.version is not None
            return pin.version
        reported = await self.engines.weight_versions(only=list(pin.admins))
        versions = {policy_version(v, self.settings.initial_weight_version) for v in reported if v}
        if len(versions) > 1:
            raise EvalFailed(
                f"the engines behind {pin.engine.url} serve different versions {sorted(versions)}"
            )
        version = versions.pop() if versions else pin.version
        if version is None:
            raise EvalFailed(f"cannot tell which weight version {pin.engine.url} serves")
        if target is not None and version != target:
            raise EvalFailed(f"version {target} is not served any more ({pin.engine.url} serves {version})")
        return version

    async def _items(self, task: EvalTask, pin: Pin, version: int) -> list[EvalItem]:
        gate = asyncio.Semaphore(CHUNKS_IN_FLIGHT)

        async def chunk(start: int) -> list[EvalItem]:
            async with gate:
                return await self._chunk(task, start, pin, version)

        tasks = [asyncio.ensure_future(chunk(s)) for s in range(0, len(task.prompts), CHUNK)]
        try:
            parts = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()  # the first failure ends the others
        return [item for part in parts for item in part]

    async def _chunk(self, task: EvalTask, start: int, pin: Pin, version: int) -> list[EvalItem]:
        """One /generate for up to CHUNK prompts (with LoRA naming the pinned adapter; sent again
        once if the engine lost it and it was reloaded), checked, then one reward batch."""
        prompts = task.prompts[start : start + CHUNK]
        params = task.sampling_params
        inputs, items_params = [p.prompt_tokens for p in prompts], [params] * len(prompts)
        try:
            gens = await self.engines.generate(pin.engine, inputs, items_params, set(), lora=pin.adapter)
        except EngineRejected as exc:
            if pin.adapter is None or pin.adapter not in lora_not_loaded(str(exc)):
                raise
            await self.weights.recover(pin.engine, pin.adapter)
            gens = await self.engines.generate(pin.engine, inputs, items_params, set(), lora=pin.adapter)
        for p, gen in zip(prompts, gens):
            self._check(p, gen, version, adapter=pin.adapter is not None)
        texts = [self._text(gen, params) for gen in gens]
        results = await self.rewards.score(
            [
                RewardItem(id=str(start + k), prompt=p.prompt_text, completion=text, spec=p.reward_spec)
                for k, (p, text) in enumerate(zip(prompts, texts))
            ]
        )
        return [
            EvalItem(
                index=start + k,
                prompt_id=p.prompt_id,
                completion=text,
                completion_tokens=len(gen.output_ids),
                finish_reason=gen.finish_reason,
                version=version,
                reward=r.reward,
                reward_status=r.status,
                reward_details=r.details,
                formatted=r.formatted,
            )
            for k, (p, gen, text, r) in enumerate(zip(prompts, gens, texts, results))
        ]

    def _check(self, prompt: EvalPrompt, gen: Generation, version: int, adapter: bool = False) -> None:
        """`adapter`: the request named the adapter of `version` (the engine serves it or refuses,
        and reports its base's `weight_version`), so only an abort can spoil the item."""
        if gen.finish_reason == "abort":
            raise EvalFailed(
                f"item {prompt.prompt_id} was aborted by the engine: its weights changed under "
                "the evaluation (a distributed update, or another replica's)"
            )
        if adapter:
            return
        got = policy_version(gen.weight_version, self.settings.initial_weight_version)
        if got != version:
            raise EvalFailed(
                f"item {prompt.prompt_id} carries version {got}; the evaluation runs at {version}"
            )

    def _text(self, gen: Generation, params: dict) -> str:
        stop_trim = gen.finish_reason == "stop" and not params.get("no_stop_trim")
        return self.tokenizer.decode(
            gen.output_ids[:-1] if stop_trim else gen.output_ids,
            skip_special_tokens=params.get("skip_special_tokens", True),
        )

    async def _finish(self, run: _Run, t0: float) -> None:
        summary = run.summary
        if not await asyncio.to_thread(self.store.finish, self.owner, summary, run.items):
            raise _Lost()
        m.EVALS_FINISHED.labels(JobState(summary.state).value).inc()
        for status, n in summary.statuses.items():
            m.EVAL_ITEMS.labels(status).inc(n)
        m.EVAL_SECONDS.observe(time.monotonic() - t0)
        if summary.state == JobState.done:
            set_gauges(summary)
        log_event(
            log,
            f"evaluation {JobState(summary.state).value}",
            logging.INFO if summary.state == JobState.done else logging.ERROR,
            eval_id=summary.eval_id,
            name=summary.name,
            version=summary.version,
            accuracy=summary.accuracy,
            format_rate=summary.format_rate,
            formatted_accuracy=summary.formatted_accuracy,
            mean_reward=summary.mean_reward,
            error=summary.error,
        )

    async def _restore_gauges(self) -> None:
        """After a restart the dashboards keep the newest results (from Redis)."""
        try:
            done = [s for s in await asyncio.to_thread(self.store.list) if s.state == JobState.done]
        except redis.RedisError as exc:
            m.EVAL_REDIS_ERRORS.inc()
            log_event(log, "evaluation gauges not restored", logging.WARNING, error=str(exc))
            return
        for summary in done[-m.EVAL_SERIES_KEPT :]:
            set_gauges(summary)


def _failed(summary: EvalSummary, error: str) -> EvalSummary:
    return summary.model_copy(
        update={"state": JobState.failed, "finished_at": time.time(), "error": error[:2000]}
    )


_series: dict[tuple[str, str], int] = {}  # gauge label sets set by this process -> version


def set_gauges(summary: EvalSummary) -> None:
    """Export a done evaluation; beyond EVAL_SERIES_KEPT series the lowest versions are removed.
    A figure that is None (no scored item, no format verdict) sets no gauge, rather than a made-up 0."""
    labels = (summary.name, str(summary.version))
    m.EVAL_ACCURACY.labels(*labels).set(summary.accuracy or 0.0)
    m.EVAL_MEAN_LENGTH.labels(*labels).set(summary.mean_length or 0.0)
    for gauge, value in (
        (m.EVAL_MEAN_REWARD, summary.mean_reward),
        (m.EVAL_FORMAT_RATE, summary.format_rate),
        (m.EVAL_FORMATTED_ACCURACY, summary.formatted_accuracy),
    ):
        if value is not None:
            gauge.labels(*labels).set(value)
    _series[labels] = summary.version or 0
    while len(_series) > m.EVAL_SERIES_KEPT:
        oldest = min(_series, key=_series.__getitem__)
        del _series[oldest]
        for gauge in m.EVAL_GAUGES:
            try:
                gauge.remove(*oldest)
            except KeyError:
                pass
