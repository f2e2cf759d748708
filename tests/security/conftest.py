"""A real reward service (uvicorn on loopback, in a thread) with the bubblewrap code verifier,
shared by the sandbox attack tests."""

from __future__ import annotations

import os
import shutil
import socket
import threading

import httpx
import pytest
from sandbox_host import SECRET_ENV, SLOTS, UID_BASE
from waiting import wait_until


@pytest.fixture(scope="session")
def reward_url():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is not installed (apt-get install bubblewrap): the sandbox tests need it")
    import uvicorn

    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings

    os.environ[SECRET_ENV] = "s3cr3t-" + os.urandom(8).hex()  # visible to the service process
    settings = RewardSettings(
        code_concurrency=SLOTS,
        code_uid_base=UID_BASE,
        math_workers=1,
        code_output_bytes=64 * 1024,
        code_tmpfs_mb=16,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(settings), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def started() -> bool:
        assert thread.is_alive(), "the reward service thread died"
        return server.started

    wait_until(started, message="the reward service started")
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    os.environ.pop(SECRET_ENV, None)


@pytest.fixture
def client(reward_url):
    with httpx.Client(base_url=reward_url, timeout=60) as c:
        yield c
