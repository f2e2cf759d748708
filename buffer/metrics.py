"""Prometheus metrics of the replay buffer (process-local; `asyncrl buffer stats` reads the
run-wide counters that the Lua scripts keep in Redis)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

DEPTH = Gauge(
    "asyncrl_buffer_depth", "Entries in a buffer stream (groups: unacked; jobs: unfinished)", ["stream"]
)
STALENESS = Histogram(
    "asyncrl_buffer_staleness", "v - min_version of each group at consumption", buckets=STALENESS_BUCKETS
)
DROPPED = Counter("asyncrl_buffer_dropped_total", "Groups taken out of training, by reason", ["reason"])
WITHHELD = Counter("asyncrl_buffer_withheld_total", "Stale groups kept for group statistics only")
DEAD_LETTERED = Counter(
    "asyncrl_buffer_dead_lettered_total", "Undecodable records moved to the dead-letter stream", ["stream"]
)
DUPLICATES = Counter("asyncrl_buffer_duplicate_puts_total", "Groups put with a group_id already seen")
PUT_SECONDS = Histogram("asyncrl_buffer_put_seconds", "Latency of a put, per group", buckets=LATENCY_BUCKETS)
TAKE_SECONDS = Histogram(
    "asyncrl_buffer_take_seconds", "Latency of a take (including blocking)", buckets=LATENCY_BUCKETS
)
PUT_BYTES = Counter("asyncrl_buffer_put_bytes_total", "Encoded bytes written to the groups stream")
ADMISSION = Counter("asyncrl_buffer_admission_total", "try_admit outcomes", ["result"])
RECLAIMED_AFTER_OUTAGE = Counter(
    "asyncrl_buffer_reclaimed_after_outage_total",
    "Groups delivered to this consumer by a read whose reply a Redis outage lost, handed out again",
)
ORPHAN_PAYLOADS = Counter(
    "asyncrl_buffer_orphan_payloads_total",
    "Cluster payloads of groups that had left, deleted by the sweep (an exit cut off before its UNLINK)",
)
