"""η = 0, bypass off: the trainer's step (FSDP2 over gloo, sharded rows, micro-batches, global
loss denominators, decoupled recompute of log π_old) must give the same parameter update as a
plain synchronous on-policy step of an unsharded model on the whole batch at once.

The "engine" logprobs are a separate forward of the same weights, one unpadded sample at a
time, as an engine would produce them. SGD is used for the update comparison because Adam's
first step (≈ lr · sign(g)) would hide gradient-scale errors such as a wrong denominator.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from spawned import finish_worker, gloo_rank, run_ranks

from asyncrl.proto import Group, Sample
from asyncrl.trainer.batch import build_rows, collate, micro_batches, token_logprobs
from asyncrl.trainer.losses import LossConfig, policy_loss
from asyncrl.trainer.step import StepConfig, policy_step, recompute_logprobs

torch.set_num_threads(1)
LR = 0.5
CLIP = 0.5  # small enough that clipping is active: the clipped update must match too


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from asyncrl.services.ops.tinymodel import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path, seed=1)
    return path


def engine_groups(model_dir, n_groups=3, n=4, seed=0) -> list[Group]:
    """Groups whose behaviour logprobs come from an unpadded per-sample forward of the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    groups = []
    for gi in range(n_groups):
        prompt = np.array([1, *rng.integers(3, 40, 3 + gi)], np.int32)
        samples = []
        for i in range(n):
            comp = rng.integers(3, 40, int(rng.integers(2, 7))).astype(np.int32)
            ids = torch.from_numpy(np.concatenate([prompt, comp]).astype(np.int64))[None]
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            lp = logp[len(prompt) - 1 : len(ids[0]) - 1].gather(
                -1, torch.from_numpy(comp.astype(np.int64))[:, None]
            )
            samples.append(Sample(prompt_id=f"p{gi}", index=i, completion_ids=comp,
                                  behavior_logprobs=lp[:, 0].numpy().astype(np.float32), versions=np.zeros(len(comp), np.int32),
                                  finish_reason="length", reward=float(rng.integers(0, 3)), reward_status="scored"))  # fmt: skip
        groups.append(Group.build(group_id=f"g{gi}", job_id="j", prompt_tokens=prompt, reward_spec={"verifier": "reverse"},
                                  samples=samples, submit_version=0))  # fmt: skip
    return groups


