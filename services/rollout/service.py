"""The rollout service object: settings, tokenizer, the buffer connection, clients and the
background scheduler, weight follower, evaluation runner and (with a `router_url`) engine fleet,
started and stopped with the app."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import httpx

from asyncrl.buffer import Buffer, EngineRoster, EvalStore, Jobs, PolicyVersions
from asyncrl.proto.evals import EvalTask
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import EngineClient, get_info
from asyncrl.services.rollout.clients.environments import EnvClient
from asyncrl.services.rollout.clients.openenv import OpenEnvClient
from asyncrl.services.rollout.clients.rewards import RewardClient
from asyncrl.services.rollout.clients.router import RouterClient
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.rollout.engine_updates import WeightSync
from asyncrl.services.rollout.evaluations.evaluator import (
    Evaluator,
    build_task,
    load_eval_file,
    sampling_params,
)
from asyncrl.services.rollout.fleet import EngineFleet
from asyncrl.services.rollout.gateway.chat import Gateway
from asyncrl.services.rollout.groups.scheduler import GroupScheduler
from asyncrl.services.rollout.intake import (
    REFERENCE_ENGINE,
    SGLANG_ENGINE,
    BadRequest,
    Intake,
    resolve_context_length,
)
from asyncrl.services.runtime.auth import engine_auth_headers
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

ENGINE_KIND_TTL_S = 300.0  # engines behind a URL rarely change kind; a restart re-probes sooner
ENGINE_KIND_RETRY_S = 5.0  # unknown kind (engines unreachable): probe again at most this often
ENGINE_PROBE_TIMEOUT_S = 2.0  # a submission waits at most this long on a probe


class RolloutService:
    def __init__(self, settings: RolloutSettings, redis_url: str, tokenizer=None):
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer)
        self.settings = settings
        self.tokenizer = tokenizer
        self.context_length = resolve_context_length(settings, tokenizer)
        self.intake = Intake(settings, tokenizer, self.context_length)
        # One connection (and pool) for every part of the buffer this process uses. The routes'
        # `jobs` only enqueue, describe, read and cancel (safe from the thread pool); the
        # scheduler's parts hold its claims.
        self.buf = Buffer(redis_url, run=settings.run)
        self.jobs = Jobs(self.buf)
        self.evals = EvalStore(redis_url, run=settings.run)  # thread-safe: routes and the evaluator share it
        self.auto_evals = self._auto_eval_tasks()
        self._tasks: list[asyncio.Task] = []
        # An embedded Redis this process started (`asyncrl rollout` without redis_url): stopped
        # with the app, because uvicorn re-raises SIGTERM after its shutdown and no `finally`
        # in `main` would run.
        self.owned_redis = None
        self.engines: EngineClient | None = None
        self.rewards: RewardClient | None = None
        self.gateway: Gateway | None = (
            None  # the OpenAI-compatible gateway (services/rollout/gateway/chat.py)
        )
        self.envs: EnvClient | None = None
        self.openenv: OpenEnvClient | None = None  # the configured OpenEnv servers
        self.router: RouterClient | None = None  # the sglang-router of an engine fleet (`router_url`)
        self.fleet: EngineFleet | None = None
        self._engine_kind: tuple[float, str | None] = (float("-inf"), None)  # (probed at, kind)
        self._engine_probe = asyncio.Lock()

    def _auto_eval_tasks(self) -> dict[str, EvalTask]:
        """The tokenized automatic evaluation sets, by name (checked now, so a bad file stops the
        service at start)."""
        s, tasks = self.settings, {}
        for name, path in s.auto_eval_files.items():
            params = sampling_params(s, s.eval_sampling_params)
            try:
                tasks[name] = build_task(self.intake, load_eval_file(path), None, params, name)
            except BadRequest as exc:
                raise ValueError(f"evaluation {name} ({path}): {exc}") from None
        return tasks

    def _headers(self) -> dict[str, str] | None:
        token = os.environ.get("ASYNCRL_API_TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else None

    async def start(self, run_scheduler: bool = True) -> None:
        s = self.settings
        self.engines = EngineClient(
            s.engine_url_list,
            [] if s.router_url else s.admin_url_list,  # a fleet's engines join it (fleet.py)
            timeout_s=s.engine_timeout_s,
            retries=s.engine_retries,
            backoff_s=s.engine_backoff_s,
            unhealthy_after=s.engine_unhealthy_after,
            probe_s=s.engine_probe_s,
            update_timeout_s=s.weight_update_timeout_s,
            update_abort=s.weight_update_abort,
            update_in_flight=s.weight_update_in_flight,
            headers=self._headers(),
        )
        self.rewards = RewardClient(
            s.reward_url,
            timeout_s=s.reward_timeout_s,
            concurrency=s.reward_concurrency,
            retries=s.reward_retries,
            verifiers_ttl_s=s.verifiers_ttl_s,
            headers=self._headers(),
            local_verifiers=s.local_verifier_list,
        )
        self.envs = EnvClient(
            s.environments_url or s.reward_url,
            timeout_s=s.env_timeout_s,
            retries=s.env_retries,
            headers=self._headers(),
        )
        self.openenv = OpenEnvClient(s.openenv)
        self.gateway = Gateway(s, self.buf, self.engines, self.rewards, self.tokenizer, self.context_length)
        if not run_scheduler:
            return
        weights = WeightSync(
            PolicyVersions(self.buf),
            self.engines,
            poll_s=s.weights_poll_s,
            initial_version=s.initial_weight_version,
            run=s.run,
            max_loaded_adapters=s.max_loaded_adapters,
        )
        evaluator = Evaluator(
            s, self.evals, self.engines, self.rewards, weights, self.tokenizer, self.auto_evals
        )
        scheduler = GroupScheduler(
            s,
            self.buf,
            self.engines,
            self.rewards,
            weights,
            self.tokenizer,
            self.context_length,
            self.envs,
            self.openenv,
        )
        self.gateway.weights = weights
        if s.router_url:
            self.router = RouterClient(
                s.router_url, timeout_s=s.engine_timeout_s, headers=engine_auth_headers()
            )
            self.fleet = EngineFleet(
                self.engines,
                weights,
                self.router,
                EngineRoster(self.buf),
                configured=s.admin_url_list,
                probe_s=s.engine_probe_s,
                down_after=s.engine_unhealthy_after,
                join_timeout_s=s.fleet_join_timeout_s,
                sync_s=s.weights_poll_s,
            )
            self._tasks.append(asyncio.create_task(_logged(self.fleet.run(), "fleet"), name="fleet"))
        self._tasks += [
            asyncio.create_task(_logged(self.gateway.reap(), "gateway"), name="gateway"),
            asyncio.create_task(_logged(weights.run(), "weights"), name="weights"),
            asyncio.create_task(_logged(scheduler.run(), "scheduler"), name="scheduler"),
            asyncio.create_task(_logged(evaluator.run(), "evaluations"), name="evaluations"),
        ]
        log_event(
            log,
            "rollout service started",
            replica=s.replica,
            engines=s.engine_url_list,
            context_length=self.context_length,
        )

    async def engine_kind(self) -> str | None:
        """`reference` when any generation URL is the reference engine (`services/engine`: its
        `GET /server_info` names the `sglang_api_commit` it follows), `sglang` when every one
        that answers is something else (a real SGLang, or a router in front of SGLang), None when
        none answers (then nothing is refused for the engine's sake: it judges the request).
        Cached ENGINE_KIND_TTL_S; an unknown kind is probed again after ENGINE_KIND_RETRY_S."""
        async with self._engine_probe:
            probed_at, kind = self._engine_kind
            ttl = ENGINE_KIND_TTL_S if kind is not None else ENGINE_KIND_RETRY_S
            if time.monotonic() - probed_at < ttl:
                return kind
            async with httpx.AsyncClient(timeout=ENGINE_PROBE_TIMEOUT_S, headers=self._headers()) as http:
                infos = await asyncio.gather(
                    *(_server_info(http, i, url) for i, url in enumerate(self.settings.engine_url_list))
                )
            answered = [info for info in infos if info is not None]
            if any("sglang_api_commit" in info for info in answered):
                kind = REFERENCE_ENGINE
            else:
                kind = SGLANG_ENGINE if answered else None
            if kind != self._engine_kind[1]:
                log_event(log, "engine kind", kind=kind, engines=len(infos), answered=len(answered))
            self._engine_kind = (time.monotonic(), kind)
            return kind

    def dead_loops(self) -> list[str]:
        return [t.get_name() for t in self._tasks if t.done()]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in (self.engines, self.rewards, self.envs, self.openenv, self.router):
            if client is not None:
                await client.aclose()
        self.buf.close()
        self.evals.close()
        if self.owned_redis is not None:
            self.owned_redis.stop()


async def _server_info(http: httpx.AsyncClient, index: int, url: str) -> dict | None:
    """`GET /server_info` of the engine at `url` (its `index` in engine_urls), or its deprecated
    `/get_server_info` where the engine (SGLang before 0.5.23's names) answers 404; None if it
    does not answer with a JSON object (counted)."""
    try:
        resp, _ = await get_info(http, url, "/server_info")
        info = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        info = None
    ok = isinstance(info, dict)
    m.ENGINE_REQUESTS.labels(str(index), "server_info", "ok" if ok else "error").inc()
    return info if ok else None


async def _logged(coro, name: str) -> None:
    """A background loop that dies takes the replica's work with it: log it loudly."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except BaseException:
        log.exception("rollout %s loop crashed", name)
        raise
