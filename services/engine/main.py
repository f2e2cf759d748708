"""`asyncrl engine --model DIR [--host] [--port] [--weights-root] [--max-running-requests]
[--max-new-tokens-cap] [--context-length] [--seed] …`: the reference inference engine (SGLang
native HTTP API).

The API token comes from `ASYNCRL_ENGINE_API_TOKEN` (else `ASYNCRL_API_TOKEN`): an engine
without one listens on loopback only and refuses its control endpoints; a weak one is refused
at start (`services/runtime/auth.py`). Parses settings first and imports torch/transformers
only after, so `--help` is instant.
"""

from __future__ import annotations

import sys

from pydantic import ValidationError

from asyncrl.services.engine.config import EngineSettings
from asyncrl.services.runtime.config import load_settings
from asyncrl.services.runtime.heap_freeze import freeze_startup_heap


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load_settings(EngineSettings, argv, prog="asyncrl engine", section="engine")
    except ValidationError as exc:
        errors = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        print(f"asyncrl engine: {errors}", file=sys.stderr)
        return 2

    import logging

    import torch
    import uvicorn

    from asyncrl.services.engine.app import build_app
    from asyncrl.services.engine.engine import InferenceEngine
    from asyncrl.services.runtime.logging import log_event, setup_logging

    setup_logging(settings.log_level)
    log = logging.getLogger("asyncrl.engine")
    if settings.token is None:
        log_event(
            log,
            "no API token: listening on loopback only; control endpoints (weight updates, pause, "
            "abort, flush) are refused",
            logging.WARNING,
            host=settings.host,
        )
    if settings.weights_root is None:
        log_event(log, "no weights_root: update_weights_from_disk is refused", logging.WARNING)
    torch.set_num_threads(settings.num_threads)
    engine = InferenceEngine(settings)
    freeze_startup_heap()
    log_event(
        log,
        "engine ready",
        model=settings.model,
        host=settings.host,
        port=settings.port,
        context_length=engine.runner.context_length,
        version=engine.weight_version,
        auth=settings.token is not None,
        weights_root=settings.weights_root,
    )
    uvicorn.run(
        build_app(engine),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        # Requests still in flight at SIGTERM (a paused engine's /generate, a weight update
        # waiting on a rendezvous) are cut after this, so the engine stops promptly.
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
    )
    return 0
