"""Riding out a Redis restart: the retry policy every buffer client uses.

`ReconnectRetry` is a redis-py `Retry` (passed as `retry=` to `redis.Redis.from_url`, so every
command, pipeline and pub/sub read of the client uses it) with a time budget instead of a
count: a `ConnectionError` / `TimeoutError` (a Redis being restarted, or loading its AOF:
`BusyLoadingError` is a `ConnectionError`) makes the caller reconnect and re-send the command
after an exponential backoff (`BASE_S` doubling to `CAP_S`), until `budget_s` has passed since
the first failure; then the error is raised as before and the process's own supervisor
(torchrun, `asyncrl up`) takes over. The budget is `ASYNCRL_REDIS_RECONNECT_S` (default 120 s;
`asyncrl up` sets it from `[launch] redis_reconnect_s`). Each outage is logged twice at most
per thread (unreachable, reachable again or given up) and counted in
`asyncrl_redis_retries_total` / `asyncrl_redis_outages_total{outcome}`.

Re-sending is safe only for commands that may run twice: a command can have run on the server
before the connection broke (the reply lost). What the buffer sends, and why a second run
changes nothing (docs/architecture.md §4, exactly-once):

* Lua scripts (buffer/lua.py) are idempotent by construction: every transition is keyed on
  the group's (or job's) state in the `index` / `jobindex` hash and is taken once. PUT_GROUPS
  answers "seen before" the second time (the caller counts a duplicate; `put` stays exact);
  TRY_ADMIT answers "resumed" (the slot is the group's, keyed by id); FINISH, ACK_JOB,
  ENQUEUE_JOB, REBUILD_ADMISSION and PUBLISH_WEIGHTS find their work done (a second PUBLISH
  announces a version subscribers already have: they ignore it); DEAD_LETTER is guarded by its
  own `XACK` (an entry already acked is not dead-lettered again). BEGIN_EPOCH run twice opens
  one more epoch with the same fork point, which no weights ever carry: no cutoff changes.
* `SET NX`, `HSET`, `HDEL`, `SET`, `XCLAIM` and every read are idempotent.
* `XREADGROUP … >` is not: entries delivered by a run whose reply was lost sit in this
  consumer's pending list, unseen. The trainer's buffer re-reads its own pending entries after
  every outage (`ReplayBuffer._next_entries`); the rollout's scheduler recovers idle jobs
  (`recover_jobs`) anyway. Neither trains nor generates anything twice: an entry is handed out
  only if this process does not already hold it.
* Counters that only inform (`HINCRBY` of the staleness histogram, of job progress, the
  `stale` inspection stream, the evaluation queue's `attempts`) may count one event twice
  after a lost reply. A lost evaluation claim waits out its lease and is claimed again.

All of this also needs Redis to keep what it acknowledged across its own crash: the embedded
Redis fsyncs before it answers (`appendfsync always`, buffer/server.py). With `everysec` a
crash may lose the last second of acknowledged writes, and a group whose `acked` was lost
would come back and be trained twice: run an external Redis with `always` where exactly-once
across Redis crashes matters.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import redis
from prometheus_client import Counter
from redis.retry import Retry

BASE_S = 0.05  # first pause after a failure; doubles per failure
CAP_S = 2.0  # longest pause between two attempts: a restarted Redis is noticed within this
DEFAULT_BUDGET_S = 120.0  # a Redis restart from its AOF takes seconds; two minutes is a real outage
ENV_BUDGET = "ASYNCRL_REDIS_RECONNECT_S"
RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError, socket.timeout)

RETRIES = Counter("asyncrl_redis_retries_total", "Redis commands re-sent after a connection error or timeout")
OUTAGES = Counter(
    "asyncrl_redis_outages_total",
    "Spells of failed Redis calls, by outcome (recovered: reconnected; gave_up: budget spent, raised)",
    ["outcome"],
)

log = logging.getLogger("asyncrl.redis")


def budget_from_env() -> float:
    raw = os.environ.get(ENV_BUDGET)
    if raw is None:
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_BUDGET} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{ENV_BUDGET} must be >= 0, got {value}")
    return value


class ReconnectRetry(Retry):
    """One per client: shared by all its connections (redis-py deep-copies a `Retry` into each
    connection; this one returns itself), so `outages` counts the client's outages."""

    def __init__(self, name: str, budget_s: float | None = None, base_s: float = BASE_S, cap_s: float = CAP_S):
        from redis.backoff import ExponentialBackoff

        super().__init__(ExponentialBackoff(cap=cap_s, base=base_s), retries=-1, supported_errors=RETRY_ERRORS)
        self.name = name
        self.budget_s = budget_from_env() if budget_s is None else budget_s
        self.outages = 0  # spells of failures this client went through (recovered or not)
        self._lock = threading.Lock()
        self._local = threading.local()  # call depth: connect() retries inside a command's retry

    def __deepcopy__(self, memo) -> ReconnectRetry:
        return self

    def __eq__(self, other) -> bool:
        return self is other

    __hash__ = object.__hash__

    def get_retries(self) -> int:
        return 1 << 30  # redis-py only compares failure counts against it (for its own metrics)

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count: bool = False):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        failures, first = 0, 0.0
        try:
            while True:
                try:
                    result = do()
                except self._supported_errors as error:
                    if is_retryable is not None and not is_retryable(error):
                        raise
                    failures += 1
                    now = time.monotonic()
                    if failures == 1:
                        first = now
                        if depth == 0:
                            with self._lock:
                                self.outages += 1
                            log.warning("redis unreachable; retrying for up to %.0f s", self.budget_s,
                                        extra={"fields": {"client": self.name, "error": str(error)}})  # fmt: skip
                    if depth == 0:
                        RETRIES.inc()
                    fail(error, failures) if with_failure_count else fail(error)
                    left = first + self.budget_s - now
                    if left <= 0:
                        if depth == 0:
                            OUTAGES.labels("gave_up").inc()
                            log.error("redis unreachable for %.0f s; giving up", now - first,
                                      extra={"fields": {"client": self.name, "error": str(error)}})  # fmt: skip
                        raise
                    time.sleep(min(self._backoff.compute(failures), left))
                    continue
                if failures and depth == 0:
                    OUTAGES.labels("recovered").inc()
                    log.warning("redis reachable again after %.1f s, %d retries", time.monotonic() - first, failures,
                                extra={"fields": {"client": self.name}})  # fmt: skip
                return result
        finally:
            self._local.depth = depth
