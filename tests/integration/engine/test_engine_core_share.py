"""Core sharing in the reference engine (`[engine] core_share`, services/runtime/cores.py): a real
engine on a tiny model, served in this process, shares a file with a real trainer-side peer
PROCESS that claims and gives up cores when the test tells it to. Checked from the engine's
own counters, the shared file and the thread count each forward of the engine's model ran
with (recorded by a hook on its decoder, on the scheduler thread): the engine waits for a
core the peer borrowed, computes on both cores while the peer rests, gives a borrowed core
back before the peer computes, and gives up everything once it has no work."""

from __future__ import annotations

import fcntl
import os
import queue
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from engine_server import serve_in_thread
from waiting import wait_until

from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.services.runtime.cores import ROLES, SIZE, SLOT, WAIT_OVERRUNS

torch.set_num_threads(1)

TOTAL = 2  # the cores the two parties share, whatever this machine has (core_share_threads)
PEER_WAIT_S = 600.0  # the peer's max_wait_s: a loaded machine never turns its wait into an overrun
REPLY_TIMEOUT_S = 120.0

# The trainer's side: a CoreShare obeying one command a line on stdin, answering one line each.
PEER = """
import sys
from asyncrl.services.runtime.cores import CoreShare
share = CoreShare(sys.argv[1], "trainer", home=1, total=2, max_wait_s=float(sys.argv[2]))
print("ready", flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "work":
        import torch
        got = share.work()
        print(got, torch.get_num_threads(), flush=True)
    elif command == "rest":
        share.rest()
        print("rested", flush=True)
    elif command == "exit":
        break
share.close()
"""


class Peer:
    """The trainer-side party in a process of its own (`PEER`)."""

    def __init__(self, path) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, str(path), str(PEER_WAIT_S)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.reply() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def reply(self) -> str:
        try:
            return self.lines.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"the peer did not answer in {REPLY_TIMEOUT_S:g} s") from None

    def ask(self, command: str) -> str:
        self.send(command)
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("exit")
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def slots(path) -> dict[str, tuple[int, int, int]]:
    """Each party's (pid, busy, claimed threads) as the shared file holds them now: read under a
    shared lock, so never half of a change (the parties write under an exclusive one)."""
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        data = f.read(SIZE)
    return {role: SLOT.unpack_from(data, i * SLOT.size) for i, role in enumerate(ROLES)}


@pytest.fixture(scope="module")
def cores_path(tmp_path_factory):
    return tmp_path_factory.mktemp("core_share") / "cores"


@pytest.fixture(scope="module")
def engine(tmp_path_factory, cores_path):
    model = tmp_path_factory.mktemp("tiny_core_share_model")
    build_tiny_model(model, seed=0)
    running = serve_in_thread(str(model), core_share=str(cores_path), core_share_threads=TOTAL,
                              num_threads=1, max_running_requests=4, context_length=128)  # fmt: skip
    share = running.engine.scheduler.cores
    assert (share.role, share.home, share.total) == ("engine", 1, TOTAL)
    share.max_wait_s = PEER_WAIT_S  # as the peer's: the wait below ends by the hand-back, never by its limit
    yield running
    running.stop()
    # torch.set_num_threads also sets the count any thread takes up at its first parallel op or
    # get_num_threads (torch's lazy_init_num_threads): the scheduler's last claim must not reach
    # the threads of later tests in this process.
    torch.set_num_threads(1)


@pytest.fixture
def peer(cores_path, engine):
    p = Peer(cores_path)
    yield p
    p.close()


@pytest.fixture
def forwards(engine):
    """(thread name, torch threads) of each forward of the engine's decoder, from a pre-hook;
    `forwards.gate(n)` makes the n-th forward (1-based) wait inside the hook until released."""

    class Forwards(list):
        def __init__(self) -> None:
            super().__init__()
            self.at, self.entered, self.released = None, threading.Event(), threading.Event()

        def gate(self, n: int) -> None:
            self.at = n

        def hook(self, module, args) -> None:
            self.append((threading.current_thread().name, torch.get_num_threads()))
            if len(self) == self.at:
                self.entered.set()
                assert self.released.wait(REPLY_TIMEOUT_S), "the gated forward was never released"

    recorded = Forwards()
    handle = engine.engine.runner.decoder.register_forward_pre_hook(recorded.hook)
    yield recorded
    recorded.released.set()
    handle.remove()


