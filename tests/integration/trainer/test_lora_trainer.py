"""`[trainer.lora]` through the trainer's own parts and loop (`trainer.parts.build` +
`trainer.loop.train_steps`, one-rank gloo world, real Redis buffer, a KL penalty on): no second
model is built, the KL reference is the base (0 at the first step, when the adapters still
equal it), every version is announced as a LoRA adapter with its name and published as the
adapter alone, and the checkpoint holds the adapters."""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.buffer import Buffer, Groups, PolicyVersions
from asyncrl.proto import Group, Sample
from asyncrl.trainer.config import TrainerSettings

torch.set_num_threads(1)
B, STEPS, RANK = 2, 3, 4
ADAPTER_PARAMS = RANK * 2048 * 2  # the tiny Qwen2's adapters on every Linear (test_lora.py)


def groups(n: int, seed: int) -> list[Group]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        samples = [Sample(prompt_id=f"p{g}", index=i, completion_ids=rng.integers(3, 40, 4).astype(np.int32),
                          behavior_logprobs=np.full(4, -3.0, np.float32), versions=np.zeros(4, np.int32),
                          finish_reason="length", reward=float(i % 2), reward_status="scored")
                   for i in range(4)]  # fmt: skip
        out.append(Group.build(group_id=f"g{seed}-{g}", job_id="job", prompt_tokens=np.array([1, 5, 6, 7], np.int32),
                               reward_spec={"verifier": "reverse"}, samples=samples, submit_version=0))  # fmt: skip
    return out


def test_a_lora_run_trains_adapters_against_the_base_and_announces_them(
    tiny, tmp_path, redis_url, run_id, one_rank, monkeypatch
):
    from safetensors import safe_open

    from asyncrl.trainer import loop
    from asyncrl.trainer.checkpoint import CheckedReader
    from asyncrl.trainer.lora import adapter_state_dict
    from asyncrl.trainer.parts import build

    Groups(Buffer(redis_url, run=run_id)).put(groups(B * STEPS, seed=5))
    ref_kl: dict[int, float] = {}
    record = loop.record

    def recorded(parts, version, taken, rows, stats, phases, step_s):  # the loop's own figures, kept
        ref_kl[version] = stats["ref_kl"]
        record(parts, version, taken, rows, stats, phases, step_s)

    monkeypatch.setattr(loop, "record", recorded)
    cfg = TrainerSettings(
        redis_url=redis_url,
        run=run_id,
        model_path=str(tiny),
        output_dir=str(tmp_path),
        batch_groups=B,
        max_steps=STEPS,
        max_staleness=100,
        checkpoint_every=2,
        metrics_port=0,
        device="cpu",
        publish="disk",
        publish_dtype="bfloat16",
        lr=1e-2,
        kl_coef=0.1,
        share_prompts=True,
        block_ms=100,
        lora={"rank": RANK, "alpha": 8.0},
    )
    parts = build(cfg, one_rank)
    assert parts.ref_model is None  # the base is the reference: no second model
    assert sum(p.numel() for g in parts.optimizer.param_groups for p in g["params"]) == ADAPTER_PARAMS
    assert loop.train_steps(parts) == 0

    # step 1 trains adapters that still equal the base (B = 0): KL to the base is exactly 0; then not
    assert ref_kl[1] == 0.0 and ref_kl[2] > 0 and ref_kl[3] > 0
    info = PolicyVersions(Buffer(redis_url, run=run_id)).latest()
    assert (info.version, info.method, info.kind) == (STEPS, "disk", "lora")
    assert info.adapter_name == f"{run_id}-{STEPS}"
    assert info.path == str(tmp_path / "weights" / f"v{STEPS:08d}")
    weights = tmp_path / "weights" / f"v{STEPS:08d}" / "adapter_model.safetensors"
    assert sorted(p.name for p in weights.parent.iterdir()) == ["adapter_config.json", weights.name]
    live = adapter_state_dict(parts.model)
    with safe_open(weights, "pt") as f:
        published = {k: f.get_tensor(k) for k in list(f.keys())}
    assert published.keys() == live.keys()
    for key, value in published.items():  # the version's adapters, in the publish dtype
        assert value.dtype == torch.bfloat16 and torch.equal(value, live[key].to(torch.bfloat16)), key
    assert sum(t.numel() for t in published.values()) == ADAPTER_PARAMS
    stored = CheckedReader(tmp_path / "checkpoints" / f"step_{STEPS:08d}").read_metadata()
    model_keys = [k for k in stored.state_dict_metadata if k.startswith("model.")]
    assert len(model_keys) == 28 and all(".lora_" in k for k in model_keys)
