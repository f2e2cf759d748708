"""`asyncrl demo`: the CPU demo end to end, in a fresh run directory.

Embedded Redis, a tiny Qwen2 model with a character tokenizer built on the spot, the
reference engine, reward service, rollout service and trainer as separate processes on
loopback; submits the `reverse` task and trains asynchronously until the mean reward over
the last few steps reaches the target or the time limit passes. Shows a live progress line,
then a summary table, and writes `progress.jsonl`, `summary.json` and `demo.png` (reward and
staleness against wall time) into the run directory.
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from asyncrl.proto.evals import CORRECT_REWARD
from asyncrl.proto.states import GroupState, JobState
from asyncrl.services.ops.run_config import (
    DemoSection,
    RunConfigError,
    load_run_config,
    validate_run_config,
)
from asyncrl.services.runtime.heap_freeze import freeze_startup_heap

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"


@dataclass
class Scrape:
    """What the demo reads off the trainer's /metrics each poll."""

    elapsed_s: float  # since the demo started
    version: int
    reward: float | None
    entropy: float | None
    tokens_per_s: float | None
    staleness_sum: float
    staleness_count: float
    staleness_max_bucket: float | None
    dropped: float
    staleness_buckets: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative groups)


def scrape_trainer(url: str, t0: float) -> Scrape | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None
    values: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    dropped = 0.0
    for name, labels, value in _samples(text, SCRAPED):
        if name == "asyncrl_trainer_group_staleness_bucket":
            buckets.append((float(labels["le"]), value))
        elif name == "asyncrl_trainer_groups_total" and labels.get("outcome") not in (
            GroupState.trained,
            None,
        ):
            dropped += value
        elif not labels:
            values[name] = value
    count = values.get("asyncrl_trainer_group_staleness_count", 0.0)
    # the largest staleness seen is the first bucket bound that already holds every observation
    max_bucket = next((le for le, c in sorted(buckets) if c >= count), None) if count else None
    version = int(values.get("asyncrl_trainer_version", 0))
    return Scrape(
        elapsed_s=time.monotonic() - t0,
        version=version,
        # before the first step the trainer's gauges hold their initial 0, not a measurement
        reward=values.get("asyncrl_trainer_reward_mean") if version else None,
        entropy=values.get("asyncrl_trainer_entropy") if version else None,
        tokens_per_s=values.get("asyncrl_trainer_tokens_per_second") if version else None,
        staleness_sum=values.get("asyncrl_trainer_group_staleness_sum", 0.0),
        staleness_count=count,
        staleness_max_bucket=max_bucket,
        dropped=dropped,
        staleness_buckets=sorted(buckets),
    )


# The trainer's samples the demo reads: only their lines are parsed (prometheus_client's parser
# read every family of the page, twice a second: a third of a core-second per minute of demo).
SCRAPED = frozenset(
    {
        "asyncrl_trainer_version",
        "asyncrl_trainer_reward_mean",
        "asyncrl_trainer_entropy",
        "asyncrl_trainer_tokens_per_second",
        "asyncrl_trainer_group_staleness_sum",
        "asyncrl_trainer_group_staleness_count",
        "asyncrl_trainer_group_staleness_bucket",
        "asyncrl_trainer_groups_total",
    }
)


