"""Run a reference engine as a real uvicorn server on a free loopback port, in a thread of the
calling process (for tests and benchmarks; `asyncrl engine` is the production entry point)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

STARTUP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningEngine:
    url: str
    engine: object  # services.engine.engine.Engine
    server: object  # uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_in_thread(model: str, **overrides) -> RunningEngine:
    import uvicorn

    from services.engine.app import build_app
    from services.engine.config import EngineSettings
    from services.engine.engine import Engine

    settings = EngineSettings(
        model=model, host="127.0.0.1", port=overrides.pop("port", None) or free_port(), **overrides
    )
    engine = Engine(settings)
    config = uvicorn.Config(
        build_app(engine), host=settings.host, port=settings.port, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"engine-http-{settings.port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"engine on port {settings.port} did not start")
        time.sleep(0.02)
    return RunningEngine(f"http://127.0.0.1:{settings.port}", engine, server, thread)
