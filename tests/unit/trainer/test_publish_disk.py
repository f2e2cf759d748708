"""Weight publishing to disk: atomic version directories, the newest `keep` kept, a resumed
trainer's older version replacing the lost newer ones, and a tied model that reloads."""

from __future__ import annotations

import torch

from asyncrl.services.transport.weights.delta import tensor_sha256
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


def test_delta_publisher_anchors_every_n_and_keeps_the_chain(tiny, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncrl.services.transport.weights.delta import DeltaManifest

    pub = DiskPublisher(tmp_path / "w", tiny, keep=1, delta=True, anchor_every=3, granularity="tensor")
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    base.pop("lm_head.weight")
    names = sorted(base)
    changed_at = {v: names[v % len(names)] for v in range(1, 8)}  # one tensor changes per version
    state = {k: v.clone() for k, v in base.items()}
    outs, anchors, listed = {}, {}, {}
    for v in range(1, 8):
        state = {k: t.clone() for k, t in state.items()}
        state[changed_at[v]] += 1.0
        outs[v] = pub.write(v, state)
        d = tmp_path / "w" / f"v{v:08d}"
        anchors[v] = (d / "model.safetensors").is_file()
        listed[v] = sorted(int(p.name[1:]) for p in (tmp_path / "w").iterdir())
        if v == 5:
            m = DeltaManifest.from_json((d / "delta.json").read_text())
            in_file = list(load_file(str(d / "delta.safetensors")))
            assert {"config.json", "tokenizer.json"} <= {p.name for p in d.iterdir()}
    full = sum(t.numel() * 4 for t in base.values())
    # anchors at 1, 4, 7 (every 3rd from the last anchor); deltas between
    assert anchors == {1: True, 2: False, 3: False, 4: True, 5: False, 6: False, 7: True}
    # keep=1, but the newest anchor and every version after it stay on disk
    assert listed == {1: [1], 2: [1, 2], 3: [1, 2, 3], 4: [4], 5: [4, 5], 6: [4, 5, 6], 7: [7]}
    assert outs[1].nbytes == outs[4].nbytes == outs[7].nbytes == full
    assert outs[5].nbytes == base[changed_at[5]].numel() * 4
    assert (m.version, m.base, m.anchor, m.granularity) == (5, 4, 4, "tensor")
    assert in_file == [changed_at[5]]
    assert m.sha256 == {changed_at[5]: tensor_sha256(state[changed_at[5]])}
    assert m.changed_bytes == outs[5].nbytes and m.full_bytes == full
    outs[8] = pub.write(8, {k: t + 0 for k, t in state.items()})  # nothing changed
    assert outs[8].nbytes == 0
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v00000007", "v00000008"]
    # a gap (a version not published here) starts a new chain with an anchor
    pub.write(10, state)
    assert (tmp_path / "w" / "v00000010" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v00000010"]


def test_a_delta_no_smaller_than_the_full_version_is_written_whole(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    pub = DiskPublisher(tmp_path / "w", tiny, keep=3, delta=True, anchor_every=10)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    base.pop("lm_head.weight")
    pub.write(1, base)
    v2 = {k: v + 1.0 for k, v in base.items()}
    out = pub.write(2, v2)  # every tensor changed
    assert (tmp_path / "w" / "v00000002" / "model.safetensors").is_file()
    assert out.nbytes == sum(t.numel() * 4 for t in base.values())
    out = pub.write(3, {k: v + (1.0 if k.endswith("norm.weight") else 0.0) for k, v in v2.items()})
    assert not (tmp_path / "w" / "v00000003" / "model.safetensors").is_file()  # 2 is its anchor
    assert out.nbytes == sum(t.numel() * 4 for k, t in base.items() if k.endswith("norm.weight"))


def test_adapter_versions_hold_the_two_peft_files_and_are_kept_like_weights(tiny, tmp_path):
    """A LoRA publisher writes each version as a PEFT adapter directory, the config given and the
    tensors handed over, and nothing of the source directory; versions are kept and dropped
    like full ones."""
    import json

    import pytest
    from safetensors import safe_open

    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj"]}
    pub = DiskPublisher(tmp_path / "w", tiny, keep=2, adapter_config=config)
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    for v in (1, 2, 3):
        out = pub.write(v, {a: torch.full((2, 128), float(v)), b: torch.zeros(128, 2)}, epoch=1)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v00000002-e1", "v00000003-e1"]
    assert out.nbytes == (2 * 128 + 128 * 2) * 4 and not out.delta
    assert sorted(p.name for p in (tmp_path / "w" / "v00000003-e1").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert json.loads((tmp_path / "w" / "v00000003-e1" / "adapter_config.json").read_text()) == config
    with safe_open(tmp_path / "w" / "v00000003-e1" / "adapter_model.safetensors", "pt") as f:
        assert sorted(f.keys()) == [a, b] and float(f.get_tensor(a)[0, 0]) == 3.0
        assert f.metadata() == {"format": "pt", "asyncrl_version": "3", "asyncrl_epoch": "1"}
    pub.write(2, {a: torch.zeros(2, 128), b: torch.zeros(128, 2)}, epoch=2)  # a resumed trainer's
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v00000002-e1", "v00000002-e2"]
    with pytest.raises(ValueError, match="no delta"):
        DiskPublisher(tmp_path / "w2", tiny, delta=True, adapter_config=config)


def test_a_write_a_crash_cut_short_is_removed_when_the_next_trainer_starts(tiny, tmp_path):
    root = tmp_path / "w"
    (root / ".tmp-v00000004").mkdir(parents=True)
    (root / ".tmp-v00000004" / "model.safetensors").write_bytes(b"half a file")
    (root / "v00000003").mkdir()  # a published version stays
    DiskPublisher(root, tiny, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["v00000003"]
