"""The buffer's payload reader (buffer/payloads.py) against real redis-servers: it must return
what redis-py's MGET returns, through auth, databases, unix sockets and dropped connections."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import subprocess
import time

import numpy as np
import pytest
import redis
from factories import make_group

from buffer import RedisServer, ReplayBuffer
from buffer.payloads import READ_SIZE, PayloadReader
from proto import Group, decode, encode


def _values(rng: np.random.Generator) -> dict[str, bytes]:
    """Values on both sides of the reader's read size, and ones holding RESP's own bytes."""
    sizes = [0, 1, 2, READ_SIZE - 7, READ_SIZE, READ_SIZE + 3, 3 * READ_SIZE + 11, 400_000]
    values = {f"v{n}": rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes}
    values["crlf"] = b"\r\n$5\r\n*2\r\n-ERR\r\n" * 100
    return values


def test_mget_returns_what_redis_py_returns(redis_url, run_id):
    r = redis.Redis.from_url(redis_url)
    values = {f"{run_id}:{k}": v for k, v in _values(np.random.default_rng(0)).items()}
    r.mset(values)
    r.hset(f"{run_id}:hash", "f", "v")  # not a string: MGET says nil for it
    keys = [*values, f"{run_id}:missing", f"{run_id}:hash", *reversed(list(values))]
    reader = PayloadReader(redis_url)
    for _ in range(3):  # the same connection serves one reply after another
        got = reader.mget(keys)
        assert [None if v is None else bytes(v) for v in got] == r.mget(keys)
        assert all(isinstance(v, bytearray) for v in got if v is not None)
    assert reader.mget([]) == []
    reader.close()


def test_auth_acl_user_and_database(tmp_path):
    with RedisServer(tmp_path, password="pw-1") as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "trainer", "on", ">pw-2", "~*", "+@all")
        redis.Redis(port=server.port, password="pw-1", db=3).set("k", b"db3")
        admin.set("k", b"db0")
        assert PayloadReader(server.url).mget(["k"]) == [bytearray(b"db0")]
        assert PayloadReader(f"redis://trainer:pw-2@127.0.0.1:{server.port}/3").mget(["k"]) == [bytearray(b"db3")]
        with pytest.raises(redis.AuthenticationError):
            PayloadReader(f"redis://:wrong@127.0.0.1:{server.port}/0").mget(["k"])
        with pytest.raises(redis.AuthenticationError, match="NOAUTH"):
            PayloadReader(f"redis://127.0.0.1:{server.port}/0").mget(["k"])


def test_unix_socket(tmp_path):
    sock = tmp_path / "redis.sock"
    binary = shutil.which("redis-server") or RedisServer(tmp_path).binary
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", str(sock), "--save", "", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"unix://{sock}?db=1"
        redis.Redis.from_url(url).set("k", b"x" * 100_000)
        assert PayloadReader(url).mget(["k", "nope"]) == [bytearray(b"x" * 100_000), None]
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_dropped_connection_is_replaced_and_a_dead_server_is_an_error(tmp_path):
    server = RedisServer(tmp_path).start()
    r = server.client()
    r.set("k", b"v" * 200_000)
    reader = PayloadReader(server.url)
    assert reader.mget(["k"]) == [bytearray(b"v" * 200_000)]
    assert r.client_kill_filter(_type="normal", skipme=True) >= 1  # the reader's connection is gone
    assert reader.mget(["k"]) == [bytearray(b"v" * 200_000)]  # fetched again on a new one
    server.stop()
    with pytest.raises(redis.ConnectionError, match="payload fetch failed"):
        reader.mget(["k"])


def test_tls_urls_are_left_to_redis_py():
    assert PayloadReader.for_url("rediss://127.0.0.1:6390/0") is None
    with pytest.raises(ValueError, match="SSLConnection"):
        PayloadReader("rediss://127.0.0.1:6390/0")


def _child_fetch(reader: PayloadReader, key: str, out) -> None:
    out.put(bytes(reader.mget([key])[0]))


def test_a_forked_child_opens_its_own_connection(redis_url, run_id):
    redis.Redis.from_url(redis_url).set(f"{run_id}:k", b"parent's")
    reader = PayloadReader(redis_url)
    assert reader.mget([f"{run_id}:k"]) == [bytearray(b"parent's")]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_fetch, args=(reader, f"{run_id}:k", out))
    child.start()
    assert out.get(timeout=30) == b"parent's"
    child.join(30)
    assert child.exitcode == 0
    assert reader.mget([f"{run_id}:k"]) == [bytearray(b"parent's")]  # the parent's socket still works


def test_large_groups_come_through_the_buffer_intact(redis_url, run_id):
    """Groups of ~400 kB (several reads each) taken through the reader decode to what was put,
    read-only, in place."""
    buf = ReplayBuffer(redis_url, run=run_id, consumer="c")
    groups = [make_group(f"g{i}", n=4, n_tokens=8_000 + i) for i in range(5)]
    assert buf.put_groups(groups) == [True] * 5
    got = buf.take_groups(5, current_version=0, max_staleness=10, block_ms=100).groups
    assert sorted(g.group_id for g in got) == [g.group_id for g in groups]
    for g in got:
        assert g == next(x for x in groups if x.group_id == g.group_id)
        assert not g.samples.completion_ids.flags.writeable and not g.samples.behavior_logprobs.flags.writeable
    assert buf.ack([g.group_id for g in got]) == 5
    buf.close()


def test_decode_reads_an_owned_payload_in_place_and_copies_any_other():
    data = bytearray(encode(make_group(n=3, n_tokens=6)))
    owned = decode(data, Group, owned=True)
    assert np.shares_memory(owned.samples.completion_ids, np.frombuffer(data, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        owned.samples.versions[0] = 7
    copied = decode(data, Group)  # a caller's bytearray may change later: it is copied
    assert not np.shares_memory(copied.samples.completion_ids, np.frombuffer(data, np.uint8))
    assert owned == copied == make_group(n=3, n_tokens=6)


class _Interrupt(BaseException):
    pass


def test_an_interrupted_fetch_never_leaves_a_reply_behind(redis_url, run_id, monkeypatch):
    """Interrupted after sending (a signal, Ctrl-C), the reader must not read that reply as the
    answer to its next request."""
    r = redis.Redis.from_url(redis_url)
    r.mset({f"{run_id}:a": b"AAA", f"{run_id}:b": b"BBB"})
    reader = PayloadReader(redis_url)
    real = reader._read_values
    monkeypatch.setattr(reader, "_read_values", lambda n: (_ for _ in ()).throw(_Interrupt()))
    with pytest.raises(_Interrupt):
        reader.mget([f"{run_id}:a"])
    monkeypatch.setattr(reader, "_read_values", real)
    assert reader.mget([f"{run_id}:b"]) == [bytearray(b"BBB")]


def test_the_buffer_falls_back_to_redis_py_when_the_reader_fails(redis_url, run_id, monkeypatch):
    from buffer import metrics

    buf = ReplayBuffer(redis_url, run=run_id, consumer="c")
    buf.put_group(make_group("g1"))

    def refuse(keys):
        raise redis.ConnectionError("payload fetch failed: refused")

    monkeypatch.setattr(buf._payloads, "mget", refuse)
    before = metrics.PAYLOAD_FETCH_FALLBACKS._value.get()
    assert [g.group_id for g in buf.take_groups(1, 0, block_ms=100).groups] == ["g1"]
    assert metrics.PAYLOAD_FETCH_FALLBACKS._value.get() == before + 1
    buf.close()
