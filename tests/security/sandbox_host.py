"""What the security tests know of the sandbox on the host: its uids and the secret a probe
looks for (shared by conftest.py's reward service and the attack tests)."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

SECRET_ENV = "ASYNCRL_SECURITY_PROBE_SECRET"
UID_BASE = 2_100_000  # sandbox host uids of these tests (slot i = UID_BASE + i)
SLOTS = 2


def pids_with_uids(first: int, count: int) -> list[int]:
    """Host processes running as a uid in [first, first + count)."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if first <= int(uid_line.split()[1]) < first + count:
            pids.append(int(status.parent.name))
    return pids


def sandbox_pids() -> list[int]:
    """Host processes running as one of this service's sandbox uids."""
    return pids_with_uids(UID_BASE, SLOTS)


@contextlib.contextmanager
def loopback_listener():
    """A TCP listener on a free loopback port, accepting in a thread for as long as the block
    runs: yields (port, the connections it accepted)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    connections: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connections.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], connections
    finally:
        stop.set()
        thread.join()
        listener.close()
