"""services/runtime/metrics.py `serve_metrics` over real HTTP: what the trainer's rank 0 and the
launcher serve (`/metrics` of their registry, JSON routes such as `/healthz`, 404 otherwise)."""

from __future__ import annotations

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter

from asyncrl.services.runtime.metrics import serve_metrics


def test_metrics_json_routes_and_not_found():
    registry = CollectorRegistry()
    restarts = Counter("asyncrl_test_restarts_total", "restarts", ["service"], registry=registry)
    restarts.labels("engine-0").inc(2)
    state = {"status": "ok", "version": 0}
    server = serve_metrics("127.0.0.1", 0, registry, json_routes={"/healthz": lambda: dict(state)})
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        page = httpx.get(f"{url}/metrics", timeout=5)
        assert page.status_code == 200 and page.headers["content-type"] == CONTENT_TYPE_LATEST
        assert 'asyncrl_test_restarts_total{service="engine-0"} 2.0' in page.text
        state["version"] = 3  # read at each request
        health = httpx.get(f"{url}/healthz", timeout=5)
        assert health.status_code == 200 and health.headers["content-type"] == "application/json"
        assert health.json() == {"status": "ok", "version": 3}
        missing = httpx.get(f"{url}/metrics/", timeout=5)
        assert missing.status_code == 404 and missing.json() == {"detail": "not found"}
        assert missing.headers["content-type"] == "application/json"
    finally:
        server.shutdown()
        server.server_close()


def test_without_json_routes_only_metrics_answers():
    server = serve_metrics("127.0.0.1", 0, CollectorRegistry())
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 404
    finally:
        server.shutdown()
        server.server_close()
