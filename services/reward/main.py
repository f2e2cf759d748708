"""`asyncrl reward`: parse settings, build the app, serve it with uvicorn."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from asyncrl.services.reward.config import RewardSettings
    from asyncrl.services.runtime.config import load_settings
    from asyncrl.services.runtime.logging import setup_logging

    settings = load_settings(RewardSettings, argv, prog="asyncrl reward", section="reward")
    setup_logging(settings.log_level)

    import uvicorn

    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.sandbox import SandboxUnavailable

    try:
        app = build_app(settings)
    except SandboxUnavailable as exc:
        print(f"asyncrl reward: code verifier refuses to start: {exc}", file=sys.stderr)
        return 2
    from asyncrl.services.runtime.heap_freeze import freeze_startup_heap

    freeze_startup_heap()
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None, log_level=settings.log_level)
    return 0
