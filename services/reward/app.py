"""Builds the reward service's FastAPI app from `RewardSettings`.

`build_verifiers` decides what this server serves: `reverse`, `arith` and `math` always,
`reasoning_gym` when enabled, `code` unless disabled (it refuses to start without a working
bubblewrap unless `allow_unsandboxed`), `judge` when `judge_base_url` is set, `nemo_gym` when
any `[reward.nemo_gym.<name>]` server is configured. `build_environments` likewise:
`secret` and `calculator` always, `python` under the same rule as `code`, in a sandbox of its
own (its host uids follow the code verifier's). Nothing here imports torch.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request

from asyncrl.services.reward.config import RewardSettings
from asyncrl.services.reward.environments.base import Environment
from asyncrl.services.reward.metrics import ENV_REJECTED, REQUESTS
from asyncrl.services.reward.routes import environments as environment_routes
from asyncrl.services.reward.routes import health, rewards
from asyncrl.services.reward.scoring import Scorer
from asyncrl.services.reward.verifiers.base import Verifier
from asyncrl.services.runtime.auth import install_auth
from asyncrl.services.runtime.limits import BodyLimit, install_validation_handler
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.runtime.metrics import router as metrics_router

if TYPE_CHECKING:
    from asyncrl.services.reward.sandbox import Sandbox

log = logging.getLogger(__name__)


def build_sandbox(settings: RewardSettings, *, slots: int, uid_base: int) -> Sandbox:
    """A `Sandbox` that passed its self-test (SandboxUnavailable otherwise), or an unsandboxed
    runner when bubblewrap is missing and `allow_unsandboxed` says so (warned)."""
    from asyncrl.services.reward.sandbox import Sandbox

    sandbox = Sandbox(
        python=settings.code_python,
        slots=slots,
        uid_base=uid_base,
        bwrap=settings.bwrap,
        allow_unsandboxed=settings.allow_unsandboxed,
    )
    sandbox.self_test()
    if not sandbox.sandboxed:
        log_event(log, "code runs WITHOUT a sandbox (allow_unsandboxed)", logging.WARNING)
    return sandbox


def build_verifiers(settings: RewardSettings) -> dict[str, Verifier]:
    from asyncrl.services.reward.verifiers.math import MathVerifier
    from asyncrl.services.reward.verifiers.toy import ArithVerifier, ReverseVerifier

    toy = {"concurrency": 1024, "timeout_s": settings.toy_timeout_s}
    verifiers: list[Verifier] = [
        ReverseVerifier(**toy),
        ArithVerifier(**toy),
        MathVerifier(
            workers=settings.math_workers,
            timeout_s=settings.math_timeout_s,
            max_chars=settings.math_max_chars,
            memory_mb=settings.math_memory_mb,
            strict=settings.math_strict,
        ),
    ]
    if settings.reasoning_gym_enabled:
        from asyncrl.services.reward.verifiers.rgym import ReasoningGymVerifier

        verifiers.append(
            ReasoningGymVerifier(
                workers=settings.reasoning_gym_workers,
                timeout_s=settings.reasoning_gym_timeout_s,
                max_chars=settings.reasoning_gym_max_chars,
                memory_mb=settings.reasoning_gym_memory_mb,
            )
        )
    if settings.code_enabled:
        from asyncrl.services.reward.verifiers.code import CodeVerifier

        verifiers.append(
            CodeVerifier(
                build_sandbox(settings, slots=settings.code_concurrency, uid_base=settings.code_uid_base),
                concurrency=settings.code_concurrency,
                item_timeout_s=settings.code_item_timeout_s,
                max_test_timeout_s=settings.code_max_test_timeout_s,
                max_memory_mb=settings.code_max_memory_mb,
                max_tests=settings.code_max_tests,
                output_bytes=settings.code_output_bytes,
                tmpfs_mb=settings.code_tmpfs_mb,
                max_procs=settings.code_max_procs,
                max_files=settings.code_max_files,
            )
        )
    if settings.judge_base_url:
        from asyncrl.services.reward.verifiers.judge import JudgeVerifier

        verifiers.append(
            JudgeVerifier(
                base_url=settings.judge_base_url,
                model=settings.judge_model,
                api_key=settings.judge_api_key,
                concurrency=settings.judge_concurrency,
                request_timeout_s=settings.judge_request_timeout_s,
                item_timeout_s=settings.judge_item_timeout_s,
                max_retries=settings.judge_max_retries,
                backoff_s=settings.judge_backoff_s,
                max_tokens=settings.judge_max_tokens,
                temperature=settings.judge_temperature,
                max_chars=settings.judge_max_chars,
            )
        )
    if settings.nemo_gym:
        from asyncrl.services.reward.verifiers.nemo_gym import NemoGymVerifier

        verifiers.append(
            NemoGymVerifier(
                settings.nemo_gym,
                concurrency=settings.nemo_gym_concurrency,
                request_timeout_s=settings.nemo_gym_request_timeout_s,
                item_timeout_s=settings.nemo_gym_item_timeout_s,
                max_retries=settings.nemo_gym_max_retries,
                backoff_s=settings.nemo_gym_backoff_s,
            )
        )
    return {v.name: v for v in verifiers}


def build_environments(settings: RewardSettings) -> dict[str, Environment]:
    from asyncrl.services.reward.environments.calculator import CalculatorEnvironment
    from asyncrl.services.reward.environments.secret import SecretEnvironment

    environments: list[Environment] = [SecretEnvironment(), CalculatorEnvironment()]
    if settings.code_enabled:
        from asyncrl.services.reward.environments.python import PythonEnvironment

        slots, uid_base = settings.env_python_concurrency, settings.code_uid_base + settings.code_concurrency
        environments.append(
            PythonEnvironment(
                build_sandbox(settings, slots=slots, uid_base=uid_base),
                timeout_s=settings.env_python_timeout_s,
                memory_mb=settings.env_python_memory_mb,
                output_chars=settings.env_python_output_chars,
                queue_timeout_s=settings.queue_timeout_s,
                output_bytes=settings.code_output_bytes,
                tmpfs_mb=settings.code_tmpfs_mb,
                max_procs=settings.code_max_procs,
                max_files=settings.code_max_files,
            )
        )
    return {e.name: e for e in environments}


def build_app(
    settings: RewardSettings,
    verifiers: dict[str, Verifier] | None = None,
    environments: dict[str, Environment] | None = None,
) -> FastAPI:
    """The app; verifiers start in its lifespan (math workers spawn, judge client opens)."""
    verifiers = build_verifiers(settings) if verifiers is None else verifiers
    environments = build_environments(settings) if environments is None else environments
    scorer = Scorer(verifiers, cache_entries=settings.cache_entries, queue_timeout_s=settings.queue_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await scorer.start()
        log_event(log, "reward service ready", verifiers=sorted(verifiers))
        try:
            yield
        finally:
            await scorer.close()

    app = FastAPI(title="asyncrl reward", version="1", lifespan=lifespan)
    app.state.scorer = scorer
    app.state.settings = settings
    app.state.environments = environments
    install_auth(app)
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, on_refused=REQUESTS.labels("rejected").inc
    )

    def count_invalid(request: Request, malformed_json: bool) -> None:
        if request.url.path == "/v1/rewards":
            REQUESTS.labels("rejected").inc()
        elif request.url.path.startswith("/v1/environments/"):
            ENV_REJECTED.labels("invalid_body").inc()

    install_validation_handler(app, count_invalid)

    app.include_router(health.router)
    app.include_router(rewards.router)
    app.include_router(environment_routes.router)
    app.include_router(metrics_router)
    return app
