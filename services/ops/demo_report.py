"""What `asyncrl demo` keeps of a run and reports at its end: the curve by trainer version
(`History`), every step's reward from the trainer's log (`StepRewards`), the held-out
evaluations (`Evals`), then `summary.json`'s figures, the summary table and `demo.png`.

The records read logs/trainer.log and the rollout service's `/v1/evaluations`; the one request
that asks for work is `Evals.run_final` (an evaluation of the version served at the end), and
nothing here changes training.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from asyncrl.proto.evals import CORRECT_REWARD
from asyncrl.proto.states import JobState
from asyncrl.services.ops.demo_jobs import EVAL_NAME
from asyncrl.services.ops.demo_metrics import Scrape
from asyncrl.services.ops.run_config import DemoSection

FINAL_POLL_S = 2.0  # how often the demo asks after its final evaluation while it waits


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

    def _row(self, e: dict) -> dict:
        """The row of one finished evaluation (a listing's summary or `GET /v1/evaluations/<id>`)."""
        return {
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
            row = self._row(e)
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
        self.write_items(version, resp.json()["items"])

    def write_items(self, version: int, items: list[dict]) -> None:
        if self.items_dir is None:
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
            for it in items
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
        # Waited for by its id, not found in the listing by version: the served version may
        # already have an evaluation (every `eval_every` versions), and the listing's rows are
        # one per version.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(FINAL_POLL_S)
            try:
                resp = httpx.get(f"{self.url}/v1/evaluations/{eval_id}", timeout=30.0)
                resp.raise_for_status()
            except httpx.HTTPError:
                continue  # the rollout service restarting: ask again until the deadline
            e = resp.json()
            if e["state"] == JobState.done:
                row = self.rows[e["version"]] = self._row(e)
                self.write_items(e["version"], e["items"])  # the answer holds them: no second GET
                return row
            if e["state"] in (JobState.failed, JobState.cancelled):
                print(f"final evaluation {eval_id} {e['state']}")
                return None
        print(f"final evaluation {eval_id} did not finish within {timeout_s:.0f} s")
        return None

    final_body: dict = field(default_factory=dict)


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


def run_summary(
    history: History, demo: DemoSection, eta: int, reached_at: float | None, run_dir: Path
) -> dict:
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
