"""Run untrusted programs under bubblewrap with rlimits, a wall clock and capped output.

Each run gets:
* fresh user, pid, net, ipc, uts and cgroup namespaces (`--unshare-all`): no network at all
  (not even the host's loopback), no view of host or other sandboxes' processes;
* a read-only root built from a read-only bind of `/usr` only (no `/etc`, `/home`, `/tmp`,
  `/proc` of the host, no service files), and a fresh size-capped tmpfs `/work` holding just
  the files of this run, copied in from memfds (nothing is written on the host);
* an empty environment (`--clearenv`) plus a fixed PATH/HOME/LANG;
* a host uid of its own: when the service runs as root, slot `i` runs as `uid_base + i`
  (seen as 65534 "nobody" inside; bwrap maps the sandbox user onto the uid that starts it, so
  without this drop it would be host root). The drop is done by exec'ing `nsenter -S -G` (no
  namespace option: setgroups([]), setgid, setuid), so that the service can vfork;
* rlimits: CPU seconds, address space, file size, open files, processes, no core. A fixed
  bootstrap sets them (hard limits included, so they cannot be raised again) in the sandboxed
  interpreter before it reads the program (`python -I -B -c BOOTSTRAP /work/main.py`): they bind
  every line of user code and cost no extra process per run (a `prlimit` exec did before).
  RLIMIT_NPROC is counted in the run's own user namespace, i.e. over this run's processes only,
  which the sandbox cannot bypass (no capability in the initial user namespace); processes of
  earlier runs of the slot, even unreaped, do not count against it;
* the program is the sandbox's pid 1 (`--as-pid-1`: no separate reaper process). When it exits,
  the kernel kills every other process of the pid namespace. Like any pid 1 it ignores signals
  it has no handler for, except those the kernel forces (SIGKILL from outside, faults): at the
  CPU soft limit SIGXCPU is therefore ignored and the hard limit's SIGKILL ends it;
* `--die-with-parent`, `--new-session`, and a wall-clock deadline after which the whole
  process group is SIGKILLed (bwrap dies, its death signal kills the sandbox's pid 1, which
  kills every process in it, so nothing outlives the run; a pid 1 killed that way is left a
  zombie for the host's init to reap);
* stdout and stderr read up to a cap; a run that writes more is killed (`output_limit`).

Expected outputs never enter the sandbox: callers compare outside. Limits of the design: this
is a namespace + rlimit sandbox, not a VM; it is not a boundary against kernel exploits, and
memory is bounded per process (RLIMIT_AS), not per sandbox (no cgroup here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UID = 65534  # "nobody" inside the sandbox
WORKDIR = "/work"
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}  # what bwrap itself sees
READ_CHUNK = 65536
PIPE_DRAIN_TIMEOUT_S = 2.0  # after the kill, how long to wait for the output pipes to reach EOF
CPU_HARD_GRACE_S = 1  # SIGXCPU at the soft limit (ignored by a pid 1), SIGKILL one second later
MB = 1 << 20

# Runs first in the sandboxed interpreter, before the program is read: sets the rlimits, then
# executes the program file in `__main__` as `python main.py` would. `exec` of the source bytes
# rather than `compile(src, path)`: builtins.compile initialises the AST types (~1 ms per run);
# the price is that tracebacks name the program `<string>` (line numbers are kept).
BOOTSTRAP = """\
import resource as _r, sys as _s
for _k, _v in {limits}:
    _r.setrlimit(_k, _v)
del _s.argv[0]
__file__ = _s.argv[0]
del _r, _s, _k, _v
exec(open(__file__, "rb").read())
"""


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


@dataclass(frozen=True)
class Limits:
    wall_s: float
    cpu_s: int
    memory_mb: int
    fsize_mb: int
    nofile: int
    nproc: int
    output_bytes: int
    tmpfs_mb: int


@dataclass
class RunResult:
    """`outcome`: `exited` (see exit_code), `timeout` (wall clock), `output_limit`, `sandbox_error`."""

    outcome: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    duration_s: float
    error: str | None = None


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)  # close-on-exec; pass_fds makes it visible to bwrap only
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def _read_capped(stream: asyncio.StreamReader, cap: int, over: asyncio.Event) -> bytes:
    """Keep up to `cap` bytes and signal `over` past it. Reading continues (discarding) to EOF:
    a paused pipe would never see EOF, and asyncio's `Process.wait()` waits for the pipes."""
    buf = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        if len(buf) <= cap:
            buf += chunk
            if len(buf) > cap:
                over.set()
    return bytes(buf[:cap])


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    # The program may exit (or close stdin) without reading its input: that is its business.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            stream.write(data)
            await stream.drain()
        stream.close()
        await stream.wait_closed()


