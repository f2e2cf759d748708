"""LoRA in the trainer (trainer/lora.py) on real gloo ranks, against plain peft.

One 2-rank world (FSDP2: the frozen base and the adapters sharded per decoder layer) and one
1-rank world (fp32: the unsharded path) run the trainer's own step (`policy_step`) twice with SGD
and no clipping on a tiny Qwen2 with adapters on every Linear layer, so each step's adapter
update is −LR · its gradient. The reference is a plain single-process peft model on the whole
batch at once, padded, its log-probs taken from its full logits, started from the adapter
values the trainer started from. With B = 0 at the start, step 1 moves only B (∂L/∂A = 0) and
step 2 moves A too, so both are compared.

On the same worlds: what a version publishes (the adapter alone, readable by
`PeftModel.from_pretrained`, reproducing the trainer's logits), and the KL reference with the
adapters switched off against a separately built base model.
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from factories import make_group
from spawned import finish_worker, gloo_rank, run_ranks

from asyncrl.trainer.batch import build_rows, collate, micro_batches
from asyncrl.trainer.losses import LossConfig, kl_penalty, policy_loss

torch.set_num_threads(1)
RANK, ALPHA, SEED = 4, 8.0, 7
LR, STEPS = 1.0, 2
NO_CLIP = 1e9  # the step's clipping off: an update is −LR · gradient exactly
PROBE = [1, 5, 6, 7, 9, 12, 30, 31]  # token ids whose logits the published adapter must reproduce
# Adapter parameters of the tiny Qwen2 (hidden 128, 2 q heads of 64 → k/v 64 wide, MLP 256, 2
# layers), r·(in + out) per Linear: q 128+128, k 128+64, v 128+64, o 128+128, gate 128+256,
# up 128+256, down 256+128 = 2048 per unit of r per layer → 4 · 2048 · 2 layers.
ADAPTER_PARAMS = RANK * 2048 * 2

# name: (options, worlds that run it)
CASES = {
    "padded": ({"publish": True, "kl": True}, (1, 2)),
    "packed-chunked-checkpointed-rslora": (
        {"max_tokens": 20, "chunk": 3, "ac": True, "rslora": True, "publish": True},
        (2,),
    ),
    "shared-prompts-chunked": ({"share": True, "chunk": 3}, (2,)),
    "bf16": ({"mp": "bfloat16"}, (2,)),
}


# (packed, attention mask dims) of a micro-batch: its layout (trainer/batch.py)
LAYOUTS = {(False, 2): "padded", (True, False): "packed", (True, 4): "shared-prompt tree"}


def groups():
    return [make_group(f"g{i}", n=4, n_tokens=3 + i, seed=i) for i in range(3)]


def settings(options: dict):
    from asyncrl.trainer.config import LoraSettings

    return LoraSettings(rank=RANK, alpha=ALPHA, rslora=options.get("rslora", False))


def snapshot(model) -> dict[str, torch.Tensor]:
    """Rank 0: the adapters now, copied (unsharded, the gathered tensors are the live ones)."""
    from asyncrl.trainer.lora import adapter_state_dict

    return {k: v.clone() for k, v in adapter_state_dict(model).items()}


def run_case(d, model_dir, name: str, options: dict, out) -> dict:
    from asyncrl.trainer.lora import adapter_config, adapter_state_dict
    from asyncrl.trainer.model import build_model
    from asyncrl.trainer.publish import DiskPublisher, cast_state
    from asyncrl.trainer.step import StepConfig, policy_step, recompute_logprobs, reference_logprobs

    model = build_model(model_dir, d, seed=SEED, mixed_precision=options.get("mp", "float32"),
                        activation_checkpointing=options.get("ac", False),
                        packing=options.get("max_tokens", 0) > 0, lora=settings(options))  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=LR)
    rows = build_rows(groups(), "grpo").rows
    micro = micro_batches(rows, d.rank, d.world, 1, 4, 0, d.device, options.get("max_tokens", 0),
                          options.get("share", False))  # fmt: skip
    chunk = options.get("chunk", 0)
    cfg = StepConfig(loss=LossConfig(), grad_clip=NO_CLIP, chunk_tokens=chunk)
    adapters, stats = [snapshot(model)], []
    for _ in range(STEPS):
        none = [None] * len(micro)
        stats.append(policy_step(model, opt, micro, none, none, cfg, d.device))
        adapters.append(snapshot(model))
    result = {
        "adapters": adapters,
        "stats": stats,
        "optimized": sum(p.numel() for g in opt.param_groups for p in g["params"]),
        "adapter_dtypes": sorted({str(p.dtype) for p in trainable}),
        "frozen_with_grad": [
            n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
        ],
        "attention": model.config._attn_implementation,
        "layouts": sorted(
            {LAYOUTS[(mb.packed, mb.attention_mask is not None and mb.attention_mask.dim())] for mb in micro}
        ),
        "row_counts": [mb.input_ids.shape[0] for mb in micro],
    }
    if options.get("publish"):  # what Parts.publish writes for a version (fp32 here, to compare exactly)
        state = adapter_state_dict(model)
        if d.is_main:
            publisher = DiskPublisher(out / f"weights-{name}-w{d.world}", model_dir,
                                      adapter_config=adapter_config(model, model_dir))  # fmt: skip
            result["published"] = publisher.write(STEPS, cast_state(state, torch.float32)).path
        with torch.no_grad():
            result["logits"] = model(input_ids=torch.tensor([PROBE])).logits
    if options.get("kl"):
        policy = recompute_logprobs(model, micro, 1.0, chunk)
        adapters_off = reference_logprobs(model, None, micro, 1.0, chunk)
        base = build_model(model_dir, d, trainable=False)
        separate = reference_logprobs(model, base, micro, 1.0, chunk)
        kl = {
            "policy": policy,
            "adapters_off": adapters_off,
            "separate": separate,
            "masks": [mb.mask for mb in micro],
        }
        torch.save(kl, out / f"kl-w{d.world}-r{d.rank}.pt")  # every rank's micro-batches
        result["trainable_after_kl"] = sum(p.requires_grad for p in model.parameters())
        result["trainable_before_kl"] = len(trainable)
    return result


def worker(rank: int, world: int, port: int, model_dir, out) -> None:
    with gloo_rank(rank, world, port) as d:
        results = {
            name: run_case(d, model_dir, name, options, out)
            for name, (options, worlds) in CASES.items()
            if world in worlds
        }
        if d.is_main:
            torch.save(results, out / f"world{world}.pt")
    finish_worker()  # (only after a clean run: an exception above exits non-zero)


def launch(world: int, model_dir, out) -> dict:
    run_ranks(world, worker, model_dir, out)
    return torch.load(out / f"world{world}.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    return {1: launch(1, tiny, out), 2: launch(2, tiny, out)}, out


def peft_reference(model_dir, options: dict, init: dict[str, torch.Tensor]) -> list[dict]:
    """Plain peft: the whole batch padded in one forward, log-probs from the full logits, the
    same loss, SGD at LR; per step the loss, the adapter gradients (peft's published names)
    and their global norm."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear",
                        use_rslora=options.get("rslora", False), task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(base, config)
    loaded = set_peft_model_state_dict(model, init)
    assert not loaded.unexpected_keys
    batch = collate(build_rows(groups(), "grpo").rows, pad_id=0)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(trainable.values(), lr=LR)
    steps = []
    for _ in range(STEPS):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = torch.log_softmax(logits.float().flatten(0, 1), dim=-1)
        picked = logp[batch.token_index[batch.present], batch.targets[batch.present]]
        lp = torch.zeros(batch.targets.shape).masked_scatter(batch.present, picked)
        loss, _ = policy_loss(
            lp, lp.detach(), batch.behavior_logprobs, batch.advantages, batch.mask, LossConfig()
        )
        loss.backward()
        grads = get_peft_model_state_dict(model, state_dict={n: p.grad.clone() for n, p in trainable.items()})
        norm = float(torch.cat([g.flatten() for g in grads.values()]).norm())
        steps.append({"loss": float(loss.detach()), "grads": grads, "norm": norm})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps


RUNS = [(name, world) for name, (_, worlds) in CASES.items() for world in worlds]


@pytest.mark.parametrize("name,world", RUNS, ids=[f"{n}-w{w}" for n, w in RUNS])
def test_adapter_updates_equal_plain_peft(tiny, runs, name, world):
    options = CASES[name][0]
    got = runs[0][world][name]
    init = got["adapters"][0]
    assert len(init) == 2 * 7 * 2  # A and B of 7 Linear layers in each of 2 decoder layers
    assert sum(t.numel() for t in init.values()) == ADAPTER_PARAMS == got["optimized"]  # adapters only
    assert got["adapter_dtypes"] == ["torch.float32"]  # the master copy, also under bf16 compute
    assert got["frozen_with_grad"] == []  # the base never got a gradient
    for key, value in init.items():  # peft's initialisation: A kaiming-uniform (bound 1/√in), B zero
        if ".lora_B." in key:
            assert not value.any(), key
        else:
            assert 0 < float(value.abs().max()) <= 1 / value.shape[1] ** 0.5, key
    if "packed" in name:
        assert got["layouts"] == ["packed"] and got["attention"] == "asyncrl_segments"
    elif "shared" in name:  # samples of one prompt in one row (12 samples, each rank 6)
        assert got["layouts"] == ["shared-prompt tree"] and sum(got["row_counts"]) < 12 // world
    else:
        assert got["layouts"] == ["padded"]
    reference = peft_reference(tiny, options, init)
    bf16 = options.get("mp") == "bfloat16"
    for step, want in enumerate(reference):
        stats = got["stats"][step]
        before, after = got["adapters"][step], got["adapters"][step + 1]
        assert after.keys() == want["grads"].keys()
        if bf16:  # the same update to bf16 rounding of the compute
            assert stats["loss"] == pytest.approx(want["loss"], rel=0.05, abs=1e-3)
            err = sum(float((after[k] - before[k] + LR * g).pow(2).sum()) for k, g in want["grads"].items())
            assert err**0.5 < 0.1 * LR * want["norm"]
            continue
        assert stats["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        assert stats["grad_norm"] == pytest.approx(want["norm"], rel=1e-5)
        for key, grad in want["grads"].items():
            trainer_grad = (before[key] - after[key]) / LR
            assert torch.allclose(trainer_grad, grad, atol=1e-6, rtol=1e-4), (step, key)
    a_moved = [
        k for k in init if ".lora_A." in k and not torch.equal(got["adapters"][1][k], got["adapters"][2][k])
    ]
    b_moved = [k for k in init if ".lora_B." in k and not torch.equal(init[k], got["adapters"][1][k])]
    assert len(a_moved) == len(b_moved) == 14  # step 1 moved every B, step 2 every A


PUBLISHED = [(name, world) for name, world in RUNS if CASES[name][0].get("publish")]


@pytest.mark.parametrize("name,world", PUBLISHED, ids=[f"{n}-w{w}" for n, w in PUBLISHED])
def test_a_version_publishes_the_adapter_alone(tiny, runs, name, world):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    got = runs[0][world][name]
    published = got["published"]
    files = sorted(p.name for p in os.scandir(published))
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert os.path.basename(published) == f"v{STEPS:08d}"  # named by version, as weight directories are
    weights = os.path.join(published, "adapter_model.safetensors")
    with safe_open(weights, "pt") as f:
        keys = list(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    assert all(k.startswith("base_model.model.model.layers.") for k in keys), keys
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys), keys
    assert sum(t.numel() for t in tensors.values()) == ADAPTER_PARAMS
    for key, value in tensors.items():
        assert torch.equal(value, got["adapters"][-1][key]), key
    with open(weights, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
    # the file is its header and the adapter's fp32 bytes, nothing else
    assert os.path.getsize(weights) == 8 + header + ADAPTER_PARAMS * 4
    assert header < 0.1 * ADAPTER_PARAMS * 4
    with open(os.path.join(published, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["peft_type"], config["r"], config["base_model_name_or_path"]) == ("LORA", RANK, str(tiny))
    if CASES[name][0].get("rslora"):  # folded: α/r with α' = α·√r is the rsLoRA scale α/√r
        assert config["use_rslora"] is False and config["lora_alpha"] == pytest.approx(ALPHA * RANK**0.5)
    else:
        assert config["lora_alpha"] == ALPHA
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    plain = base(input_ids=torch.tensor([PROBE])).logits.detach()
    loaded = PeftModel.from_pretrained(base, published)
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor([PROBE])).logits
    assert torch.allclose(logits, got["logits"], atol=1e-5, rtol=1e-5)
    assert float((logits - plain).abs().max()) > 1e-3  # the adapter does change the model


@pytest.mark.parametrize("world", [1, 2])
def test_kl_reference_with_adapters_off_is_the_base_model(runs, world):
    out = runs[1]
    for rank in range(world):
        kl = torch.load(out / f"kl-w{world}-r{rank}.pt", weights_only=True)
        for policy, off, separate, mask in zip(kl["policy"], kl["adapters_off"], kl["separate"], kl["masks"]):
            assert torch.allclose(off, separate, atol=1e-6, rtol=0), rank
            k3_off, k3_separate = kl_penalty(policy, off, mask), kl_penalty(policy, separate, mask)
            assert torch.allclose(k3_off, k3_separate, atol=1e-7, rtol=1e-5)
            assert float(((policy - separate).abs() * mask).max()) > 1e-4  # the adapters moved the policy
    got = runs[0][world]["padded"]
    assert got["trainable_after_kl"] == got["trainable_before_kl"]  # nothing left frozen by the switch


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
