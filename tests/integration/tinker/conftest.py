"""A Tinker-compatible service on the real backend: a tiny model built on the spot, a reference
engine with LoRA in a thread (sampling), the service's app in a thread on the suite's Redis, and
the real `tinker` SDK as the client (helpers: tests/integration/tinker_stack.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from engine_server import free_port, serve_in_thread
from tinker_stack import start_stack, tinker_settings


@pytest.fixture(scope="module")
def tinker_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tinker")
    (root / "weights").mkdir()
    return root


@pytest.fixture(scope="module")
def tinker_model(tiny) -> Path:
    """The base model the stack trains and its engine serves: the tiny one, unless a module
    overrides this fixture (test_tinker_smollm2.py)."""
    return tiny


@pytest.fixture(scope="module")
def sft_lr() -> float:
    """Adam's lr for the tests' supervised steps: large for the tiny random model; a module on a
    pretrained model overrides it (at 2e-2 SmolLM2's loss diverges)."""
    return 2e-2


@pytest.fixture(scope="module")
def engine(tinker_model, tinker_root):
    """A reference engine serving the base model with LoRA adapters from the service's weights_root."""
    running = serve_in_thread(
        str(tinker_model),
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
def stack(redis_server, tinker_model, tinker_root, engine):
    torch.set_num_threads(1)
    namespace = f"t{os.getpid()}{free_port()}"
    settings = tinker_settings(
        redis_server.url, namespace, tinker_root, tinker_model, engine.url, gap_timeout_s=3.0
    )
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
