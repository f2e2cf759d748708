"""Prometheus metrics of the reference engine (process-wide, default registry, `/metrics`).

Names follow docs/architecture.md §9: `asyncrl_engine_` prefix, base units, `_total` counters, bounded
labels (finish reasons, rejection reasons, weight sources and results: never request ids).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

RUNNING = Gauge("asyncrl_engine_running_requests", "Requests holding a KV slot (decoding or frozen)")
QUEUED = Gauge("asyncrl_engine_queued_requests", "Requests waiting for a KV slot")
GENERATED_TOKENS = Counter("asyncrl_engine_generated_tokens_total", "Tokens sampled")
PROMPT_TOKENS = Counter(
    "asyncrl_engine_prompt_tokens_total", "Prompt tokens prefilled (first admission only)"
)
CACHED_TOKENS = Counter(
    "asyncrl_engine_cached_tokens_total",
    "Prompt tokens not computed for their request: copied from an identical prompt of the same prefill "
    "(meta_info.cached_tokens summed)",
)
TOKENS_PER_SECOND = Gauge(
    "asyncrl_engine_generation_tokens_per_second", "Tokens sampled per second, last 10 s"
)
TIME_TO_FIRST_TOKEN = Histogram(
    "asyncrl_engine_time_to_first_token_seconds",
    "Submission to first sampled token",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
E2E_LATENCY = Histogram(
    "asyncrl_engine_request_latency_seconds",
    "Submission to finish",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
DECODE_BATCH = Histogram(
    "asyncrl_engine_decode_batch_size", "Requests per decode step", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
)
BUSY_SECONDS = Counter(
    "asyncrl_engine_busy_seconds_total", "Wall time the scheduler spent in prefill and decode forwards"
)
PREFILL_STEPS = Counter("asyncrl_engine_prefill_steps_total", "Batched prefill forwards")
DECODE_STEPS = Counter("asyncrl_engine_decode_steps_total", "Batched decode forwards")
REQUESTS_FINISHED = Counter(
    "asyncrl_engine_requests_finished_total", "Requests answered, by finish reason", ["finish_reason"]
)
REQUESTS_REJECTED = Counter(
    "asyncrl_engine_requests_rejected_total", "Requests refused before scheduling, by reason", ["reason"]
)
STEP_FAILURES = Counter(
    "asyncrl_engine_step_failures_total", "Scheduler steps that raised (requests aborted)"
)
WEIGHT_UPDATES = Counter(
    "asyncrl_engine_weight_updates_total",
    "Weight update attempts by source (disk, distributed, group = init_weights_update_group, "
    "session = /begin_weight_update and /end_weight_update) and "
    "result (ok, error, timeout, refused = before any work, busy = no turn within the deadline)",
    ["source", "result"],
)
WEIGHT_UPDATES_PENDING = Gauge(
    "asyncrl_engine_weight_updates_pending", "Weight updates running or waiting for their turn"
)
WEIGHT_UPDATE_LAST_SUCCESS = Gauge(
    "asyncrl_engine_weight_update_last_success_timestamp_seconds",
    "Unix time of the last successful weight update (0: none since start); "
    "time() minus this is the age of the weights served",
)
WEIGHT_SYNC_DEGRADED = Gauge(
    "asyncrl_engine_weight_sync_degraded",
    "1 while the last weight update failed and none has succeeded since (/health answers 503)",
)
WEIGHT_VERSION = Gauge("asyncrl_engine_weight_version", "Current weight_version when it is an integer")


def set_weight_version(version: str) -> None:
    try:
        WEIGHT_VERSION.set(int(version))
    except ValueError:
        pass  # a non-integer version (SGLang allows any string) has no numeric gauge value


class Throughput:
    """Tokens per second over a sliding window (O(1) per step: a running sum)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), tokens))
            self._total += tokens

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._events and now - self._events[0][0] > self.window_s:
                self._total -= self._events.popleft()[1]
            if not self._events:
                return 0.0
            span = max(now - self._events[0][0], 1.0)  # no spike from a single fresh step
            return self._total / span


WEIGHT_RESYNCS = Counter(
    "asyncrl_engine_weight_resyncs_total",
    "Delta weight updates not applied on top of the weights held, so rebuilt from the chain's "
    "full anchor and its deltas, by reason (base = the engine did not hold the delta's base "
    "version, hash = a sha256 after applying differed, malformed = an unreadable delta)",
    ["reason"],
)
WEIGHT_DELTAS = Counter(
    "asyncrl_engine_weight_deltas_total",
    "Delta weight directories loaded, by result (applied = on top of the base held, resynced = "
    "rebuilt from the anchor, failed = the rebuild failed too: the weights were left as they were)",
    ["result"],
)

LORA_UPDATES = Counter(
    "asyncrl_engine_lora_updates_total",
    "LoRA adapter operations by operation (load, unload, evict = unloaded to make room for a load) and "
    "result (ok; error = the adapter could not be read or does not fit the model; timeout = reading it "
    "took past weight_update_timeout_s; refused = before any adapter was read: LoRA off, a path outside "
    "weights_root, a name already loaded or not loaded, no room)",
    ["operation", "result"],
)
LORA_ADAPTERS = Gauge(
    "asyncrl_engine_lora_adapters_loaded",
    "LoRA adapters requests may name (an unloaded one still used by requests in flight not counted)",
)
LORA_REQUESTS = Counter(
    "asyncrl_engine_lora_requests_total",
    "Requests (items of a batch) served with a LoRA adapter; per adapter: /server_info's lora_adapters",
)
