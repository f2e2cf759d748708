"""Step overhead of the stack against the work itself, every ratio paired in one run.

(a) Generation per step: B = 32 prompts x 8 samples of the demo's task through the whole
    generation side (embedded Redis, reference engine, reward and rollout services started by
    the launcher, no trainer), against the same sampling done in-process by the engine's own
    scheduler and model runner. The stack arm is driven like a synchronous trainer (η = 0): take
    B groups, publish a weights directory of version v + 1 (the same tensors) and set the
    version, take the next B groups; the figure is the time from the version bump to the B-th
    group taken, so it holds admission, the engine's weight reload, generation, scoring and the
    buffer. The in-process arm submits the 256 requests to a `Scheduler` at once and waits. Both
    arms follow configs/demo.toml's [demo] with the `--set` overrides: `--set demo.prompt_len=16`
    gives 16-letter prompts and 16-token answers, to see how the stack's cost scales with the work.
    A floor goes with them: the in-process time plus, measured alone, what each policy version
    costs under the stack's guarantees whatever the transport (`guarantee_floor`: the answers
    scored and built into records, the fsynced buffer write of the B groups, the trainer's take,
    the engine's reload of the weights).
(b) Trainer busy time per step (a step's time minus its wait for data) against a plain step on a
    batch of the demo's shape: one forward with entropy, the policy loss, backward, clipping and
    AdamW on the model as transformers loads it, batch tensors built once. Two trainer figures:
    standalone (the trainer's own parts and loop, `trainer.parts.build` +
    `trainer.loop.train_steps`, world of one, reading groups put beforehand, publishing to disk
    every step as the demo does) and in the demo runs of (c) (median over their steps after the
    first 20, sharing the 2 cores with generation).
(c) Time to mean reward 0.9 of `asyncrl demo` against `benchmarks/recipe_screen.py` (the
    synchronous single-process loop on the same task, model, batch and seed, run with each of
    `--screen-threads`, the faster run being the baseline), paired per seed, one after the other.

    .venv/bin/python benchmarks/stack_overhead.py                      # (a), (b) and (c) for seeds 0-4
    .venv/bin/python benchmarks/stack_overhead.py --seeds 0 --steps 20 # quicker
    .venv/bin/python benchmarks/stack_overhead.py --skip-demo          # (a) and (b) only (~2 min)

The services listen on ports 18001-18004 and 31000 (`--port-base`), so a demo another user runs
on the default ports is not in the way. Prints a JSON object and a table; figures go to
benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

DEMO_CONFIG = ROOT / "configs" / "demo.toml"
SETTLE_STEPS = 20  # demo steps left out of the trainer's busy time (start-up, first publishes)


OVERRIDES: list[tuple[str, str, object]] = []  # `--set table.field=value`: (table, field, value)


def parse_override(text: str) -> tuple[str, str, object]:
    """`trainer.share_prompts=false` → ("trainer", "share_prompts", False): the value is TOML."""
    key, sep, value = text.partition("=")
    table, dot, field = key.strip().partition(".")
    if not (sep and dot and table and field):
        raise argparse.ArgumentTypeError(f"expected table.field=value, got {text!r}")
    return table, field, tomllib.loads(f"v = {value.strip()}")["v"]


def demo_config(port_base: int, **launch) -> dict:
    raw = tomllib.loads(DEMO_CONFIG.read_text())
    for table, field, value in OVERRIDES:
        raw.setdefault(table, {})[field] = value
    raw["launch"].update(engine_port=port_base + 13000, rollout_port=port_base + 1, reward_port=port_base + 2,
                         trainer_metrics_port=port_base + 3, metrics_port=port_base + 4, **launch)  # fmt: skip
    return raw


def write_config(raw: dict, path: Path) -> Path:
    import tomli_w  # the demo's own writer of the run config

    path.write_text(tomli_w.dumps(raw))
    return path


def med_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 1)


# ----------------------------------------------------------------------------- (a) generation
def inproc_generation(
    model_dir: str, prompts: list[list[int]], group: int, steps: int, new_tokens: int
) -> list[float]:
    """Seconds per step: every sample of the step submitted to the engine's scheduler at once,
    `new_tokens` each (no stop token: the demo's answers are fixed-length, `ignore_eos`)."""
    from asyncrl.services.engine.model_runner import ModelRunner
    from asyncrl.services.engine.sampling import RowSampling
    from asyncrl.services.engine.scheduler import Request, Scheduler

    n = len(prompts) * group
    runner = ModelRunner(model_dir, slots=n, context_length=None, device="cpu", dtype="float32")
    sched = Scheduler(runner, max_running=n, max_prefill_tokens=4096, weight_version="0")
    sched.start()
    rng = random.Random(0)
    times = []
    try:
        for i in range(steps + 2):  # two warm-up steps
            done, left, lock = threading.Event(), [n], threading.Lock()

            def finished(_, left=left, lock=lock, done=done):
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

            t0 = time.perf_counter()
            for p in prompts:
                for _ in range(group):
                    sched.submit(Request(rid=f"{i}-{rng.getrandbits(48)}", prompt_ids=p, max_new_tokens=new_tokens,
                                         stop_ids=frozenset(), sampling=RowSampling(1.0, 1.0, -1, 0.0),
                                         seed=rng.getrandbits(63), on_finish=finished,
                                         return_logprob=True))  # fmt: skip
            done.wait()
            if i >= 2:
                times.append(time.perf_counter() - t0)
    finally:
        sched.stop()
    return times


def stack_generation(run_dir: Path, port_base: int, steps: int, eta: int) -> dict:
    """Seconds per step of the generation side driven by a trainer stand-in that takes B groups
    and publishes a weights directory (the same tensors) as the next version, without training:
    with η = 0 (synchronous: the figure is the latency from the version bump to the B-th group
    taken) and then with η = `eta` (the demo's admission: the figure is the time per B groups
    with generation running ahead, i.e. its throughput)."""
    from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions
    from asyncrl.proto import WeightsInfo
    from asyncrl.services.ops.demo_jobs import submit
    from asyncrl.services.ops.launcher import Launcher
    from asyncrl.services.ops.run_config import DemoSection, RunConfig
    from asyncrl.trainer.publish import DiskPublisher

    raw = demo_config(port_base, trainer=False)
    raw["model"].update(path=str(run_dir / "base"), seed=0)
    raw["run"].update(id="overhead", dir=str(run_dir))
    demo = DemoSection.model_validate(raw["demo"])
    b = demo.prompts_per_step
    launcher = Launcher(RunConfig.model_validate(raw), write_config(raw, run_dir / "config.toml"), echo=False)
    out: dict = {}
    try:
        launcher.start()
        buf = Buffer(launcher.redis_url, run="overhead")
        admission = AdmissionControl(buf)
        groups, weights = Groups(buf, consumer="bench-trainer"), PolicyVersions(buf)
        publisher = DiskPublisher(run_dir / "trainer" / "weights", run_dir / "base", keep=3)
        from safetensors.torch import load_file

        state = load_file(str(run_dir / "base" / "model.safetensors"))
        submit(launcher.rollout_urls()[0], demo, (2 * steps + 20) * b * (eta + 2), random.Random(0))
        v = 0
        for name, max_staleness in (("sync", 0), ("async", eta)):
            admission.configure(batch_groups=b, max_staleness=max_staleness)
            times, dropped = [], 0
            for i in range(steps + 3):  # three warm-up steps
                t0 = time.perf_counter()
                taken = 0
                while taken < b:
                    res = groups.take(b - taken, v, max_staleness, 5000)
                    taken += len(res.groups)
                    dropped += len(res.dropped)
                if max_staleness == 0 and i >= 3:
                    times.append(time.perf_counter() - t0)
                v += 1
                published = publisher.write(v, state)
                info = WeightsInfo(
                    version=v, epoch=0, method="disk", path=published.path, published_at=time.time()
                )
                if "set_version" in inspect.signature(weights.publish).parameters:  # one round trip
                    weights.publish(info, set_version=True)
                else:  # an older buffer without `set_version`: two round trips
                    weights.publish(info)
                    weights.set_version(v)
                if max_staleness and i >= 3:
                    times.append(time.perf_counter() - t0)  # a whole step: take and publish
            out[name] = {"step_s": times, "dropped_stale": dropped}
    finally:
        launcher.stop()
    return out


def guarantee_floor(run_dir: Path, model_dir: str, prompts: list[dict], group: int, answer_tokens: int,
                    steps: int) -> dict:  # fmt: skip
    """Milliseconds per step of what every policy version costs the stack under its guarantees,
    each alone and in-process, on the demo's shapes: the answers scored by the task's verifier
    and built into group records by the rollout's own code (`GroupScheduler._score`, the local
    scorer, `Group.build`), the groups put in the buffer (one pipeline on an embedded Redis that
    fsyncs every write, as the launcher starts it) and taken by the trainer, and the engine
    reading the published weights directory and loading it into its model runner. No HTTP, no
    scheduling, no waiting: a floor under the stack's overhead."""
    import asyncio
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from asyncrl.buffer import Buffer, Groups
    from asyncrl.buffer.server import EMBEDDED_FSYNC, RedisServer
    from asyncrl.proto import Group, GroupJob, RewardStatus
    from asyncrl.services.engine.model_runner import ModelRunner, read_checkpoint
    from asyncrl.services.rollout.clients.rewards import RewardClient
    from asyncrl.services.rollout.groups.scheduler import GroupScheduler
    from asyncrl.services.rollout.segments import Draft
    from asyncrl.trainer.publish import DiskPublisher

    def timed(fn) -> list[float]:
        times = []
        for i in range(steps + 3):  # three warm-up steps
            t0 = time.perf_counter()
            fn(i)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return times

    n_groups = len(prompts)
    rng = np.random.default_rng(0)
    jobs = [GroupJob(job_id="floor", group_id=f"g{i}", prompt_id=f"p{i}", prompt_tokens=np.arange(1, answer_tokens + 3, dtype=np.int32),
                     group_size=group, reward_spec=p["reward_spec"], prompt_text=p["text"]) for i, p in enumerate(prompts)]  # fmt: skip

    def drafts() -> list[list[Draft]]:
        now = time.time()
        return [[Draft(i, tokens=rng.integers(3, 13, answer_tokens).tolist(), logprobs=[-1.0] * answer_tokens,
                       versions=[1] * answer_tokens, lineage={0: 1}, segments=1, submitted=now, first_token=now, finished=now,
                       text="".join(rng.choice(list("abcdefghij"), answer_tokens))) for i in range(group)] for _ in jobs]  # fmt: skip

    async def score_steps() -> tuple[list[float], list[list[Group]]]:
        rollout = SimpleNamespace(rewards=RewardClient("http://127.0.0.1:9", timeout_s=5, concurrency=1, retries=0,
                                                       verifiers_ttl_s=60, local_verifiers=["reverse"]))  # fmt: skip
        times, batches = [], []
        for i in range(steps + 3):  # three warm-up steps
            answers = drafts()
            t0 = time.perf_counter()
            batches.append([Group.build(group_id=f"{job.group_id}-{i}", job_id=job.job_id, prompt_tokens=job.prompt_tokens,
                                        reward_spec=job.reward_spec, samples=await GroupScheduler._score(rollout, job, d),
                                        submit_version=1, lineage={0: 1}) for job, d in zip(jobs, answers)])  # fmt: skip
            if i >= 3:
                times.append(time.perf_counter() - t0)
        await rollout.rewards.aclose()
        return times, batches

    score, batches = asyncio.run(score_steps())
    unscored = sum(s is not RewardStatus.scored for b in batches for g in b for s in g.samples.reward_status)
    assert not unscored, f"{unscored} answers not scored: the floor's records are not the demo's"
    took: list[int] = []
    with RedisServer(run_dir / "redis", fsync=EMBEDDED_FSYNC) as server:
        groups = Groups(Buffer(server.url, run="floor"), consumer="floor")
        put = timed(lambda i: groups.put(batches[i]))
        take = timed(lambda i: took.append(len(groups.take(n_groups, 0, 10**6, 1000).groups)))
    assert took == [n_groups] * len(took), f"took {took} groups, not {n_groups} a step"
    publisher = DiskPublisher(run_dir / "weights", Path(model_dir), keep=3)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    path = publisher.write(1, state).path
    runner = ModelRunner(model_dir, slots=1, context_length=None, device="cpu", dtype="float32")

    def reload(_: int) -> None:
        named = read_checkpoint(path)
        assert runner.check_weights(named, full=True) is None
        runner.apply_weights(named)

    return {"score_ms": med_ms(score), "put_ms": med_ms(put), "take_ms": med_ms(take),
            "reload_ms": med_ms(timed(reload))}  # fmt: skip


# ----------------------------------------------------------------------------- (b) trainer
def demo_groups(n_groups: int, group: int, prompt_len: int, vocab: range, seed: int, bos: int):
    from asyncrl.proto import Group, Sample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = np.array([bos, *rng.integers(vocab.start, vocab.stop, prompt_len), vocab.stop], np.int32)
        samples = [Sample(prompt_id=f"p{g}", index=i, completion_ids=rng.integers(vocab.start, vocab.stop, prompt_len).astype(np.int32),
                          behavior_logprobs=np.full(prompt_len, -2.0, np.float32), versions=np.zeros(prompt_len, np.int32),
                          finish_reason="length", truncated=True, reward=float(rng.integers(0, prompt_len + 1)) / prompt_len,
                          reward_status="scored") for i in range(group)]  # fmt: skip
        out.append(Group.build(group_id=f"bench-{seed}-{g}", job_id="bench", prompt_tokens=prompt,
                               reward_spec={"verifier": "reverse"}, samples=samples, submit_version=0))  # fmt: skip
    return out


def plain_step(
    model_dir: str, groups, steps: int, lr: float, entropy_coef: float, share_prompts: bool
) -> list[float]:
    """Forward (with entropy), policy loss, backward, clip, AdamW: the work of a step, nothing
    else, on the layout the trainer uses (padded rows, or one row per prompt: `share_prompts`)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.batch import build_rows, collate, collate_shared, token_logprobs
    from asyncrl.trainer.losses import LossConfig, entropy_bonus, policy_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batch = (collate_shared if share_prompts else collate)(build_rows(groups, "dr_grpo").rows, 0)
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        lp, ent = token_logprobs(model, batch, with_entropy=True)
        loss, _ = policy_loss(
            lp, lp.detach(), batch.behavior_logprobs, batch.advantages, batch.mask, LossConfig()
        )
        loss = loss + entropy_bonus(ent, batch.mask, entropy_coef)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


class StepLog(logging.Handler):
    """The trainer's `step` log events (trainer/loop.py `record`), as dicts."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "step":
            self.steps.append(getattr(record, "fields", {}))


def trainer_standalone(run_dir: Path, model_dir: str, steps: int) -> list[dict]:
    """The trainer's loop for `steps` versions over groups put beforehand (none stale)."""
    from asyncrl.buffer import Buffer, Groups
    from asyncrl.buffer.server import RedisServer
    from asyncrl.trainer.config import TrainerSettings
    from asyncrl.trainer.loop import train_steps
    from asyncrl.trainer.model import init_distributed
    from asyncrl.trainer.parts import build

    raw = tomllib.loads(DEMO_CONFIG.read_text())["trainer"]
    b = raw["batch_groups"]
    with RedisServer(run_dir / "redis", fsync="always") as server:
        groups = demo_groups(b * (steps + 1), 8, 3, range(3, 13), seed=1, bos=1)
        Groups(Buffer(server.url, run="bench")).put(groups)
        cfg = TrainerSettings(**{**raw, "redis_url": server.url, "run": "bench", "model_path": model_dir,
                                 "output_dir": str(run_dir / "trainer"), "max_steps": steps, "max_staleness": 10**6,
                                 "checkpoint_every": 10**6, "metrics_port": 0, "device": "cpu"})  # fmt: skip
        handler = StepLog()
        logging.getLogger("asyncrl.trainer").addHandler(handler)
        logging.getLogger("asyncrl.trainer").setLevel(logging.INFO)
        try:
            d = init_distributed("cpu")
            train_steps(build(cfg, d))
        finally:
            logging.getLogger("asyncrl.trainer").removeHandler(handler)
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return handler.steps[:-1]  # the last step also writes the final checkpoint


def busy_s(step: dict) -> float:
    return step["step_s"] - step.get("wait_s", 0.0)


def phase_medians(steps: list[dict]) -> dict[str, float]:
    keys = sorted({k for s in steps for k in s if k.endswith("_s")})
    return {k: med_ms([s.get(k, 0.0) for s in steps]) for k in keys}


# ----------------------------------------------------------------------------- (c) time to 0.9
def demo_run(seed: int, port_base: int, time_limit: float, run_dir: Path) -> dict:
    raw = demo_config(port_base)
    config = write_config(raw, run_dir.parent / f"demo-config-{seed}.toml")
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "demo", "--config", str(config), "--seed", str(seed),
           "--time-limit", str(time_limit), "--run-dir", str(run_dir)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = []
    for line in (run_dir / "logs" / "trainer.log").read_text().splitlines():
        start = line.find("{")
        try:
            event = json.loads(line[start:]) if start >= 0 else {}
        except ValueError:
            continue
        if event.get("msg") == "step":
            steps.append(event)
    return {"time_to_target_s": summary["time_to_target_s"], "steps": summary["steps"], "wall_s": summary["wall_s"],
            "mean_staleness": summary["mean_staleness"], "dropped": summary["dropped"],
            "trainer_steps": steps[SETTLE_STEPS:]}  # fmt: skip


def screen_run(seed: int, threads: int) -> dict:
    """The single-process loop's steps and seconds to 0.9 (None if not reached in its 700 steps).
    On a shared 2-core machine its 2-thread runs slow down badly while anything else runs (the
    second thread waits on a busy core), so (c) runs it with 1 and 2 threads and takes the faster."""
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "recipe_screen.py"),
        "--seed",
        str(seed),
        "--threads",
        str(threads),
    ]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"steps": result["reached"], "time_to_target_s": result["seconds"] if result["reached"] else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per arm of (a) and (b)")
    ap.add_argument("--time-limit", type=float, default=150, help="seconds per demo run of (c)")
    ap.add_argument("--screen-threads", type=int, nargs="+", default=[1, 2],
                    help="torch threads of the single-process loop: one run each, the faster is the baseline")  # fmt: skip
    ap.add_argument("--port-base", type=int, default=18000)
    ap.add_argument(
        "--eta", type=int, help="η of the generation arm run ahead (default: configs/demo.toml's)"
    )
    ap.add_argument("--skip-demo", action="store_true", help="only (a) and (b)")
    ap.add_argument("--skip-generation", action="store_true")
    ap.add_argument("--skip-trainer", action="store_true")
    ap.add_argument("--set", type=parse_override, action="append", default=[], metavar="TABLE.FIELD=VALUE",
                    help="override configs/demo.toml for the stack's runs (a and c), e.g. trainer.share_prompts=false")  # fmt: skip
    args = ap.parse_args()
    OVERRIDES.extend(args.set)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result: dict = {
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
        "overrides": [f"{t}.{f}={v}" for t, f, v in OVERRIDES],
    }
    with tempfile.TemporaryDirectory(prefix="stack-overhead-") as tmp:
        tmp = Path(tmp)
        from asyncrl.services.ops.tinymodel import build_tiny_model

        model_cfg = tomllib.loads(DEMO_CONFIG.read_text())["model"]
        base = tmp / "gen" / "base"
        build_tiny_model(base, chars=model_cfg["tiny_chars"], hidden_size=model_cfg["tiny_hidden_size"],
                         num_layers=model_cfg["tiny_layers"], tie_word_embeddings=model_cfg["tiny_tie_embeddings"],
                         seed=0)  # fmt: skip
        if not args.skip_generation:
            from transformers import AutoTokenizer

            from asyncrl.services.ops.run_config import DemoSection
            from asyncrl.services.ops.tasks import reverse_prompts

            # The stack's task (configs/demo.toml's [demo], with --set): B prompts of prompt_len
            # letters, group_size answers of prompt_len tokens each.
            demo = DemoSection.model_validate(demo_config(args.port_base)["demo"])
            tok = AutoTokenizer.from_pretrained(base)
            prompts = [tok(p["text"], add_special_tokens=False)["input_ids"]
                       for p in reverse_prompts(demo.prompts_per_step, demo.letters, demo.prompt_len, random.Random(0))]  # fmt: skip
            inproc = inproc_generation(str(base), prompts, demo.group_size, args.steps, demo.prompt_len)
            eta = (
                args.eta
                if args.eta is not None
                else tomllib.loads(DEMO_CONFIG.read_text())["trainer"]["max_staleness"]
            )
            stack = stack_generation(tmp / "gen", args.port_base, args.steps, eta)
            floor = guarantee_floor(tmp / "floor", str(base), reverse_prompts(demo.prompts_per_step, demo.letters,
                                    demo.prompt_len, random.Random(1)), demo.group_size, demo.prompt_len, args.steps)  # fmt: skip
            result["generation"] = {"inproc_ms": med_ms(inproc), "eta": eta, "answer_tokens": demo.prompt_len, **{
                f"{arm}_{k}": v for arm, r in stack.items() for k, v in (
                    ("ms", med_ms(r["step_s"])), ("ratio", statistics.median(r["step_s"]) / statistics.median(inproc)),
                    ("dropped_stale", r["dropped_stale"]))},
                "floor_ms": floor, "floor_ratio": 1 + sum(floor.values()) / med_ms(inproc)}  # fmt: skip
        if not args.skip_trainer:
            trainer_cfg = tomllib.loads(DEMO_CONFIG.read_text())["trainer"]
            shared = trainer_cfg.get("share_prompts", False)
            steps_by_layout = {
                layout: plain_step(
                    str(base),
                    demo_groups(32, 8, 3, range(3, 13), seed=2, bos=1),
                    args.steps,
                    trainer_cfg["lr"],
                    trainer_cfg["entropy_coef"],
                    layout,
                )
                for layout in dict.fromkeys((shared, False))
            }  # (padded once when it is the layout)
            plain, padded = steps_by_layout[shared], steps_by_layout[False]
            alone = trainer_standalone(tmp / "trainer", str(base), args.steps + 3)[3:]
            result["trainer"] = {"share_prompts": shared, "plain_ms": med_ms(plain), "plain_padded_ms": med_ms(padded),
                                 "standalone_busy_ms": med_ms([busy_s(s) for s in alone]),
                                 "standalone_ratio": statistics.median(busy_s(s) for s in alone) / statistics.median(plain),
                                 "standalone_phases_ms": phase_medians(alone)}  # fmt: skip
        if not args.skip_demo:
            rows = []
            for seed in args.seeds:
                demo = demo_run(seed, args.port_base, args.time_limit, tmp / f"demo-{seed}")
                screens = {t: screen_run(seed, t) for t in args.screen_threads}
                reached = [r for r in screens.values() if r["time_to_target_s"]]
                screen = (
                    min(reached, key=lambda r: r["time_to_target_s"])
                    if reached
                    else {"steps": None, "time_to_target_s": None}
                )
                screen = {**screen, "by_threads": screens}
                steps = demo.pop("trainer_steps")
                demo["trainer_busy_ms"] = med_ms([busy_s(s) for s in steps]) if steps else None
                demo["trainer_phases_ms"] = phase_medians(steps) if steps else {}
                d, s = demo["time_to_target_s"], screen["time_to_target_s"]
                rows.append(
                    {"seed": seed, "demo": demo, "screen": screen, "ratio": d / s if d and s else None}
                )
                print(json.dumps(rows[-1]), flush=True)
            result["time_to_target"] = rows
            if "trainer" in result:
                busy = [r["demo"]["trainer_busy_ms"] for r in rows if r["demo"]["trainer_busy_ms"]]
                result["trainer"]["demo_busy_ms"] = statistics.median(busy) if busy else None
                result["trainer"]["demo_ratio"] = (
                    statistics.median(busy) / result["trainer"]["plain_ms"] if busy else None
                )
    print(json.dumps(result, indent=2))
    print_table(result)
    return 0