def stats(client) -> dict:
    return client.get("/get_server_info").json()["internal_states"][0]


def steps(s: dict) -> int:
    return s["prefill_steps"] + s["decode_steps"]


def generate(url: str, prompt: list[int], n: int) -> dict:
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": params}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_engine_waits_for_a_borrowed_core_and_gives_all_back_once_idle(
    engine, peer, forwards, cores_path
):
    me = os.getpid()
    wait_until(lambda: slots(cores_path)["engine"] == (me, 0, 0), message="the engine rests")
    # The engine idles: the peer gets both cores, applied to its torch.
    assert peer.ask("work") == "2 2"
    assert slots(cores_path)["trainer"] == (peer.pid, 1, 2)
    overruns = WAIT_OVERRUNS.labels("engine")._value.get()
    with httpx.Client(base_url=engine.url, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        before = stats(client)
        request = pool.submit(generate, engine.url, [1, 5, 6, 7], 8)
        try:
            # The engine has work, says so, and claims nothing while the peer holds its core ...
            wait_until(
                lambda: slots(cores_path)["engine"] == (me, 1, 0), message="the engine waits for its core"
            )
            waiting = stats(client)
            assert (waiting["num_waiting_reqs"], waiting["num_running_reqs"]) == (1, 0)
            assert waiting["generated_tokens"] == before["generated_tokens"]  # ... and computes nothing
            assert steps(waiting) == steps(before) and forwards == []
            # The peer checks in while the engine is busy: it keeps only its own core.
            assert peer.ask("work") == "1 1"
        except BaseException:
            peer.ask("rest")  # a failed check: the engine's wait ends, so the request and the pool do
            raise
        out = request.result(timeout=300)
        after = stats(client)
    assert len(out["output_ids"]) == 8
    assert after["generated_tokens"] - before["generated_tokens"] == 8
    # Every forward of the request ran on the scheduler thread, on the one core the engine owns.
    assert forwards == [("engine-scheduler", 1)] * (steps(after) - steps(before))
    assert WAIT_OVERRUNS.labels("engine")._value.get() == overruns  # the hand-back ended the wait
    # With no work left the engine gives up everything, and the peer may take both cores again.
    wait_until(lambda: slots(cores_path)["engine"] == (me, 0, 0), message="the engine rests")
    assert peer.ask("work") == "2 2"


def test_the_engine_computes_on_every_core_while_the_peer_rests(engine, peer, forwards, cores_path):
    assert peer.ask("rest") == "rested"
    assert slots(cores_path)["trainer"] == (peer.pid, 0, 0)
    with httpx.Client(base_url=engine.url, timeout=60) as client:
        before = stats(client)
        out = generate(engine.url, [1, 8, 9, 10], 6)
        after = stats(client)
    assert len(out["output_ids"]) == 6
    assert forwards == [("engine-scheduler", TOTAL)] * (steps(after) - steps(before))


def test_the_engine_hands_a_borrowed_core_back_before_the_peer_computes(engine, peer, forwards, cores_path):
    """The engine computes on both cores; the peer gets work in the middle of a request (the
    third forward is held until the peer has said so): the peer waits while the engine holds
    both, the engine's next forward runs on one core, and the peer gets the other."""
    assert peer.ask("rest") == "rested"
    forwards.gate(3)
    with httpx.Client(base_url=engine.url, timeout=60) as client, ThreadPoolExecutor(1) as pool:
        before = stats(client)
        request = pool.submit(generate, engine.url, [1, 11, 12, 13], 10)
        try:
            assert forwards.entered.wait(REPLY_TIMEOUT_S), "the request's third forward never started"
            assert slots(cores_path)["engine"] == (os.getpid(), 1, TOTAL)
            peer.send("work")
            # The peer has work and waits: busy, claiming nothing while the engine holds both cores.
            wait_until(lambda: slots(cores_path)["trainer"] == (peer.pid, 1, 0), message="the peer waits")
        finally:
            forwards.released.set()  # (also on failure: the request must end for the pool to close)
        assert peer.reply() == "1 1"
        out = request.result(timeout=300)
        after = stats(client)
    assert len(out["output_ids"]) == 10
    n = steps(after) - steps(before)
    assert n == 10  # one prefill, nine decode steps
    assert forwards == [("engine-scheduler", TOTAL)] * 3 + [("engine-scheduler", 1)] * (n - 3)
