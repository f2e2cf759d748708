"""`asyncrl demo`: the CPU demo end to end, in a fresh run directory.

Embedded Redis, a tiny Qwen2 model with a character tokenizer built on the spot, the
reference engine, reward service, rollout service and trainer as separate processes on
loopback; submits the `reverse` task and trains asynchronously until the mean reward over
the last few steps reaches the target or the time limit passes. Shows a live progress line,
then a summary table, and writes `progress.jsonl`, `summary.json` and `demo.png` (reward and
staleness against wall time) into the run directory.

This module is the flow; what it submits is demo_jobs.py, what it reads off the services'
/metrics demo_metrics.py, and what it keeps of the run and reports demo_report.py.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from asyncrl.services.ops.demo_jobs import EVAL_NAME, TOPUP_STEPS, heldout_sets, submit
from asyncrl.services.ops.demo_metrics import scrape_trainer, utilisation
from asyncrl.services.ops.demo_report import (
    Evals,
    History,
    StepRewards,
    eval_summary,
    plot,
    run_summary,
    summary_table,
)
from asyncrl.services.ops.run_config import (
    DemoSection,
    RunConfigError,
    load_run_config,
    validate_run_config,
)
from asyncrl.services.runtime.heap_freeze import freeze_startup_heap

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--run-dir", type=Path, help="default: runs/demo-<time>")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--time-limit", type=float, help="seconds of training before giving up")
    parser.add_argument("--max-steps", type=int, help="stop after this many versions whatever the reward")
    parser.add_argument("--max-staleness", type=int, help="η (0 = synchronous)")
    parser.add_argument(
        "--core-share",
        choices=("auto", "on", "off"),
        help="[launch] core_share: engine and trainer lend idle cores",
    )
    args = parser.parse_args(argv)

    from asyncrl.services.ops.launcher import Launcher, stop_on_first_signal

    try:
        demo = load_run_config(args.config, require=("model",)).demo
    except RunConfigError as exc:
        print(f"asyncrl demo: {exc}", file=sys.stderr)
        return 2
    raw = tomllib.loads(args.config.read_text())
    if args.seed is not None:
        demo.seed = args.seed
    if args.time_limit is not None:
        demo.time_limit_s = args.time_limit
    run_dir = (args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a demo is always a fresh run: no stale buffer or checkpoint
    run_dir.mkdir(parents=True)
    trainer_cfg = raw.setdefault("trainer", {})
    trainer_cfg["seed"] = demo.seed
    if args.max_staleness is not None:
        trainer_cfg["max_staleness"] = args.max_staleness
    if args.core_share is not None:
        raw.setdefault("launch", {})["core_share"] = args.core_share
    raw["model"]["seed"] = demo.seed
    if raw["model"].get("build_tiny"):
        raw["model"]["path"] = str(run_dir / "base")  # built fresh for this run
    elif not (Path(raw["model"]["path"]) / "config.json").is_file():
        print(
            f"asyncrl demo: no model at {raw['model']['path']} (for SmolLM2: `make model-smollm2`)",
            file=sys.stderr,
        )
        return 2
    raw["run"].update(id=run_dir.name, dir=str(run_dir))
    heldout = heldout_sets(demo, run_dir, raw)
    config_path = run_dir / "config.toml"
    try:
        cfg = validate_run_config(raw, config_path)  # what the flags above changed is checked too
    except RunConfigError as exc:
        print(f"asyncrl demo: {exc}", file=sys.stderr)
        return 2
    import tomli_w  # (the `demo` extra installs it; the images, which lack it, never import this module)

    config_path.write_text(tomli_w.dumps(raw))
    eta = int(trainer_cfg.get("max_staleness", 1))
    max_steps = args.max_steps or int(trainer_cfg.get("max_steps", 0)) or 10**9

    launcher = Launcher(cfg, config_path, echo=False)
    topups = ThreadPoolExecutor(1, thread_name_prefix="demo-submit")
    stop_on_first_signal()
    history, progress = History(), (run_dir / "progress.jsonl").open("w")
    evals: dict[str, Evals] = {}  # by held-out set name
    tty = sys.stdout.isatty()
    t0 = time.monotonic()
    reached_at: float | None = None
    code = 0
    print(f"asyncrl demo: run directory {run_dir} (service logs in logs/)")
    try:
        print("starting Redis, reward, engine, rollout and trainer ...", flush=True)
        launcher.start()
        freeze_startup_heap()  # this process polls /metrics and the trainer's log twice a second
        # Stale groups are dropped and consume prompts too: keep twice what the steps need
        # submitted, in chunks of TOPUP_STEPS steps, topped up as the trainer advances.
        rng, rollout_url = random.Random(demo.seed), launcher.rollout_urls()[0]
        chunk = 2 * min(TOPUP_STEPS, max_steps + eta + 2) * demo.prompts_per_step
        jobs = submit(rollout_url, demo, chunk, rng)
        submitted, topup = chunk, None  # a top-up posts from a thread: the progress line keeps moving
        print(
            f"submitted {len(jobs)} job(s), {chunk} prompts x {demo.group_size} samples, more as training "
            "advances; training (Ctrl-C stops)"
        )
        t0 = time.monotonic()
        steps = StepRewards(run_dir / "logs" / "trainer.log", time.time())
        evals = {
            name: Evals(
                rollout_url,
                name,
                time.time(),
                items_dir=run_dir / "evals",
                final_body={
                    "name": name,
                    "prompts": prompts,
                    "idempotency_key": f"{run_dir.name}-final-{name}",
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": demo.max_new_tokens},
                },
            )
            for name, prompts in heldout.items()
        }
        last_print = 0.0
        while True:
            s = scrape_trainer(launcher.trainer_url, t0)
            row = history.add(s) if s else None
            steps.poll()
            if reached_at is None and demo.target_reward is not None:
                reached_at = steps.reached(demo.target_window, demo.target_reward)
            if row:
                progress.write(json.dumps(row) + "\n")
                progress.flush()
                windowed = steps.windowed(demo.target_window)
                line = _progress_line(row, windowed, demo)
                if tty:
                    print("\r" + line.ljust(110), end="", flush=True)
                elif row["t"] - last_print >= 5:
                    print(line, flush=True)
                    last_print = row["t"]
            for e in (row for set_ in evals.values() for row in set_.poll()):
                progress.write(json.dumps({"eval": e}) + "\n")
                progress.flush()
                print(("\n" if tty else "") + _eval_progress(e), flush=True)
            if topup is not None and topup.done():
                try:
                    jobs += topup.result()
                except (RuntimeError, httpx.HTTPError) as exc:  # e.g. a full queue: the next poll retries
                    submitted -= chunk
                    print(f"\nprompt top-up refused, retrying: {exc}", flush=True)
                topup = None
            if (
                s
                and topup is None
                and submitted < 2 * (s.version + TOPUP_STEPS // 2 + eta + 2) * demo.prompts_per_step
            ):
                topup = topups.submit(submit, rollout_url, demo, chunk, rng, first_job=len(jobs))
                submitted += chunk
            elapsed = time.monotonic() - t0
            if reached_at is not None:
                print(f"\nreward {demo.target_reward} reached (mean of the last {demo.target_window} steps)")
                break
            if s and s.version >= max_steps:
                print(f"\nstep limit {max_steps} reached")
                break
            if elapsed > demo.time_limit_s:
                print(f"\ntime limit {demo.time_limit_s:.0f} s reached")
                code = 1 if demo.target_reward is not None else 0
                break
            # a crashed service is restarted (`asyncrl up`'s policy, logs/launcher.log); the demo
            # ends here when the trainer exits, or a service crashed more often than allowed
            if (outcome := launcher.supervise()) is not None:
                code = outcome
                print(f"\n{launcher.stop_reason} (see {run_dir / 'logs'})")
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\ninterrupted")
        code = 130
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"\nerror: {exc}")
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        if tty:
            print()
        usage = utilisation(launcher, time.monotonic() - t0) if launcher.procs else {}
        for set_ in evals.values() if code in (0, 1) and launcher.procs and demo.final_eval else ():
            last = history.rows[-1]["version"] if history.rows else 0
            if not set_.rows or max(set_.rows) < last:
                print(
                    f"final evaluation of {set_.name} at the served version (training goes on) ...",
                    flush=True,
                )
                final = set_.run_final(demo.final_eval_timeout_s)
                if final:
                    progress.write(json.dumps({"eval": final}) + "\n")
                    print(_eval_progress(final))
        print("stopping services ...", flush=True)
        topups.shutdown(wait=False, cancel_futures=True)
        launcher.stop()
        progress.close()
    if history.rows:
        summary = {
            **run_summary(history, demo, eta, reached_at, run_dir),
            **usage,
            "samples_per_step": demo.prompts_per_step * demo.group_size,
        }
        if EVAL_NAME in evals:  # the main held-out set's figures stay at the top level
            summary.update(eval_summary(evals[EVAL_NAME].sorted()))
        more = {name: set_.sorted() for name, set_ in evals.items() if name != EVAL_NAME}
        if more:
            summary["eval_sets"] = {name: eval_summary(rows) for name, rows in more.items()}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        main_rows = evals[EVAL_NAME].sorted() if EVAL_NAME in evals else []
        plot(history, run_dir / "demo.png", demo.target_reward, eta, main_rows, demo.task, more)
        print(summary_table(summary))
        if reached_at is None and code == 0 and demo.target_reward is not None:
            code = 1
    return code


def _eval_progress(e: dict) -> str:
    """One evaluation as it lands: accuracy, then how much of it is format (when the verifier says)."""
    line = f"eval {e['name']} v{e['version']}: accuracy {e['accuracy']:.3f} on {e['prompts']} problems"
    if e.get("format_rate") is not None:
        among = e["formatted_accuracy"]
        line += (
            f" (format {e['format_rate']:.3f}, among formatted {'-' if among is None else f'{among:.3f}'})"
        )
    return line + f", mean length {e['mean_length']:.0f} tokens ({e['eval_s']:.0f} s)"


def _progress_line(row: dict, windowed: float | None, demo: DemoSection) -> str:
    reward = f"{row['reward']:.3f}" if row["reward"] is not None else "-"
    avg = f"{windowed:.3f}" if windowed is not None else "-"
    stale = f"{row['staleness']:.2f}" if row["staleness"] is not None else "-"
    tps = f"{row['tokens_per_s']:.0f}" if row["tokens_per_s"] else "-"
    ent = f"{row['entropy']:.2f}" if row["entropy"] is not None else "-"
    done = min(int(20 * (windowed or 0) / (demo.target_reward or 1.0)), 20)
    return (
        f"[{'#' * done}{'.' * (20 - done)}] {row['t']:6.1f}s  step {row['version']:4d}  reward {reward} "
        f"(avg{demo.target_window} {avg})  staleness {stale}  entropy {ent}  tok/s {tps}"
    )