def print_table(r: dict) -> None:
    if "generation" in r:
        g = r["generation"]
        print(f"\n(a) generation per step ({g['answer_tokens']}-token answers), in-process {g['inproc_ms']} ms; "
              "through the stack: synchronous "
              f"{g['sync_ms']} ms = {g['sync_ratio']:.2f}x, η = {g['eta']} (throughput) {g['async_ms']} ms = "
              f"{g['async_ratio']:.2f}x (target <= 1.5x)")  # fmt: skip
        f = g["floor_ms"]
        print(f"    floor: the in-process work plus what each version costs under the guarantees, each alone "
              f"(scoring and records {f['score_ms']} + put {f['put_ms']} + take {f['take_ms']} + engine reload "
              f"{f['reload_ms']} ms) = "
              f"{g['floor_ratio']:.2f}x")  # fmt: skip
    if "trainer" in r:
        t = r["trainer"]
        line = f"(b) trainer busy per step: standalone {t['standalone_busy_ms']} ms = {t['standalone_ratio']:.2f}x"
        if t.get("demo_ratio"):
            line += f", in the demo {t['demo_busy_ms']} ms = {t['demo_ratio']:.2f}x"
        layout = "one row per prompt" if t.get("share_prompts") else "padded rows"
        print(line + f" a plain step's {t['plain_ms']} ms on the trainer's layout, {layout} (target <= 1.3x); "
              f"the plain step on padded rows: {t.get('plain_padded_ms')} ms")  # fmt: skip
    if "time_to_target" in r:
        print(
            "(c) | seed | demo: time to 0.9, steps | single process: time, steps | ratio (target <= 1.0 on >= 4 of 5) |"
        )
        for row in r["time_to_target"]:
            d, s = row["demo"], row["screen"]
            fmt = lambda x: "not reached" if x is None else f"{x:.1f} s"  # noqa: E731
            ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
            each = ", ".join(f"{t} thr {fmt(x['time_to_target_s'])}" for t, x in s["by_threads"].items())
            print(f"    | {row['seed']} | {fmt(d['time_to_target_s'])}, {d['steps']} | {fmt(s['time_to_target_s'])}, "
                  f"{s['steps']} ({each}) | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
