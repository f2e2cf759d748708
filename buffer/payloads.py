"""Group payloads fetched with one copy.

redis-py's reply parser copies a bulk string about five times on its way from the socket
(`recv` into a bytes, into its BytesIO, out of it, a concatenation, a slice). For ~200 kB
group payloads that was the largest cost of `take_groups`: 233 µs a group against 100 µs
for the same MGET received straight into the buffer it returns
(`benchmarks/buffer_throughput.py`, the "payload fetch" rows). `PayloadReader` does that:
one `MGET` on a connection of its own, each value received into a `bytearray` of its exact
size, handed over to the caller (the codec reads it in place).

It speaks only what it needs of RESP2: `AUTH` and `SELECT` on connect, then `MGET`. Every
other command of the buffer goes through redis-py. Plain TCP and unix sockets; for a TLS URL
(`rediss://`) `for_url` returns None and the buffer uses redis-py's `MGET`. A failed fetch is
retried once on a new connection (MGET only reads), then raised as redis-py's own error types
so callers handle one set of exceptions; the buffer then tries redis-py's `MGET` (with its
retries) before it gives up.
"""

from __future__ import annotations

import os
import socket

import redis
from redis.connection import parse_url

READ_SIZE = 1 << 16  # headers and small values are read through a buffer of this size
MAX_LINE = 1 << 12  # a RESP header line (`*n`, `$n`, `-ERR …`) longer than this is a broken stream


class PayloadReader:
    """`mget(keys)` → one `bytearray` per key (None where the key has no string value)."""

    def __init__(self, url: str):
        opts = parse_url(url)
        if opts.get("connection_class") not in (None, redis.UnixDomainSocketConnection):
            raise ValueError(f"PayloadReader speaks plain TCP or unix sockets, not {opts['connection_class'].__name__}")
        self._path = opts.get("path")
        self._address = (opts.get("host", "localhost"), int(opts.get("port", 6379)))
        self._auth = [a for a in (opts.get("username"), opts.get("password")) if a is not None]
        self._db = int(opts.get("db", 0))
        self._timeout = opts.get("socket_timeout")
        self._connect_timeout = opts.get("socket_connect_timeout", self._timeout)
        self._sock: socket.socket | None = None
        self._pid = 0
        self._buf = bytearray(READ_SIZE)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]

    @classmethod
    def for_url(cls, url: str) -> PayloadReader | None:
        """A reader for `url`, or None where only redis-py can connect (TLS)."""
        try:
            return cls(url)
        except ValueError:
            return None

    def mget(self, keys: list[str]) -> list[bytearray | None]:
        if not keys:
            return []
        request = _command(b"MGET", *keys)
        for attempt in (0, 1):
            try:
                self._connect()
                self._sock.sendall(request)
                return self._read_values(len(keys))
            except (redis.AuthenticationError, redis.ResponseError):
                self.close()
                raise  # Redis answered: asking again would get the same answer
            except (OSError, ValueError, redis.ConnectionError, redis.TimeoutError) as exc:
                self.close()  # ValueError: a header that is not a number, a broken stream
                if attempt:
                    kind = redis.TimeoutError if isinstance(exc, (TimeoutError, redis.TimeoutError)) else redis.ConnectionError
                    raise kind(f"payload fetch failed: {exc}") from exc
            except BaseException:
                # (an interrupt mid-reply): the rest of the reply is still on the socket, and the
                # next fetch would read it as its own
                self.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            self._sock.close()
        self._sock = None  # (a forked child never closes its parent's socket)
        self._start = self._end = 0

    # ------------------------------------------------------------------ connection
    def _connect(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            return
        self._sock, self._pid, self._start, self._end = None, os.getpid(), 0, 0
        if self._path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._connect_timeout)
            sock.connect(self._path)
        else:
            sock = socket.create_connection(self._address, timeout=self._connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # as the buffer's redis-py client
        sock.settimeout(self._timeout)
        self._sock = sock
        setup = []
        if self._auth:
            setup.append(_command(b"AUTH", *self._auth))
        if self._db:
            setup.append(_command(b"SELECT", str(self._db)))
        if setup:
            sock.sendall(b"".join(setup))
            for _ in setup:
                line = self._line()
                if line[:1] == b"-":
                    raise _error(line)
                if line != b"+OK":
                    raise redis.ConnectionError(f"unexpected reply {line[:80]!r} while connecting")

    # ------------------------------------------------------------------ RESP2
    def _read_values(self, n: int) -> list[bytearray | None]:
        head = self._line()
        if head[:1] == b"-":
            raise _error(head)
        if head != b"*%d" % n:
            raise redis.ConnectionError(f"expected an array of {n}, got {head[:80]!r}")
        return [self._bulk() for _ in range(n)]

    def _bulk(self) -> bytearray | None:
        line = self._line()
        if line[:1] != b"$":
            raise redis.ConnectionError(f"expected a bulk string, got {line[:80]!r}")
        size = int(line[1:])
        if size < 0:
            return None
        out = bytearray(size)
        have = min(size, self._end - self._start)
        out[:have] = self._view[self._start : self._start + have]
        self._start += have
        if have < size:
            target = memoryview(out)
            while have < size:  # the rest arrives straight into `out`
                got = self._sock.recv_into(target[have:])
                if not got:
                    raise redis.ConnectionError("Redis closed the connection mid-reply")
                have += got
        if self._line() != b"":  # the bulk string's closing CRLF
            raise redis.ConnectionError("bulk string not followed by CRLF")
        return out

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._start, self._end)
            if end >= 0:
                line = bytes(self._view[self._start : end])
                self._start = end + 2
                return line
            if self._end - self._start > MAX_LINE:
                raise redis.ConnectionError("RESP header line too long")
            self._fill()

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # keep the unread tail, at the front
            tail = self._end - self._start
            self._buf[:tail] = self._view[self._start : self._end]
            self._start, self._end = 0, tail
        got = self._sock.recv_into(self._view[self._end :])
        if not got:
            raise redis.ConnectionError("Redis closed the connection")
        self._end += got


def _error(line: bytes) -> redis.RedisError:
    """An error reply as the exception redis-py raises for it (LOADING is a ConnectionError:
    the fetch is tried again)."""
    message = line[1:].decode(errors="replace")
    if message.startswith(("NOAUTH", "WRONGPASS", "NOPERM")) or "invalid password" in message:
        return redis.AuthenticationError(message)
    if message.startswith("LOADING"):
        return redis.BusyLoadingError(message)
    return redis.ResponseError(message)


def _command(*args: bytes | str) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)
