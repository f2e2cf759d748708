"""The attack programs of the security tests, written once: each function returns one program's
Python source, for `test_sandbox_attacks.py` (sent as a code item to the code verifier) and
`test_env_tool_attacks.py` (sent as a `python` tool call to the environment endpoint).

Convention: an attack prints PWNED only if it worked, and something else (what stopped it)
otherwise. So the code verifier's test expects the stdout PWNED (a contained attack scores 0),
and a tool call's observation must not contain PWNED. What a program needs from the host (a
port, a path, pids, a marker, a secret) is a parameter; the tests still check the host directly.
"""

from __future__ import annotations

from collections.abc import Iterable


def _hidden(secret: str) -> str:
    """An expression that evaluates to `secret` while the program's source does not contain it
    (a search must not find the secret in its own program)."""
    return f"'{secret[::-1]}'[::-1]"


def infinite_loop() -> str:
    return "while True:\n    pass"


def fork_bomb() -> str:
    """Forks sleeping children until fork fails; worked if it got 1000 of them."""
    return (
        "import os\n"
        "n = 0\n"
        "for _ in range(100000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            import time; time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print('PWNED' if n >= 1000 else f'capped at {n}')"
    )


def memory_bomb() -> str:
    """Allocates 64 MB blocks forever; prints PWNED only if allocation never fails (it can't end)."""
    return "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\nprint('PWNED')"


def output_bomb(filler: str = "PWND") -> str:
    """Writes `filler` to stdout forever. The flood is the attack, never a PWNED line: a tool
    call's observation shows the output, so its filler must not contain PWNED; a code item may
    flood with PWNED itself (the flood can never equal its expected stdout)."""
    return f"import sys\nwhile True:\n    sys.stdout.write({filler!r} * 1000)"


def disk_fill() -> str:
    """Writes 1 MB at a time into every writable place it finds; worked if 200 MB got written."""
    return (
        "written = 0\n"
        "for target in ['/work', '/tmp', '/dev/shm', '/']:\n"
        "    for i in range(64):\n"
        "        try:\n"
        "            with open(f'{target}/fill{i}', 'wb') as f:\n"
        "                for _ in range(16):\n"
        "                    f.write(b'x' * (1 << 20)); written += 1 << 20\n"
        "        except OSError:\n"
        "            break\n"
        "print('PWNED' if written >= 200 << 20 else f'wrote {written >> 20} MB')"
    )


def loopback_egress(port: int) -> str:
    """Connects to the host's 127.0.0.1:`port` and sends a little; prints `blocked ...` otherwise."""
    return (
        "import socket\n"
        "try:\n"
        f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    s.sendall(b'exfiltrated')\n"
        "    print('PWNED')\n"
        "except OSError as e:\n"
        "    print('blocked', e)"
    )


def write_outside_workdir(host_file: str) -> str:
    """Writes `host_file` (a host path) and system paths; prints `nothing written` otherwise."""
    return (
        "wrote = []\n"
        f"for path in [{host_file!r}, '/usr/pwned', '/pwned', '/etc/pwned', '/proc/pwned', '/dev/pwned']:\n"
        "    try:\n"
        "        open(path, 'w').write('x'); wrote.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('PWNED' if wrote else 'nothing written')"
    )


def read_service_secrets(secret_env: str) -> str:
    """Looks for the service's environment variable `secret_env` (by name) in its own environment
    and every readable /proc/*/environ, and for the host's /etc/passwd and root's shell history;
    prints `no secret` otherwise."""
    return (
        "import os, glob\n"
        "seen = ' '.join(os.environ)\n"
        "for path in glob.glob('/proc/*/environ') + ['/etc/passwd', '/root/.bash_history']:\n"
        "    try:\n"
        "        seen += open(path, 'rb').read().decode(errors='ignore')\n"
        "    except OSError:\n"
        "        pass\n"
        f"print('PWNED' if {secret_env!r} in seen or 'root:' in seen else 'no secret')"
    )


