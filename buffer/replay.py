"""The Redis replay buffer (docs/architecture.md §4–5): a handful of typed methods over streams and Lua.

Delivery is at-least-once with idempotent ids. A group leaves the buffer exactly once, by
`ack` (trained; called when the checkpoint covering it is durable), by staleness (`drop` or
`withhold`), by `discard` (e.g. dynamic sampling) or to the dead-letter stream; each exit is
counted. Every key of a run shares the hash tag `{run}` so scripts stay single-slot on a
Redis Cluster. Not thread-safe per instance (one per thread); any number of processes.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Self

import redis

from buffer import lua
from buffer import metrics as m
from buffer.alloc import tune_malloc
from buffer.connection import ReconnectRetry
from buffer.payloads import PayloadReader
from proto import Group, GroupJob, RecordDecodeError, WeightsInfo, decode, encode
from proto.lineage import Lineage

TRAINER_GROUP = "trainer"
ROLLOUT_GROUP = "rollout"
STALE_STREAM_MAXLEN = 10_000  # the `stale` stream is for inspection; cap it
DEADLETTER_MAXLEN = 100_000  # far above any sane rate of bad records; the counter is exact anyway
WEIGHTS_KEEP = 16  # weight locations kept per run
STALENESS_POLICIES = ("drop", "withhold")


class Admission(str, Enum):
    admitted = "admitted"  # new slot taken: generate
    resumed = "resumed"  # this group already holds a slot (e.g. reclaimed job): generate
    done = "done"  # already in the buffer or trained: nothing to generate
    full = "full"  # capacity reached: wait for the trainer

    @property
    def go(self) -> bool:
        return self in (Admission.admitted, Admission.resumed)


_ADMISSION_CODES = {1: Admission.admitted, 2: Admission.resumed, 3: Admission.done, 0: Admission.full}


@dataclass
class TakeResult:
    groups: list[Group] = field(default_factory=list)
    withheld: list[Group] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # too stale (policy `drop`)
    lost: list[str] = field(default_factory=list)  # sampled by weights of a lost history
    dead_lettered: int = 0
    staleness: list[int] = field(default_factory=list)


@dataclass
class ClaimedJob:
    entry_id: str
    job: GroupJob


class Keys:
    def __init__(self, run: str):
        if not run or any(c in run for c in "{}: "):
            raise ValueError(f"invalid run id {run!r}: no braces, colons or spaces")
        p = f"asyncrl:{{{run}}}:"
        self.prefix = p
        self.jobs, self.groups, self.version = p + "jobs", p + "groups", p + "version"
        self.weights, self.latest_weights, self.weights_channel = p + "weights", p + "weights:latest", p + "weights"
        self.admission, self.running, self.config = p + "admission", p + "running", p + "config"
        self.deadletter, self.stale, self.stats = p + "deadletter", p + "stale", p + "stats"
        self.index, self.job_index, self.gjob = p + "index", p + "jobindex", p + "gjob"
        self.staleness, self.job_prefix, self.cancelled = p + "staleness", p + "job:", p + "cancelled"
        self.payload_prefix = p + "payload:"
        self.epoch, self.forks = p + "epoch", p + "forks"

    def payload(self, group_id: str) -> str:
        return self.payload_prefix + group_id


class ReplayBuffer:
    """One run's buffer. `consumer` must be stable across restarts of the same worker."""

    def __init__(
        self,
        redis_url: str,
        run: str = "default",
        consumer: str | None = None,
        *,
        batch_groups: int = 1,
        max_staleness: int = 0,
        client: redis.Redis | None = None,
    ):
        tune_malloc()  # large payloads: keep freed memory instead of faulting it in again (buffer/alloc.py)
        self.keys = Keys(run)
        self.run = run
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        # A lost connection is retried with backoff until Redis is back (buffer/connection.py:
        # why re-sending what this class sends keeps exactly-once).
        self._retry = ReconnectRetry(f"buffer:{self.consumer}") if client is None else None
        self._outages_seen = 0
        self.r = client or redis.Redis.from_url(redis_url, socket_keepalive=True, health_check_interval=30,
                                                retry=self._retry)  # fmt: skip
        # Group payloads come in through a reader that receives each one in place (payloads.py);
        # with an injected client, or over TLS, through redis-py.
        self._payloads = PayloadReader.for_url(redis_url) if client is None else None
        self._redelivery: deque[tuple[str, dict]] = deque()
        # Entries this instance holds (delivered, not yet acked/finished): recovery must not
        # hand them out again, or a trainer would train a group twice.
        self._held_groups: dict[str, str] = {}  # group_id -> entry id
        self._held_jobs: dict[str, str] = {}
        self._scripts = {name: self.r.register_script(getattr(lua, name)) for name in (
            "PUT_GROUPS", "TRY_ADMIT", "FINISH", "DEAD_LETTER", "ENQUEUE_JOB", "ACK_JOB",
            "REBUILD_ADMISSION", "PUBLISH_WEIGHTS", "BEGIN_EPOCH")}  # fmt: skip
        for stream, group in ((self.keys.groups, TRAINER_GROUP), (self.keys.jobs, ROLLOUT_GROUP)):
            try:
                self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def _evalsha(self, pipe, name: str, keys: list, args: list) -> None:
        """A script call queued on a pipeline. Script objects there would cost a SCRIPT EXISTS
        round trip per execute; `_pipeline` loads the scripts only if Redis lost them."""
        pipe.evalsha(self._scripts[name].sha, len(keys), *keys, *args)

    def _pipeline(self, fill) -> list:
        """Run the commands `fill(pipe)` queues in one round trip. If Redis lost its script
        cache (a restart), load the scripts and run them again: every queued write is idempotent."""
        for attempt in (0, 1):
            pipe = self.r.pipeline(transaction=False)
            fill(pipe)
            try:
                return pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                for script in self._scripts.values():
                    self.r.script_load(script.script)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.r.close()
        if self._payloads is not None:
            self._payloads.close()

    # ------------------------------------------------------------------ run configuration
    def configure(self, batch_groups: int, max_staleness: int) -> None:
        """Store B and η run-wide so every admitting replica applies the same rule."""
        if batch_groups < 1 or max_staleness < 0:
            raise ValueError("batch_groups must be >= 1 and max_staleness >= 0")
        self.batch_groups, self.max_staleness = batch_groups, max_staleness
        self.r.hset(self.keys.config, mapping={"batch_groups": batch_groups, "max_staleness": max_staleness})

    def set_version(self, version: int) -> None:
        self.r.set(self.keys.version, int(version))

    def get_version(self) -> int:
        return int(self.r.get(self.keys.version) or 0)

    def begin_epoch(self, fork_version: int) -> int:
        """A trainer resumed at `fork_version`: open a new epoch (proto/lineage.py) and return it.
        Versions of older epochs above `fork_version` are from now on a lost history."""
        k = self.keys
        return int(self._scripts["BEGIN_EPOCH"](keys=[k.epoch, k.forks], args=[int(fork_version)]))

    def lineage(self) -> Lineage:
        pipe = self.r.pipeline(transaction=False)
        epoch, forks = pipe.get(self.keys.epoch).hgetall(self.keys.forks).execute()
        return Lineage(int(epoch or 0), {int(e): int(v) for e, v in forks.items()})

    # ------------------------------------------------------------------ producer side
    def put_group(self, group: Group) -> bool:
        """Append a scored group; a group_id seen before is a no-op. Returns True if new."""
        return self.put_groups([group])[0]

    def put_groups(self, groups: list[Group]) -> list[bool]:
        """`put_group` for many groups in one round trip and one script (each put stays
        idempotent; a group_id twice in one call is put once)."""
        if not groups:
            return []
        t0 = time.perf_counter()
        k = self.keys
        payloads, payload_keys, args = [], [], [len(groups)]
        for group in groups:
            if not group.scored:
                raise ValueError(f"group {group.group_id} has samples without a reward status")
            payloads.append(encode(group))
            payload_keys.append(k.payload(group.group_id))
            args += [group.group_id, group.job_id, group.min_version]

        def fill(pipe) -> None:
            for key, payload in zip(payload_keys, payloads):
                pipe.execute_command("SET", key, payload, "NX")
            self._evalsha(pipe, "PUT_GROUPS", [k.index, k.groups, k.admission, k.stats, k.running, k.gjob,
                                               *payload_keys], args)  # fmt: skip

        results = [bool(flag) for flag in self._pipeline(fill)[-1]]
        m.PUT_BYTES.inc(sum(len(payload) for new, payload in zip(results, payloads) if new))
        if not all(results):
            m.DUPLICATES.inc(results.count(False))
        elapsed = time.perf_counter() - t0
        for _ in groups:
            m.PUT_SECONDS.observe(elapsed / len(groups))
        return results

    def try_admit(self, group_id: str) -> Admission:
        """Take an admission slot for `group_id` if `accepted + running < (η + v + 1)·B`."""
        k = self.keys
        code, *_ = self._scripts["TRY_ADMIT"](
            keys=[k.admission, k.running, k.version, k.config, k.index],
            args=[group_id, time.time(), self.max_staleness, self.batch_groups],
        )
        result = _ADMISSION_CODES[int(code)]
        m.ADMISSION.labels(result.value).inc()
        return result

    def release(self, group_id: str) -> bool:
        """Give back the slot of a group that will not be put (failed or cancelled)."""
        return bool(self.r.hdel(self.keys.running, group_id))

    def admission(self) -> dict[str, int]:
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(k.admission, "accepted").hlen(k.running).get(k.version).hgetall(k.config)
        accepted, running, version, cfg = pipe.execute()
        b = int(cfg.get(b"batch_groups", self.batch_groups))
        eta = int(cfg.get(b"max_staleness", self.max_staleness))
        v = int(version or 0)
        return {"accepted": int(accepted or 0), "running": running, "version": v,
                "batch_groups": b, "max_staleness": eta, "capacity": (eta + v + 1) * b}  # fmt: skip

    def rebuild_admission(self, version: int) -> int:
        """After a trainer restart: accepted := version·B + groups still in the buffer; sets v."""
        k = self.keys
        return int(self._scripts["REBUILD_ADMISSION"](
            keys=[k.admission, k.groups, k.version, k.config], args=[int(version), self.batch_groups]))  # fmt: skip

    # ------------------------------------------------------------------ consumer side
    def take_groups(
        self,
        n: int,
        current_version: int,
        max_staleness: int | None = None,
        block_ms: int = 1000,
        policy: str = "drop",
    ) -> TakeResult:
        """Up to `n` groups with `current_version − min_version ≤ η`, waiting up to `block_ms`.

        Stale groups leave the buffer at once (counted; `withhold` also returns them in
        `withheld` for group statistics); groups with a token from a lost history (a trainer
        resumed from an older checkpoint, proto/lineage.py) leave as `lost`; undecodable ones
        go to the dead-letter stream. Groups claimed by `recover_pending` are served first.
        """
        if policy not in STALENESS_POLICIES:
            raise ValueError(f"staleness policy must be one of {STALENESS_POLICIES}, got {policy!r}")
        eta = self.max_staleness if max_staleness is None else max_staleness
        t0 = time.perf_counter()
        deadline = time.monotonic() + block_ms / 1000
        out = TakeResult()
        stale_hist: dict[int, int] = {}
        lineage: Lineage | None = None
        while len(out.groups) < n:
            entries = self._next_entries(n - len(out.groups), deadline)
            if not entries:
                break
            self._attach_payloads(entries)
            lineage = lineage or self.lineage()  # read once per take, after the wait
            for eid, fields in entries:
                group = self._decode_entry(self.keys.groups, TRAINER_GROUP, eid, fields, Group, out)
                if group is None:
                    continue
                self._held_groups[group.group_id] = eid
                if lineage.forks and lineage.lost(sampled_lineage(group)):
                    self._finish([(group.group_id, eid)], "lost", stale_payload=memoryview(fields.get(b"data", b"")))
                    out.lost.append(group.group_id)
                    m.DROPPED.labels("lost").inc()
                    continue
                staleness = current_version - group.min_version
                m.STALENESS.observe(max(staleness, 0))
                stale_hist[staleness] = stale_hist.get(staleness, 0) + 1
                if staleness <= eta:
                    out.groups.append(group)
                    out.staleness.append(staleness)
                    continue
                reason = "withheld" if policy == "withhold" else "dropped"
                self._finish([(group.group_id, eid)], reason, stale_payload=memoryview(fields.get(b"data", b"")))
                if policy == "withhold":
                    out.withheld.append(group)
                    m.WITHHELD.inc()
                else:
                    out.dropped.append(group.group_id)
                    m.DROPPED.labels("stale").inc()
        if stale_hist:
            pipe = self.r.pipeline(transaction=False)
            for s, c in stale_hist.items():
                pipe.hincrby(self.keys.staleness, str(s), c)
            pipe.xlen(self.keys.groups)
            m.DEPTH.labels("groups").set(pipe.execute()[-1])
        m.TAKE_SECONDS.observe(time.perf_counter() - t0)
        return out

    def _next_entries(self, count: int, deadline: float) -> list[tuple[str, dict]]:
        if self._retry is not None and self._retry.outages != self._outages_seen:
            self._outages_seen = self._retry.outages
            self._reclaim_own()
        if self._redelivery:
            return [self._redelivery.popleft() for _ in range(min(count, len(self._redelivery)))]
        block = max(int((deadline - time.monotonic()) * 1000), 0)
        resp = self.r.xreadgroup(
            TRAINER_GROUP, self.consumer, {self.keys.groups: ">"}, count=count, block=block or None
        )
        if not resp:
            return []
        return [(eid.decode(), fields) for eid, fields in resp[0][1]]

    def _reclaim_own(self) -> None:
        """After a Redis outage: an `XREADGROUP` that ran on the server but whose reply was lost
        left entries in this consumer's pending list that this instance never saw. Hand those
        (and only those: not the ones it holds) out next, so nothing waits for a restart."""
        resp = self.r.xreadgroup(TRAINER_GROUP, self.consumer, {self.keys.groups: "0"}, count=100_000)
        held = set(self._held_groups.values()) | {eid for eid, _ in self._redelivery}
        unseen = [(eid.decode(), f) for eid, f in resp[0][1] if f and eid.decode() not in held] if resp else []
        self._redelivery.extend(unseen)
        m.RECLAIMED_AFTER_OUTAGE.inc(len(unseen))

    def _attach_payloads(self, entries: list[tuple[str, dict]]) -> None:
        """Group entries carry the id; fetch each payload (entries with inline data keep it)."""
        missing = [f for _, f in entries if b"data" not in f and b"gid" in f]
        if missing:
            keys = [self.keys.payload(f[b"gid"].decode(errors="replace")) for f in missing]
            try:
                values = self._payloads.mget(keys) if self._payloads is not None else self.r.mget(keys)
            except (redis.ConnectionError, redis.TimeoutError):
                m.PAYLOAD_FETCH_FALLBACKS.inc()  # e.g. Redis restarting: redis-py's retries ride it out
                values = self.r.mget(keys)
            for fields, value in zip(missing, values):
                if value is not None:
                    fields[b"data"] = value

    def _decode_entry(self, stream, group_name, eid, fields, cls, out: TakeResult | None = None):
        data = fields.get(b"data") if fields else None
        gid = (fields or {}).get(b"gid", b"").decode(errors="replace")
        try:
            if data is None:
                raise RecordDecodeError("stream entry has no 'data' field and no payload key")
            # a fetched payload (a bytearray) is this buffer's alone: read in place
            return decode(data, cls, owned=isinstance(data, bytearray))
        except RecordDecodeError as exc:
            self._dead_letter(stream, group_name, eid, exc.reason, bytes(data or b""), gid)
            if out is not None:
                out.dead_lettered += 1
            return None

    def _dead_letter(self, stream: str, group_name: str, eid: str, reason: str, payload: bytes, gid: str) -> None:
        k = self.keys
        is_groups = stream == k.groups
        self._scripts["DEAD_LETTER"](
            keys=[stream, k.deadletter, k.stats, k.index if is_groups else k.job_index, k.admission,
                  k.payload(gid) if is_groups and gid else stream],
            args=[group_name, eid, reason, payload, stream.rsplit(":", 1)[-1], gid, DEADLETTER_MAXLEN,
                  "1" if is_groups else "0"],
        )
        m.DEAD_LETTERED.labels(stream.rsplit(":", 1)[-1]).inc()

    def _finish(self, pairs: list[tuple[str, str]], reason: str, stale_payload: bytes = b"") -> int:
        k = self.keys
        args: list = [TRAINER_GROUP, reason, len(pairs)]
        for gid, eid in pairs:
            args += [gid, eid]
            self._held_groups.pop(gid, None)
        changed = int(self._scripts["FINISH"](
            keys=[k.index, k.groups, k.admission, k.stats, k.gjob, k.job_prefix, k.payload_prefix], args=args))
        if stale_payload and changed:
            self.r.xadd(k.stale, {"gid": pairs[0][0], "reason": reason, "data": stale_payload},
                        maxlen=STALE_STREAM_MAXLEN, approximate=True)  # fmt: skip
        return changed

    def ack(self, group_ids: list[str]) -> int:
        """Mark groups trained (call once the checkpoint covering them is durable). Idempotent."""
        return self._finish([(gid, "") for gid in group_ids], "acked") if group_ids else 0

    def discard(self, group_ids: list[str], reason: str) -> int:
        """Take groups out of training for a counted reason (e.g. `zero_spread`). Idempotent."""
        if not reason.replace("_", "").isalnum() or reason in ("acked",):
            raise ValueError(f"invalid discard reason {reason!r}")
        n = self._finish([(gid, "") for gid in group_ids], reason) if group_ids else 0
        if n:
            m.DROPPED.labels(reason).inc(n)
        return n

    def recover_pending(self, idle_ms: int) -> int:
        """Claim groups pending (delivered, unacked) for ≥ idle_ms, e.g. those of a dead trainer
        or of this consumer before a restart; the next `take_groups` returns them first."""
        held = set(self._held_groups.values()) | {eid for eid, _ in self._redelivery}
        claimed = [e for e in self._autoclaim(self.keys.groups, TRAINER_GROUP, idle_ms) if e[0] not in held]
        self._redelivery.extend(claimed)
        return len(claimed)


    def _autoclaim(self, stream: str, group_name: str, idle_ms: int) -> list[tuple[str, dict]]:
        out, start = [], "0-0"
        while True:
            resp = self.r.xautoclaim(stream, group_name, self.consumer, min_idle_time=idle_ms, start_id=start, count=100)
            start, entries = resp[0], resp[1]
            out += [(eid.decode(), fields) for eid, fields in entries if fields is not None]
            if start in (b"0-0", "0-0"):
                return out

    # ------------------------------------------------------------------ rollout jobs
    def enqueue_job(self, job: GroupJob) -> bool:
        """Queue one prompt group for generation; idempotent on job.group_id."""
        return self.enqueue_jobs([job]) == 1

    def enqueue_jobs(self, jobs: list[GroupJob], chunk: int = 512) -> int:
        """`enqueue_job` for many, pipelined `chunk` at a time (each stays atomic). Returns how
        many were new."""
        k = self.keys
        new = 0
        for start in range(0, len(jobs), chunk):
            encoded = [(job.group_id, encode(job)) for job in jobs[start : start + chunk]]

            def fill(pipe, encoded=encoded) -> None:
                for group_id, payload in encoded:
                    self._evalsha(pipe, "ENQUEUE_JOB", [k.job_index, k.jobs, k.stats], [group_id, payload])

            new += sum(int(reply[0]) for reply in self._pipeline(fill))
        return new

    def claim_jobs(self, n: int, block_ms: int = 1000) -> list[ClaimedJob]:
        resp = self.r.xreadgroup(ROLLOUT_GROUP, self.consumer, {self.keys.jobs: ">"}, count=n, block=block_ms or None)
        entries = [(eid.decode(), f) for eid, f in resp[0][1]] if resp else []
        return self._decode_jobs(entries)

    def recover_jobs(self, idle_ms: int) -> list[ClaimedJob]:
        """Claim jobs another replica left pending for ≥ idle_ms (a dead replica's work)."""
        held = set(self._held_jobs.values())
        return self._decode_jobs([e for e in self._autoclaim(self.keys.jobs, ROLLOUT_GROUP, idle_ms) if e[0] not in held])

    def resume_own_jobs(self) -> list[ClaimedJob]:
        """After a restart under the same consumer name: the jobs this consumer had claimed."""
        resp = self.r.xreadgroup(ROLLOUT_GROUP, self.consumer, {self.keys.jobs: "0"}, count=100_000)
        held = set(self._held_jobs.values())
        entries = [(eid.decode(), f) for eid, f in resp[0][1] if f] if resp else []
        return self._decode_jobs([e for e in entries if e[0] not in held])

    def _decode_jobs(self, entries: list[tuple[str, dict]]) -> list[ClaimedJob]:
        jobs = []
        for eid, fields in entries:
            job = self._decode_entry(self.keys.jobs, ROLLOUT_GROUP, eid, fields, GroupJob)
            if job is not None:
                self._held_jobs[job.group_id] = eid
                jobs.append(ClaimedJob(eid, job))
        return jobs

    def touch_jobs(self, entry_ids: list[str]) -> None:
        """Reset the idle time of jobs still being worked on, so no one reclaims them."""
        if entry_ids:
            self.r.xclaim(self.keys.jobs, ROLLOUT_GROUP, self.consumer, 0, entry_ids, justid=True)

    def ack_job(self, group_id: str, state: str = "done") -> bool:
        """The job's group is in the buffer (or finally failed/cancelled): remove it from `jobs`."""
        k = self.keys
        self._held_jobs.pop(group_id, None)
        return bool(self._scripts["ACK_JOB"](keys=[k.job_index, k.jobs, k.stats], args=[ROLLOUT_GROUP, group_id, state]))

    def set_job_info(self, job_id: str, **fields: str | float) -> None:
        self.set_jobs_info({job_id: fields})

    def set_jobs_info(self, fields_by_job: dict[str, dict[str, str | float]]) -> None:
        """`set_job_info` for many jobs in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for job_id, fields in fields_by_job.items():
            if fields:
                pipe.hset(self.keys.job_prefix + job_id, mapping={f"info:{k}": v for k, v in fields.items()})
        pipe.execute()

    def job_progress(self, job_id: str) -> dict[str, str]:
        raw = self.r.hgetall(self.keys.job_prefix + job_id)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def cancel_job(self, job_id: str) -> None:
        self.r.sadd(self.keys.cancelled, job_id)

    def job_cancelled(self, job_id: str) -> bool:
        return bool(self.r.sismember(self.keys.cancelled, job_id))

    # ------------------------------------------------------------------ weights
    def publish_weights(self, info: WeightsInfo, *, rollback: bool = False) -> None:
        """Record and announce where version `info.version` is. `rollback=True` (a trainer resumed
        behind what it had published) makes it the latest and forgets every newer version."""
        k = self.keys
        self._scripts["PUBLISH_WEIGHTS"](
            keys=[k.weights, k.latest_weights, k.version],
            args=[info.version, encode(info), k.weights_channel, WEIGHTS_KEEP, "1" if rollback else "0"],
        )

    def latest_weights(self) -> WeightsInfo | None:
        data = self.r.hget(self.keys.latest_weights, "data")
        return decode(data, WeightsInfo) if data else None

    def subscribe_weights(self) -> WeightsSubscription:
        return WeightsSubscription(self)

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict:
        k = self.keys
        pipe = self.r.pipeline(transaction=False)
        for stream in (k.jobs, k.groups, k.deadletter, k.stale):
            pipe.xlen(stream)
        pipe.hgetall(k.stats).hgetall(k.staleness)
        pipe.xpending(k.groups, TRAINER_GROUP).xpending(k.jobs, ROLLOUT_GROUP)
        jobs, groups, dead, stale, counters, hist, pend_g, pend_j = pipe.execute()
        for name, depth in (("jobs", jobs), ("groups", groups), ("deadletter", dead), ("stale", stale)):
            m.DEPTH.labels(name).set(depth)
        histogram = {int(s): int(c) for s, c in hist.items()}
        total = sum(histogram.values())
        mean = sum(s * c for s, c in histogram.items()) / total if total else 0.0
        return {
            "run": self.run,
            "depth": {"jobs": jobs, "groups": groups, "deadletter": dead, "stale": stale},
            "pending": {"groups": pend_g["pending"], "jobs": pend_j["pending"]},
            "counters": {key.decode(): int(v) for key, v in counters.items()},
            "admission": self.admission(),
            "staleness": {"histogram": dict(sorted(histogram.items())), "count": total, "mean": mean,
                          "max": max(histogram) if histogram else None},
        }


class WeightsSubscription:
    """Pub/sub on the run's `weights` channel; `get(timeout)` returns the next WeightsInfo."""

    def __init__(self, buf: ReplayBuffer):
        self._buf = buf
        self._pubsub = buf.r.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(buf.keys.weights_channel)

    def get(self, timeout: float = 1.0) -> WeightsInfo | None:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            msg = self._pubsub.get_message(timeout=left)
            if msg is None or msg.get("type") != "message":
                continue
            try:
                return decode(msg["data"], WeightsInfo)
            except RecordDecodeError as exc:
                # The authoritative copy is the `weights` hash; a bad broadcast is only counted.
                m.DEAD_LETTERED.labels("weights").inc()
                self._buf.r.hincrby(self._buf.keys.stats, "bad_weight_events", 1)
                del exc
        return None

    def close(self) -> None:
        self._pubsub.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sampled_lineage(group: Group) -> dict[int, int]:
    """`Group.lineage`, or for a group written before lineage existed: all of epoch 0."""
    if group.lineage:
        return group.lineage
    versions = group.samples.versions
    return {0: int(versions.max())} if len(versions) else {}
