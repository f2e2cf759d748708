"""Run a reference engine as a real uvicorn server on a free loopback port, in a thread of the
calling process (for tests and benchmarks; `asyncrl engine` is the production entry point)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.buffer.server import free_port
from asyncrl.services.runtime.serving import ThreadServer, serve_app_in_thread

__all__ = ["RunningEngine", "free_port", "serve_in_thread"]


@dataclass
class RunningEngine:
    url: str
    engine: object  # services.engine.engine.InferenceEngine
    http: ThreadServer

    def stop(self) -> None:
        self.http.stop()


def serve_in_thread(model: str, *, tokenless_control: bool = True, **overrides) -> RunningEngine:
    """An engine on a free loopback port. Differs from `asyncrl engine` in two defaults, for
    tests that drive control endpoints directly: without an `api_token` (override or env) its
    control endpoints stay open (`tokenless_control`; pass False for the production behaviour),
    and `weights_root` is "/" (any absolute path, symlinks resolved) unless overridden."""
    from asyncrl.services.engine.app import build_app
    from asyncrl.services.engine.config import EngineSettings
    from asyncrl.services.engine.engine import InferenceEngine

    overrides.setdefault("weights_root", "/")
    settings = EngineSettings(
        model=model, host="127.0.0.1", port=overrides.pop("port", None) or free_port(), **overrides
    )
    engine = InferenceEngine(settings)
    http = serve_app_in_thread(
        build_app(engine, tokenless_control=tokenless_control), settings.port, "engine", settings.host
    )
    return RunningEngine(http.url, engine, http)