def kill_host_processes(pids: Iterable[int]) -> str:
    """SIGKILLs each of the host's `pids`, then -1 (everything it may) and 1; worked if one of
    `pids` took the signal; prints `nothing killed` otherwise."""
    return (
        "import os, signal\n"
        "killed = False\n"
        f"for pid in {[*pids, -1, 1]!r}:\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL); killed = killed or pid not in (-1, 1)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('PWNED' if killed else 'nothing killed')"
    )


def leave_background_process(marker: str, then_print: str) -> str:
    """Starts a detached 60 s sleeper (its command line carries `marker`) in a new session, then
    prints `then_print`: the attack is the leftover process, which the test looks for on the
    host by `marker`, not the program's output."""
    return (
        "import os, subprocess\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    subprocess.Popen(['/usr/bin/python3', '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    os._exit(0)\n"
        f"print({then_print!r})"
    )


def write_secret_and_wait(secret: str, seconds: float) -> str:
    """The victim of `find_concurrent_runs_file`: writes `secret` into /work/secret.txt, stays
    alive `seconds`, then prints `ok`."""
    return (
        f"import time\nopen('/work/secret.txt', 'w').write({secret!r})\ntime.sleep({seconds!r})\nprint('ok')"
    )


def find_concurrent_runs_file(secret: str, search_s: float) -> str:
    """The thief: it cannot see the victim to wait for its file, so it searches the whole tree
    (and other processes' roots and cwds through /proc) for `secret` again and again for
    `search_s` seconds; prints `not found in N files, M searches` otherwise."""
    return (
        "import glob, os, time\n"
        f"needle = {_hidden(secret)}\n"
        "def search():\n"
        "    candidates = glob.glob('/proc/*/root/work/*') + glob.glob('/proc/*/cwd/*')\n"
        "    for dirpath, dirs, files in os.walk('/'):\n"
        "        dirs[:] = [d for d in dirs if dirpath != '/' or d not in ('proc', 'sys', 'dev', 'usr')]\n"
        "        candidates += [os.path.join(dirpath, name) for name in files]\n"
        "    found = False\n"
        "    for path in candidates:\n"
        "        try:\n"
        "            found = found or needle in open(path, errors='ignore').read(4096)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return found, len(candidates)\n"
        f"deadline, searches = time.monotonic() + {search_s!r}, 0\n"
        "while True:\n"
        "    found, n = search(); searches += 1\n"
        "    if found or time.monotonic() > deadline: break\n"
        "    time.sleep(0.05)\n"
        "print('PWNED' if found else f'not found in {n} files, {searches} searches')"
    )


def leave_secret_file(secret: str) -> str:
    """The earlier call of `find_earlier_calls_file`: writes `secret` into /work/left.txt and
    prints `written`."""
    return f"open('/work/left.txt', 'w').write({secret!r})\nprint('written')"


def find_earlier_calls_file(secret: str) -> str:
    """Searches the whole tree once for `secret`, left by an earlier run; prints `not found` otherwise."""
    return (
        "import os\n"
        f"needle = {_hidden(secret)}\n"
        "found = False\n"
        "for dirpath, dirs, files in os.walk('/'):\n"
        "    dirs[:] = [d for d in dirs if dirpath != '/' or d not in ('proc', 'sys', 'dev', 'usr')]\n"
        "    for name in files:\n"
        "        try:\n"
        "            found = found or needle in open(os.path.join(dirpath, name), errors='ignore').read(4096)\n"
        "        except OSError:\n"
        "            pass\n"
        "print('PWNED' if found else 'not found')"
    )


def raise_rlimits() -> str:
    """Checks that each rlimit is set and tries to raise it back to unlimited; prints `held` otherwise."""
    return (
        "import resource as r\n"
        "names = ['RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_NPROC', 'RLIMIT_CORE']\n"
        "raised = []\n"
        "for name in names:\n"
        "    key = getattr(r, name)\n"
        "    soft, hard = r.getrlimit(key)\n"
        "    if hard == r.RLIM_INFINITY or soft == r.RLIM_INFINITY:\n"
        "        raised.append(name + ' not set')\n"
        "    try:\n"
        "        r.setrlimit(key, (r.RLIM_INFINITY, r.RLIM_INFINITY))\n"
        "        raised.append(name)\n"
        "    except (ValueError, OSError):\n"
        "        pass\n"
        "print('PWNED' if raised else 'held')"
    )
