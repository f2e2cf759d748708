"""A Tinker-compatible service for tests (tests/integration/tinker): its settings on a tiny model,
and its app served in a thread on the suite's Redis."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from engine_server import free_port
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from asyncrl.services.runtime.serving import serve_app_in_thread

BASE = "tiny-qwen2"  # the model name clients send
PROTO = {"Content-Type": "application/x-protobuf"}
KEY = "tml-" + "k3y-for-the-tinker-tests-0123456789"


@dataclass
class Stack:
    url: str
    service: object  # services.tinker.service.TinkerService
    settings: object
    engine_url: str

    def steps(self, model_id: str) -> int:
        """The optimizer steps the backend applied to a model."""
        from asyncrl.services.tinker.paths import backend_id

        return self.service.backend.info(backend_id(model_id))["step"]


def tinker_settings(
    redis_url: str, namespace: str, root: Path, model: Path, engine_url: str | None, **overrides
):
    from asyncrl.services.tinker.config import TinkerServiceSettings

    return TinkerServiceSettings(
        redis_url=redis_url,
        namespace=namespace,
        base_models={BASE: str(model)},
        engine_urls=[engine_url] if engine_url else [],
        weights_root=str(root / "weights"),
        checkpoints_root=str(root / "checkpoints"),
        **{"poll_hold_s": 2.0, **overrides},
    )


def start_stack(settings) -> tuple[Stack, object]:
    from asyncrl.services.tinker.app import build_app

    app = build_app(settings)
    http = serve_app_in_thread(app, free_port(), "tinker")
    engine_url = settings.engine_urls[0] if settings.engine_urls else ""
    return Stack(http.url, app.state.service, settings, engine_url), http


def wait_future(http: httpx.Client, rid: str, timeout: float = 120.0) -> httpx.Response:
    """Poll retrieve_future as the SDK does until it is no longer 408 (try again)."""
    deadline = time.monotonic() + timeout
    while True:
        resp = http.post("/api/v1/retrieve_future", json={"request_id": rid})
        if resp.status_code != 408 or time.monotonic() > deadline:
            return resp
        assert resp.json() == {"type": "try_again", "request_id": rid, "queue_state": "active"}


def fb_body(model_id: str, seq: int, tokens: list[int]) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def optim_body(model_id: str, seq: int, lr: float = 1e-2) -> dict:
    return types.OptimStepRequest(optim_params=types.AdamParams(learning_rate=lr), model_id=model_id, seq_id=seq).model_dump(
        mode="json", exclude_none=True
    )  # fmt: skip
