"""Where a step's groups come from: rank 0 reads the buffer, every rank receives the same list.

Rank 0 takes groups until it has `B` trainable ones: too-stale groups are dropped or withheld
by the buffer (counted there and here), as are groups sampled by the weights of a lost history
(proto/lineage.py), undecodable ones are dead-lettered, and with dynamic
sampling groups without reward spread are discarded (`zero_spread`, counted). The groups are
sent to the other ranks as msgpack-framed records (proto codec bytes in a uint8 tensor; no
pickle on the wire). A stop request (SIGTERM/SIGINT on rank 0) is sent the same way, so all
ranks leave the loop at the same step; a stop with a partial batch leaves those groups
pending, and the next start reclaims them.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from asyncrl.proto import Group, decode, encode
from asyncrl.proto.states import GroupState
from asyncrl.services.runtime.logging import log_event
from asyncrl.trainer import metrics as tm
from asyncrl.trainer.batch import Shaping, zero_spread_groups
from asyncrl.trainer.model import Dist, broadcast_from_main

if TYPE_CHECKING:
    from asyncrl.buffer import Groups

log = logging.getLogger("asyncrl.trainer")

READY, STOP, WAIT = 0, 1, 2
PREFILL_POLL_S = 0.05


@dataclass
class Taken:
    groups: list[Group] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    withheld: list[Group] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # sampled by weights of a lost history
    discarded: list[str] = field(default_factory=list)
    dead_lettered: int = 0
    stop: bool = False


class GroupSource:
    def __init__(
        self,
        ranks: Dist,
        groups: Groups | None,
        batch_groups: int,
        max_staleness: int,
        policy: str,
        block_ms: int,
        dynamic_sampling: bool,
        shaping: Shaping | None,
        heartbeat_s: float = 30.0,
        prefill: int = 0,
    ):
        self.ranks, self.groups = ranks, groups  # (the buffer's groups: rank 0 only)
        self.batch_groups, self.max_staleness, self.policy = batch_groups, max_staleness, policy
        self.block_ms, self.dynamic_sampling, self.shaping = block_ms, dynamic_sampling, shaping
        self.heartbeat_s = heartbeat_s
        self.prefill = prefill  # groups a fresh run's first step waits for (TrainerSettings.prefill_groups)
        self.heartbeats = 0
        self.stop_requested = threading.Event()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop_requested.set())

    def _read(self, version: int, taken: Taken, deadline: float) -> None:
        """Rank 0: add to `taken` until it holds B trainable groups, a stop request, or `deadline`."""
        while (
            len(taken.groups) < self.batch_groups
            and not self.stop_requested.is_set()
            and time.monotonic() < deadline
        ):
            res = self.groups.take(
                self.batch_groups - len(taken.groups), version, self.max_staleness, self.block_ms, self.policy
            )
            taken.withheld += res.withheld
            taken.dropped += res.dropped
            taken.lost += res.lost
            taken.dead_lettered += res.dead_lettered
            for outcome, n in (
                (GroupState.lost, len(res.lost)),
                (GroupState.dropped, len(res.dropped)),
                (GroupState.withheld, len(res.withheld)),
                (GroupState.dead_lettered, res.dead_lettered),
            ):
                tm.GROUPS.labels(outcome.value).inc(n)
            flat = (
                zero_spread_groups(res.groups, self.shaping)
                if self.dynamic_sampling
                else [False] * len(res.groups)
            )
            skip = [g.group_id for g, z in zip(res.groups, flat) if z]
            if skip:
                self.groups.discard(skip, GroupState.zero_spread)
                tm.GROUPS.labels(GroupState.zero_spread.value).inc(len(skip))
                taken.discarded += skip
            for g, s, z in zip(res.groups, res.staleness, flat):
                if not z:
                    taken.groups.append(g)
                    taken.staleness.append(s)

    def _prefilling(self, version: int, deadline: float) -> bool:
        """Rank 0: True while a fresh run (version 0) waits for `prefill` groups in the buffer,
        polling until `deadline` or a stop request; False once they are there (then for good)."""
        if not self.prefill or version > 0:
            return False
        while self.groups.depth() < self.prefill:
            if self.stop_requested.is_set() or time.monotonic() >= deadline:
                return True
            time.sleep(PREFILL_POLL_S)
        log_event(log, "buffer prefilled", groups=self.prefill)
        self.prefill = 0
        return False

    def next(self, version: int) -> Taken:
        """Collective: every rank returns the same groups (only rank 0's Taken has the rest).

        While rank 0 waits for data the ranks exchange a heartbeat every `heartbeat_s`, so an
        idle trainer never trips the collective timeout of the ranks waiting for it."""
        taken = Taken()
        while True:
            state = READY
            if self.ranks.is_main:
                if self._prefilling(version, time.monotonic() + self.heartbeat_s):
                    state = STOP if self.stop_requested.is_set() else WAIT
                else:
                    self._read(version, taken, time.monotonic() + self.heartbeat_s)
                    if len(taken.groups) < self.batch_groups:
                        state = STOP if self.stop_requested.is_set() else WAIT
            if self.ranks.world == 1:  # no other rank to tell: no encoding, no broadcasts
                if state == WAIT:
                    self.heartbeats += 1
                    tm.HEARTBEATS.inc()
                    continue
                taken.stop = state == STOP
                return taken
            payload = (
                msgspec.msgpack.encode([encode(g) for g in taken.groups])
                if self.ranks.is_main and state == READY
                else b""
            )
            header = torch.tensor([state, len(payload)], dtype=torch.long)
            broadcast_from_main(self.ranks, header)
            state = int(header[0])
            if state == WAIT:
                self.heartbeats += 1
                tm.HEARTBEATS.inc()
                continue
            taken.stop = state == STOP
            if state == READY:
                data = (
                    torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                    if self.ranks.is_main
                    else torch.empty(int(header[1]), dtype=torch.uint8)
                )
                broadcast_from_main(self.ranks, data)
                if not self.ranks.is_main:
                    taken.groups = [
                        decode(b, Group)
                        for b in msgspec.msgpack.decode(data.numpy().tobytes(), type=list[bytes])
                    ]
            return taken
