"""`asyncrl engine --model DIR [--host] [--port] [--max-running-requests] [--max-new-tokens-cap]
[--context-length] [--seed] …`: the reference inference engine (SGLang native HTTP API).

Parses settings first and imports torch/transformers only after, so `--help` is instant.
"""

from __future__ import annotations

from services.common.config import load_settings
from services.engine.config import EngineSettings


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(EngineSettings, argv, prog="asyncrl engine", section="engine")

    import logging

    import torch
    import uvicorn

    from services.common.logging import log_event, setup_logging
    from services.engine.app import build_app
    from services.engine.engine import Engine

    setup_logging(settings.log_level)
    torch.set_num_threads(settings.num_threads)
    engine = Engine(settings)
    log_event(
        logging.getLogger("asyncrl.engine"),
        "engine ready",
        model=settings.model,
        port=settings.port,
        context_length=engine.runner.context_length,
        version=engine.weight_version,
    )
    uvicorn.run(
        build_app(engine),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
    )
    return 0
