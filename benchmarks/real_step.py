"""The trainer's step on SmolLM2-135M at the real recipe's shape, one arm per micro-batch layout
(issue #33): which of chunked log-probs, packing and shared prompts pay at 135M, on 1 and 2 threads.

The real recipe is configs/smollm2-math.toml: B = 4 prompts × G = 8 answers, micro-batches of 8,
bypass (π_old = the engine's logprobs), one minibatch, fp32 on the CPU. Its [trainer] table is read
with the run config's own loader, and each arm changes one setting of it:

    padded        today's layout: padded micro-batches of 8 rows, LM head in chunks of 1,024 tokens
    all-logits    logprob_chunk_tokens = 0: the LM head's logits of every answer token at once
    packed-1024   max_tokens_per_micro_batch = 1024: samples back to back, no padding
    packed-2048   max_tokens_per_micro_batch = 2048
    shared        share_prompts: one row per prompt, its answers under a tree attention mask
    bf16-auto     mixed_precision as the config says ("auto"), with the padded layout: bf16 where
                  the CPU has native bf16 (AMX or AVX512-BF16), else the arm is left out
    bf16-shared, bf16-packed-2048   the same two layouts in the config's dtype ("auto"): the
                  recipe as it runs on a CPU with native bf16

Every fp32 arm runs with mixed_precision = "float32" (what "auto" picks on a CPU without native
bf16, where the recipe was tuned). lr = 0 for all: AdamW still does its whole step, but the
weights never move, so every arm and every round computes the same loss on the same weights. The
check printed below: each fp32 arm's grad norm within 1e-4 relative of the padded arm's, and its
loss within 1e-4 relative of the padded arm's loss, and of the mean |advantage| per token (the
size of the loss's terms: with π/μ ≈ 1 and advantages centred per group the loss nearly cancels,
so a difference relative to the loss itself is ill-conditioned; both are reported).

The batch: the recipe's 4 groups of 8 answers; prompts of 45–65 tokens (one per group, shared by
its answers, as GRPO groups are), answers of 20 + 180·Beta(2, 2) tokens (20–200, mean 110) ending
in EOS, token ids drawn from the vocabulary without its special tokens, rewards 0/1 with both in
every group. The behaviour logprobs are the model's own (one no-grad forward at the sampling
temperature before timing), so π/μ ≈ 1 as in a run with no mismatch.

One step, timed: `micro_batches` → log π_old (`trainer.loop.old_logprobs`, bypass: μ) →
`policy_step` (forward + backward per micro-batch, grad clip, AdamW), on the trainer's model
(`build_model`, one gloo rank). Each arm warms up with one step (on the fewest threads), then
every round runs every (threads, arm) once, the order reversed every other round; ratios are
paired per round. `--json FILE` writes the figures after every round (a run cut short keeps them).

    .venv/bin/python benchmarks/real_step.py --quick                  # smoke test, ~3 min
    nice -n 5 .venv/bin/python benchmarks/real_step.py --rounds 3     # ~45 min on 2 idle cores

Prints one JSON object, then a markdown table. Peak RSS is the process's during the step (all the
arms' models resident; VmHWM reset through /proc/self/clear_refs before each step).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

CONFIG = ROOT / "configs" / "smollm2-math.toml"
ARMS = {  # name → the [trainer] settings it changes
    "padded": {},
    "all-logits": {"logprob_chunk_tokens": 0},
    "packed-1024": {"max_tokens_per_micro_batch": 1024},
    "packed-2048": {"max_tokens_per_micro_batch": 2048},
    "shared": {"share_prompts": True},
    "bf16-auto": {"mixed_precision": "auto"},
    "bf16-shared": {"mixed_precision": "auto", "share_prompts": True},
    "bf16-packed-2048": {"mixed_precision": "auto", "max_tokens_per_micro_batch": 2048},
}
SAME_LOSS_RTOL = 1e-4  # fp32 arms: the same arithmetic in another layout or chunking


def make_groups(
    n_groups: int, group_size: int, answer_max: int, vocab: int, first_id: int, eos: int, seed: int
):
    """The recipe's batch: one prompt per group, answers of 20..answer_max tokens ending in EOS."""
    from asyncrl.proto import Group, Sample

    rng = np.random.default_rng(seed)
    low = min(20, answer_max // 2)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(first_id, vocab, int(rng.integers(45, 66))).astype(np.int32)
        rewards = rng.permutation([1.0] + [0.0] + list(rng.integers(0, 2, group_size - 2).astype(float)))
        samples = []
        for i in range(group_size):
            n = int(round(low + (answer_max - low) * rng.beta(2.0, 2.0)))
            ids = np.append(rng.integers(first_id, vocab, n - 1), eos).astype(np.int32)
            samples.append(
                Sample(
                    prompt_id=f"p{g}",
                    index=i,
                    completion_ids=ids,
                    behavior_logprobs=np.zeros(n, np.float32),  # replaced by the model's own below
                    versions=np.zeros(n, np.int32),
                    finish_reason="stop",
                    reward=float(rewards[i]),
                    reward_status="scored",
                )
            )
        groups.append(
            Group.build(
                group_id=f"g{g}",
                job_id="real-step",
                prompt_tokens=prompt,
                reward_spec={"verifier": "math"},
                samples=samples,
                submit_version=0,
            )
        )
    return groups


class Trained:
    """One model (and its AdamW) per (packing, compute dtype), built as trainer/parts.py builds it."""

    def __init__(self, ranks):
        self.ranks, self.models = ranks, {}

    def get(self, cfg):
        from asyncrl.trainer.model import build_model, resolve_mixed_precision

        dtype = resolve_mixed_precision(cfg.mixed_precision, self.ranks.device)
        key = (cfg.max_tokens_per_micro_batch > 0, dtype)
        if key not in self.models:
            model = build_model(
                cfg.model_path,
                self.ranks,
                random_init=cfg.random_init,
                seed=cfg.seed,
                mixed_precision=dtype,
                activation_checkpointing=cfg.activation_checkpointing,
                packing=key[0],
            )
            opt = torch.optim.AdamW(
                model.parameters(),
                lr=cfg.lr,
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
            )
            self.models[key] = (model, opt, checksum(model))
        return self.models[key][:2], dtype


def checksum(model) -> float:
    with torch.no_grad():
        full = (
            p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()
        )  # FSDP2: DTensor
        return sum(float(p.detach().double().sum()) for p in full)


def rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def behaviour_logprobs(rows, model, cfg, pad_id: int, device) -> None:
    """μ := the model's own logprobs at the sampling temperature (rows in order, 8 at a time)."""
    from asyncrl.trainer.batch import collate
    from asyncrl.trainer.step import recompute_logprobs

    for i in range(0, len(rows), cfg.micro_batch_size):
        chunk = rows[i : i + cfg.micro_batch_size]
        (lp,) = recompute_logprobs(
            model, [collate(chunk, pad_id).to(device)], cfg.temperature, cfg.logprob_chunk_tokens
        )
        for row, values in zip(chunk, lp):
            row.behavior_logprobs = values[: len(row.completion_ids)].float().numpy().copy()


def one_step(arm, rows, pad_id: int, device, threads: int) -> dict:
    from asyncrl.trainer.batch import micro_batches
    from asyncrl.trainer.loop import old_logprobs
    from asyncrl.trainer.step import policy_step

    cfg = arm.cfg
    torch.set_num_threads(threads)
    rss_before = rss_mb("VmRSS")
    peak_ok = reset_peak_rss()
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    micro = micro_batches(rows, 0, 1, cfg.minibatches, cfg.micro_batch_size, pad_id, device,
                          cfg.max_tokens_per_micro_batch, cfg.share_prompts)  # fmt: skip
    old = old_logprobs(SimpleNamespace(cfg=cfg, model=arm.model), micro)  # the loop's own rule
    stats = policy_step(arm.model, arm.opt, micro, old, [None] * len(micro), arm.step_cfg, device)
    seconds = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = rss_mb("VmHWM") if peak_ok else float("nan")
    return {
        "seconds": seconds,
        "cpu_user_s": usage.ru_utime - usage0.ru_utime,
        "cpu_sys_s": usage.ru_stime - usage0.ru_stime,
        "minor_faults": usage.ru_minflt - usage0.ru_minflt,
        "forward_backward_s": stats["forward_backward_s"],
        "optimizer_s": stats["optimizer_s"],
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "tokens": stats["tokens"],
        "micro_batches": len(micro),
        "positions": sum(mb.input_ids.numel() for mb in micro),
        "peak_rss_mb": peak,
        "step_extra_rss_mb": peak - rss_before,
    }


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one group, answers of at most 40 tokens")
    ap.add_argument(
        "--rounds",
        type=int,
        help="timed rounds, default 3 (--quick: 1) (every arm once per round and thread count)",
    )
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--model", type=Path, help="model directory (default: the config's [model] path)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the JSON object here, after every round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")

    from asyncrl.buffer.server import free_port
    from asyncrl.services.ops.run_config import load_run_config
    from asyncrl.trainer.batch import build_rows
    from asyncrl.trainer.config import TrainerSettings
    from asyncrl.trainer.model import init_distributed, resolve_mixed_precision
    from asyncrl.trainer.parts import step_config

    os.environ["MASTER_PORT"] = str(free_port())
    run = load_run_config(CONFIG)
    model_path = args.model or (ROOT / run.model.path)
    base = run.trainer.model_dump()
    # every arm: the recipe's settings; lr 0 (same weights every step); fp32 unless the arm says
    base.update(model_path=str(model_path), lr=0.0, mixed_precision="float32")
    n_groups = 1 if args.quick else run.trainer.batch_groups
    group_size, answer_max = run.demo.group_size, 40 if args.quick else run.demo.max_new_tokens
    rounds = args.rounds or (1 if args.quick else 3)
    thread_counts = [int(t) for t in args.threads.split(",")]

    ranks = init_distributed("cpu", timeout_s=3600)
    trained = Trained(ranks)
    arms = {}
    for name in args.arms.split(","):
        cfg = TrainerSettings(**{**base, **ARMS[name]})
        if (
            name.startswith("bf16-")
            and resolve_mixed_precision(cfg.mixed_precision, ranks.device) == "float32"
        ):
            print(f"{name}: no native bf16 on this CPU, left out", file=sys.stderr)
            continue
        (model, opt), dtype = trained.get(cfg)
        arms[name] = SimpleNamespace(cfg=cfg, model=model, opt=opt, dtype=dtype, step_cfg=step_config(cfg))
    padded = TrainerSettings(**base)
    (model, _), _ = trained.get(padded)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    pad_id = hf.pad_token_id or 0
    specials = json.loads((Path(model_path) / "tokenizer.json").read_text())["added_tokens"]
    first_id = max(t["id"] for t in specials) + 1  # SmolLM2's special tokens are ids 0..16
    groups = make_groups(
        n_groups, group_size, answer_max, hf.vocab_size, first_id, hf.eos_token_id, args.seed
    )
    rows = build_rows(groups, padded.advantage).rows
    t0 = time.perf_counter()
    behaviour_logprobs(rows, model, padded, pad_id, ranks.device)
    mu_s = time.perf_counter() - t0
    completion = sum(len(r.completion_ids) for r in rows)
    sample_tokens = sum(len(r.prompt_tokens) + len(r.completion_ids) for r in rows)
    print(f"batch: {len(rows)} samples, {completion} answer + {sample_tokens - completion} prompt tokens; "
          f"μ computed in {mu_s:.1f} s; arms {list(arms)}", file=sys.stderr, flush=True)  # fmt: skip

    results: dict[tuple[int, str], list[dict]] = {(t, a): [] for t in thread_counts for a in arms}
    warm = {}
    for name, arm in arms.items():
        warm[name] = one_step(arm, rows, pad_id, ranks.device, min(thread_counts))
        print(f"warm-up {name}: {warm[name]['seconds']:.1f} s", file=sys.stderr, flush=True)

    def summary(done: int) -> dict:
        """The figures of the first `done` rounds."""
        # With π/μ ≈ 1 the loss is a token mean of terms ≈ −A (ratio·advantage): GRPO's advantages are
        # centred per group, so it nearly cancels and a difference relative to the loss itself is
        # ill-conditioned. Reported both ways: relative to the loss, and relative to its terms' size.
        adv_scale = sum(abs(r.advantage) * len(r.completion_ids) for r in rows if r.valid) / completion
        ref = warm.get("padded") or next(iter(warm.values()))  # the losses are compared with the padded arm's
        ref_loss, ref_norm = ref["loss"], ref["grad_norm"]
        out = {
            "config": str(CONFIG.relative_to(ROOT)),
            "model": str(model_path),
            "quick": args.quick,
            "rounds": done,
            "lr": 0.0,
            "auto_resolves_to": resolve_mixed_precision("auto", ranks.device),
            "batch": {
                "groups": n_groups,
                "group_size": group_size,
                "samples": len(rows),
                "answer_tokens": completion,
                "prompt_tokens": sample_tokens - completion,
                "sample_tokens": sample_tokens,
                "answer_lengths": sorted(len(r.completion_ids) for r in rows),
                "mean_abs_advantage_per_token": adv_scale,
            },
            "behaviour_logprobs_s": mu_s,
            "arms": {},
        }
        for t in thread_counts:
            for a, arm in arms.items():
                runs = results[(t, a)]
                med = statistics.median(r["seconds"] for r in runs)
                base_runs = results[(t, "padded")] if "padded" in arms else runs
                one_thread = results[(min(thread_counts), a)]
                losses = [r["loss"] for r in runs] + [warm[a]["loss"]]
                norms = [r["grad_norm"] for r in runs] + [warm[a]["grad_norm"]]
                loss_diff = max(abs(x - ref_loss) for x in losses)
                out["arms"][f"{a}@{t}"] = {
                    "arm": a,
                    "threads": t,
                    "settings": ARMS[a],
                    "compute_dtype": arm.dtype,
                    "median_step_s": med,
                    "step_s": [r["seconds"] for r in runs],
                    "warmup_step_s": warm[a]["seconds"],
                    "median_forward_backward_s": statistics.median(r["forward_backward_s"] for r in runs),
                    "median_optimizer_s": statistics.median(r["optimizer_s"] for r in runs),
                    "median_cpu_user_s": statistics.median(r["cpu_user_s"] for r in runs),
                    "median_cpu_sys_s": statistics.median(r["cpu_sys_s"] for r in runs),
                    "median_minor_faults": statistics.median(r["minor_faults"] for r in runs),
                    "answer_tokens_per_s": runs[0]["tokens"] / med,
                    "micro_batches": runs[0]["micro_batches"],
                    "positions_computed": runs[0]["positions"],
                    "positions_per_sample_token": runs[0]["positions"] / sample_tokens,
                    # paired, round by round: the padded arm's time over this arm's at these threads,
                    # and this arm's time on the fewest threads over its time on these
                    "speedup_vs_padded": statistics.median(
                        b["seconds"] / r["seconds"] for b, r in zip(base_runs, runs)
                    ),
                    "speedup_vs_fewest_threads": statistics.median(
                        o["seconds"] / r["seconds"] for o, r in zip(one_thread, runs)
                    ),
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
                    "step_extra_rss_mb": max(r["step_extra_rss_mb"] for r in runs),
                    "loss": warm[a]["loss"],
                    "grad_norm": warm[a]["grad_norm"],
                    "loss_abs_diff_vs_padded": loss_diff,
                    "loss_rel_diff_vs_padded": loss_diff / max(abs(ref_loss), 1e-30),
                    "loss_diff_over_advantage_scale": loss_diff / adv_scale,
                    "grad_norm_rel_diff_vs_padded": max(abs(x - ref_norm) for x in norms) / ref_norm,
                }
        fp32 = [v for v in out["arms"].values() if v["compute_dtype"] == "float32"]
        norms_agree = all(v["grad_norm_rel_diff_vs_padded"] <= SAME_LOSS_RTOL for v in fp32)
        out["same_loss_relative_to_loss"] = norms_agree and all(
            v["loss_rel_diff_vs_padded"] <= SAME_LOSS_RTOL for v in fp32
        )
        out["same_loss_relative_to_advantage_scale"] = norms_agree and all(
            v["loss_diff_over_advantage_scale"] <= SAME_LOSS_RTOL for v in fp32
        )
        out["weights_unchanged"] = all(checksum(m) == c for m, _, c in trained.models.values())
        return out

    order = [(t, a) for t in thread_counts for a in arms]
    for r in range(rounds):
        for t, a in order if r % 2 == 0 else order[::-1]:
            res = one_step(arms[a], rows, pad_id, ranks.device, t)
            results[(t, a)].append(res)
            print(f"round {r} threads {t} {a}: {res['seconds']:.1f} s, loss {res['loss']:.8f}",
                  file=sys.stderr, flush=True)  # fmt: skip
        if args.json:  # a run cut short keeps its finished rounds
            args.json.write_text(json.dumps(summary(r + 1), indent=2))

    out = summary(rounds)
    print(json.dumps(out, indent=2))
    print()
    print("| arm | threads | dtype | median step s (all) | answer tok/s | vs padded (paired) | vs 1 thread "
          "| micro-batches | positions / sample tokens | peak RSS MB (step's extra) "
          "| Δloss (rel. loss · rel. scale) | Δgrad-norm rel. |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v in out["arms"].values():
        steps = ", ".join(f"{x:.1f}" for x in v["step_s"])
        print(f"| {v['arm']} | {v['threads']} | {v['compute_dtype']} | {v['median_step_s']:.1f} ({steps}) "
              f"| {v['answer_tokens_per_s']:.1f} | {v['speedup_vs_padded']:.2f}× | {v['speedup_vs_fewest_threads']:.2f}× "
              f"| {v['micro_batches']} | {v['positions_computed']:,} / {sample_tokens:,} ({v['positions_per_sample_token']:.2f}) "
              f"| {v['peak_rss_mb']:,.0f} (+{v['step_extra_rss_mb']:,.0f}) "
              f"| {v['loss_abs_diff_vs_padded']:.1e} ({v['loss_rel_diff_vs_padded']:.1e} · {v['loss_diff_over_advantage_scale']:.1e}) "
              f"| {v['grad_norm_rel_diff_vs_padded']:.1e} |")  # fmt: skip
    print(f"\nfp32 arms vs padded within {SAME_LOSS_RTOL} (grad norm relative; loss relative to itself / to "
          f"the mean |advantage| {out['batch']['mean_abs_advantage_per_token']:.3f}): {out['same_loss_relative_to_loss']} / "
          f"{out['same_loss_relative_to_advantage_scale']}; weights unchanged (lr 0): {out['weights_unchanged']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
