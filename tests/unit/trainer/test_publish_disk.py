"""Weight publishing to disk: atomic version directories, the newest `keep` kept, a resumed
trainer's older version replacing the lost newer ones, and a tied model that reloads."""

from __future__ import annotations

import torch

from asyncrl.trainer.publish import DiskPublisher

torch.set_num_threads(1)


def perturbed(state: dict[str, torch.Tensor], delta: float) -> dict[str, torch.Tensor]:
    return {
        k: v + delta * torch.arange(v.numel(), dtype=v.dtype).reshape(v.shape) / v.numel()
        for k, v in state.items()
    }


def test_disk_publisher_atomic_dirs_keep_n_and_tied_reload(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    pub = DiskPublisher(tmp_path / "w", tiny, keep=2)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    base.pop("lm_head.weight")  # the trainer publishes a tied weight once
    for v in (1, 2, 3):
        out = pub.write(v, perturbed(base, 0.01 * v))
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "v00000002",
        "v00000003",
    ]  # no temp dirs left
    assert out.path == str(tmp_path / "w" / "v00000003")
    assert out.nbytes == sum(t.numel() * 4 for t in base.values())
    files = {p.name for p in (tmp_path / "w" / "v00000003").iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= files
    # a resumed trainer republishes an older version: the lost, newer ones go
    pub.write(2, perturbed(base, 0.02))
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v00000002"]
    out = pub.write(3, perturbed(base, 0.03))
    loaded = AutoModelForCausalLM.from_pretrained(out.path, dtype=torch.float32)
    expected = perturbed(base, 0.03)
    for name, value in loaded.state_dict().items():
        want = expected["model.embed_tokens.weight"] if name == "lm_head.weight" else expected[name]
        assert torch.equal(value, want), name
