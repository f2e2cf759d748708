"""Run a reference engine as a real uvicorn server on a free loopback port, in a thread of the
calling process (for tests and benchmarks; `asyncrl engine` is the production entry point)."""

from __future__ import annotations

from dataclasses import dataclass

from buffer.server import free_port
from services.common.serving import ThreadServer, serve_app_in_thread

__all__ = ["RunningEngine", "free_port", "serve_in_thread"]


@dataclass
class RunningEngine:
    url: str
    engine: object  # services.engine.engine.Engine
    http: ThreadServer

    def stop(self) -> None:
        self.http.stop()


def serve_in_thread(model: str, **overrides) -> RunningEngine:
    from services.engine.app import build_app
    from services.engine.config import EngineSettings
    from services.engine.engine import Engine

    settings = EngineSettings(
        model=model, host="127.0.0.1", port=overrides.pop("port", None) or free_port(), **overrides
    )
    engine = Engine(settings)
    http = serve_app_in_thread(build_app(engine), settings.port, "engine", settings.host)
    return RunningEngine(http.url, engine, http)