class Sandbox:
    """Runs `python` programs; `slots` bounds concurrent runs (one host uid per slot)."""

    def __init__(
        self,
        *,
        python: str,
        slots: int,
        uid_base: int,
        bwrap: str = "bwrap",
        allow_unsandboxed: bool = False,
    ):
        self.python = python
        self.bwrap = shutil.which(bwrap)
        if self.bwrap is None and not allow_unsandboxed:
            raise SandboxUnavailable(
                f"bubblewrap ({bwrap!r}) is not installed: install it (`apt-get install bubblewrap`) "
                "or, for local development only, set allow_unsandboxed"
            )
        self.sandboxed = self.bwrap is not None
        self.as_root = os.geteuid() == 0
        # Switching uid in an exec'd helper lets Popen vfork: to switch uid itself it must fork()
        # the whole service process (~3 ms per run at 60 MB resident, more as the service grows).
        # util-linux `nsenter -S uid -G gid` with no namespace option is setgroups([]), setgid,
        # setuid, exec: the same credentials as `setpriv --reuid --regid --clear-groups`, and
        # ~0.5 ms cheaper per run (fewer libraries to load).
        self.nsenter = shutil.which("nsenter") if self.as_root else None
        self.slot_uids: list[int | None] = [uid_base + i if self.as_root else None for i in range(slots)]
        self.uids: asyncio.Queue[int | None] = asyncio.Queue()
        for uid in self.slot_uids:
            self.uids.put_nowait(uid)

    def self_test(self) -> None:
        """Run `print(1)` in a sandbox once, synchronously; raise SandboxUnavailable if it fails."""
        if not self.sandboxed:
            return
        limits = Limits(
            wall_s=10, cpu_s=5, memory_mb=512, fsize_mb=1, nofile=64, nproc=16, output_bytes=4096, tmpfs_mb=1
        )
        fd = _memfd("main.py", b"print(1)\n")
        status_r, status_w = os.pipe()
        try:
            argv, identity = self._as_user(
                self._argv(limits, {"main.py": fd}, status_w, ["main.py"]), self.slot_uids[0]
            )
            proc = subprocess.run(
                argv,
                capture_output=True,
                check=False,
                timeout=limits.wall_s,
                pass_fds=(fd, status_w),
                env=HOST_ENV,
                **identity,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"bubblewrap self-test could not run: {exc}") from exc
        finally:
            os.close(fd)
            os.close(status_w)
            os.close(status_r)
        if proc.returncode != 0 or proc.stdout.strip() != b"1":
            raise SandboxUnavailable(
                "bubblewrap self-test failed (are unprivileged user namespaces enabled?): "
                f"exit {proc.returncode}: {proc.stderr.decode(errors='replace')[-500:]}"
            )

    def _as_user(self, argv: list[str], uid: int | None) -> tuple[list[str], dict]:
        """`argv` and Popen keywords that run it as host uid and gid `uid` with no groups."""
        if uid is None:
            return argv, {}
        if self.nsenter:
            return [self.nsenter, "-S", str(uid), "-G", str(uid), "--", *argv], {}
        return argv, {"user": uid, "group": uid, "extra_groups": []}

    def _python(self, limits: Limits, program: str, args: list[str]) -> list[str]:
        """`python -I -B` running `program` with `args` under `limits` (set by BOOTSTRAP)."""
        rlimits = (
            ("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + CPU_HARD_GRACE_S),
            ("RLIMIT_AS", limits.memory_mb * MB, limits.memory_mb * MB),
            ("RLIMIT_FSIZE", limits.fsize_mb * MB, limits.fsize_mb * MB),
            ("RLIMIT_NOFILE", limits.nofile, limits.nofile),
            ("RLIMIT_NPROC", limits.nproc, limits.nproc),
            ("RLIMIT_CORE", 0, 0),
        )
        table = "(" + "".join(f"(_r.{name}, ({soft}, {hard})), " for name, soft, hard in rlimits) + ")"
        return [self.python, "-I", "-B", "-c", BOOTSTRAP.format(limits=table), program, *args]

    def _argv(self, limits: Limits, fds: dict[str, int], status_fd: int, args: list[str]) -> list[str]:
        argv = [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--json-status-fd",
            str(status_fd),
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--symlink",
            "usr/sbin",
            "/sbin",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(limits.tmpfs_mb << 20),
            "--tmpfs",
            WORKDIR,
        ]
        for name, fd in fds.items():
            argv += ["--ro-bind-data", str(fd), f"{WORKDIR}/{name}"]
        argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR, "--clearenv"]
        for key, value in SANDBOX_ENV.items():
            argv += ["--setenv", key, value]
        program, *rest = (f"{WORKDIR}/{a}" if a in fds else a for a in args)
        return argv + self._python(limits, program, rest)

    async def run(self, files: dict[str, str], args: list[str], stdin: str, limits: Limits) -> RunResult:
        """Run `python -I -B <args>` with `files` in the work dir; `args` naming a file get its path.
        `args[0]` is the program file."""
        uid = await self.uids.get()
        try:
            if self.sandboxed:
                return await self._run_bwrap(files, args, stdin.encode(), limits, uid)
            return await self._run_unsandboxed(files, args, stdin.encode(), limits, uid)
        finally:
            self.uids.put_nowait(uid)

    async def _run_bwrap(self, files, args, stdin: bytes, limits: Limits, uid: int | None) -> RunResult:
        fds = {name: _memfd(name, text.encode()) for name, text in files.items()}
        status_r, status_w = os.pipe()
        os.set_blocking(status_r, False)
        try:
            started = time.monotonic()
            try:
                argv = self._argv(limits, fds, status_w, args)
                proc = await self._spawn(argv, uid, pass_fds=(*fds.values(), status_w))
            finally:  # the child holds its copies; ours must go so EOF can arrive
                for fd in (*fds.values(), status_w):
                    os.close(fd)
            if isinstance(proc, RunResult):
                return proc
            result = await _supervise(proc, stdin, limits, started)
            if result.outcome == "exited" and not _child_exited(_read_all(status_r)):
                # bwrap itself failed (setup or exec): the program never ran to completion.
                result.outcome = "sandbox_error"
                result.error = (
                    result.stderr.decode(errors="replace")[-500:] or f"bwrap exit {result.exit_code}"
                )
            return result
        finally:
            os.close(status_r)

    async def _run_unsandboxed(self, files, args, stdin: bytes, limits: Limits, uid: int | None) -> RunResult:
        """DEVELOPMENT ONLY (`allow_unsandboxed`): rlimits and a private temp dir, no namespaces."""
        with tempfile.TemporaryDirectory(prefix="asyncrl-unsandboxed-") as tmp:
            for name, text in files.items():
                Path(tmp, name).write_text(text)  # noqa: ASYNC240 — development only; a few small files
            if uid is not None:
                for path in [tmp, *(os.path.join(tmp, n) for n in files)]:
                    os.chown(path, uid, uid)
            program, *rest = (os.path.join(tmp, a) if a in files else a for a in args)
            started = time.monotonic()
            proc = await self._spawn(
                self._python(limits, program, rest),
                uid,
                cwd=tmp,
                env={**SANDBOX_ENV, "HOME": tmp, "TMPDIR": tmp},
            )
            if isinstance(proc, RunResult):
                return proc
            return await _supervise(proc, stdin, limits, started)

    async def _spawn(self, argv, uid: int | None, *, pass_fds=(), cwd=None, env=None):
        """The started process, or a `sandbox_error` RunResult if it could not be started.

        Not `asyncio.create_subprocess_exec`: on Python < 3.12 its default child watcher starts
        a thread per process to wait for it, which cost ~6 ms per run on the 2-core dev box (a
        third of the sandbox's overhead then). The exit is watched through a pidfd instead."""
        argv, identity = self._as_user(argv, uid)
        try:
            # Blocking, as inside asyncio's own subprocess support: vfork + exec, ~1 ms.
            popen = subprocess.Popen(  # noqa: ASYNC220
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                start_new_session=True,
                cwd=cwd,
                env=env or HOST_ENV,
                **identity,
            )
        except OSError as exc:
            return RunResult("sandbox_error", None, b"", b"", 0.0, error=f"spawn failed: {exc}")
        try:
            return await _Child.attach(popen)
        except BaseException:  # never leave a started sandbox behind
            _kill_group(popen.pid)
            popen.wait()
            raise


