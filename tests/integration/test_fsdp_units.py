"""Which FSDP2 units stay gathered between forward and backward (trainer/model.py build_model):
a trainable model keeps the root (embeddings, final norm, LM head) and its last decoder layer
gathered, since its backward starts with them; every other layer, and every unit of a frozen
(reference) model, is resharded after forward. A one-rank gloo group in the test process, in
bf16 mixed precision (which shards even a world of one)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from trainer.model import _decoder_layers, build_model, init_distributed

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dist1():
    import torch.distributed as dist

    d = init_distributed("cpu", timeout_s=60)
    yield d
    dist.destroy_process_group()


def sharded(module: torch.nn.Module) -> list[bool]:
    """For each of the module's own parameters: is it the sharded DTensor (not gathered)?"""
    return [isinstance(p, DTensor) for p in module.parameters()]


def units(model) -> dict[str, list[bool]]:
    layers = _decoder_layers(model)
    root_params = [p for name, p in model.named_parameters() if ".layers." not in name]
    return {"root": [isinstance(p, DTensor) for p in root_params],
            **{f"layer{i}": sharded(layer) for i, layer in enumerate(layers)}}  # fmt: skip


def test_trainable_model_keeps_root_and_last_layer_gathered_until_backward(tiny, dist1):
    model = build_model(tiny, dist1, mixed_precision="bfloat16")
    n = len(_decoder_layers(model))
    assert n >= 2
    before = units(model)
    assert all(all(v) for v in before.values())  # everything sharded at rest
    ids = torch.randint(3, 40, (2, 6))
    loss = model(input_ids=ids).logits.float().square().mean()
    after_forward = units(model)
    assert not any(after_forward["root"]) and not any(after_forward[f"layer{n - 1}"])
    assert all(all(after_forward[f"layer{i}"]) for i in range(n - 1))
    loss.backward()
    assert all(all(v) for v in units(model).values())  # the backward resharded them
    assert all(p.grad is not None for p in model.parameters())


def test_frozen_model_reshards_every_unit_after_forward(tiny, dist1):
    ref = build_model(tiny, dist1, mixed_precision="bfloat16", trainable=False)
    with torch.no_grad():
        ref(input_ids=torch.randint(3, 40, (2, 6)))
    assert all(all(v) for v in units(ref).values())
