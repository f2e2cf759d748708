"""Which FSDP2 units stay gathered between forward and backward (trainer/model.py build_model):
a trainable model keeps the root (embeddings, final norm, LM head) and its last decoder layer
gathered, since its backward starts with them; every other layer, and every unit of a frozen
(reference) model, is resharded after forward. Two gloo ranks in spawned processes (FSDP2 in
the test process would leave DTensor caches holding its process group in the main thread,
which a later fork in the same process can deadlock on)."""

from __future__ import annotations

import json

import pytest
import torch
from spawned import finish_worker, gloo_rank, run_ranks

torch.set_num_threads(1)


def _units(model) -> dict[str, list[bool]]:
    """For each unit (the root's own parameters, each decoder layer's): is each of its
    parameters the sharded DTensor (not gathered)?"""
    from torch.distributed.tensor import DTensor

    from asyncrl.trainer.model import _decoder_layers

    root = [isinstance(p, DTensor) for name, p in model.named_parameters() if ".layers." not in name]
    return {"root": root, **{f"layer{i}": [isinstance(p, DTensor) for p in layer.parameters()]
                             for i, layer in enumerate(_decoder_layers(model))}}  # fmt: skip


def worker(rank: int, world: int, port: int, model_dir: str, out_path: str) -> None:
    from asyncrl.trainer.model import build_model

    with gloo_rank(rank, world, port) as d:
        model = build_model(model_dir, d)
        ids = torch.randint(3, 40, (2, 6))
        seen = {"at_rest": _units(model)}
        loss = model(input_ids=ids).logits.float().square().mean()
        seen["after_forward"] = _units(model)
        loss.backward()
        seen["after_backward"] = _units(model)
        seen["all_grads"] = all(p.grad is not None for p in model.parameters())
        ref = build_model(model_dir, d, trainable=False)
        with torch.no_grad():
            ref(input_ids=ids)
        seen["frozen_after_forward"] = _units(ref)
        if d.is_main:
            with open(out_path, "w") as f:
                json.dump(seen, f)
    finish_worker()


@pytest.fixture(scope="module")
def seen(tiny, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp-units") / "seen.json"
    run_ranks(2, worker, str(tiny), str(out))
    return json.loads(out.read_text())


def _all_sharded(units: dict[str, list[bool]]) -> bool:
    return all(all(flags) and flags for flags in units.values())


def test_trainable_model_keeps_root_and_last_layer_gathered_until_backward(seen):
    n = sum(k.startswith("layer") for k in seen["at_rest"])
    assert n >= 2
    assert _all_sharded(seen["at_rest"])
    after = seen["after_forward"]
    assert not any(after["root"]) and not any(after[f"layer{n - 1}"])
    assert all(all(after[f"layer{i}"]) for i in range(n - 1))
    assert _all_sharded(seen["after_backward"]) and seen["all_grads"]  # the backward resharded them


def test_frozen_model_reshards_every_unit_after_forward(seen):
    assert _all_sharded(seen["frozen_after_forward"])