class _Child:
    """A started process with its pipes on the event loop and a future set when it exits."""

    def __init__(self, popen: subprocess.Popen, stdin, stdout, stderr, exited: asyncio.Future):
        self.popen, self.pid = popen, popen.pid
        self.stdin, self.stdout, self.stderr, self.exited = stdin, stdout, stderr, exited

    @classmethod
    async def attach(cls, popen: subprocess.Popen) -> _Child:
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        try:
            pidfd = os.pidfd_open(popen.pid)  # readable once the process has exited
        except OSError:  # kernel < 5.3 or a seccomp filter: wait in a thread instead
            fallback = loop.run_in_executor(None, popen.wait)
            fallback.add_done_callback(lambda _: exited.done() or exited.set_result(None))
        else:

            def on_exit() -> None:
                loop.remove_reader(pidfd)
                os.close(pidfd)
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(pidfd, on_exit)
        stdin_transport, stdin_protocol = await loop.connect_write_pipe(
            lambda: asyncio.streams.FlowControlMixin(loop=loop), popen.stdin
        )
        stdin = asyncio.StreamWriter(stdin_transport, stdin_protocol, None, loop)
        readers = []
        for pipe in (popen.stdout, popen.stderr):
            reader = asyncio.StreamReader(limit=READ_CHUNK, loop=loop)
            await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r, loop=loop), pipe)
            readers.append(reader)
        return cls(popen, stdin, *readers, exited)

    def returncode(self) -> int:
        """Reap the exited process (call after `exited`); negative: killed by that signal."""
        return self.popen.wait()


