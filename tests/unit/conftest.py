"""Unit tests start no processes and serve nothing: every unit test runs with process creation,
listening sockets and torch.distributed process groups refused. A test that needs one belongs in
tests/integration (see tests/README.md)."""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess
import sys

import pytest

PROCESS_STARTS = [
    (subprocess.Popen, "_execute_child"),  # subprocess and asyncio's subprocesses
    (_posixsubprocess, "fork_exec"),  # multiprocessing's spawn and forkserver
    (os, "fork"),
    (os, "forkpty"),  # and pty.fork
    (os, "system"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
]


@pytest.fixture(autouse=True)
def no_processes_or_servers(monkeypatch):
    """Refuses, and fails the test afterwards even if the code under test swallowed the error:
    forks and spawns (subprocess, multiprocessing, redis-server, bubblewrap all go through
    these), `listen` on a socket (an HTTP server, in a thread or not), and a torch.distributed
    process group (its TCP store listens from C++, out of the socket module's sight)."""
    refused: list[str] = []

    def refuse(what: str):
        def refused_call(*args, **kwargs):
            refused.append(what)
            raise AssertionError(f"a unit test may not {what}: move it to tests/integration")

        return refused_call

    for module, name in PROCESS_STARTS:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, refuse(f"start a process ({module.__name__}.{name})"))
    monkeypatch.setattr(socket.socket, "listen", refuse("listen on a socket"))
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "init_process_group"):
        monkeypatch.setattr(dist, "init_process_group", refuse("start a torch.distributed process group"))
    yield
    assert not refused, f"a unit test may not {refused[0]}: move it to tests/integration"
