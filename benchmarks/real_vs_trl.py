"""TRL's `GRPOTrainer` against this stack: same model, task, batch, lengths and lr, same wall time.

One command runs both sides back to back on the same machine, never at once:

1. TRL: `GRPOTrainer` in this process, generating with its own `model.generate` (no vLLM), torch
   threads = the cores this process may use (one process owning the machine is TRL's shape);
2. asyncrl: `asyncrl demo` as a subprocess (Redis, engine, reward, rollout and trainer processes
   sharing the same cores, as configured),

each for `--minutes` of training. Then one evaluator scores the base model (once), TRL's final
model and ours' last published weights on the held-out problems: HF `generate`, greedy, fp32,
batched, the `math` verifier's scoring. Prints a markdown table (trained samples/s, completion
tokens/s, held-out accuracy, ours/TRL ratios) and where each side's step time went.

Equal by construction, from the config: the model; the prompts (`MathTask.train_prompts` from
`random.Random(seed)`, held-out problems rejected, in ours' submission order: TRL's dataset is not
shuffled); B prompts x G completions per optimizer step (TRL: per_device_train_batch_size = the
trainer's micro_batch_size, gradient accumulation up to B x G, one generation batch per optimizer
step, so no old-logprob recompute on either side); max_new_tokens; temperature; constant lr; grad
clip; AdamW settings; the clipped token-mean loss (TRL `loss_type="dapo"`, epsilon = clip_low,
epsilon_high = clip_high); group-std advantages; no KL; bf16 autocast when the trainer computes in
bf16 and the CPU has it; no gradient checkpointing (TRL's default is on, ours has none); no
tracking; no evaluation during training.

Time: "training wall" is the time limit, from the start of the training loop (TRL:
`on_train_begin`; ours: the demo's clock, started once its prompts are submitted); each side counts
the optimizer steps finished within it (TRL stops after the last step expected to fit, ours loses
the step in flight at the limit). Both include waiting for the first rollouts. Startup (model
loading, services) is reported apart; "steady" rates run from the first finished step to the last.

Not equal:
- Ours runs with `eval_every = 0` (no evaluations while training; held-out problems are still
  never trained on), like TRL's side: both are evaluated afterwards by this script.
- Rewards: math-verify in TRL's process, serial, on its critical path, with no deadline (a
  pathological completion could hang it); ours: the reward service's worker pool.
- Our engine samples in its configured dtype; TRL samples with the training model, under bf16
  autocast when bf16 is on (reported as "TRL generation dtype").
- Completion tokens: TRL's count includes the EOS token; ours is the trainer's loss-mask count.

    .venv/bin/python benchmarks/real_vs_trl.py --config configs/smollm2-math.toml --minutes 10 \\
        --json runs/trl-bench.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
import tomllib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The demo's version-0 evaluation, cut to prefill: one greedy token per held-out problem.
TRL_MAX_STEPS = 10**6  # the wall-clock callback stops TRL; this only has to be out of reach
ADVANTAGE_TO_TRL = {"grpo": "group", "dr_grpo": "none"}  # GRPOConfig.scale_rewards
AGG_TO_TRL = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}


@dataclass(frozen=True)
class Bench:
    """What both sides run with: the config's values and the command line's overrides."""

    config: str
    model: str
    prompts_per_step: int  # B: groups per optimizer step (the trainer's batch_groups)
    group_size: int  # G
    max_new_tokens: int
    temperature: float
    lr: float
    micro_batch_size: int
    grad_clip: float
    clip_low: float
    clip_high: float
    advantage: str
    loss_agg: str
    kl_coef: float
    entropy_coef: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    bf16: bool  # the trainer computes in bf16 (and this CPU can)
    seed: int
    minutes: float
    eval_size: int  # held-out problems scored (a prefix of the config's held-out set)
    math_max_chars: int
    threads: int

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


def load_bench(args: argparse.Namespace):
    """(Bench, the raw TOML, the demo section) from `--config` and the overrides."""
    import torch

    from asyncrl.services.ops.run_config import DemoSection
    from asyncrl.trainer.config import TrainerSettings
    from asyncrl.trainer.model import resolve_mixed_precision

    raw = tomllib.loads(args.config.read_text())
    demo = DemoSection.model_validate(raw.get("demo", {}))
    if demo.task != "math":
        raise SystemExit(f"{args.config}: [demo] task must be math (TRL's side scores math answers)")
    # --model is relative to the working directory, the config's path to the repo root (as for `asyncrl demo`)
    model = str(Path(args.model).resolve() if args.model else REPO / raw["model"]["path"])
    tr = TrainerSettings.model_validate({**raw.get("trainer", {}), "model_path": model})
    if tr.loss.kind != "ppo" or tr.advantage not in ADVANTAGE_TO_TRL or tr.minibatches != 1:
        raise SystemExit("only the PPO-clip loss, grpo/dr_grpo advantages and one minibatch map onto TRL")
    if tr.batch_groups != demo.prompts_per_step:
        print(f"note: trainer batch_groups {tr.batch_groups} != demo prompts_per_step {demo.prompts_per_step}; "
              "both sides train batch_groups groups per step")  # fmt: skip
    eval_size = demo.eval_size if args.eval_size is None else args.eval_size
    if not 0 < eval_size <= demo.eval_size:
        raise SystemExit(f"--eval-size must be in 1..{demo.eval_size}: the held-out set kept out of training")
    bench = Bench(
        config=str(args.config), model=model, prompts_per_step=tr.batch_groups, group_size=demo.group_size,
        max_new_tokens=demo.max_new_tokens, temperature=demo.temperature, lr=tr.lr,
        micro_batch_size=tr.micro_batch_size, grad_clip=tr.grad_clip, clip_low=tr.loss.clip_low,
        clip_high=tr.loss.clip_high, advantage=tr.advantage, loss_agg=tr.loss.agg, kl_coef=tr.kl_coef,
        entropy_coef=tr.entropy_coef, weight_decay=tr.weight_decay, adam_beta1=tr.adam_beta1,
        adam_beta2=tr.adam_beta2, adam_eps=tr.adam_eps,
        bf16=resolve_mixed_precision(tr.mixed_precision, torch.device("cpu")) == "bfloat16",
        seed=demo.seed if args.seed is None else args.seed, minutes=args.minutes, eval_size=eval_size,
        math_max_chars=int(raw.get("reward", {}).get("math_max_chars", 8192)),
        threads=args.threads or len(os.sched_getaffinity(0)),
    )  # fmt: skip
    return bench, raw, demo


# ---------------------------------------------------------------------------- pure helpers


def trl_layout(samples_per_step: int, micro_batch_size: int) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) whose product is one optimizer
    step's completions: the trainer's micro-batch when it divides the step, else the largest
    divisor of the step below it."""
    per_device = math.gcd(samples_per_step, micro_batch_size)
    return per_device, samples_per_step // per_device