def _samples(text: str, names: frozenset[str]):
    """(name, labels, value) of the samples of `names` in a Prometheus text page (the exposition
    format prometheus_client writes: `name{k="v",…} value`, label values without `",` inside)."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        if name not in names:
            continue
        labels = (
            dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if "=" in pair) if rest else {}
        )
        yield name, {k: v.strip('"') for k, v in labels.items()}, float(value)


@dataclass
class History:
    """One row per trainer version seen: the curve the plot and the summary come from."""

    rows: list[dict] = field(default_factory=list)
    _last: Scrape | None = None

    @property
    def staleness_histogram(self) -> dict[str, int]:
        """Trained groups by staleness bucket ("≤0", "≤1", … as the trainer's histogram bounds
        them; not cumulative), from the last scrape."""
        out, below = {}, 0.0
        for le, count in self._last.staleness_buckets if self._last else []:
            if count > below:
                out[f"<={le:g}"] = int(count - below)
            below = count
        return out

    def add(self, s: Scrape) -> dict | None:
        if self._last is not None and s.version == self._last.version:
            return None
        prev = self._last
        self._last = s
        dc = s.staleness_count - (prev.staleness_count if prev else 0)
        ds = s.staleness_sum - (prev.staleness_sum if prev else 0)
        row = {
            "t": round(s.elapsed_s, 3),
            "version": s.version,
            "reward": s.reward,
            "entropy": s.entropy,
            "tokens_per_s": s.tokens_per_s,
            "staleness": ds / dc if dc else None,
            "staleness_max": s.staleness_max_bucket,
            "dropped": s.dropped,
        }
        self.rows.append(row)
        return row


@dataclass
class StepRewards:
    """Every trainer step's `reward_mean`, read from its `step` events (trainer/loop.py `record`)
    in logs/trainer.log as the launcher writes it: the target is the mean over the last
    `target_window` steps, each step counted once, as the single-process loop
    (benchmarks/recipe_screen.py) measures it. (Scrapes, twice a second, see one step in two
    to five; a window of scrapes spans more steps than it says.)"""

    path: Path
    t0_wall: float  # time.time() at the demo's t0
    rewards: list[tuple[int, float, float]] = field(default_factory=list)  # (version, t since t0, reward)
    _offset: int = 0

    def poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        for line in data[:end].splitlines():
            if b'"msg": "step"' not in line:
                continue
            try:
                event = json.loads(line[line.find(b"{") :])
                self.rewards.append(
                    (int(event["version"]), float(event["ts"]) - self.t0_wall, float(event["reward_mean"]))
                )
            except (ValueError, KeyError, TypeError):  # not a step event after all
                continue

    def reached(self, window: int, target: float) -> float | None:
        """When (s since t0) the mean of `window` consecutive steps first reached `target`."""
        r = [reward for _, _, reward in self.rewards]
        for i in range(window, len(r) + 1):
            if sum(r[i - window : i]) / window >= target:
                return self.rewards[i - 1][1]
        return None

    def windowed(self, window: int) -> float | None:
        last = [reward for _, _, reward in self.rewards[-window:]]
        return sum(last) / window if len(last) == window else None


@dataclass
class Evals:
    """Finished held-out evaluations, one row per version, read from the rollout service's
    `GET /v1/evaluations` (the rollout service runs them: at version 0 and every `eval_every`)."""

    url: str
    name: str
    t0_wall: float
    items_dir: Path | None = (
        None  # each finished evaluation's items go to <items_dir>/<name>-v<version>.jsonl
    )
    rows: dict[int, dict] = field(default_factory=dict)
    _next_poll: float = 0.0

    def poll(self, every_s: float = 5.0) -> list[dict]:
        """New finished evaluations since the last poll (at most one poll per `every_s`)."""
        if time.monotonic() < self._next_poll:
            return []
        self._next_poll = time.monotonic() + every_s
        try:
            resp = httpx.get(f"{self.url}/v1/evaluations", params={"name": self.name}, timeout=5.0)
            resp.raise_for_status()
        except httpx.HTTPError:
            return []
        new = []
        for e in resp.json()["evaluations"]:
            if e["state"] != JobState.done or e["version"] in self.rows:
                continue
            row = {
                "name": self.name,
                "version": e["version"],
                "t": round(e["finished_at"] - self.t0_wall, 3),
                "accuracy": e["accuracy"],
                "format_rate": e.get("format_rate"),  # (absent from an older rollout service's answer)
                "formatted_accuracy": e.get("formatted_accuracy"),
                "mean_reward": e["mean_reward"],
                "mean_length": e["mean_length"],
                "prompts": e["prompts"],
                "eval_id": e["eval_id"],
                "eval_s": round(e["finished_at"] - e["started_at"], 1),
            }
            self.rows[e["version"]] = row
            new.append(row)
            self.save_items(e["eval_id"], e["version"])
        return new

    def save_items(self, eval_id: str, version: int) -> None:
        """Per item: right or not, formatted or not, its length. The same problems at every version, so a
        gain can be judged item by item (benchmarks/real_run_report.py: a paired interval)."""
        if self.items_dir is None:
            return
        try:
            resp = httpx.get(f"{self.url}/v1/evaluations/{eval_id}", timeout=30.0)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            print(f"items of evaluation {eval_id} not saved: {exc}")
            return
        self.items_dir.mkdir(exist_ok=True)
        lines = [
            json.dumps(
                {
                    "prompt_id": it["prompt_id"],
                    "correct": it["reward_status"] == "scored" and (it["reward"] or 0.0) >= CORRECT_REWARD,
                    "formatted": it.get("formatted"),
                    "tokens": it["completion_tokens"],
                }
            )  # fmt: skip
            for it in resp.json()["items"]
        ]
        (self.items_dir / f"{self.name}-v{version}.jsonl").write_text("\n".join(lines) + "\n")

    def sorted(self) -> list[dict]:
        return [self.rows[v] for v in sorted(self.rows)]

    def run_final(self, timeout_s: float) -> dict | None:
        """Evaluate the version the engines serve now and wait for it (the run's last point)."""
        try:
            resp = httpx.post(f"{self.url}/v1/evaluations", json=self.final_body, timeout=60.0)
            resp.raise_for_status()
            eval_id = resp.json()["eval_id"]
        except httpx.HTTPError as exc:
            print(f"final evaluation not submitted: {exc}")
            return None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(2.0)
            self._next_poll = 0.0
            for row in self.poll():
                if row["eval_id"] == eval_id:
                    return row
        print(f"final evaluation {eval_id} did not finish within {timeout_s:.0f} s")
        return None

    final_body: dict = field(default_factory=dict)


def make_prompts(n: int, cfg: DemoSection, rng: random.Random) -> list[dict]:
    """`n` training prompts of the demo's task (services/ops/tasks.py)."""
    from asyncrl.services.ops.tasks import reverse_prompts

    if cfg.task == "math":
        return math_task(cfg).train_prompts(n, rng)
    if cfg.task == "secret":  # the word is the environment's (one per episode), not the prompt's
        return [{"text": "<bos>>"} for _ in range(n)]
    return reverse_prompts(n, cfg.letters, cfg.prompt_len, rng)


def episode(cfg: DemoSection) -> dict:
    """secret: each sample is an episode with the `secret` environment, whose one tool (`lookup`,
    called by sampling `?`) answers the episode's word; the answer is the word. Without the
    tool the word is a guess (expected reward 1/len(letters))."""
    if cfg.task != "secret":
        return {}
    return {
        "episode": {
            "environment": "secret",
            "max_turns": cfg.max_turns,
            "tool_format": "tagged",
            "tool_open": "?",
            "tool_close": "",
            "default_tool": "lookup",
            "observation_template": "{observation}",
            "tools": cfg.tools,
            "env_args": {"letters": cfg.letters, "length": cfg.prompt_len},
        }
    }


def math_task(cfg: DemoSection):
    from asyncrl.services.ops.tasks import HeldoutSet, MathTask

    return MathTask(
        eval_seed=cfg.eval_seed,
        eval_size=cfg.eval_size,
        word_fraction=cfg.word_fraction,
        level=cfg.level,
        more_heldout={name: HeldoutSet(**e.model_dump()) for name, e in cfg.eval_sets.items()},
        worked_example=cfg.worked_example,
    )


def sampling_params(cfg: DemoSection) -> dict:
    if cfg.task == "math":
        # EOS-terminated answers (the engine stops at any of the model's end-of-turn ids); the
        # reward reads the text without special tokens.
        return {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens}
    # Fixed-length answers: every completion has exactly prompt_len tokens, so stopping
    # early is never an option the policy can collapse into (docs/architecture.md §10). Special
    # tokens stay in the text, so a sampled <eos> costs its position instead of vanishing
    # and sliding the later characters into place: the reward is exact per token.
    return {
        "temperature": 1.0,
        "max_new_tokens": cfg.prompt_len,
        "ignore_eos": True,
        "skip_special_tokens": False,
    }


EVAL_NAME = "heldout"


def heldout_sets(demo: DemoSection, run_dir: Path, raw: dict) -> dict[str, list[dict]]:
    """The math task's held-out sets, name -> prompts (the main one, `heldout`, first), each
    written to `<run_dir>/<name>.jsonl` and named in the run config `raw` as an automatic
    evaluation of the rollout service (`[rollout] eval_sets`, every `eval_every` versions)."""
    if demo.task != "math" or not demo.eval_every:
        return {}
    task = math_task(demo)
    heldout = {EVAL_NAME: task.heldout_prompts()} if demo.eval_size else {}
    heldout |= {name: held.prompts(name) for name, held in task.more_heldout.items()}
    for name, prompts in heldout.items():
        (run_dir / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    if heldout:
        raw.setdefault("rollout", {}).update(
            eval_sets={name: str(run_dir / f"{name}.jsonl") for name in heldout},
            eval_every=demo.eval_every,
            eval_max_new_tokens=demo.max_new_tokens,
        )
    return heldout


PROMPTS_PER_JOB = 20_000  # well under the rollout service's per-job cap
TOPUP_STEPS = 250  # the demo submits prompts for this many steps at a time (twice over)


def submit(
    rollout_url: str, cfg: DemoSection, n_prompts: int, rng: random.Random, first_job: int = 0
) -> list[str]:
    """Post the reverse task in jobs of at most PROMPTS_PER_JOB prompts; returns the job ids.
    Job k gets the idempotency key demo-<seed>-<first_job + k>."""
    jobs = []
    for k, start in enumerate(range(0, n_prompts, PROMPTS_PER_JOB), start=first_job):
        body = {
            "prompts": make_prompts(min(PROMPTS_PER_JOB, n_prompts - start), cfg, rng),
            "group_size": cfg.group_size,
            "sampling_params": sampling_params(cfg),
            "idempotency_key": f"demo-{cfg.seed}-{k}",
            **episode(cfg),
        }
        resp = httpx.post(f"{rollout_url}/v1/rollouts", json=body, timeout=120)
        if resp.status_code != 202:
            raise RuntimeError(
                f"the rollout service refused the demo job ({resp.status_code}): {resp.text[:500]}"
            )
        jobs.append(resp.json()["job_id"])
    return jobs


def scrape_samples(url: str):
    """Every sample on a service's /metrics (none when it does not answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return []
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def scrape_counters(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Unlabelled samples of `names` from a service's /metrics (missing ones are left out)."""
    return {s.name: s.value for s in scrape_samples(url) if s.name in names and not s.labels}


def utilisation(launcher, wall_s: float) -> dict[str, float | None]:
    """Engine busy ratio and trainer idle ratio over the run, from the services' counters."""
    busy = [
        scrape_counters(u, ("asyncrl_engine_busy_seconds_total",)).get("asyncrl_engine_busy_seconds_total")
        for u in launcher.engine_urls
    ]
    t = scrape_counters(
        launcher.trainer_url, ("asyncrl_trainer_idle_seconds_total", "asyncrl_trainer_busy_seconds_total")
    )
    idle, tbusy = t.get("asyncrl_trainer_idle_seconds_total"), t.get("asyncrl_trainer_busy_seconds_total")
    known = [b for b in busy if b is not None]
    shares = (
        {"engine": launcher.engine_urls[:1], "trainer": [launcher.trainer_url]} if launcher.core_share else {}
    )
    return {
        "engine_busy_ratio": sum(known) / (len(known) * wall_s) if known and wall_s > 0 else None,
        "trainer_idle_ratio": idle / (idle + tbusy) if idle is not None and tbusy else None,
        "trainer_idle_s": idle,
        "trainer_busy_s": tbusy,
        # core sharing: seconds each had work, by torch threads it used, and seconds it waited for a core
        "core_share": {role: core_share_seconds(urls[0], role) for role, urls in shares.items() if urls}
        or None,
    }


def core_share_seconds(url: str, role: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in scrape_samples(url):
        if s.labels.get("role") != role:
            continue
        if s.name == "asyncrl_core_share_busy_seconds_total":
            out[f"busy_s_{s.labels['threads']}_threads"] = round(s.value, 1)
        elif s.name == "asyncrl_core_share_wait_seconds_total":
            out["wait_s"] = round(s.value, 2)
    return out


def plot(
    history: History,
    out: Path,
    target: float | None,
    eta: int,
    evals: list[dict] | None = None,
    task: str = "reverse",
    more: dict[str, list[dict]] | None = None,
) -> None:
    """Reward and staleness against wall time; with evaluations (`evals`: the main held-out set's
    rows; `more`: other sets' by name), a second panel of training reward and each set's
    held-out accuracy against the policy version (and, dashed, its accuracy among formatted
    answers), and the accuracies on the first panel too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in history.rows if r["reward"] is not None]
    sets = {name: r for name, r in {EVAL_NAME: evals or [], **(more or {})}.items() if r}
    colours = dict(zip(sets, ("tab:green", "tab:purple", "tab:brown", "tab:gray")))
    evals = evals or next(iter(sets.values()), [])  # whether there are panels for evaluations at all
    if evals:
        fig, (ax, axv) = plt.subplots(1, 2, figsize=(13, 4.5), dpi=110)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    window = 10  # per-step figures jump around; a rolling mean shows the level

    def smooth(values: list[float]) -> list[float]:
        return [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]

    def accuracies(axis, x: str, formatted: bool) -> None:
        """Each set's greedy accuracy against `x` ("t" or "version"), and with `formatted` its
        accuracy among formatted answers, dashed."""
        for name, set_rows in sets.items():
            axis.plot([e[x] for e in set_rows], [e["accuracy"] for e in set_rows], "o-",
                      color=colours.get(name), label=f"{name}: greedy accuracy")  # fmt: skip
            among = [e for e in set_rows if e.get("formatted_accuracy") is not None]
            if formatted and among:
                axis.plot([e[x] for e in among], [e["formatted_accuracy"] for e in among], "s--",
                          color=colours.get(name), alpha=0.7,
                          label=f"{name}: accuracy among formatted answers")  # fmt: skip

    ax.plot(
        [r["t"] for r in rows],
        [r["reward"] for r in rows],
        color="tab:blue",
        alpha=0.35 if evals else 1.0,
        label="mean training reward",
    )
    if evals:
        ax.plot(
            [r["t"] for r in rows],
            smooth([r["reward"] for r in rows]),
            color="tab:blue",
            label=f"training reward (last {window} steps)",
        )
        accuracies(ax, "t", formatted=False)
    if target is not None:
        ax.axhline(target, color="tab:blue", linestyle=":", linewidth=1, label=f"target {target}")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("reward / accuracy" if evals else "mean reward", color="tab:blue")
    ax.set_ylim(0, 1.02)
    ax2 = ax.twinx()
    st = [r for r in rows if r["staleness"] is not None]
    ax2.plot(
        [r["t"] for r in st],
        smooth([r["staleness"] for r in st]),
        color="tab:orange",
        alpha=0.9,
        label=f"mean staleness (last {window} steps)",
    )
    ax2.axhline(eta, color="tab:orange", linestyle=":", linewidth=1, label=f"η = {eta}")
    ax2.set_ylabel("staleness (versions)", color="tab:orange")
    ax2.set_ylim(0, max(eta + 0.5, 1))
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="lower right" if not evals else "upper left", fontsize=8)
    if evals:
        ax.set_title("against wall time")
        axv.plot(
            [r["version"] for r in rows],
            smooth([r["reward"] for r in rows]),
            color="tab:blue",
            label=f"training reward (last {window} steps)",
        )
        accuracies(axv, "version", formatted=True)
        axv.set_xlabel("policy version (optimizer steps)")
        axv.set_ylim(0, 1.02)
        axv.set_title("against version")
        axv.legend(loc="upper left", fontsize=8)
        fig.suptitle("asyncrl CPU demo: async GRPO on a pretrained model")
    else:
        ax.set_title(f"asyncrl CPU demo: {'tool use (secret)' if task == 'secret' else task}, async GRPO")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def eval_summary(rows: list[dict]) -> dict:
    """A held-out set's key figures: at version 0 (the base model), the last, the best; the
    format rate and the accuracy among formatted answers at the base and the last version (a gain
    in accuracy at a flat accuracy among formatted answers is a gain in format alone)."""
    if not rows:
        return {"evals": []}
    base = next((r for r in rows if r["version"] == 0), None)
    last, best = rows[-1], max(rows, key=lambda r: r["accuracy"])
    out = {
        "evals": rows,
        "eval_base_accuracy": base["accuracy"] if base else None,
        "eval_last_accuracy": last["accuracy"],
        "eval_last_version": last["version"],
        "eval_best_accuracy": best["accuracy"],
        "eval_best_version": best["version"],
    }
    for key in ("format_rate", "formatted_accuracy"):
        out[f"eval_base_{key}"] = base.get(key) if base else None
        out[f"eval_last_{key}"] = last.get(key)
    if base:
        out["eval_gain_last"] = round(last["accuracy"] - base["accuracy"], 4)
        out["eval_gain_best"] = round(best["accuracy"] - base["accuracy"], 4)
        if None not in (out["eval_base_formatted_accuracy"], out["eval_last_formatted_accuracy"]):
            out["eval_formatted_gain_last"] = round(
                out["eval_last_formatted_accuracy"] - out["eval_base_formatted_accuracy"], 4
            )
    return out


def _eval_line(s: dict) -> str:
    def f(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    line = f"{f(s['eval_base_accuracy'])} / {f(s['eval_last_accuracy'])} (v{s['eval_last_version']})"
    if s.get("eval_last_format_rate") is not None:
        line += (
            f"; format {f(s['eval_base_format_rate'])} / {f(s['eval_last_format_rate'])}, among formatted "
            f"{f(s['eval_base_formatted_accuracy'])} / {f(s['eval_last_formatted_accuracy'])}"
        )
    return line


def summary_table(s: dict) -> str:
    rows = [
        ("steps (versions)", s["steps"]),
        ("wall time", f"{s['wall_s']:.0f} s"),
        ("first / final reward", f"{s['first_reward']:.3f} / {s['final_reward']:.3f}"),
        (
            f"time to reward {s['target']}",
            f"{s['time_to_target_s']:.0f} s" if s["time_to_target_s"] else "not reached",
        ),
        ("mean / max staleness", f"{s['mean_staleness']:.2f} / {s['max_staleness']} (η = {s['eta']})"),
        ("groups not trained (stale etc.)", int(s["dropped"])),
        ("trainer tokens/s (last)", f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else "-"),
        *([("held-out accuracy: base / last", _eval_line(s))] if s.get("evals") else []),
        *(
            (f"{name}: base / last", _eval_line(e))
            for name, e in s.get("eval_sets", {}).items()
            if e["evals"]
        ),
        ("plot", s["plot"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


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
    import tomli_w  # (here: deploy/init_demo.py imports this module in an image without it)

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
            **_summary(history, demo, eta, reached_at, run_dir),
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


def _summary(history: History, demo: DemoSection, eta: int, reached_at: float | None, run_dir: Path) -> dict:
    rows = history.rows
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    st = [r["staleness"] for r in rows if r["staleness"] is not None]
    maxes = [r["staleness_max"] for r in rows if r["staleness_max"] is not None]
    return {
        "steps": rows[-1]["version"],
        "wall_s": rows[-1]["t"],
        "target": demo.target_reward,
        "first_reward": rewards[0] if rewards else float("nan"),
        "final_reward": rewards[-1] if rewards else float("nan"),
        "time_to_target_s": reached_at,
        "mean_staleness": sum(st) / len(st) if st else 0.0,
        "max_staleness": int(max(maxes)) if maxes else 0,
        "staleness_histogram": history.staleness_histogram,
        "eta": eta,
        "dropped": rows[-1]["dropped"],
        "tokens_per_s": rows[-1]["tokens_per_s"],
        "seed": demo.seed,
        "plot": str(run_dir / "demo.png"),
    }
