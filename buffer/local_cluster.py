"""A private Redis Cluster on loopback, for tests and benchmarks: `masters` × (1 + `replicas`)
`redis-server --cluster-enabled yes` processes on free ports, each in its own directory with
AOF (`appendfsync always`, like the embedded server: buffer/server.py), joined by `redis-cli
--cluster create`. `url` is the `redis+cluster://` URL the buffer takes
(buffer/connection.py); `kill(port)` SIGKILLs one node and `wait_ok()` waits for the cluster to
serve every slot again (a replica promoted in a few `node_timeout_ms`)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

TIMEOUT_S = 60.0


def _free_port_with_bus() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class LocalCluster:
    def __init__(
        self, data_dir: str | Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
    ):
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        if not shutil.which("redis-server") or not shutil.which("redis-cli"):
            raise RuntimeError("a local cluster needs redis-server and redis-cli on PATH")
        self.dir, self.masters_n, self.replicas_n = Path(data_dir), masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """The live nodes as startup nodes."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.live())

    def live(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def start(self) -> LocalCluster:
        for _ in range(self.masters_n * (1 + self.replicas_n)):
            port = _free_port_with_bus()
            d = self.dir / str(port)
            d.mkdir(parents=True)
            self.procs[port] = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(self.node_timeout_ms), "--appendonly", "yes",
                 "--appendfsync", "always", "--save", "", "--logfile", str(d / "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        for port in self.procs:
            self._wait(lambda port=port: self._ping(port), f"redis-server on {port} answers")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.procs),
             "--cluster-replicas", str(self.replicas_n), "--cluster-yes"],
            check=True, capture_output=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        self.wait_ok()
        return self

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_connect_timeout=0.5)

    def masters(self) -> list[int]:
        return [p for p in self.live() if self.node(p).info("replication")["role"] == "master"]

    def owner(self, key: str) -> int:
        """The port of the master serving `key`'s slot."""
        any_node = self.node(self.live()[0])
        slot = any_node.cluster("keyslot", key)
        for start, end, master, *_ in any_node.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(master[1])
        raise RuntimeError(f"no master serves slot {slot}")

    def wait_ok(self) -> None:
        """Every live node sees `cluster_state:ok` with every slot's master alive, and every
        replica's link to its master up (a replica still syncing confirms no `WAIT`)."""

        def ok() -> bool:
            for port in self.live():
                try:
                    node = self.node(port)
                    owners = {s[2][1] for s in node.execute_command("CLUSTER SLOTS")}
                    if node.cluster("info").get("cluster_state") != "ok" or not owners <= set(self.live()):
                        return False
                    replication = node.info("replication")
                except redis.RedisError:
                    return False
                if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                    return False
            return True

        self._wait(ok, "cluster_state ok on every live node")

    def kill(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            proc.wait(timeout=10)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _ping(self, port: int) -> bool:
        try:
            return bool(redis.Redis(port=port, socket_connect_timeout=0.2).ping())
        except redis.RedisError:
            return False

    @staticmethod
    def _wait(predicate, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"local Redis Cluster: timed out after {TIMEOUT_S:g} s waiting until {what}"
                )
            time.sleep(0.05)
