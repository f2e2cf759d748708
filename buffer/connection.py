"""The buffer's connection: one redis-py client per process, the run's key names, the Lua
scripts, and the retry policy that rides out a Redis restart.

`Buffer` is what every part of the buffer (buffer/groups.py, jobs.py, admission.py,
weights.py) is built on; a process opens one and shares it between its parts and threads
(redis-py's pool is thread-safe). `Script` gives a Lua script's KEYS and ARGV names: the body
reads them as locals, a call passes them by keyword.

`ReconnectRetry` is a redis-py `Retry` (passed as `retry=` to `redis.Redis.from_url`, so every
command, pipeline and pub/sub read of the client uses it) with a time budget instead of a
count: a `ConnectionError` / `TimeoutError` (a Redis being restarted, or loading its AOF:
`BusyLoadingError` is a `ConnectionError`) makes the caller reconnect and re-send the command
after an exponential backoff (`BASE_S` doubling to `CAP_S`), until `budget_s` has passed since
the first failure; then the error is raised to the caller and the process's own supervisor
(torchrun, `asyncrl up`) takes over. The budget is `ASYNCRL_REDIS_RECONNECT_S` (default 120 s;
`asyncrl up` sets it from `[launch] redis_reconnect_s`). Each outage is logged twice at most
per thread (unreachable, reachable again or given up) and counted in
`asyncrl_redis_retries_total` / `asyncrl_redis_outages_total{outcome}`. On a Redis Cluster
(`redis+cluster://`, `Buffer`) the same retry wraps every cluster command and pipeline, and
also retries what a failover looks like (`CLUSTER_RETRY_ERRORS`), reading the slot map again.

Re-sending is safe only for commands that may run twice: a command can have run on the server
before the connection broke (the reply lost). What the buffer sends, and why a second run
changes nothing (docs/architecture.md §4, exactly-once):

* Lua scripts are idempotent by construction: every transition is keyed on the group's (or
  job's) state in `groups:state` / `jobs:state` and is taken once. PUT answers "seen
  before" the second time (the caller counts a duplicate; `put` stays exact); TRY_ADMIT answers
  "resumed" (the slot is the group's, keyed by id); EXIT, ENQUEUE, END, REBUILD and PUBLISH
  find their work done (a second PUBLISH announces a version subscribers already have: they
  ignore it); the DEAD_LETTER scripts are guarded by their own `XACK` (an entry already acked
  is not dead-lettered again). BEGIN_EPOCH run twice opens one more epoch with the same fork
  point, which no weights ever carry: no cutoff changes.
* `SET NX`, `HSET`, `HDEL`, `SET`, `XCLAIM` and every read are idempotent.
* `XREADGROUP … >` is not: entries delivered by a run whose reply was lost sit in this
  consumer's pending list, unseen. The trainer's consumer re-reads its own pending entries
  after every outage (`Groups.take`); the rollout's scheduler recovers idle jobs
  (`Jobs.recover`) anyway. Neither trains nor generates anything twice: an entry is handed out
  only if its consumer does not already hold it.
* Counters that only inform (`HINCRBY` of the staleness histogram, of job progress, the
  `stale` inspection stream, the evaluation queue's `attempts`) may count one event twice
  after a lost reply. A lost evaluation claim waits out its lease and is claimed again.

All of this also needs Redis to keep what it acknowledged across its own crash: the embedded
Redis fsyncs before it answers (`appendfsync always`, buffer/server.py). With `everysec` a
crash may lose the last second of acknowledged writes, and a group whose `trained` was lost
would come back and be trained twice: run an external Redis with `always` where exactly-once
across Redis crashes matters.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import Counter
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    ClusterDownError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from asyncrl.buffer.malloc_tuning import tune_malloc

BASE_S = 0.05  # first pause after a failure; doubles per failure
CAP_S = 2.0  # longest pause between two attempts: a restarted Redis is noticed within this
DEFAULT_BUDGET_S = 120.0  # a Redis restart from its AOF takes seconds; two minutes is a real outage
ENV_BUDGET = "ASYNCRL_REDIS_RECONNECT_S"
TRAINER_GROUP, ROLLOUT_GROUP = "trainer", "rollout"  # the consumer groups of `groups` and `jobs`
RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError, socket.timeout)
# In a cluster a failover also shows as these: the slot's master is down (CLUSTERDOWN, a slot
# without an owner), or moved (MOVED, a demoted master's READONLY) until the client's slot map
# is read again. Every command the buffer sends may be re-sent (above), so all are retried.
CLUSTER_RETRY_ERRORS = RETRY_ERRORS + (
    ClusterDownError,
    SlotNotCoveredError,
    TryAgainError,
    MovedError,
    ReadOnlyError,
)
CLUSTER_SCHEME = "redis+cluster://"
ORPHAN_TTL_MS = 3_600_000  # a cluster payload written before its group is recorded expires unless kept
DEFAULT_WAIT_MS = 1000  # how long a cluster write waits for its replica (WAIT) before it is counted

RETRIES = Counter("asyncrl_redis_retries_total", "Redis commands re-sent after a connection error or timeout")
OUTAGES = Counter(
    "asyncrl_redis_outages_total",
    "Spells of failed Redis calls, by outcome (recovered: reconnected; gave_up: budget spent, raised)",
    ["outcome"],
)

UNREPLICATED = Counter(
    "asyncrl_redis_unreplicated_total",
    "Cluster write batches that no replica confirmed within the WAIT timeout (a failover may lose them)",
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

    def __init__(
        self,
        name: str,
        budget_s: float | None = None,
        base_s: float = BASE_S,
        cap_s: float = CAP_S,
        errors: tuple = RETRY_ERRORS,
    ):
        from redis.backoff import ExponentialBackoff

        super().__init__(ExponentialBackoff(cap=cap_s, base=base_s), retries=-1, supported_errors=errors)
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
                            log.warning(
                                "redis unreachable; retrying for up to %.0f s",
                                self.budget_s,
                                extra={"fields": {"client": self.name, "error": str(error)}},
                            )
                    if depth == 0:
                        RETRIES.inc()
                    fail(error, failures) if with_failure_count else fail(error)
                    left = first + self.budget_s - now
                    if left <= 0:
                        if depth == 0:
                            OUTAGES.labels("gave_up").inc()
                            log.error(
                                "redis unreachable for %.0f s; giving up",
                                now - first,
                                extra={"fields": {"client": self.name, "error": str(error)}},
                            )
                        raise
                    time.sleep(min(self._backoff.compute(failures), left))
                    continue
                if failures and depth == 0:
                    OUTAGES.labels("recovered").inc()
                    log.warning(
                        "redis reachable again after %.1f s, %d retries",
                        time.monotonic() - first,
                        failures,
                        extra={"fields": {"client": self.name}},
                    )
                return result
        finally:
            self._local.depth = depth


class Keys:
    """The names of one run's keys, all `asyncrl:{run}:<name>` (docs/architecture.md §4): one
    hash tag per run, so every script stays in one Redis Cluster slot."""

    def __init__(self, run: str):
        if not run or any(c in run for c in "{}: "):
            raise ValueError(f"invalid run id {run!r}: no braces, colons or spaces")
        p = self.prefix = f"asyncrl:{{{run}}}:"
        self.groups, self.group_state, self.group_entry = p + "groups", p + "groups:state", p + "groups:entry"
        self.group_job, self.payload_prefix, self.stale = p + "groups:job", p + "payload:", p + "stale"
        self.group_stepped = p + "groups:stepped"  # group id -> the version that trained it, until it leaves
        self.jobs, self.job_state, self.job_entry = p + "jobs", p + "jobs:state", p + "jobs:entry"
        self.job_prefix, self.cancelled = p + "job:", p + "cancelled"
        self.admission, self.running, self.config, self.version = (
            p + "admission",
            p + "running",
            p + "config",
            p + "version",
        )
        self.weights, self.latest_weights, self.weights_channel = (
            p + "weights",
            p + "weights:latest",
            p + "weights",
        )
        self.epoch, self.forks = p + "epoch", p + "forks"
        self.deadletter, self.stats, self.staleness = p + "deadletter", p + "stats", p + "staleness"
        self.engines = p + "engines"  # the engine fleet the rollout replicas manage (roster.py)


class Script:
    """A Lua script whose KEYS and ARGV have names. `keys` and `args` list them in order; a last
    name `*rest` takes every further value (a Lua table; a list in Python). The body reads each
    name as a local; `Buffer.call` takes them by keyword."""

    def __init__(self, keys: str, args: str, body: str):
        self.keys, self.args = keys.split(), args.split()
        names = [n.lstrip("*") for n in self.keys + self.args]
        if len(set(names)) != len(names) or any(n.startswith("*") for n in (self.keys[:-1] + self.args[:-1])):
            raise ValueError(f"script names must be unique, a `*rest` only last: {names}")
        if LUA_GLOBALS & set(names):
            raise ValueError(f"script names would hide Lua's own: {sorted(LUA_GLOBALS & set(names))}")
        self.names = set(names)
        self.source = _locals("KEYS", self.keys) + _locals("ARGV", self.args) + body
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def layout(self, values: dict) -> tuple[list, list]:
        if values.keys() != self.names:
            raise TypeError(f"script takes {sorted(self.names)}, got {sorted(values)}")
        return _ordered(self.keys, values), _ordered(self.args, values)


# Globals the scripts use: a KEYS/ARGV local of one of these names would hide it.
LUA_GLOBALS = {
    "redis",
    "type",
    "unpack",
    "tonumber",
    "tostring",
    "pairs",
    "ipairs",
    "next",
    "select",
    "string",
    "table",
    "math",
    "KEYS",
    "ARGV",
}


def _locals(table: str, names: list[str]) -> str:
    fixed = [n for n in names if not n.startswith("*")]
    lua = (
        f"local {', '.join(fixed)} = {', '.join(f'{table}[{i}]' for i in range(1, len(fixed) + 1))}\n"
        if fixed
        else ""
    )
    if len(fixed) < len(names):  # (a loop, not `unpack`: Lua's stack would bound the length)
        rest = names[-1][1:]
        lua += f"local {rest} = {{}}\nfor i = {len(fixed) + 1}, #{table} do {rest}[#{rest} + 1] = {table}[i] end\n"
    return lua


def _ordered(names: list[str], values: dict) -> list:
    out = []
    for name in names:
        out += values[name[1:]] if name.startswith("*") else [values[name]]
    return out


@dataclass(frozen=True)
class Part:
    """One call's share of a shared pipeline (`Buffer.pipeline_parts`): `fill(pipe)` queues its
    commands, `finish(replies)` makes its result from their replies."""

    fill: Callable[[redis.client.Pipeline], None]
    finish: Callable[[list], Any]
    # Its commands carry group payloads: the pipeline runs as one MULTI/EXEC (`Buffer.pipeline`).
    transaction: bool = False


class ClusterURL:
    """`redis+cluster://host:port[,host:port...][?replicas=N&wait_ms=M]`: the startup nodes of a
    Redis Cluster (any reachable one is enough; more ride out one being down at start), and how
    many replicas must confirm a write (`WAIT`, default 1; 0 turns it off) within `wait_ms`."""

    def __init__(self, url: str):
        from urllib.parse import parse_qs

        if not url.startswith(CLUSTER_SCHEME):
            raise ValueError(f"a cluster URL starts with {CLUSTER_SCHEME!r}, got {url!r}")
        netloc, _, query = url[len(CLUSTER_SCHEME) :].partition("?")
        self.nodes = []
        for part in netloc.rstrip("/").split(","):
            host, sep, port = part.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"cluster node must be host:port, got {part!r} in {url!r}")
            self.nodes.append(ClusterNode(host, int(port)))
        params = {k: v[-1] for k, v in parse_qs(query).items()}
        unknown = set(params) - {"replicas", "wait_ms"}
        if unknown:
            raise ValueError(f"unknown cluster URL parameters {sorted(unknown)} in {url!r}")
        try:
            self.replicas = int(params.get("replicas", 1))
            self.wait_ms = int(params.get("wait_ms", DEFAULT_WAIT_MS))
        except ValueError:
            raise ValueError(f"replicas and wait_ms must be integers in {url!r}") from None


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME)


class RetryingCluster(RedisCluster):
    """A `RedisCluster` whose every command rides out a failover under `ReconnectRetry`: redis-py
    re-reads the slot map on a connection error, and this re-sends after a backoff until the
    budget is spent (redis-py's own cluster retries are immediate, too few for an election)."""

    def __init__(self, *args, reconnect: ReconnectRetry, **kwargs):
        self.reconnect = reconnect
        super().__init__(*args, retry=Retry(NoBackoff(), retries=0), **kwargs)

    def refresh(self, *_) -> None:
        """Read the slot map again (after a failover its master moved); unreachable nodes skipped."""
        with contextlib.suppress(redis.RedisError, RedisClusterException):
            self.nodes_manager.initialize()

    def execute_command(self, *args, **kwargs):
        run = super().execute_command
        return self.reconnect.call_with_retry(lambda: run(*args, **kwargs), self.refresh)


def open_client(url: str, retry: ReconnectRetry, **kwargs) -> redis.Redis | RetryingCluster:
    """The client a URL names: one Redis, or (`redis+cluster://`) a cluster. `retry` must have
    been made with `CLUSTER_RETRY_ERRORS` for a cluster."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, retry=retry, **kwargs)
    kwargs.pop("health_check_interval", None)
    return RetryingCluster(startup_nodes=ClusterURL(url).nodes, reconnect=retry, **kwargs)


class Buffer:
    """One run's connection to the buffer, shared by its parts and threads: the client (with
    `ReconnectRetry`), the key names, and the scripts it has sent (loaded again if Redis lost
    them, e.g. after a restart). Opening one creates the run's two streams and their consumer
    groups: `groups` read by the trainer, `jobs` by the rollout replicas.

    On a Redis Cluster (`redis+cluster://`, docs/architecture.md §4) the run's metadata keys all
    carry the `{run}` tag, so they live in one slot and every script stays atomic; scripts and
    `pipeline` run on that slot's master, followed by `WAIT` on the same connection, so a write
    is reported done once a replica has it. Group payloads get a tag of their own
    (`payload_key`) and spread over the masters: they are written, kept and deleted by the
    `payload_*` methods, outside the scripts (buffer/groups.py says in which order, and why a
    crash between two steps loses nothing)."""

    def __init__(self, redis_url: str, run: str = "default"):
        tune_malloc()  # large payloads: keep freed memory instead of faulting it in again (buffer/malloc_tuning.py)
        self.run, self.keys = run, Keys(run)
        self.cluster = ClusterURL(redis_url) if is_cluster_url(redis_url) else None
        # its `outages` tell a consumer to look for lost reads
        self.retry = ReconnectRetry(
            f"buffer:{run}", errors=CLUSTER_RETRY_ERRORS if self.cluster else RETRY_ERRORS
        )
        self.redis = open_client(redis_url, self.retry, socket_keepalive=True, health_check_interval=30)
        self._scripts: dict[str, Script] = {}
        self._executor, self._pool_lock = None, threading.Lock()  # cluster: one thread per master's pipeline
        for stream, group in ((self.keys.groups, TRAINER_GROUP), (self.keys.jobs, ROLLOUT_GROUP)):
            try:
                self.redis.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def call(self, script: Script, pipe: redis.client.Pipeline | None = None, **values):
        """Run `script` with its KEYS and ARGV by name, or queue it on `pipe` (by sha: see
        `pipeline`)."""
        keys, args = script.layout(values)
        self._scripts[script.sha] = script
        if pipe is not None:
            return pipe.evalsha(script.sha, len(keys), *keys, *args)
        if self.cluster:
            return self.pipeline(lambda p: p.evalsha(script.sha, len(keys), *keys, *args))[0]
        try:
            return self.redis.evalsha(script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self.redis.script_load(script.source)
            return self.redis.evalsha(script.sha, len(keys), *keys, *args)

    def pipeline(self, fill, wait: bool = True, transaction: bool = False) -> list:
        """The replies of the commands `fill(pipe)` queues, sent in one round trip. If Redis lost
        its script cache, load the scripts and run the pipeline again: every write queued in
        one is idempotent. (On a cluster: on the master of the run's slot, `fill` queuing only
        the run's metadata keys, then `WAIT` unless `wait` is False: for reads.)

        `transaction` (one Redis) wraps the commands in MULTI/EXEC, for pipelines that carry
        group payloads: Redis reads a pipeline one large argument per event-loop turn and, under
        `appendfsync always`, fsyncs at the end of every turn that wrote, so payloads in a plain
        pipeline cost an fsync each; queued, they are applied in one turn and fsynced once (and
        together: a put cut off mid-pipeline writes nothing)."""
        for attempt in (0, 1):
            try:
                if self.cluster:
                    return self._on_master(self.keys.groups, fill, wait)
                pipe = self.redis.pipeline(transaction=transaction)
                fill(pipe)
                return pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                for script in list(self._scripts.values()):
                    self.redis.script_load(script.source)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ cluster payloads
    def payload_key(self, group_id: str) -> str:
        """A group's payload: with the run's tag on one Redis; on a cluster with its own tag, so
        payloads spread over the slots (and masters)."""
        if self.cluster:
            return f"asyncrl:{{{self.run}:p:{group_id}}}"
        return self.keys.payload_prefix + group_id

    def payload_get(self, keys: list[str], *parts: Part) -> tuple[list[bytes | None], list]:
        """The payloads under `keys`, in order, and the results of `parts` (reads of the run's
        metadata). On one Redis all in one round trip (`MGET` and the parts' commands in one
        pipeline); on a cluster one pipeline per master for the payloads, the parts on the run's
        master."""
        if self.cluster:
            payloads = self._per_master([(key, ("GET", key)) for key in keys], wait=False)
            return payloads, self.pipeline_parts(*parts, wait=False) if parts else []
        mget = Part(lambda pipe: pipe.mget(keys), lambda replies: replies[0])
        payloads, *results = self.pipeline_parts(mget, *parts)
        return payloads, results

    def payload_commands(self, commands: list[tuple]) -> list:
        """Cluster only: each command (its second word the key) on its key's master, one
        pipeline per master, each followed by `WAIT`; the replies in order."""
        return self._per_master([(cmd[1], cmd) for cmd in commands], wait=True)

    def _per_master(self, items: list[tuple[str, tuple]], wait: bool) -> list:
        by_node: dict[str, list[int]] = {}
        for i, (key, _) in enumerate(items):
            by_node.setdefault(self.redis.get_node_from_key(key).name, []).append(i)
        replies: list = [None] * len(items)

        def one_node(indexes: list[int]) -> None:  # (re-routed per node's first key after a failover)
            def fill(pipe):
                for i in indexes:
                    pipe.execute_command(*items[i][1])

            for i, reply in zip(indexes, self._on_master(items[indexes[0]][0], fill, wait)):
                replies[i] = reply

        groups = list(by_node.values())
        if len(groups) == 1:
            one_node(groups[0])
        else:  # the masters' round trips (and fsyncs, and WAITs) overlap
            for future in [self._pool().submit(one_node, g) for g in groups]:
                future.result()
        return replies

    def _pool(self):
        with self._pool_lock:
            if self._executor is None:
                from concurrent.futures import ThreadPoolExecutor

                self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix=f"buffer-{self.run}")
            return self._executor

    def _on_master(self, key: str, fill, wait: bool = True) -> list:
        """`fill`'s commands (all on `key`'s slot, or slots of the same master) in one pipeline
        on that master, then `WAIT replicas wait_ms` on the same connection. Re-sent after a
        failover (slot map read again), as every buffer write may be."""

        def run() -> list:
            node = self.redis.get_node_from_key(key)
            pipe = self.redis.get_redis_connection(node).pipeline(transaction=False)
            fill(pipe)
            n = len(pipe.command_stack)
            waiting = wait and self.cluster.replicas > 0
            if waiting:
                pipe.execute_command("WAIT", self.cluster.replicas, self.cluster.wait_ms)
            replies = pipe.execute()
            if waiting and int(replies[n]) < self.cluster.replicas:
                UNREPLICATED.inc()
                log.warning(
                    "cluster write not confirmed by a replica in %d ms",
                    self.cluster.wait_ms,
                    extra={"fields": {"node": node.name, "replicas": int(replies[n])}},
                )
            return replies[:n]

        return self.retry.call_with_retry(run, self.redis.refresh)

    def pipeline_parts(self, *parts: Part, wait: bool = True) -> list:
        """Several calls' commands in one round trip (`pipeline`), in order: each part's `fill`
        queues its commands, its `finish` turns their replies into its result."""
        bounds: list[tuple[int, int]] = []

        def fill(pipe) -> None:
            bounds.clear()  # (filled again if the pipeline is re-run)
            for part in parts:
                start = len(pipe.command_stack)
                part.fill(pipe)
                bounds.append((start, len(pipe.command_stack)))

        replies = self.pipeline(fill, wait, transaction=any(part.transaction for part in parts))
        return [part.finish(replies[a:b]) for part, (a, b) in zip(parts, bounds)]

    def read(
        self,
        stream: str,
        group: str,
        consumer: str,
        start: str = ">",
        count: int = 100_000,
        block_ms: int = 0,
    ) -> list[tuple[str, dict]]:
        """`consumer`'s entries of `stream`: new ones (`>`, waiting up to `block_ms`) or its own
        pending ones (`0`); entries deleted since they were delivered are left out."""
        resp = self.redis.xreadgroup(group, consumer, {stream: start}, count=count, block=block_ms or None)
        return [(eid.decode(), fields) for eid, fields in resp[0][1] if fields] if resp else []

    def autoclaim(self, stream: str, group: str, consumer: str, idle_ms: int) -> list[tuple[str, dict]]:
        """Every entry of `group` pending for ≥ idle_ms, now `consumer`'s (deleted ones left out)."""
        out, start = [], "0-0"
        while True:
            start, entries, *_ = self.redis.xautoclaim(
                stream, group, consumer, min_idle_time=idle_ms, start_id=start, count=100
            )
            out += [(eid.decode(), fields) for eid, fields in entries if fields]
            if start in (b"0-0", "0-0"):
                return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self.redis.close()
