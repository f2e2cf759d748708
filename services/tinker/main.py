"""`asyncrl tinker`: parse settings, build the app (and the trainer backend), serve it."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from asyncrl.services.runtime.config import load_settings
    from asyncrl.services.runtime.logging import setup_logging
    from asyncrl.services.tinker.config import TinkerServiceSettings

    settings = load_settings(TinkerServiceSettings, argv, prog="asyncrl tinker", section="tinker")
    setup_logging(settings.log_level)

    import uvicorn

    from asyncrl.services.tinker.app import build_app

    app = build_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None, log_level=settings.log_level)
    return 0
