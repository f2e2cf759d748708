"""Prometheus exposition shared by every process.

A FastAPI service mounts `router` (`/metrics` on the default registry). A process that is not
a FastAPI service (the trainer's rank 0, the launcher) calls `serve_metrics`: a stdlib
ThreadingHTTPServer in a daemon thread, so a slow scrape never touches the caller's loop; it
answers GET only, its routes and nothing else (404 `{"detail":"not found"}`).

Naming (docs/architecture.md §9): `asyncrl_` prefix, base units (seconds, bytes), `_total` counters,
bounded label values only (verifier names, stream names, reasons; never ids).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

router = APIRouter()
NOT_FOUND = b'{"detail":"not found"}'


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def serve_metrics(
    host: str,
    port: int,
    registry: CollectorRegistry = REGISTRY,
    *,
    json_routes: dict[str, Callable[[], dict]] | None = None,
    thread_name: str = "metrics",
) -> ThreadingHTTPServer:
    """Serve `/metrics` of `registry`, and each of `json_routes` (path → the body's dict, read at
    each request, e.g. `/healthz`), on (host, port) from a daemon thread; port 0 picks one. The
    caller stops it with `shutdown()` and `server_close()`."""
    routes = dict(json_routes or {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
            elif self.path in routes:
                body, ctype, code = json.dumps(routes[self.path]()).encode(), "application/json", 200
            else:
                body, ctype, code = NOT_FOUND, "application/json", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes are not events worth a log line
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name=thread_name, daemon=True).start()
    return server
