"""LoRA against full fine-tuning of SmolLM2-135M at the real recipe's step (issue #34), the
step-level half of its benchmark: trainer s/step, publish bytes and s/step, peak memory.

The two arms are the two recipes' [trainer] tables, read with the run config's own loader:

    full    configs/smollm2-math.toml: every parameter trains, a version is the whole model
            (model.safetensors in publish_dtype, fp32, beside hard links to the config and
            tokenizer files)
    lora    configs/smollm2-math-lora.toml: rank-16 adapters on every linear layer of the
            frozen base ([trainer.lora]), a version is a PEFT adapter directory

Each arm lives in its own process (a gloo world of one), so its peak memory is its own. The
process builds the trainer with `trainer.parts.build`, as `asyncrl trainer` does (the model,
AdamW over the trainable parameters, the disk publisher; the buffer on a private redis-server,
W&B and /metrics off), with the recipe's settings as they are: lr as configured (3e-5 and
1.5e-4: the weights move, as in a run; the work of a step does not depend on their values),
mixed_precision "auto" (bf16 where the CPU has it natively, else fp32: the dtype is printed).

The batch (benchmarks/real_step.py's `make_groups`, the same seed in both arms): the recipe's
4 groups of 8 answers of 20–200 tokens, prompts of 45–65 tokens; μ is each arm's own model's
log-probs before the first step (`behaviour_logprobs`), the same in both arms since a fresh
adapter's B is zero: the two arms' first losses must agree (printed as a check).

One step, timed (real_step.py's `one_step`): micro-batches → log π_old (bypass: μ) →
`policy_step` (forward + backward per micro-batch, grad clip, AdamW). Then the version is
published through the trainer's own `Parts.publish` to a temp weights dir (under runs/, where
the demo writes its weights) and announced in Redis: "publish blocking s" is what the step
waits for (gather, cast, the background writer's snapshot), "publish s" that plus the write
(safetensors, fsyncs, the rename; `publish_background` runs it beside the next step in a
run). "publish bytes" are the bytes a version puts on disk: its files, less those hard-linked
to the model directory. Each arm warms up with one step and one publish; then every round runs
one step and publish of each arm, full first in even rounds and LoRA first in odd ones; the
LoRA/full ratios are paired round by round (the median of the per-round ratios).

Memory, per arm process: peak RSS (VmHWM) after building the trainer, and over each step and
its publish (VmHWM reset through /proc/self/clear_refs before the step); the process's peak is
the larger. On CUDA also torch's peak allocation over a step and its publish. Trainable
parameters and the optimizer's state bytes (AdamW: two fp32 tensors per trainable one) are
counted after the warm-up.

    .venv/bin/python benchmarks/lora_vs_full.py --quick      # smoke test, ~40 s
    nice -n 5 .venv/bin/python benchmarks/lora_vs_full.py --model runs/models/smollm2 --rounds 5 \\
        --json runs/lora_vs_full.json                        # ~15 min, one core per arm's step

`--quick` runs one round of one group on a 64-wide tiny model built on the spot: its figures
check the plumbing only (a rank-16 adapter is 40% of so small a model, so the bytes target is
not met there).

Prints one JSON object, then a markdown table. `--json FILE` writes the figures after every
round (a run cut short keeps them). The learning curves (held-out accuracy against wall time)
come from `asyncrl demo` runs of the two configs, not from here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "full": ROOT / "configs" / "smollm2-math.toml",
    "lora": ROOT / "configs" / "smollm2-math-lora.toml",
}
TARGET_BYTES_RATIO = 20.0  # issue #34: a LoRA version ≥ 20× smaller than the full fp32 one
SAME_FIRST_LOSS_RTOL = 1e-4  # a fresh adapter (B = 0) leaves the base's forward unchanged
STOP_TIMEOUT_S = 10.0  # an idle arm leaves its process group and exits in about a second
QUICK_MODEL = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
}


# ----------------------------------------------------------------------------- figures (pure)
def summarize(runs: dict[str, list[dict]], ready: dict[str, dict], warm: dict[str, dict]) -> dict:
    """The figures of both arms from their per-round step records (`runs[arm][round]`), what each
    process reported once built (`ready`) and its warm-up record (`warm`): per arm the medians,
    peaks and counts; then LoRA over full, each ratio paired round by round (the median of the
    rounds' ratios) where a round has both, and the bytes target."""
    arms = {}
    for arm, steps in runs.items():
        step_peak = max(r["peak_rss_mb"] for r in [warm[arm], *steps])
        cuda = [r["cuda_peak_mb"] for r in [warm[arm], *steps] if r.get("cuda_peak_mb") is not None]
        arms[arm] = {
            "compute_dtype": ready[arm]["compute_dtype"],
            "lr": ready[arm]["lr"],
            "median_step_s": statistics.median(r["step_s"] for r in steps),
            "step_s": [r["step_s"] for r in steps],
            "warmup_step_s": warm[arm]["step_s"],
            "median_forward_backward_s": statistics.median(r["forward_backward_s"] for r in steps),
            "median_optimizer_s": statistics.median(r["optimizer_s"] for r in steps),
            "median_publish_s": statistics.median(r["publish_s"] for r in steps),
            "median_publish_blocking_s": statistics.median(r["publish_blocking_s"] for r in steps),
            "publish_s": [r["publish_s"] for r in steps],
            "publish_bytes": statistics.median(r["publish_bytes"] for r in steps),
            "publish_files": steps[0]["publish_files"],
            "peak_rss_mb": max(ready[arm]["build_peak_rss_mb"], step_peak),
            "build_peak_rss_mb": ready[arm]["build_peak_rss_mb"],
            "step_peak_rss_mb": step_peak,
            "cuda_peak_mb": max(cuda) if cuda else None,
            "parameters": ready[arm]["parameters"],
            "trainable_parameters": ready[arm]["trainable_parameters"],
            "optimizer_state_bytes": warm[arm]["optimizer_state_bytes"],
            "first_loss": warm[arm]["loss"],
            "loss": [r["loss"] for r in steps],
        }
    out: dict = {"arms": arms}
    if {"full", "lora"} <= arms.keys():
        full, lora = arms["full"], arms["lora"]
        paired = list(zip(runs["full"], runs["lora"]))

        def paired_ratio(key: str) -> float:
            return statistics.median(b[key] / a[key] for a, b in paired)

        bytes_ratio = full["publish_bytes"] / lora["publish_bytes"]
        out["lora_over_full"] = {
            "step_s": paired_ratio("step_s"),
            "forward_backward_s": paired_ratio("forward_backward_s"),
            "optimizer_s": paired_ratio("optimizer_s"),
            "publish_s": paired_ratio("publish_s"),
            "publish_blocking_s": paired_ratio("publish_blocking_s"),
            "publish_bytes": lora["publish_bytes"] / full["publish_bytes"],
            "peak_rss_mb": lora["peak_rss_mb"] / full["peak_rss_mb"],
            "step_peak_rss_mb": lora["step_peak_rss_mb"] / full["step_peak_rss_mb"],
            "trainable_parameters": lora["trainable_parameters"] / full["trainable_parameters"],
            "optimizer_state_bytes": lora["optimizer_state_bytes"] / full["optimizer_state_bytes"],
        }
        first_diff = abs(lora["first_loss"] - full["first_loss"]) / max(abs(full["first_loss"]), 1e-30)
        out["first_loss_rel_diff"] = first_diff
        out["same_first_loss"] = first_diff <= SAME_FIRST_LOSS_RTOL
        out["publish_bytes_full_over_lora"] = bytes_ratio
        out["bytes_target"] = {
            "full_over_lora_at_least": TARGET_BYTES_RATIO,
            "met": bytes_ratio >= TARGET_BYTES_RATIO,
        }
    return out


def table(out: dict) -> str:
    """The markdown table of `summarize`'s figures, one row a measure, LoRA/full last."""
    full, lora, ratio = out["arms"]["full"], out["arms"]["lora"], out["lora_over_full"]
    rows = [
        ("trainer s/step (median)", "median_step_s", "step_s", "{:.2f}"),
        ("forward + backward s", "median_forward_backward_s", "forward_backward_s", "{:.2f}"),
        ("optimizer s", "median_optimizer_s", "optimizer_s", "{:.3f}"),
        ("publish s/step (write included)", "median_publish_s", "publish_s", "{:.3f}"),
        ("publish s the step waits for", "median_publish_blocking_s", "publish_blocking_s", "{:.4f}"),
        ("publish bytes / version", "publish_bytes", "publish_bytes", "{:,.0f}"),
        ("peak RSS MB (process)", "peak_rss_mb", "peak_rss_mb", "{:,.0f}"),
        ("peak RSS MB (step + publish)", "step_peak_rss_mb", "step_peak_rss_mb", "{:,.0f}"),
        ("trainable parameters", "trainable_parameters", "trainable_parameters", "{:,}"),
        ("optimizer state bytes", "optimizer_state_bytes", "optimizer_state_bytes", "{:,}"),
    ]
    lines = ["| measure | full | LoRA | LoRA/full |", "|---|---|---|---|"]
    for label, key, ratio_key, fmt in rows:
        lines.append(
            f"| {label} | {fmt.format(full[key])} | {fmt.format(lora[key])} | {ratio[ratio_key]:.3g} |"
        )
    if full["cuda_peak_mb"] is not None:
        lines.append(f"| CUDA peak allocated MB | {full['cuda_peak_mb']:,.0f} | {lora['cuda_peak_mb']:,.0f} "
                     f"| {lora['cuda_peak_mb'] / full['cuda_peak_mb']:.3g} |")  # fmt: skip
    return "\n".join(lines)


# ----------------------------------------------------------------------------- one arm's process
def written_bytes(version_dir: Path, source_dir: Path) -> tuple[int, list[str]]:
    """The bytes a version put on disk (its files, less hard links to the model directory's) and
    its file names."""
    linked = {(s.st_dev, s.st_ino) for s in (f.stat() for f in source_dir.iterdir() if f.is_file())}
    files = sorted(f for f in version_dir.iterdir() if f.is_file())
    stats = [f.stat() for f in files]
    return sum(s.st_size for s in stats if (s.st_dev, s.st_ino) not in linked), [f.name for f in files]


def worker(threads: int, seed: int, n_groups: int, group_size: int, answer_max: int) -> int:
    """One arm: builds the trainer from the settings on stdin's first line, reports on stdout
    (one JSON line each) once built and after every `step` line: one step, then its publish."""
    import torch

    torch.set_num_threads(threads)
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the results
    from types import SimpleNamespace

    import torch.distributed as dist
    from real_step import behaviour_logprobs, make_groups, one_step, rss_mb
    from transformers import AutoConfig

    from asyncrl.trainer.batch import build_rows
    from asyncrl.trainer.config import TrainerSettings
    from asyncrl.trainer.model import init_distributed, resolve_mixed_precision
    from asyncrl.trainer.parts import build

    cfg = TrainerSettings(**json.loads(sys.stdin.readline()))
    ranks = init_distributed(cfg.device, cfg.dist_timeout_s)
    parts = build(cfg, ranks)
    cuda = ranks.device.type == "cuda"
    hf = AutoConfig.from_pretrained(cfg.model_path)
    specials = json.loads((Path(cfg.model_path) / "tokenizer.json").read_text())["added_tokens"]
    first_id = max(t["id"] for t in specials) + 1  # token ids drawn from the vocabulary without the specials
    groups = make_groups(n_groups, group_size, answer_max, hf.vocab_size, first_id, hf.eos_token_id, seed)
    rows = build_rows(groups, cfg.advantage).rows
    behaviour_logprobs(rows, parts.model, cfg, parts.pad_id, ranks.device)
    arm = SimpleNamespace(cfg=cfg, model=parts.model, opt=parts.optimizer, step_cfg=parts.step_cfg)
    params = list(parts.model.parameters())
    ready = {
        "compute_dtype": resolve_mixed_precision(cfg.mixed_precision, ranks.device),
        "lr": cfg.lr,
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "build_peak_rss_mb": rss_mb("VmHWM"),  # before the first step resets it
        "batch": {
            "samples": len(rows),
            "answer_tokens": sum(len(r.completion_ids) for r in rows),
            "prompt_tokens": sum(len(r.prompt_tokens) for r in rows),
        },
    }
    print(json.dumps(ready), file=results)
    for version, line in enumerate(sys.stdin, start=1):
        if line.strip() != "step":
            break
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rec = one_step(arm, rows, parts.pad_id, ranks.device, threads)  # resets VmHWM first
        parts.scheduler.step()  # once per version, as the loop does
        t0 = time.perf_counter()
        parts.publish(version)
        t1 = time.perf_counter()
        parts.finish_publishing()  # the background write, waited for here
        t2 = time.perf_counter()
        peak_reset = not math.isnan(rec["peak_rss_mb"])  # one_step reset VmHWM before the step
        nbytes, names = written_bytes(parts.disk.path_of(version, parts.epoch), Path(cfg.model_path))
        state = parts.optimizer.state.values()
        rec.update(
            step_s=rec.pop("seconds"),
            publish_blocking_s=t1 - t0,
            publish_s=t2 - t0,
            publish_bytes=nbytes,
            publish_files=names,
            step_only_peak_rss_mb=rec.pop("peak_rss_mb"),  # before the publish
            peak_rss_mb=rss_mb("VmHWM") if peak_reset else float("nan"),  # step + publish
            cuda_peak_mb=torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            optimizer_state_bytes=sum(
                t.numel() * t.element_size() for s in state for t in s.values() if torch.is_tensor(t)
            ),
        )
        print(json.dumps(rec), file=results)
    dist.destroy_process_group()
    return 0


class Arm:
    """The parent's handle on one arm's process: settings in, one JSON line per request out."""

    def __init__(self, name: str, settings: dict, args: list[str], env: dict):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self._send(json.dumps(settings))

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the {self.name} arm's process exited ({self.proc.wait()}): see its stderr above"
            )
        return json.loads(line)

    def step(self) -> dict:
        self._send("step")
        return self.reply()

    def close(self) -> None:
        """An idle arm exits on `stop`; one still in a step (a run cut short) is killed."""
        if self.proc.poll() is None:
            try:
                self._send("stop")
                self.proc.stdin.close()
                self.proc.wait(STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def arm_settings(config: Path, model_path: Path, redis_url: str, out_dir: Path) -> dict:
    """The config's [trainer] table as the arm's trainer runs it: on this model, this Redis and
    this output dir; W&B, /metrics and the audit log off (nothing measured goes through them)."""
    from asyncrl.services.ops.run_config import load_run_config

    settings = load_run_config(config).trainer.model_dump()
    settings.update(model_path=str(model_path), redis_url=redis_url, run=out_dir.name, output_dir=str(out_dir),
                    metrics_port=0, audit_log=False)  # fmt: skip
    settings["wandb"] = {**settings["wandb"], "enabled": False}
    return settings


def measure(arms: dict[str, Arm], rounds: int, head: dict, json_path: Path | None) -> dict:
    """Warm-up, then `rounds` rounds of one step and publish per arm, alternating which goes first."""
    ready = {name: arm.reply() for name, arm in arms.items()}
    head = {**head, "batch": ready["full"]["batch"]}
    print(
        f"batch: {head['batch']}; model {head['model']}; threads {head['threads']}",
        file=sys.stderr,
        flush=True,
    )
    warm = {}
    for name, arm in arms.items():
        warm[name] = arm.step()
        print(f"warm-up {name}: step {warm[name]['step_s']:.2f} s, publish {warm[name]['publish_s']:.3f} s, "
              f"loss {warm[name]['loss']:.8f}", file=sys.stderr, flush=True)  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    out: dict = {}
    for r in range(rounds):
        for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            rec = arms[name].step()
            runs[name].append(rec)
            print(f"round {r} {name}: step {rec['step_s']:.2f} s, publish {rec['publish_s']:.3f} s "
                  f"({rec['publish_bytes']:,} B), loss {rec['loss']:.6f}", file=sys.stderr, flush=True)  # fmt: skip
        out = {**head, "rounds": r + 1, **summarize(runs, ready, warm)}
        if json_path:  # a run cut short keeps its finished rounds
            json_path.write_text(json.dumps(out, indent=2))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="a tiny model built on the spot, 1 round (smoke test)"
    )
    ap.add_argument("--rounds", type=int, help="timed rounds, default 5 (--quick: 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each arm's process")
    ap.add_argument("--model", type=Path, help="model directory (default: the configs' [model] path)")
    ap.add_argument("--seed", type=int, default=0, help="the batch's seed, the same in both arms")
    ap.add_argument("--json", type=Path, help="also write the JSON object here, after every round")
    ap.add_argument("--worker", nargs=5, type=int, help=argparse.SUPPRESS)  # worker()'s arguments
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)

    from asyncrl.buffer.server import RedisServer
    from asyncrl.services.ops.run_config import load_run_config

    # a `timeout` or kill cuts the run short: the `finally` below still stops the arms and Redis
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run = load_run_config(CONFIGS["full"])
    if load_run_config(CONFIGS["lora"]).model.path != run.model.path:
        raise SystemExit("the two configs train different models")
    rounds = args.rounds or (1 if args.quick else 5)
    n_groups = 1 if args.quick else run.trainer.batch_groups
    answer_max = 40 if args.quick else run.demo.max_new_tokens
    (ROOT / "runs").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".lora-vs-full-", dir=ROOT / "runs"))  # beside the demo's weights
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    try:
        if args.quick:
            from asyncrl.services.ops.tinymodel import build_tiny_model

            model_path = tmp / "model"
            build_tiny_model(model_path, **QUICK_MODEL)
        else:
            model_path = (args.model or ROOT / run.model.path).resolve()
        worker_args = [str(x) for x in (args.threads, args.seed, n_groups, run.demo.group_size, answer_max)]
        head = {"configs": {k: str(v.relative_to(ROOT)) for k, v in CONFIGS.items()}, "model": str(model_path),
                "threads": args.threads, "seed": args.seed, "quick": args.quick}  # fmt: skip
        with RedisServer(tmp / "redis") as redis:
            arms: dict[str, Arm] = {}
            try:  # the arms stop before Redis does
                for name, config in CONFIGS.items():
                    settings = arm_settings(config, model_path, redis.url, tmp / name)
                    arms[name] = Arm(name, settings, worker_args, env)
                out = measure(arms, rounds, head, args.json)
            finally:
                for arm in arms.values():
                    arm.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=2))
    print()
    print(table(out))
    print(f"\npublish bytes full/LoRA {out['publish_bytes_full_over_lora']:.1f}× (target ≥ {TARGET_BYTES_RATIO:.0f}×: "
          f"{out['bytes_target']['met']}); first losses agree within {SAME_FIRST_LOSS_RTOL} "
          f"(B = 0): {out['same_first_loss']} ({out['first_loss_rel_diff']:.1e}); compute dtype "
          f"{out['arms']['full']['compute_dtype']}; lr {out['arms']['full']['lr']} / {out['arms']['lora']['lr']}"
          + ("; --quick: a tiny model, the plumbing checked, not the target" if args.quick else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
