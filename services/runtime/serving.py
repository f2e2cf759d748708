"""Serve an ASGI app with uvicorn in a thread of the calling process: tests and benchmarks
start real HTTP servers on loopback this way (the `asyncrl <service>` commands are the
production entry points)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

STARTUP_TIMEOUT_S = 60.0


@dataclass
class ThreadServer:
    url: str
    server: object  # uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_app_in_thread(app, port: int, name: str, host: str = "127.0.0.1") -> ThreadServer:
    """Start `app` on (host, port) and return once uvicorn reports it started."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"{name}-http-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{name} on port {port} did not start")
        time.sleep(0.02)
    return ThreadServer(f"http://{host}:{port}", server, thread)
