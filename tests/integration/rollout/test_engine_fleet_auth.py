"""Who may change the rollout's engine fleet (`/v1/engines`, services/rollout/routes/engines.py).

Joining an engine makes the rollout call the URL it is given with the engine token, the
credential of every engine's control plane (weight loads, pause, abort). So the fleet's routes
take the engine token, never the API token alone (a client that may submit rollouts must not
learn the engine token by naming its own host as an engine), and never nothing when the rollout
holds an engine token (`asyncrl up` generates one per run even where no API token is set)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncrl.buffer.server import free_port
from asyncrl.services.runtime.auth import API_TOKEN_ENV, ENGINE_TOKEN_ENV

API_TOKEN = "rollout-api-token-3k9QzX7w"
ENGINE_TOKEN = "engine-ctrl-token-8Jd2mLp4"


@pytest.fixture
def listener():
    """An HTTP server on loopback standing for a host the caller owns: it records the
    Authorization header of every request it gets and answers like an engine at "default"."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            body = json.dumps({"weight_version": "default", "success": True}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def rollout_app(redis_url: str, run_id: str, tokenizer_dir: str):
    from asyncrl.services.rollout.app import build_app
    from asyncrl.services.rollout.config import RolloutSettings
    from asyncrl.services.rollout.service import RolloutService

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: the router is never reached here
    settings = RolloutSettings(run=run_id, replica="r0", router_url=closed, reward_url=closed,
                               tokenizer=tokenizer_dir, weights_poll_s=0.2)  # fmt: skip
    return build_app(RolloutService(settings, redis_url))


@pytest.mark.parametrize("api_token", [API_TOKEN, None], ids=["api-token-set", "no-api-token"])
def test_engine_routes_need_the_engine_token(monkeypatch, redis_url, run_id, tiny, listener, api_token):
    from fastapi.testclient import TestClient

    if api_token:
        monkeypatch.setenv(API_TOKEN_ENV, api_token)
    else:
        monkeypatch.delenv(API_TOKEN_ENV, raising=False)
    monkeypatch.setenv(ENGINE_TOKEN_ENV, ENGINE_TOKEN)
    url, seen = listener
    with TestClient(rollout_app(redis_url, run_id, str(tiny))) as client:
        for headers in ({}, {"Authorization": f"Bearer {API_TOKEN}"}):
            joined = client.post("/v1/engines", json={"url": url}, headers=headers)
            refused = (headers, 401, {"detail": "missing or invalid bearer token"}, [])
            assert (headers, joined.status_code, joined.json(), seen) == refused
            left = client.delete("/v1/engines", params={"url": url}, headers=headers)
            assert left.status_code == 401
            assert client.get("/v1/engines", headers=headers).status_code == 401
        assert seen == []  # the rollout never called the caller's host, so never sent it a token
        control = {"Authorization": f"Bearer {ENGINE_TOKEN}"}
        listing = client.get("/v1/engines", headers=control)
        assert (listing.status_code, listing.json()["engines"]) == (200, [])
        if api_token:  # the other routes keep the API token
            assert client.get("/v1/rollouts/none", headers=control).status_code == 401
            api = {"Authorization": f"Bearer {api_token}"}
            assert client.get("/v1/rollouts/none", headers=api).status_code == 404
