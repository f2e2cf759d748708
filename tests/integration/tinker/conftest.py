"""A Tinker-compatible service on the real backend: a tiny model built on the spot, a reference
engine with LoRA in a thread (sampling), the service's app in a thread on the suite's Redis, and
the real `tinker` SDK as the client."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine_server import free_port, serve_in_thread

from asyncrl.services.runtime.serving import serve_app_in_thread

BASE = "tiny-qwen2"  # the model name clients send
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
        poll_hold_s=2.0,
        **overrides,
    )


def start_stack(settings) -> tuple[Stack, object]:
    from asyncrl.services.tinker.app import build_app

    app = build_app(settings)
    http = serve_app_in_thread(app, free_port(), "tinker")
    engine_url = settings.engine_urls[0] if settings.engine_urls else ""
    return Stack(http.url, app.state.service, settings, engine_url), http


@pytest.fixture(scope="module")
def tinker_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tinker")
    (root / "weights").mkdir()
    return root


@pytest.fixture(scope="module")
def engine(tiny, tinker_root):
    """A reference engine serving the tiny model with LoRA adapters from the service's weights_root."""
    running = serve_in_thread(
        str(tiny),
        weights_root=str(tinker_root / "weights"),
        enable_lora=True,
        max_lora_rank=16,
        lora_target_modules="all",
        max_loras_per_batch=4,
        max_loaded_loras=8,
        seed=0,
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stack(redis_server, tiny, tinker_root, engine):
    torch.set_num_threads(1)
    namespace = f"t{os.getpid()}{free_port()}"
    settings = tinker_settings(redis_server.url, namespace, tinker_root, tiny, engine.url, gap_timeout_s=3.0)
    running, http = start_stack(settings)
    yield running
    http.stop()


@pytest.fixture
def sdk(stack):
    """A `tinker.ServiceClient` on the stack (one session), closed after the test."""
    import tinker

    client = tinker.ServiceClient(base_url=stack.url, api_key="tml-any-key-without-auth")
    yield client
    client.close("success").result(timeout=60)