def trl_args(b: Bench, output_dir: str) -> dict:
    """`GRPOConfig` keyword arguments equal to our trainer's settings (see the module docstring)."""
    per_device, accum = trl_layout(b.samples_per_step, b.micro_batch_size)
    return {
        # plumbing: CPU, no tracking, no checkpoints, stopped by the wall-clock callback, data in order
        "output_dir": output_dir, "use_cpu": True, "bf16": b.bf16, "seed": b.seed, "report_to": "none",
        "disable_tqdm": True, "logging_steps": 1, "save_strategy": "no", "max_steps": TRL_MAX_STEPS,
        "shuffle_dataset": False, "gradient_checkpointing": False, "use_vllm": False,
        # the batch: B x G completions per optimizer step, generated in one batch
        "per_device_train_batch_size": per_device, "gradient_accumulation_steps": accum,
        "num_generations": b.group_size, "max_completion_length": b.max_new_tokens, "temperature": b.temperature,
        # the update
        "learning_rate": b.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "max_grad_norm": b.grad_clip,
        "weight_decay": b.weight_decay, "adam_beta1": b.adam_beta1, "adam_beta2": b.adam_beta2,
        "adam_epsilon": b.adam_eps, "beta": b.kl_coef, "epsilon": b.clip_low, "epsilon_high": b.clip_high,
        "entropy_coef": b.entropy_coef, "scale_rewards": ADVANTAGE_TO_TRL[b.advantage],
        "loss_type": AGG_TO_TRL[b.loss_agg],
    }  # fmt: skip