async def _supervise(proc: _Child, stdin: bytes, limits: Limits, started: float) -> RunResult:
    """Feed stdin, read capped output, enforce the wall clock; kill the process group on any exit path."""
    over = asyncio.Event()
    feeder = asyncio.ensure_future(_feed(proc.stdin, stdin))
    out = asyncio.ensure_future(_read_capped(proc.stdout, limits.output_bytes, over))
    err = asyncio.ensure_future(_read_capped(proc.stderr, limits.output_bytes, over))
    exited = proc.exited
    overflow = asyncio.ensure_future(over.wait())
    outcome = "exited"
    try:
        await asyncio.wait({exited, overflow}, timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED)
        if not exited.done():
            outcome = "output_limit" if over.is_set() else "timeout"
            _kill_group(proc.pid)
        await exited
    finally:
        if not exited.done():  # cancelled by the caller: never leave a sandbox running
            _kill_group(proc.pid)
            await asyncio.shield(exited)
        returncode = proc.returncode()  # only now, reaped: until here the pgid cannot be reused
        overflow.cancel()
        feeder.cancel()
    if over.is_set():
        outcome = "output_limit"
    stdout, stderr = await _collect(out), await _collect(err)
    exit_code = returncode if outcome == "exited" else None
    return RunResult(outcome, exit_code, stdout, stderr, time.monotonic() - started)


async def _collect(task: asyncio.Future) -> bytes:
    # Once the sandbox's pid 1 is dead every writer of the pipes is gone and readers see EOF;
    # the timeout guards against a pipe held open by something outside our control.
    done, _ = await asyncio.wait({task}, timeout=PIPE_DRAIN_TIMEOUT_S)
    if not done:
        task.cancel()
        return b""
    return task.result()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read_all(fd: int) -> bytes:
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, READ_CHUNK):
            chunks.append(chunk)
    return b"".join(chunks)


def _child_exited(status: bytes) -> bool:
    """bwrap's --json-status-fd reports `{"exit-code": N}` only when the sandboxed child ran and exited."""
    for line in status.splitlines():
        with contextlib.suppress(ValueError):
            if "exit-code" in json.loads(line):
                return True
    return False
