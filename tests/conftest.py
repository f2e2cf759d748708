"""Shared fixtures. Redis tests start their own redis-server on a free loopback port in a
temporary directory; they never touch the machine's 6379 or anyone else's data."""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from asyncrl.buffer.server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def run_id() -> str:
    """A fresh run id per test: keys of different tests never collide on the shared server."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model directory (services/ops/tinymodel.py), built once per test module; a
    module that needs other weights defines its own `tiny` (test_parity.py)."""
    from asyncrl.services.ops.tinymodel import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(path, seed=2)
    return path