def trainer_steps(lines: Iterable[str]) -> list[dict]:
    """The trainer's JSON "step" log records (logs/trainer.log), in order."""
    steps = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # torchrun's own lines are not JSON
            continue
        if isinstance(rec, dict) and rec.get("msg") == "step":
            steps.append(rec)
    return steps


def trainer_window(lines: Iterable[str], t_end: float) -> dict:
    """Our trainer's JSON "step" log lines (logs/trainer.log) that finished by `t_end` (epoch s):
    steps, groups, tokens, the finish times, rewards and the summed phase seconds (`wait`,
    `forward_backward`, ...; `step` is the whole step)."""
    steps = [rec for rec in trainer_steps(lines) if rec["ts"] <= t_end]
    phases: dict[str, float] = defaultdict(float)
    for s in steps:
        for k, v in s.items():
            if k.endswith("_s"):
                phases[k[:-2]] += v
    return {"steps": len(steps), "version": steps[-1]["version"] if steps else 0,
            "groups": [s["groups"] for s in steps], "tokens": sum(s["tokens"] for s in steps),
            "step_ends": [s["ts"] for s in steps], "rewards": [s["reward_mean"] for s in steps],
            "phases_s": dict(phases)}  # fmt: skip


def rates(step_samples: list[int], tokens: int, wall_s: float, step_ends: list[float]) -> dict:
    """Trained samples/s and completion tokens/s over the window, and samples/s between the first
    and the last finished step ("steady": no first-batch latency, no unfinished tail)."""
    samples = sum(step_samples)
    steady = None
    if len(step_ends) >= 2 and step_ends[-1] > step_ends[0]:
        steady = (samples - step_samples[0]) / (step_ends[-1] - step_ends[0])
    return {"samples": samples, "samples_per_s": samples / wall_s if wall_s > 0 else None,
            "tokens_per_s": tokens / wall_s if wall_s > 0 else None, "steady_samples_per_s": steady}  # fmt: skip


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------- scoring and evaluation


def score(completion: str, answer: str, max_chars: int) -> float:
    """The `math` verifier's verdict, in-process and without its deadline: the last `\\boxed{}` of
    the completion (else its tail) against the gold answer, with the worker's gold parsing."""
    from math_verify import parse, verify

    from asyncrl.services.reward.verifiers.math import answer_region
    from asyncrl.services.reward.verifiers.math_worker import _parse_gold  # the worker's exact gold rule

    gold = _parse_gold(parse, answer)
    if not gold:
        raise ValueError(f"gold answer {answer!r} does not parse")
    pred = parse(answer_region(completion, max_chars)[0], parsing_timeout=None)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0


