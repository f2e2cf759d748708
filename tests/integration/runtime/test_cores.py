"""Core sharing (`services/runtime/cores.py`): this test process is one party, a real second
process the other, meeting in one file as the engine and the trainer do."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

PEER = r"""
import sys
from asyncrl.services.runtime.cores import CoreShare
share = CoreShare(sys.argv[1], sys.argv[2], home=1, total=2, max_wait_s=30)
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "work":
        print(share.work(), flush=True)
    elif cmd == "rest":
        share.rest()
        print("rested", flush=True)
"""


class Peer:
    """Another process holding the other role; it acts only when told, like a party in the
    middle of a long computation between two checkpoints."""

    def __init__(self, path, role: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, str(path), role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def say(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def share(tmp_path):
    from asyncrl.services.runtime.cores import CoreShare

    shares, peers = [], []

    def make(role="engine", peer_role="trainer", max_wait_s=30.0):
        path = tmp_path / "cores"
        me = CoreShare(path, role, home=1, total=2, max_wait_s=max_wait_s)
        peer = Peer(path, peer_role)
        shares.append(me)
        peers.append(peer)
        return me, peer

    yield make
    for p in peers:
        p.kill()
    for s in shares:
        s.close()


def sample(name: str, role: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"role": role}) or 0.0


def test_the_busy_party_takes_every_core_while_the_other_rests_and_its_own_while_both_work(share):
    import torch

    me, peer = share()
    assert me.work() == 2 and torch.get_num_threads() == 2  # the peer has no work
    peer.proc.stdin.write("work\n")  # the peer has work now: it waits for its core back
    peer.proc.stdin.flush()
    time.sleep(0.2)
    # My next checkpoint sees it busy and gives its core back; then its work() returns 1.
    assert me.work() == 1 and torch.get_num_threads() == 1
    assert peer.proc.stdout.readline().strip() == "1"
    assert me.peer()[1:] == (True, 1)
    assert peer.say("rest") == "rested"
    assert me.work() == 2 and torch.get_num_threads() == 2
    me.rest()
    assert peer.say("work") == "2"  # I rest: the peer gets both


def test_work_waits_until_the_peer_hands_back_the_borrowed_core(share):
    me, peer = share(role="trainer", peer_role="engine")
    waited = sample("asyncrl_core_share_wait_seconds_total", "trainer")
    assert peer.say("work") == "2"  # the engine generates on both cores while I wait for rollouts
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(me.work()))
    t.start()
    time.sleep(0.3)
    # Between two of its checkpoints the peer still holds both cores: I do not start.
    assert got == [] and t.is_alive()
    assert me.peer()[1:] == (True, 2)
    assert peer.say("work") == "1"  # its next checkpoint sees me busy and keeps its own core
    t.join(timeout=10)
    assert got == [1]
    assert sample("asyncrl_core_share_wait_seconds_total", "trainer") - waited >= 0.3


def test_a_dead_peer_holds_nothing(share):
    me, peer = share()
    assert peer.say("work") == "2"
    peer.kill()  # died holding both cores
    assert me.work() == 2


def test_a_stuck_peer_is_waited_for_only_max_wait_s_and_the_overrun_is_counted(share):
    me, peer = share(max_wait_s=0.2)
    overruns = sample("asyncrl_core_share_wait_overruns_total", "engine")
    assert peer.say("work") == "2"  # and never checks in again
    assert me.work() == 1  # its own core only
    assert sample("asyncrl_core_share_wait_overruns_total", "engine") - overruns == 1


def test_busy_seconds_are_counted_by_the_threads_used(share):
    me, peer = share()
    before = sample_threads("engine", "2")
    me.work()
    time.sleep(0.2)
    me.rest()
    assert sample_threads("engine", "2") - before >= 0.2


def sample_threads(role: str, threads: str) -> float:
    from prometheus_client import REGISTRY

    return (
        REGISTRY.get_sample_value("asyncrl_core_share_busy_seconds_total", {"role": role, "threads": threads})
        or 0.0
    )


def test_bad_settings_are_refused(tmp_path):
    from asyncrl.services.runtime.cores import CoreShare

    with pytest.raises(ValueError, match="role"):
        CoreShare(tmp_path / "c", "reward")
    with pytest.raises(ValueError, match="home threads 3"):
        CoreShare(tmp_path / "c", "engine", home=3, total=2)