def plain_step(model_dir, groups, loss_cfg: LossConfig):
    """A synchronous on-policy step: one forward of the whole batch, π_old = sg(π_θ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batch = collate(build_rows(groups, "grpo").rows, pad_id=0)
    lp, _ = token_logprobs(model, batch)
    loss, _ = policy_loss(lp, lp.detach(), batch.behavior_logprobs, batch.advantages, batch.mask, loss_cfg)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norm, float(loss.detach())


AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def fsdp_worker(rank, world, port, model_dir, cases, out_path, micro_batch_size):
    """Trainer steps on `world` gloo ranks, a fresh sharded model per case; rank 0 saves
    [(full state dict, stats)] in case order."""
    from asyncrl.trainer.model import build_model, full_state_dict

    results = []
    with gloo_rank(rank, world, port) as d:
        for groups, loss_cfg, optimizer, lr, recompute, opts in cases:
            model = build_model(model_dir, d, mixed_precision=opts.get("mp", "float32"),
                                activation_checkpointing=opts.get("ac", False),
                                packing=opts.get("max_tokens", 0) > 0 and not opts.get("dense"))  # fmt: skip
            opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
                   else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1))  # fmt: skip
            rows = build_rows(groups, "grpo").rows
            micro = micro_batches(
                rows, d.rank, d.world, 1, micro_batch_size, 0, d.device, opts.get("max_tokens", 0)
            )
            chunk = opts.get("chunk", 0)
            old = (
                recompute_logprobs(model, micro, 1.0, chunk) if recompute else [None] * len(micro)
            )  # None: in-step π_old
            stats = policy_step(model, opt, micro, old, [None] * len(micro),
                                StepConfig(loss=loss_cfg, grad_clip=CLIP, chunk_tokens=chunk), d.device)  # fmt: skip
            state = full_state_dict(model)
            results.append({"state": state, "stats": stats, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                            "micro": len(micro), "attention": model.config._attn_implementation,
                            "packed": all(mb.packed for mb in micro)})  # fmt: skip
        if d.is_main:
            torch.save(results, out_path)
    finish_worker()  # (only after a clean run: an exception above exits non-zero)


@pytest.fixture(scope="module")
def fsdp_results(tiny, tmp_path_factory):
    """One 2-rank world runs every case (process start-up dominates the cost)."""
    groups, groups_lr0 = engine_groups(tiny), engine_groups(tiny, seed=1)
    cases = [(groups, LossConfig(agg=agg, max_tokens=8), "sgd", LR, True, {}) for agg in AGGS]
    cases.append(
        (groups, LossConfig(agg="token_mean"), "sgd", LR, False, {})
    )  # the loop's one-minibatch path
    cases += [
        (groups, LossConfig(agg=VARIANTS[v][0], max_tokens=8), "sgd", LR, True, VARIANTS[v][1])
        for v in VARIANTS
    ]
    cases.append((groups, LossConfig(agg="token_mean"), "sgd", LR, True, {"mp": "bfloat16", "chunk": 3}))
    cases.append((groups_lr0, LossConfig(is_correction="tis"), "adamw", 0.0, True, {}))
    out = tmp_path_factory.mktemp("fsdp") / "results.pt"
    run_ranks(
        2, fsdp_worker, tiny, cases, out, 4, timeout_s=180
    )  # 12 rows → 6 per rank → micro-batches of 4 and 2
    return groups, groups_lr0, torch.load(out, weights_only=True)


# chunked log-probs, packed micro-batches (a budget of 20 tokens: 2-3 samples a bin, bins per rank
# differ and are evened out; per-sample SDPA segments, or transformers' dense block-diagonal mask)
# and activation checkpointing: each the plain step's update too
VARIANTS = {"token_mean-chunked": ("token_mean", {"chunk": 3}),
            "token_mean-packed": ("token_mean", {"max_tokens": 20}),
            "token_mean-packed-dense-mask": ("token_mean", {"max_tokens": 20, "dense": True}),
            "seq_mean_token_mean-packed": ("seq_mean_token_mean", {"max_tokens": 20}),
            "seq_mean_token_sum_norm-packed-chunked": ("seq_mean_token_sum_norm", {"max_tokens": 20, "chunk": 5}),
            "token_mean-checkpointed-packed-chunked": ("token_mean", {"ac": True, "max_tokens": 20, "chunk": 3})}  # fmt: skip
CASES = [*AGGS, "token_mean-in-step-old", *VARIANTS]
RUNS = [*CASES, "bf16", "lr0"]  # the order of fsdp_results' cases


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_fsdp_step_equals_plain_synchronous_step(tiny, fsdp_results, case):
    """Each aggregation with a recomputed π_old, and token_mean with π_old taken from the update's
    own forward (what the loop does with one minibatch): both equal the plain step."""
    from safetensors.torch import load_file

    groups, _, results = fsdp_results
    expected, norm, loss = plain_step(tiny, groups, LossConfig(agg=CASES[case].split("-")[0], max_tokens=8))
    got = results[case]
    assert got["packed"] == ("packed" in CASES[case])
    # packed rows attend per sample segment (trainer/attention.py), or under transformers' block-diagonal mask
    assert got["attention"] == (
        "asyncrl_segments" if "packed" in CASES[case] and "dense" not in CASES[case] else "sdpa"
    )
    initial = load_file(tiny / "model.safetensors")
    assert got["stats"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert norm > CLIP  # clipping was active in both
    assert got["stats"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    moved = 0.0
    for name, value in got["state"].items():
        assert torch.allclose(value, expected[name], atol=2e-6, rtol=1e-5), name
        moved = max(moved, float((expected[name] - initial[name]).abs().max()))
    assert "lm_head.weight" not in got["state"]  # tied: published once, as HF writes it
    assert moved > 1e-3  # the step did move the weights


def test_lr_zero_gives_unit_is_weights_and_zero_mismatch(tiny, fsdp_results):
    from safetensors.torch import load_file

    stats, state = fsdp_results[2][RUNS.index("lr0")]["stats"], fsdp_results[2][RUNS.index("lr0")]["state"]
    # the trainer's π_old (batched, padded, sharded) and the engine's μ (unpadded, one by one)
    # agree to float rounding, so ρ = 1 and KL(μ‖π_old) = 0
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert abs(stats["mismatch_kl"]) < 1e-9
    assert stats["approx_kl"] == 0.0 and stats["clip_frac"] == 0.0
    initial = load_file(tiny / "model.safetensors")
    for name, value in state.items():
        assert torch.equal(value, initial[name]), (
            name
        )  # lr 0: AdamW (with weight decay) leaves them as they were


def test_bf16_compute_keeps_fp32_master_weights(tiny, fsdp_results):
    """FSDP2 mixed precision: bf16 forward/backward, fp32 sharded parameters and update. The
    step lands near the fp32 one (bf16 rounding of activations, fp32 softmax of the log-probs)
    and the weights keep fp32 precision (not rounded to bf16)."""
    from safetensors.torch import load_file

    groups, _, results = fsdp_results
    got = results[RUNS.index("bf16")]
    assert got["param_dtypes"] == ["torch.float32"]  # the sharded master weights
    expected, _, loss = plain_step(tiny, groups, LossConfig(agg="token_mean"))
    initial = load_file(tiny / "model.safetensors")
    assert got["stats"]["loss"] == pytest.approx(loss, rel=0.05, abs=1e-3)
    delta_err = delta_norm = 0.0
    for name, value in got["state"].items():
        assert value.dtype == torch.float32, name
        delta_err += float(((value - initial[name]) - (expected[name] - initial[name])).pow(2).sum())
        delta_norm += float((expected[name] - initial[name]).pow(2).sum())
    assert len(results) == len(RUNS)
    assert delta_err**0.5 < 0.1 * delta_norm**0.5  # the same update to bf16 precision
    assert delta_err > 0  # it really computed in bf16
    moved = torch.cat([v.flatten() for v in got["state"].values()])
    assert (moved != moved.bfloat16().float()).any()  # fp32 master weights, not bf16-rounded ones


def test_in_step_old_logprobs_need_a_single_minibatch():
    """From the second minibatch on π_θ has moved: π_old must then be a recompute."""
    with pytest.raises(ValueError, match="one minibatch"):
        policy_step(None, None, [None, None], [None, None], [None, None],
                    StepConfig(loss=LossConfig(), minibatches=2), torch.device("cpu"))  # fmt: skip


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
