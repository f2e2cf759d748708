"""A real reward service (uvicorn on loopback, in a thread) with the bubblewrap code verifier,
shared by the sandbox attack tests."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

SECRET_ENV = "ASYNCRL_SECURITY_PROBE_SECRET"
UID_BASE = 2_100_000  # sandbox host uids of these tests (slot i = UID_BASE + i)
SLOTS = 2


def sandbox_pids() -> list[int]:
    """Host processes running as one of this service's sandbox uids."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if UID_BASE <= int(uid_line.split()[1]) < UID_BASE + SLOTS:
            pids.append(int(status.parent.name))
    return pids


@pytest.fixture(scope="session")
def reward_url():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed (apt-get install bubblewrap): the sandbox tests need it")
    import uvicorn

    from services.reward.app import build_app
    from services.reward.config import RewardSettings

    os.environ[SECRET_ENV] = "s3cr3t-" + os.urandom(8).hex()  # visible to the service process
    settings = RewardSettings(
        code_concurrency=SLOTS, code_uid_base=UID_BASE, math_workers=1, code_output_bytes=64 * 1024, code_tmpfs_mb=16
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(settings), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "reward service did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    os.environ.pop(SECRET_ENV, None)


@pytest.fixture
def client(reward_url):
    with httpx.Client(base_url=reward_url, timeout=60) as c:
        yield c