def eos_ids(model, tokenizer) -> list[int]:
    """Every end id the engine stops at: the generation config's, the model config's, the tokenizer's."""
    ids: set[int] = set()
    for source in (model.generation_config, model.config):
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else value or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def evaluate(
    model_dir: str, problems: list[dict], max_new_tokens: int, batch_size: int, max_chars: int
) -> dict:
    """Greedy held-out accuracy of the model in `model_dir` (fp32, left-padded batches)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ends = eos_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else ends[0]
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=ends, pad_token_id=pad
    )
    correct, lengths = 0.0, []
    for i in range(0, len(problems), batch_size):
        batch = problems[i : i + batch_size]
        texts = [
            tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False) for p in batch
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, generation_config=gen)
        for row, p in zip(out[:, enc["input_ids"].shape[1] :].tolist(), batch, strict=True):
            n = next((j + 1 for j, t in enumerate(row) if t in ends), len(row))
            lengths.append(n)
            correct += score(
                tok.decode(row[:n], skip_special_tokens=True), p["reward_spec"]["answer"], max_chars
            )
    del model
    gc.collect()
    return {"accuracy": correct / len(problems), "correct": int(correct), "n": len(problems),
            "mean_length": sum(lengths) / len(lengths), "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


# ---------------------------------------------------------------------------- TRL's side


def run_trl(b: Bench, demo, out_dir: Path) -> dict:
    """Train with GRPOTrainer for `b.minutes`, save the final model to out_dir/final."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.services.ops.demo_jobs import TOPUP_STEPS, math_task

    class TimedGRPOTrainer(GRPOTrainer):
        """Adds up where TRL's step time goes (its own profiling reports only to W&B, MLflow or
        Trackio) and counts completion tokens per generation batch."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.bench_phases: dict[str, float] = defaultdict(float)
            self.bench_tokens: list[int] = []
            self.bench_gen_dtypes: set[str] = set()
            self._generating = False
            self.model.get_output_embeddings().register_forward_hook(self._note_dtype)

        def _note_dtype(self, module, inputs, output) -> None:  # None: the output is left as it is
            if self._generating:
                self.bench_gen_dtypes.add(str(output.dtype))

        def _timed(self, phase, fn, *a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.bench_phases[phase] += time.perf_counter() - t0

        def _generate_single_turn(self, *a, **kw):
            self._generating = True
            try:
                out = self._timed("generate", super()._generate_single_turn, *a, **kw)
            finally:
                self._generating = False
            self.bench_tokens.append(sum(len(c) for c in out[0]))
            return out

        def _calculate_rewards(self, *a, **kw):
            return self._timed("reward", super()._calculate_rewards, *a, **kw)

        def _generate_and_score_completions(self, *a, **kw):
            return self._timed("generate_and_score", super()._generate_and_score_completions, *a, **kw)

    class WallClock(TrainerCallback):
        """Stops training after the last step expected to finish within the limit (the next one
        would take as long as this one), as ours loses its unfinished step at the limit; keeps
        the step end times and the logs."""

        def __init__(self, limit_s: float):
            self.limit_s, self.t_begin, self.step_ends, self.logs = limit_s, None, [], []

        def on_train_begin(self, args, state, control, **kw):
            self.t_begin = time.monotonic()

        def on_step_end(self, args, state, control, **kw):
            now = time.monotonic()
            last = now - (self.step_ends[-1] if self.step_ends else self.t_begin)
            self.step_ends.append(now)
            if now + last - self.t_begin > self.limit_s:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            logs = dict(logs or {})
            self.logs.append(logs)
            if "reward" in logs:
                t = time.monotonic() - self.t_begin
                print(f"  [trl] {t:7.1f}s  step {state.global_step:4d}  reward {logs['reward']:.3f}  "
                      f"mean length {logs.get('completions/mean_length', float('nan')):.0f}", flush=True)  # fmt: skip

    torch.set_num_threads(b.threads)
    t_launch = time.monotonic()
    task = math_task(demo)
    # The demo's first job: the same generator, seed and count, in submission order.
    prompts = task.train_prompts(2 * TOPUP_STEPS * b.prompts_per_step, random.Random(b.seed))
    data = Dataset.from_list(
        [{"prompt": p["messages"], "answer": p["reward_spec"]["answer"]} for p in prompts]
    )

    def math_verify_reward(completions, answer, **_):  # TRL logs rewards/<name>/mean
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(t, a, b.math_max_chars) for t, a in zip(texts, answer, strict=True)]

    tok = AutoTokenizer.from_pretrained(b.model)
    model = AutoModelForCausalLM.from_pretrained(b.model, dtype=torch.float32)
    cfg = GRPOConfig(**trl_args(b, str(out_dir)))
    assert cfg.generation_batch_size == b.samples_per_step, "one generation batch per optimizer step"
    clock = WallClock(b.minutes * 60)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[math_verify_reward], args=cfg, train_dataset=data,
                               processing_class=tok, callbacks=[clock])  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # our own one-line progress instead of the log dicts
    trainer.train()
    limit = b.minutes * 60
    counted = [t for t in clock.step_ends if t - clock.t_begin <= limit]  # a step that overran is not
    steps, run = len(counted), (clock.step_ends[-1] - clock.t_begin if clock.step_ends else 0.0)
    trainer.model.save_pretrained(out_dir / "final")
    tok.save_pretrained(out_dir / "final")
    tokens = sum(trainer.bench_tokens[:steps])
    result = {
        "steps": steps, "steps_run": len(clock.step_ends), "run_s": run, "wall_s": limit,
        "startup_s": clock.t_begin - t_launch, "total_s": clock.t_begin - t_launch + limit,
        "step_ends": [t - clock.t_begin for t in counted], **rates([b.samples_per_step] * steps, tokens, limit, counted),
        "tokens": tokens, "phases_s": dict(trainer.bench_phases), "generation_dtype": sorted(trainer.bench_gen_dtypes),
        "rewards": [x["reward"] for x in clock.logs if "reward" in x], "logs": clock.logs,
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "bf16": cfg.bf16,
        "final_model": str(out_dir / "final"),
    }  # fmt: skip
    del trainer, model
    gc.collect()
    return result


# ---------------------------------------------------------------------------- our side


def run_ours(b: Bench, raw: dict, bench_dir: Path) -> dict:
    """`asyncrl demo` for `b.minutes` on a copy of the config (free ports, no tracking, no
    evaluations while training)."""
    import tomli_w  # the demo's own writer of the run config

    from asyncrl.buffer.server import free_port

    raw = json.loads(json.dumps(raw))  # a copy
    raw["model"].update(path=b.model, build_tiny=False)
    # no evaluations while training (training still rejects held-out problems)
    raw["demo"].update(seed=b.seed, final_eval=False, eval_every=0)
    raw.setdefault("trainer", {}).setdefault("wandb", {})["enabled"] = False
    launch = raw.setdefault("launch", {})  # any other run on this machine keeps its ports
    for key in ("engine_port", "reward_port", "rollout_port", "trainer_metrics_port"):
        launch[key] = free_port()
    config = bench_dir / "ours.toml"
    config.write_text(tomli_w.dumps(raw))
    run_dir = bench_dir / "ours"
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "demo", "--config", str(config), "--seed", str(b.seed),
           "--time-limit", str(b.minutes * 60), "--run-dir", str(run_dir)]  # fmt: skip
    env = dict(os.environ)
    t_launch, t0_wall, t0 = time.monotonic(), None, None
    with (
        (bench_dir / "ours.stdout").open("w") as log,
        subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc,
    ):
        for line in proc.stdout:
            log.write(line)
            if t0 is None and line.startswith("submitted "):  # printed just before the demo starts its clock
                t0_wall, t0 = time.time(), time.monotonic()
            print(f"  [ours] {line.rstrip()}", flush=True)
    t_done = time.monotonic()
    if t0 is None:
        raise RuntimeError(
            f"the demo never started training (exit {proc.returncode}); see {bench_dir / 'ours.stdout'}"
        )
    limit = b.minutes * 60
    lines = (run_dir / "logs" / "trainer.log").read_text(errors="replace").splitlines()
    win = trainer_window(lines, t0_wall + limit)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    step_samples = [g * b.group_size for g in win["groups"]]
    final = _weights_of(run_dir / "trainer" / "weights", win["version"])
    progress = run_dir / "progress.jsonl"
    rows = [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []
    v0_eval_s = next((r["eval"]["eval_s"] for r in rows if "eval" in r and r["eval"]["version"] == 0), None)
    return {
        "steps": win["steps"], "version": win["version"], "wall_s": limit, "startup_s": t0 - t_launch,
        "total_s": t0 - t_launch + limit, "process_s": t_done - t_launch, "exit_code": proc.returncode,
        "step_ends": [t - t0_wall for t in win["step_ends"]],
        **rates(step_samples, win["tokens"], limit, win["step_ends"]), "tokens": win["tokens"],
        "phases_s": win["phases_s"], "rewards": win["rewards"],
        **{k: summary.get(k) for k in ("engine_busy_ratio", "trainer_idle_ratio", "mean_staleness", "dropped", "core_share")},
        "final_model": final, "eval_version": int(Path(final).name[1:]) if final else None,
        "run_dir": str(run_dir), "engine_dtype": raw.get("engine", {}).get("dtype", "auto"),
        "demo_v0_eval_s": v0_eval_s,
    }  # fmt: skip


def _weights_of(root: Path, version: int) -> str | None:
    """The published weights of `version`, else the oldest kept one after it (the trainer keeps the
    newest few and may have stepped on while the demo stopped)."""
    kept = sorted(root.glob("v*"))
    exact = root / f"v{version:08d}"
    if exact.exists():
        return str(exact)
    later = [p for p in kept if int(p.name[1:]) > version]
    return str(later[0]) if later else None


# ---------------------------------------------------------------------------- report


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(b: Bench, trl: dict | None, ours: dict | None, evals: dict) -> tuple[str, dict]:
    """The markdown table, the where-the-time-goes lines, and the ratios."""
    t, o = trl or {}, ours or {}
    ratios = {k: ratio(o.get(k), t.get(k)) for k in ("samples_per_s", "tokens_per_s", "steady_samples_per_s")}
    acc = {k: (evals.get(k) or {}).get("accuracy") for k in ("base", "trl", "ours")}

    def row(name: str, key: str, spec: str, with_ratio: bool = False) -> str:
        r = ratio(o.get(key), t.get(key)) if with_ratio else None
        return f"| {name} | {_f(t.get(key), spec)} | {_f(o.get(key), spec)} | {'' if r is None else f'**{r:.2f}x**'} |"

    def first_last(side: dict, key: str, spec: str) -> str:
        v = side.get(key) or []
        return f"{v[0]:{spec}} / {v[-1]:{spec}}" if v else "-"

    diff = None if acc["ours"] is None or acc["trl"] is None else f"{acc['ours'] - acc['trl']:+.3f}"
    out = [
        "| | TRL GRPOTrainer | asyncrl | ours / TRL |",
        "|---|---|---|---|",
        row("optimizer steps in the window", "steps", "d"),
        row("trained samples", "samples", "d", True),
        row("training wall (s)", "wall_s", ".0f"),
        row("**trained samples/s**", "samples_per_s", ".3f", True),
        row("completion tokens/s", "tokens_per_s", ".1f", True),
        row("steady samples/s (first to last step)", "steady_samples_per_s", ".3f", True),
        (f"| first / last step finished at (s) | {first_last(t, 'step_ends', '.0f')} | "
         f"{first_last(o, 'step_ends', '.0f')} | |"),
        row("startup before training (s)", "startup_s", ".0f"),
        row("wall incl. startup (s)", "total_s", ".0f"),
        (f"| training reward, first / last step | {first_last(t, 'rewards', '.3f')} | "
         f"{first_last(o, 'rewards', '.3f')} | |"),
        (f"| held-out accuracy ({b.eval_size} problems, greedy; base {_f(acc['base'], '.3f')}) | "
         f"{_f(acc['trl'], '.3f')} | {_f(acc['ours'], '.3f')} | {diff or ''} |"),
        f"| evaluated model | step {_f(t.get('steps_run'), 'd')} | version {_f(o.get('eval_version'), 'd')} | |",
    ]  # fmt: skip
    out += ["", *where_time_goes(t, o, b.threads)]
    return "\n".join(out), {**ratios, "accuracy": acc}


def where_time_goes(t: dict, o: dict, threads: int) -> list[str]:
    """Per-step seconds by phase: TRL's from the timed trainer (over every step it ran), ours from
    the trainer's step lines (the steps in the window)."""
    lines, t_step = [], {}
    if t.get("steps_run"):
        p, n = t["phases_s"], t["steps_run"]
        gen, rew, prep = p.get("generate", 0.0), p.get("reward", 0.0), p.get("generate_and_score", 0.0)
        t_step = {"step": t["run_s"] / n, "generate": gen / n, "train": (t["run_s"] - prep) / n}
        lines.append(
            f"- TRL, per step ({n} steps, one process, {threads} threads): {t_step['step']:.1f} s = generate "
            f"{t_step['generate']:.1f} s + rewards {rew / n:.2f} s + other scoring and tokenizing "
            f"{(prep - gen - rew) / n:.2f} s + train (forward, backward, optimizer) {t_step['train']:.1f} s, one "
            f"after the other; generation dtype {'/'.join(t.get('generation_dtype') or ['?'])}.")  # fmt: skip
    if o.get("steps"):
        p, n = o["phases_s"], o["steps"]
        o_train = (p.get("forward_backward", 0.0) + p.get("optimizer", 0.0)) / n
        lines.append(
            f"- asyncrl, trainer per step ({n} steps): {p.get('step', 0.0) / n:.1f} s = wait for rollouts "
            f"{p.get('wait', 0.0) / n:.1f} s + forward and backward {p.get('forward_backward', 0.0) / n:.1f} s + "
            f"optimizer {p.get('optimizer', 0.0) / n:.2f} s + publish {p.get('publish', 0.0) / n:.2f} s + checkpoint "
            f"{p.get('checkpoint', 0.0) / n:.2f} s; meanwhile the engine ({o.get('engine_dtype')}) generates the "
            f"next batches: engine busy {_f(o.get('engine_busy_ratio'), '.0%')}, trainer idle "
            f"{_f(o.get('trainer_idle_ratio'), '.0%')} of the run, mean staleness {_f(o.get('mean_staleness'))}, "
            f"{int(o.get('dropped') or 0)} stale groups dropped; the demo's version-0 evaluation (prefill "
            f"only) took {_f(o.get('demo_v0_eval_s'), '.0f')} s of engine time.")  # fmt: skip
        if t_step:
            lines.append(
                f"- So: TRL's step is the sum of generating ({t_step['generate']:.1f} s) and training "
                f"({t_step['train']:.1f} s) on {threads} threads; ours overlaps them in separate processes, the "
                f"trainer computing {o_train:.1f} s per step and waiting {p.get('wait', 0.0) / n:.1f} s for "
                "rollouts.")  # fmt: skip
    return lines


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "smollm2-math.toml")
    ap.add_argument("--minutes", type=float, default=10.0, help="training wall time per side")
    ap.add_argument("--seed", type=int, help="default: the config's [demo] seed")
    ap.add_argument(
        "--eval-size", type=int, help="held-out problems scored (default: the config's eval_size)"
    )
    ap.add_argument("--eval-batch", type=int, default=50, help="held-out problems per generate call")
    ap.add_argument("--model", help="model directory for both sides (default: the config's [model] path)")
    ap.add_argument(
        "--threads", type=int, help="TRL's and the evaluator's torch threads (default: usable cores)"
    )
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--no-base-eval", action="store_true", help="do not evaluate the base model")
    ap.add_argument("--no-eval", action="store_true", help="evaluate no model (throughput only)")
    ap.add_argument("--out", type=Path, help="run directory (default: runs/trl-bench-<time>)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)

    b, raw, demo = load_bench(args)
    bench_dir = (args.out or REPO / "runs" / time.strftime("trl-bench-%Y%m%d-%H%M%S")).resolve()
    bench_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call run without a timeout
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # here and in the demo's services
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.set_num_threads(b.threads)
    from asyncrl.services.ops.demo_jobs import math_task

    heldout = math_task(demo).heldout_prompts()[: b.eval_size]
    print(f"real_vs_trl: {b.model}, B={b.prompts_per_step} x G={b.group_size}, max_new_tokens={b.max_new_tokens}, "
          f"T={b.temperature}, lr={b.lr:g}, bf16={b.bf16}, {b.minutes:g} min per side, seed {b.seed}, "
          f"{b.threads} threads for TRL; run dir {bench_dir}", flush=True)  # fmt: skip

    def ev(model_dir: str | None, name: str) -> dict | None:
        if args.no_eval:
            return None
        if model_dir is None:
            print(f"{name}: no model to evaluate", flush=True)
            return None
        r = evaluate(model_dir, heldout, b.max_new_tokens, args.eval_batch, b.math_max_chars)
        print(f"{name}: held-out accuracy {r['accuracy']:.3f} ({r['correct']}/{r['n']}), mean length "
              f"{r['mean_length']:.0f}, {r['seconds']:.0f} s", flush=True)  # fmt: skip
        return {**r, "model": model_dir}

    evals: dict = {}
    if not args.no_base_eval:
        evals["base"] = ev(b.model, "base")
    trl = ours = None
    if not args.skip_trl:
        print(f"TRL GRPOTrainer for {b.minutes:g} min ...", flush=True)
        trl = run_trl(b, demo, bench_dir / "trl")
        evals["trl"] = ev(trl["final_model"], f"TRL after {trl['steps_run']} steps")
    if not args.skip_ours:
        print(f"asyncrl demo for {b.minutes:g} min ...", flush=True)
        ours = run_ours(b, raw, bench_dir)
        evals["ours"] = ev(ours["final_model"], f"asyncrl after {ours['steps']} steps (v{ours['version']})")

    table, ratios = report(b, trl, ours, evals)
    print("\n" + table)
    if ratios["samples_per_s"] is not None:
        verdict = "meets" if ratios["samples_per_s"] >= 1.0 else "misses"
        print(
            f"\nours / TRL trained samples/s = {ratios['samples_per_s']:.2f}x ({verdict} the >= 1.0x target)"
        )
    figures = {
        "settings": asdict(b),
        "trl": trl,
        "ours": ours,
        "evals": evals,
        "ratios": ratios,
        "table": table,
    }
    (bench_dir / "results.json").write_text(json.dumps(figures, indent=2, default=str))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
