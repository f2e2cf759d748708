"""The rollout service object: settings, tokenizer, buffer handles, clients and the background
scheduler, weight follower and evaluation runner, started and stopped with the app."""

from __future__ import annotations

import asyncio
import logging
import os

from buffer import EvalStore, ReplayBuffer
from services.common.logging import log_event
from services.rollout.config import RolloutSettings
from services.rollout.engine_client import EngineClient
from services.rollout.evaluations import Evaluator, build_task, load_eval_file, sampling_params
from services.rollout.intake import BadRequest, Intake, resolve_context_length
from services.rollout.reward_client import RewardClient
from services.rollout.scheduler import Scheduler
from services.rollout.weights import WeightSync

log = logging.getLogger(__name__)


class RolloutService:
    def __init__(self, settings: RolloutSettings, redis_url: str, tokenizer=None):
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer)
        self.settings = settings
        self.redis_url = redis_url
        self.tokenizer = tokenizer
        self.context_length = resolve_context_length(settings, tokenizer)
        self.intake = Intake(settings, tokenizer, self.context_length)
        # The routes' buffer handle: they call only stateless methods (enqueue, job info,
        # cancel), which are safe from the thread pool; the scheduler has its own handle.
        self.api_buf = ReplayBuffer(redis_url, run=settings.run, consumer=f"rollout-{settings.replica}-api")
        self.evals = EvalStore(redis_url, run=settings.run)  # thread-safe: routes and the evaluator share it
        self.auto_eval = self._auto_eval_task()
        self._tasks: list[asyncio.Task] = []
        # An embedded Redis this process started (`asyncrl rollout` without redis_url): stopped
        # with the app, because uvicorn re-raises SIGTERM after its shutdown and no `finally`
        # in `main` would run.
        self.owned_redis = None
        self.engines: EngineClient | None = None
        self.rewards: RewardClient | None = None

    def _auto_eval_task(self):
        """The tokenized `eval_file` (checked now, so a bad file stops the service at start)."""
        s = self.settings
        if s.eval_file is None:
            return None
        try:
            return build_task(self.intake, load_eval_file(s.eval_file), None,
                              sampling_params(s, s.eval_sampling_params), s.eval_name)  # fmt: skip
        except BadRequest as exc:
            raise ValueError(f"eval_file {s.eval_file}: {exc}") from None

    def _headers(self) -> dict[str, str] | None:
        token = os.environ.get("ASYNCRL_API_TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else None

    async def start(self, run_scheduler: bool = True) -> None:
        s = self.settings
        self.engines = EngineClient(
            s.engine_url_list,
            s.admin_url_list,
            timeout_s=s.engine_timeout_s,
            retries=s.engine_retries,
            backoff_s=s.engine_backoff_s,
            unhealthy_after=s.engine_unhealthy_after,
            probe_s=s.engine_probe_s,
            update_timeout_s=s.weight_update_timeout_s,
            headers=self._headers(),
        )
        self.rewards = RewardClient(
            s.reward_url,
            timeout_s=s.reward_timeout_s,
            concurrency=s.reward_concurrency,
            retries=s.reward_retries,
            verifiers_ttl_s=s.verifiers_ttl_s,
            headers=self._headers(),
        )
        if not run_scheduler:
            return
        consumer = f"rollout-{s.replica}"
        weights = WeightSync(
            ReplayBuffer(self.redis_url, run=s.run, consumer=consumer),
            self.engines,
            poll_s=s.weights_poll_s,
            initial_version=s.initial_weight_version,
        )
        evaluator = Evaluator(
            s, self.evals, self.engines, self.rewards, weights, self.tokenizer, self.auto_eval
        )
        scheduler = Scheduler(
            s,
            ReplayBuffer(self.redis_url, run=s.run, consumer=consumer),
            self.engines,
            self.rewards,
            weights,
            self.tokenizer,
            self.context_length,
        )
        self._tasks = [
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

    def dead_loops(self) -> list[str]:
        return [t.get_name() for t in self._tasks if t.done()]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in (self.engines, self.rewards):
            if client is not None:
                await client.aclose()
        self.api_buf.close()
        self.evals.close()
        if self.owned_redis is not None:
            self.owned_redis.stop()


async def _logged(coro, name: str) -> None:
    """A background loop that dies takes the replica's work with it: log it loudly."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except BaseException:
        log.exception("rollout %s loop crashed", name)
        raise
