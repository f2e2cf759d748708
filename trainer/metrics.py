"""Trainer metrics (docs/architecture.md §6) and what rank 0's `/healthz` reports.

The trainer is not a FastAPI service: rank 0 serves `/metrics` and `/healthz` with
services/runtime/metrics.py `serve_metrics` (a stdlib server in a daemon thread, so a slow
scrape never touches the training loop). Gauges hold the last step's value; counters and histograms accumulate. Names follow
docs/architecture.md §9 (`asyncrl_` prefix, base units, `_total` counters, bounded labels).
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

PHASES = ("wait", "recompute", "forward_backward", "optimizer", "publish", "checkpoint")

VERSION = Gauge("asyncrl_trainer_version", "policy version v (optimizer steps taken)")
STEPS = Counter("asyncrl_trainer_steps_total", "training steps completed")
PHASE_SECONDS = Histogram(
    "asyncrl_trainer_phase_seconds",
    "time per step phase",
    ["phase"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
STEP_SECONDS = Gauge("asyncrl_trainer_step_seconds", "wall time of the last step")
IDLE_RATIO = Gauge("asyncrl_trainer_idle_ratio", "fraction of the last step spent waiting for data")
IDLE_SECONDS = Counter("asyncrl_trainer_idle_seconds_total", "time spent waiting for data")
BUSY_SECONDS = Counter("asyncrl_trainer_busy_seconds_total", "time spent not waiting for data")
TOKENS = Counter("asyncrl_trainer_tokens_total", "completion tokens trained on")
TOKENS_PER_SECOND = Gauge(
    "asyncrl_trainer_tokens_per_second", "trained completion tokens / step time (excl. wait)"
)
GROUPS = Counter(
    "asyncrl_trainer_groups_total", "groups leaving the trainer's input, by outcome", ["outcome"]
)
SAMPLES_MASKED = Counter("asyncrl_trainer_samples_masked_total", "samples masked out of the loss", ["reason"])
ZERO_SPREAD = Gauge("asyncrl_trainer_zero_spread_groups", "groups with zero reward spread in the last step")
STALENESS = Histogram(
    "asyncrl_trainer_group_staleness",
    "v − min_version of trained groups",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
)
RESPONSE_LENGTH = Histogram(
    "asyncrl_trainer_response_length_tokens",
    "completion length of trained samples",
    buckets=(8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
)
TRUNCATION = Gauge("asyncrl_trainer_truncation_ratio", "truncated samples / samples in the last step")
PUBLISH_SECONDS = Histogram(
    "asyncrl_trainer_weight_publish_seconds",
    "end of optimizer step → version visible",
    ["method"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
PUBLISH_BYTES = Counter("asyncrl_trainer_weight_publish_bytes_total", "weight bytes published", ["method"])
PUBLISH_FAILURES = Counter(
    "asyncrl_trainer_weight_publish_failures_total",
    "background weight publishes that failed (the trainer stops at its next publish)",
)
PUBLISH_RESYNCS = Counter(
    "asyncrl_trainer_weight_resyncs_total",
    "broadcast versions sent whole instead of as a delta because an engine could not take the "
    "delta, by reason (refused = a reference engine answered 409: it did not hold the base, or "
    "a sha256 differed; behind = an SGLang engine did not serve the base before the delta)",
    ["reason"],
)
HEARTBEATS = Counter(
    "asyncrl_trainer_wait_heartbeats_total", "heartbeats exchanged by the ranks while waiting for data"
)
CHECKPOINTS = Counter("asyncrl_trainer_checkpoints_total", "durable checkpoints written")
WORKER_RESTARTS = Gauge(
    "asyncrl_trainer_worker_restarts",
    "times torchrun restarted the workers of this trainer launch (--max-restarts)",
)
TRACKING_ERRORS = Counter(
    "asyncrl_trainer_tracking_errors_total", "W&B calls that failed (training went on)", ["op"]
)
STEP_GAUGES = {
    name: Gauge(f"asyncrl_trainer_{name}", help_)
    for name, help_ in {
        "loss": "policy loss of the last step (mean over minibatches)",
        "clip_fraction": "fraction of tokens whose ratio was clipped",
        "is_weight_mean": "mean behaviour-correction weight",
        "is_weight_max": "max behaviour-correction weight",
        "is_masked_fraction": "fraction of tokens the IS correction zeroed",
        "mismatch_kl": "k3 KL of engine μ against trainer π_old",
        "approx_kl": "k3 KL of π_old against π_θ",
        "entropy": "mean token entropy",
        "ref_kl": "KL estimate to the reference model",
        "grad_norm": "global gradient norm before clipping",
        "reward_mean": "mean scored reward (trained and withheld groups)",
        "lr": "learning rate of the last step's update (trainer/schedule.py)",
    }.items()
}


def observe_step(stats: dict[str, float]) -> None:
    for name, gauge in STEP_GAUGES.items():
        if name in stats:
            gauge.set(stats[name])


class TrainerStatus:
    """What /healthz reports (state, version, last step); the loop updates it."""

    def __init__(self) -> None:
        self.version = 0
        self.last_step_at: float | None = None
        self.started_at = time.time()
        self.state = "starting"

    def as_dict(self) -> dict:
        return {
            "status": "ok",
            "state": self.state,
            "version": self.version,
            "last_step_at": self.last_step_at,
            "uptime_s": round(time.time() - self.started_at, 3),
        }
