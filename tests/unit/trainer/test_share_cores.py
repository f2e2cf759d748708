"""Core sharing in the trainer (`[trainer] core_share`, services/runtime/cores.py): where the
model checks in (`trainer.model.share_cores`), on a tiny real transformers model, and which
trainers `trainer.parts.build` refuses it for. The thread counts themselves are CoreShare's
(tests/unit/runtime/test_cores.py); here the shared file is stood in for by a recorder."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.trainer.config import TrainerSettings
from asyncrl.trainer.model import Dist, enable_activation_checkpointing, share_cores
from asyncrl.trainer.parts import build

torch.set_num_threads(1)
LAYERS = 3


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny3")
    build_tiny_model(path, seed=2, num_layers=LAYERS)
    return path


class WorkRecorder:
    """A stand-in for `CoreShare` with the one call `share_cores` makes (`work()`): records, for
    each call, the calling thread, how many decoder layers had finished their forward (from
    the test's own forward hooks) and which layers had gradients already."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers
        self.forwarded: list[int] = []
        self.calls: list[tuple[int, int, tuple[bool, ...]]] = []
        for i, layer in enumerate(layers):
            layer.register_forward_hook(lambda module, args, output, i=i: self.forwarded.append(i))

    def work(self) -> int:
        grads = tuple(any(p.grad is not None for p in layer.parameters()) for layer in self.layers)
        self.calls.append((threading.get_ident(), len(self.forwarded), grads))
        return 1


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_each_layer_checks_in_before_its_forward_and_its_backward(tiny3, checkpointing):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny3, dtype=torch.float32)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    layers = list(model.model.layers)
    assert len(layers) == LAYERS
    recorder = WorkRecorder(layers)
    share_cores(model, recorder)
    me = threading.get_ident()

    logits = model(torch.tensor([[1, 5, 6, 7, 8]])).logits
    # Forward: one call per layer, each before that layer ran (0, 1, 2 layers done), no grads yet.
    none = (False,) * LAYERS
    assert recorder.calls == [(me, done, none) for done in range(LAYERS)]
    assert recorder.forwarded == list(range(LAYERS))

    recorder.calls.clear()
    logits.logsumexp(-1).sum().backward()
    # Backward: one call per layer, last layer first, each before that layer's gradients exist
    # (the layers after it have theirs). With checkpointing, transformers recomputes `forward`
    # inside the checkpoint, outside the module's hooks: no second call per layer.
    assert recorder.calls == [
        (me, LAYERS, (False, False, False)),
        (me, LAYERS, (False, False, True)),
        (me, LAYERS, (False, True, True)),
    ]
    assert all(p.grad is not None for p in model.parameters())
    recorder.calls.clear()
    recorder.forwarded.clear()
    with torch.no_grad():  # the reference model and the recompute phase: forward only
        model(torch.tensor([[1, 5, 6]]))
    assert recorder.calls == [(me, done, (True,) * LAYERS) for done in range(LAYERS)]


@pytest.mark.parametrize(
    ("ranks", "said"),
    [
        (Dist(rank=0, world=2, local_rank=0, device=torch.device("cpu"), backend="gloo"), "2 ranks on cpu"),
        (
            Dist(rank=0, world=1, local_rank=0, device=torch.device("cuda", 0), backend="nccl"),
            "1 ranks on cuda",
        ),
    ],
    ids=["two_ranks", "cuda"],
)
def test_build_refuses_core_share_beyond_one_cpu_rank_before_loading_anything(tiny3, tmp_path, ranks, said):
    cfg = TrainerSettings(model_path=str(tiny3), output_dir=str(tmp_path / "out"),
                          core_share=str(tmp_path / "cores"), metrics_port=0)  # fmt: skip
    with pytest.raises(
        ValueError, match=rf"core_share is for one CPU rank .*\(this trainer: {said}\); unset it"
    ):
        build(cfg, ranks)
    # refused first: no shared file opened, no output directory written
    assert not (tmp_path / "cores").exists() and not (tmp_path / "out").exists()
