"""`asyncrl rollout --tokenizer DIR --engine-urls URL[,URL…] --reward-url URL [--redis-url URL]
[--run RUN] [--replica ID] …`: the rollout service.

Parses settings first and imports transformers/uvicorn only after, so `--help` is instant.
"""

from __future__ import annotations

from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.runtime.config import load_settings
from asyncrl.services.runtime.heap_freeze import freeze_startup_heap


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(RolloutSettings, argv, prog="asyncrl rollout", section="rollout")

    import logging
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the tokenizer may pull in torch; keep it to one thread

    import uvicorn

    from asyncrl.buffer import ensure_redis
    from asyncrl.services.rollout.app import build_app
    from asyncrl.services.rollout.service import RolloutService
    from asyncrl.services.runtime.logging import log_event, setup_logging

    setup_logging(settings.log_level)
    os.environ.setdefault("ASYNCRL_RUN", settings.run)
    embedded = None
    redis_url = settings.redis_url
    if redis_url is None:
        redis_url, embedded = ensure_redis(settings.run_dir)
    try:
        service = RolloutService(settings, redis_url)
        service.owned_redis = embedded
        freeze_startup_heap()
        log_event(
            logging.getLogger("asyncrl.rollout"),
            "rollout service listening",
            port=settings.port,
            replica=settings.replica,
        )
        uvicorn.run(
            build_app(service),
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=False,
        )
    finally:
        if embedded is not None:
            embedded.stop()
    return 0
