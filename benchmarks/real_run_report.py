"""The figures of `asyncrl demo` runs on a real model, from their run directories: the held-out
accuracy curve against wall time and version, the gain over the base model, when the gain first
reached `--gain` points (all of the main set, `heldout`), each held-out set's evaluations with
their format rate and accuracy among formatted answers, and where a step's time went (from the
trainer's per-step log lines).

    .venv/bin/python benchmarks/real_run_report.py runs/real-s0 runs/real-s1 [--gain 0.10]

Prints markdown: one summary row per run, then each run's evaluations and step-time breakdown.
Reads `summary.json`, `progress.jsonl` and `logs/trainer.log`; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from real_vs_trl import trainer_steps  # this script's folder is on sys.path

PHASES = ("wait_s", "recompute_s", "forward_backward_s", "optimizer_s", "publish_s")


MAIN = "heldout"  # the main held-out set's name (rows of runs before sets were named have none)


def evals(run: Path) -> dict[str, list[dict]]:
    """Each held-out set's evaluations by version, the main set first."""
    rows = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines() if line.strip()]
    out: dict[str, dict[int, dict]] = {MAIN: {}}
    for e in (r["eval"] for r in rows if "eval" in r):
        out.setdefault(e.get("name", MAIN), {})[e["version"]] = e
    return {name: [by_version[v] for v in sorted(by_version)] for name, by_version in out.items()}


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _acc(e: dict | None) -> str:
    return f"{e['accuracy']:.3f} (v{e['version']})" if e else "-"


def items(run: Path, name: str, version: int) -> dict[str, dict] | None:
    """The items of one evaluation by prompt id (`asyncrl demo` saves them under evals/)."""
    path = run / "evals" / f"{name}-v{version}.jsonl"
    if not path.exists():
        return None
    return {r["prompt_id"]: r for r in map(json.loads, path.read_text().splitlines()) if r}


def paired_gain(base: dict[str, dict] | None, now: dict[str, dict] | None) -> str:
    """Accuracy gain over the base on the same problems, with a 95% interval over the items
    (paired: each problem's change, -1, 0 or +1; normal approximation), and the gain in accuracy
    among formatted answers with an unpaired 95% interval (its denominators differ)."""
    if not base or not now:
        return "-"
    ids = sorted(base.keys() & now.keys())
    d = [int(now[i]["correct"]) - int(base[i]["correct"]) for i in ids]
    n = len(d)
    mean = sum(d) / n
    sd = statistics.pstdev(d) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n) if n else 0.0
    out = f"{mean:+.3f} [{mean - half:+.3f}, {mean + half:+.3f}]"
    fa = [[r for r in x.values() if r.get("formatted")] for x in (base, now)]
    if all(fa):
        p = [sum(r["correct"] for r in f) / len(f) for f in fa]
        half_f = 1.96 * math.sqrt(sum(q * (1 - q) / len(f) for q, f in zip(p, fa)))
        out += f" | {p[1] - p[0]:+.3f} [{p[1] - p[0] - half_f:+.3f}, {p[1] - p[0] + half_f:+.3f}]"
    else:
        out += " | -"
    return out


def report(run: Path, gain: float) -> tuple[str, list[str]]:
    summary = json.loads((run / "summary.json").read_text())
    sets, st = evals(run), trainer_steps((run / "logs" / "trainer.log").read_text().splitlines())
    ev = sets[MAIN]
    base = next((e["accuracy"] for e in ev if e["version"] == 0), None)
    reached = next(
        (e for e in ev if base is not None and e["version"] > 0 and e["accuracy"] - base >= gain - 1e-9), None
    )
    best = max(ev, key=lambda e: e["accuracy"]) if ev else None
    train = [s for s in st if s["version"] > 1]  # the first step waits for the first rollouts
    med = {k: statistics.median(s[k] for s in train) for k in (*PHASES, "step_s", "tokens")} if train else {}
    best_gain = f"+{best['accuracy'] - base:.3f}" if best and base is not None else "-"
    when = f"{reached['t']:.0f} s (v{reached['version']})" if reached else "not reached"
    step_s = f"{med['step_s']:.0f} s" if med else "-"
    row = (f"| {run.name} | {summary.get('seed')} | {summary['steps']} | {summary['wall_s']:.0f} s | "
           f"{'-' if base is None else f'{base:.3f}'} | {_acc(best)} | {_acc(ev[-1] if ev else None)} | "
           f"{best_gain} | {when} | {step_s} |")  # fmt: skip
    detail = []
    for name, rows in sets.items():
        detail += [f"\n{run.name}: {name} (greedy, {rows[0]['prompts'] if rows else 0} held-out problems)\n",
                   "| version | wall time | accuracy | format rate | among formatted | mean length | eval s | "
                   "gain over v0 [95% CI, paired] | gain among formatted [95% CI] |",
                   "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        base_items = items(run, name, 0)
        detail += [
            f"| {e['version']} | {e['t']:.0f} s | {e['accuracy']:.3f} | {_f(e.get('format_rate'))} | "
            f"{_f(e.get('formatted_accuracy'))} | {e['mean_length']:.0f} | {e['eval_s']:.0f} | "
            + (paired_gain(base_items, items(run, name, e["version"])) if e["version"] else "- | -")
            + " |"
            for e in rows
        ]
    if med:
        detail += [f"\n{run.name}: median step (versions 2..{st[-1]['version']}, {len(train)} steps): "
                   f"{med['step_s']:.1f} s for {med['tokens']:.0f} completion tokens; "
                   + ", ".join(f"{k[:-2]} {med[k]:.2f} s" for k in PHASES)]  # fmt: skip
    return row, detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument(
        "--gain", type=float, default=0.10, help="absolute accuracy gain to time (0.10 = 10 points)"
    )
    args = parser.parse_args(argv)
    print(
        "| run | seed | steps | wall | base acc | best acc | last acc | best gain | "
        f"+{args.gain * 100:.0f} pts reached at | median step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    details = []
    for run in args.runs:
        row, detail = report(run, args.gain)
        print(row)
        details += detail
    print("\n".join(details))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
