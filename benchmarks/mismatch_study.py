"""Do the corrections correct? Policy lag and engine/trainer mismatch, with and without importance
sampling, on the CPU demo's full topology (issue 19).

    .venv/bin/python benchmarks/mismatch_study.py           # the study: 23 cells x seeds 0-2, ~2 h
    .venv/bin/python benchmarks/mismatch_study.py --full    # every slice x every correction, ~7 h
    .venv/bin/python benchmarks/mismatch_study.py --slices mismatch --seeds 0 --budget 30   # quick look
    .venv/bin/python benchmarks/mismatch_study.py --resume  # finish a stopped study; with every run
                                                            # done: the table and figure again

Every cell is `asyncrl demo` (embedded Redis, engine, reward, rollout and trainer services: the
real stack, not a loop in one process) on `configs/demo.toml`'s task, with the cell's
overrides, until reward 0.9 or `--budget` seconds of training. Three slices:

* `lag`: η ∈ {0, 2, 8, 32} (`--max-staleness`; the demo's generation outruns its trainer, so
  the buffer fills towards η: the measured staleness distribution is reported, not only η),
  fp32 weights;
* `mismatch`: η = 1 with the engine sampling from fp32 weights (no mismatch), from bf16 weights
  while the trainer keeps fp32 (`publish_dtype = "bfloat16"`: real rounding mismatch), or with
  Gaussian noise of std `--noise` on its sampling logits (`[engine] logit_noise_std`, a study-only
  option: a mismatch of known size);
* `pi_old`: bypass (π_old := μ, the engine's logprobs) against decoupled (π_old recomputed by
  the trainer) at η = 8 with the noise.

Corrections (`--corrections`, default one of each family): `none`, `tis` (truncated IS, the
default), `icepop` (token IS, masked outside [is_low, is_high]), `token_mask`, `seq_tis`
(sequence-level truncated IS) and `geo_mask` (geometric-mean sequence mask). The study grid
(`cells`) runs every correction where ρ = π_old/μ is far from 1 (η = 32, the injected noise)
and only `none` / `tis` where it is not; `--full` crosses everything.

Per run: from the trainer's step log, time and steps to 0.9 (or the reward reached in the
budget: the mean of the last 5 steps, the engine's samples), the final entropy, the mean / max
IS weight, the masked fraction, the mismatch KL (k3 of μ against π_old); from the demo's
summary, the trained groups' staleness (mean, max, histogram); `collapsed` (the entropy-collapse
signature of docs/architecture.md §10: entropy below `COLLAPSE_ENTROPY` while the reward is
below 0.5); and `clean_eval`: the final weights sampled in this process without the engine
(every prompt × 8 at temperature 1, and greedy), so that injected noise does not hide what the
policy learned. Writes `<out>/cells.jsonl` (one line per run, appended as runs finish: `--resume`
skips those), `<out>/table.md` (means over seeds) and `<out>/figure.png`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = ROOT / "configs" / "demo.toml"
CORRECTIONS = ("none", "tis", "icepop", "token_mask", "seq_tis", "geo_mask")
STUDY_CORRECTIONS = (
    "none",
    "tis",
    "icepop",
    "geo_mask",
)  # one of each family: truncated, token mask, sequence mask
COLLAPSE_ENTROPY = 0.05
STEP_MARK = 200  # the reward at this step too: every η ≥ 1 run gets there within the budget
CELL = ("slice", "eta", "mismatch", "correction", "bypass", "prefill")  # what names a cell


def cell_key(row: dict) -> tuple:
    return tuple(row.get(k, False) for k in CELL)  # (rows from before `prefill` existed: False)


TARGET = 0.9


def cells(slices: list[str], corrections: list[str], noise: float, full: bool = False) -> list[dict]:
    """The grid: one dict of overrides per cell. `full`: every slice crossed with every correction
    (50 cells, ~7.5 h at 3 seeds); otherwise the study's grid (23 cells, ~2 h), which drops the
    cells that repeat another: where ρ stays near 1 (no noise, the lag the buffer reaches by
    itself) only `none` and `tis` run, all of them where ρ is far from 1 (η = 32 prefilled, the
    injected noise);
    the mismatch slice's fp32 control repeats the lag slice's η = 2 cells, run next to the
    mismatched ones (the machine's speed drifts over an hour: steps per minute differ); under bypass
    π_old := μ makes ρ = 1 for every correction, so one of them stands for all.

    Generation here is only a little faster than training, so the buffer fills towards η slowly
    (measured: η = 8 and η = 32 both train ~3–6 versions old). `prefill` cells start the trainer
    once the buffer holds η·B groups (`[trainer] prefill_groups`): the lag a generation-rich
    deployment has from its first step."""

    def cell(
        slice_: str, eta: int, mismatch: str, correction: str, bypass: bool = False, prefill: bool = False
    ) -> dict:
        return {"slice": slice_, "eta": eta, "mismatch": mismatch, "correction": correction, "bypass": bypass,
                "prefill": prefill}  # fmt: skip

    noisy, out = f"noise{noise:g}", []
    if full:
        if "lag" in slices:
            out += [cell("lag", eta, "fp32", c) for eta, c in itertools.product((0, 2, 8, 32), corrections)]
            out += [cell("lag", 32, "fp32", c, prefill=True) for c in corrections]
        if "mismatch" in slices:
            out += [
                cell("mismatch", 2, m, c) for m, c in itertools.product(("fp32", "bf16", noisy), corrections)
            ]
        if "pi_old" in slices:
            out += [
                cell("pi_old", 8, noisy, c, b) for b, c in itertools.product((True, False), ("none", "tis"))
            ]
        return out
    few = [c for c in ("none", "tis") if c in corrections]
    if "lag" in slices:
        out += [cell("lag", eta, "fp32", c) for eta in (0, 2, 8) for c in few]
        out += [cell("lag", 32, "fp32", c) for c in few]
        out += [cell("lag", 32, "fp32", c, prefill=True) for c in corrections]
    if "mismatch" in slices:
        out += [cell("mismatch", 2, "bf16", c) for c in few]
        out += [cell("mismatch", 2, noisy, c) for c in corrections]
        out += [
            cell("mismatch", 2, "fp32", c) for c in few
        ]  # the control (the same runs as lag η = 2, next to these)
    if "pi_old" in slices:
        out += [cell("pi_old", 8, noisy, c) for c in few]
        out += [cell("pi_old", 8, noisy, corrections[0], bypass=True)]
    return out


def config_for(cell: dict, seed: int, budget: float, base: Path | None = None) -> dict:
    raw = tomllib.loads(BASE.read_text())
    if base is not None:  # the seed's tiny model, built once for all its cells (the demo would rebuild it)
        raw["model"].update(path=str(base), build_tiny=False)
    trainer, engine = raw["trainer"], raw.setdefault("engine", {})
    trainer["bypass"] = cell["bypass"]
    trainer.setdefault("loss", {})["is_correction"] = cell["correction"]
    trainer["publish_dtype"] = "bfloat16" if cell["mismatch"] == "bf16" else "float32"
    if cell["mismatch"].startswith("noise"):
        engine["logit_noise_std"] = float(cell["mismatch"][len("noise") :])
    raw["demo"].update(seed=seed, time_limit_s=budget, target_reward=TARGET)
    trainer["max_staleness"] = cell["eta"]  # (`asyncrl demo --max-staleness` sets it too)
    if cell.get("prefill"):
        trainer["prefill_groups"] = cell["eta"] * trainer["batch_groups"]
    return raw


def run_cell(cell: dict, seed: int, budget: float, tmp: Path) -> dict:
    import tomli_w  # the demo's own writer of the run config

    name = f"{cell['slice']}-eta{cell['eta']}-{cell['mismatch']}-{cell['correction']}-{'bypass' if cell['bypass'] else 'decoupled'}{'-prefill' if cell.get('prefill') else ''}-s{seed}"
    config, run_dir = tmp / f"{name}.toml", tmp / name
    config.write_text(tomli_w.dumps(config_for(cell, seed, budget, tiny_model(tmp / f"base-s{seed}", seed))))
    t0 = time.time()
    subprocess.run([str(ROOT / ".venv" / "bin" / "asyncrl"), "demo", "--config", str(config), "--run-dir", str(run_dir),
                    "--max-staleness", str(cell["eta"])], cwd=ROOT, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)  # fmt: skip
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )
    clean = clean_eval(run_dir, seed=seed)
    steps = trainer_steps(run_dir / "logs" / "trainer.log")
    last = steps[-5:] or [{}]

    def mean(key: str) -> float | None:
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.fmean(values) if values else None

    final_reward = statistics.fmean(s.get("reward_mean", 0.0) for s in last) if steps else None
    mark = (
        steps[STEP_MARK - 5 : STEP_MARK] if len(steps) >= STEP_MARK else []
    )  # (the machine's speed left out)
    final_entropy = statistics.fmean(s.get("entropy", 0.0) for s in last) if steps else None
    return {**cell, "seed": seed, "wall_s": round(time.time() - t0, 1), "steps": len(steps),
            "time_to_target_s": summary.get("time_to_target_s"), "final_reward": final_reward,
            f"reward_at_{STEP_MARK}": statistics.fmean(s.get("reward_mean", 0.0) for s in mark) if mark else None,
            "final_entropy": final_entropy, "is_weight_mean": mean("is_weight_mean"),
            "is_weight_max": max((s.get("is_weight_max", 0.0) for s in steps), default=None),
            "masked_fraction": mean("is_masked_fraction"), "mismatch_kl": mean("mismatch_kl"),
            "staleness_mean": summary.get("mean_staleness"), "staleness_max": summary.get("max_staleness"),
            "staleness_histogram": summary.get("staleness_histogram"),
            "collapsed": bool(steps) and final_entropy < COLLAPSE_ENTROPY and final_reward < 0.5, **clean}  # fmt: skip


def tiny_model(path: Path, seed: int) -> Path:
    """`configs/demo.toml`'s tiny model for `seed`, as `asyncrl demo` builds it, built once."""
    if not (path / "config.json").exists():
        from asyncrl.services.ops.tinymodel import build_tiny_model

        m = tomllib.loads(BASE.read_text())["model"]
        build_tiny_model(path, chars=m["tiny_chars"], hidden_size=m["tiny_hidden_size"], num_layers=m["tiny_layers"],
                         tie_word_embeddings=m["tiny_tie_embeddings"], seed=seed)  # fmt: skip
    return path


def clean_eval(run_dir: Path, samples: int = 8, seed: int = 0) -> dict:
    """The final policy, sampled without the engine: every prompt of the task (all
    len(letters)^prompt_len words) × `samples` answers at temperature 1 from the trainer's last
    published weights, in this process in fp32, scored by the `reverse` verifier's own rule.
    Under injected noise the run's reward is the noisy engine's; this is what the policy learned.
    Also the greedy answer's exact-match accuracy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.services.reward.verifiers.toy import reverse_reward

    published = sorted((run_dir / "trainer" / "weights").glob("v*"))
    if not published:
        return {}
    demo = tomllib.loads(BASE.read_text())["demo"]
    letters, length = demo["letters"], demo["prompt_len"]
    words = ["".join(w) for w in itertools.product(letters, repeat=length)]
    tok = AutoTokenizer.from_pretrained(published[-1])
    model = AutoModelForCausalLM.from_pretrained(published[-1], dtype=torch.float32).eval()
    prompts = torch.tensor([tok(f"<bos>{w}>")["input_ids"] for w in words])  # (one length: no padding)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ids = prompts.repeat_interleave(samples, 0)
        greedy = prompts
        for _ in range(length):  # the demo's answers: exactly `length` tokens, specials kept
            probs = torch.softmax(model(ids).logits[:, -1].float(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
            greedy = torch.cat([greedy, model(greedy).logits[:, -1].argmax(-1, keepdim=True)], 1)
    n = prompts.shape[1]
    rewards = [reverse_reward(words[i // samples][::-1], tok.decode(row[n:], skip_special_tokens=False))[0]
               for i, row in enumerate(ids.tolist())]  # fmt: skip
    exact = [
        tok.decode(row[n:], skip_special_tokens=False) == w[::-1] for w, row in zip(words, greedy.tolist())
    ]
    return {"clean_reward": statistics.fmean(rewards), "greedy_accuracy": statistics.fmean(exact),
            "eval_version": published[-1].name}  # fmt: skip


def trainer_steps(log: Path) -> list[dict]:
    """The trainer's `step` events (one JSON line each), in order."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("msg") == "step":
            out.append(event)
    return out


def table(rows: list[dict]) -> str:
    """Means over seeds per cell, one markdown row each."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(cell_key(r), []).append(r)

    def avg(rs: list[dict], key: str, fmt: str) -> str:
        values = [r[key] for r in rs if r.get(key) is not None]
        return format(statistics.fmean(values), fmt) if values else "–"

    def spread(rs: list[dict], key: str) -> str:  # mean ± the seeds' standard deviation
        values = [r[key] for r in rs if r.get(key) is not None]
        sd = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        return f"{statistics.fmean(values):.3f}{sd}" if values else "–"

    lines = ["| slice | η | mismatch | correction | π_old | seeds | reached 0.9 | time to 0.9 (s) | final reward | "
             f"reward at step {STEP_MARK} | clean reward | greedy exact | final entropy | IS mean / max | masked | mismatch KL | "
             "staleness: mean (max; groups by age) | collapsed |", "|" + "---|" * 18]  # fmt: skip
    for key, rs in groups.items():
        reached = [r for r in rs if r.get("time_to_target_s") is not None]
        lines.append(
            f"| {key[0]} | {key[1]}{' prefilled' if key[5] else ''} | {key[2]} | {key[3]} | "
            f"{'bypass' if key[4] else 'decoupled'} | {len(rs)} | "
            f"{len(reached)} | {avg(reached, 'time_to_target_s', '.0f')} | {spread(rs, 'final_reward')} | "
            f"{spread(rs, f'reward_at_{STEP_MARK}')} | {spread(rs, 'clean_reward')} | {avg(rs, 'greedy_accuracy', '.2f')} | "
            f"{avg(rs, 'final_entropy', '.2f')} | {avg(rs, 'is_weight_mean', '.3f')} / {avg(rs, 'is_weight_max', '.2f')} | "
            f"{avg(rs, 'masked_fraction', '.3f')} | {avg(rs, 'mismatch_kl', '.2e')} | {avg(rs, 'staleness_mean', '.2f')} "
            f"({max((r['staleness_max'] or 0) for r in rs)}; {shares(rs)}) | "
            f"{sum(r['collapsed'] for r in rs)} |"
        )
    return "\n".join(lines)


def shares(rows: list[dict]) -> str:
    """The trained groups' staleness distribution over the cell's seeds: "≤0 40%, ≤1 60%"
    (the trainer's histogram buckets; a bucket under 1% is left out)."""
    total: dict[str, int] = {}
    for r in rows:
        for bucket, n in (r.get("staleness_histogram") or {}).items():
            total[bucket] = total.get(bucket, 0) + n
    n = sum(total.values())
    ordered = sorted(total.items(), key=lambda kv: float(kv[0][2:]))
    return ", ".join(f"{b.replace('<=', '≤')} {c / n:.0%}" for b, c in ordered if c >= 0.01 * n) or "–"


def figure(rows: list[dict], out: Path) -> None:
    """Per cell, the reward at the end of the budget (bars: the engine's samples, the mean of
    the seeds; gray dots: each seed) and the final policy's clean reward (black ticks, each
    seed), one panel per slice, cells in grid order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def key(r: dict) -> tuple:
        return r["eta"], r["mismatch"], r["correction"], r["bypass"], r.get("prefill", False)

    slices = list(dict.fromkeys(r["slice"] for r in rows))
    fig, axes = plt.subplots(len(slices), 1, figsize=(10, 3.4 * len(slices)), squeeze=False)
    for ax, name in zip(axes[:, 0], slices):
        rs = [r for r in rows if r["slice"] == name]
        labels = list(dict.fromkeys(key(r) for r in rs))
        for x, label in enumerate(labels):
            cell = [r for r in rs if key(r) == label]
            ys = [r["final_reward"] or 0.0 for r in cell]
            clean = [r["clean_reward"] for r in cell if r.get("clean_reward") is not None]
            ax.bar(x, statistics.fmean(ys), alpha=0.5, color="tab:red" if label[2] == "none" else "tab:blue")
            ax.scatter([x] * len(ys), ys, s=12, color="gray", zorder=3)
            ax.scatter([x] * len(clean), clean, s=40, marker="_", color="black", zorder=3)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([f"η{e}{'+pf' if p else ''} {m}\n{c}{' bypass' if b else ''}" for e, m, c, b, p in labels],
                           fontsize=7)  # fmt: skip
        ax.axhline(TARGET, color="red", lw=0.8, ls=":")
        ax.set_ylim(0, 1)
        ax.set_ylabel("reward at the budget")
        ax.set_title(f"{name} (red: no correction; black ticks: the final policy sampled without the engine)",
                     fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--slices", nargs="+", default=["lag", "mismatch", "pi_old"], choices=["lag", "mismatch", "pi_old"]
    )
    ap.add_argument("--corrections", nargs="+", default=list(STUDY_CORRECTIONS), choices=list(CORRECTIONS))
    ap.add_argument(
        "--full", action="store_true", help="every slice x every correction (46 cells with all six)"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--budget", type=float, default=60, help="seconds of training per run")
    ap.add_argument("--noise", type=float, default=1.0, help="std of the injected logit noise")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "mismatch-study")
    ap.add_argument("--resume", action="store_true", help="skip the runs cells.jsonl already has")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "cells.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if args.resume and log.exists() else []
    if not args.resume:
        log.write_text("")
    seen = {(cell_key(r), r["seed"]) for r in done}
    rows = list(done)
    grid = cells(args.slices, args.corrections, args.noise, args.full)
    print(f"{len(grid)} cells x {len(args.seeds)} seeds, {args.budget:.0f} s each at most; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="mismatch-study-") as tmp:
        for cell, seed in itertools.product(grid, args.seeds):
            if (cell_key(cell), seed) in seen:
                continue
            row = run_cell(cell, seed, args.budget, Path(tmp))
            rows.append(row)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    (args.out / "table.md").write_text(table(rows) + "\n")
    figure(rows, args.out / "figure.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
