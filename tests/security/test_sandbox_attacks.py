"""One test per attack on the code sandbox, each through the real service (HTTP, bubblewrap).

Pattern: an attack program prints a marker only if the attack worked, and the test's expected
stdout is that marker; so "the attack failed" reads as reward 0 with a per-test status, and a
sandbox that let the attack through would score 1. Each test also checks the host directly
(files, processes, listener, disk) and that the service then answers a normal request right.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

from sandbox_host import SECRET_ENV, sandbox_pids
from waiting import wait_until


def score(client, program: str, expected: str = "PWNED", *, stdin: str = "", **spec) -> dict:
    spec = {"verifier": "code", "tests": [{"stdin": stdin, "stdout": expected}], "timeout_s": 2, **spec}
    body = {"items": [{"id": "attack", "completion": f"```python\n{program}\n```", "spec": spec}]}
    reply = client.post("/v1/rewards", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["results"][0]


def test_status(result: dict) -> str:
    return result["details"]["tests"][0]["status"]


test_status.__test__ = False  # a helper, not a test


def assert_attack_failed(result: dict, *statuses: str) -> None:
    assert result["status"] == "scored", result
    assert result["reward"] == 0.0, result
    if statuses:
        assert test_status(result) in statuses, result


def assert_host_clean_and_serving(client) -> None:
    wait_until(lambda: not sandbox_pids(), timeout=5, interval=0.05, message="the sandbox processes are gone")
    assert sandbox_pids() == [], "sandbox processes survived their run"
    assert client.get("/healthz").json()["status"] == "ok"
    ok = score(client, "a, b = map(int, input().split())\nprint(a + b)", "5", stdin="2 3")
    assert (ok["status"], ok["reward"]) == ("scored", 1.0), ok


def test_infinite_loop_is_killed_at_the_deadline(client):
    started = time.monotonic()
    result = score(client, "while True:\n    pass", timeout_s=1)
    assert_attack_failed(result, "timeout")
    assert time.monotonic() - started < 10
    assert_host_clean_and_serving(client)


def test_fork_bomb_is_capped_by_the_process_limit(client):
    program = (
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
    result = score(client, program)
    assert_attack_failed(result, "failed", "timeout")
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    assert_host_clean_and_serving(client)


def test_memory_bomb_hits_the_address_space_limit(client):
    program = "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\nprint('PWNED')"
    result = score(client, program, memory_mb=256)
    assert_attack_failed(result, "memory")
    assert_host_clean_and_serving(client)


def test_disk_fill_is_capped_and_leaves_the_host_disk_alone(client):
    free_before = shutil.disk_usage("/tmp").free
    program = (
        "import os\n"
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
    result = score(client, program, timeout_s=5)
    assert_attack_failed(result, "failed")
    assert free_before - shutil.disk_usage("/tmp").free < 100 << 20
    assert_host_clean_and_serving(client)


def test_output_bomb_is_cut_at_the_cap(client):
    result = score(client, "import sys\nwhile True:\n    sys.stdout.write('PWNED' * 1000)")
    assert_attack_failed(result, "output_limit")
    assert_host_clean_and_serving(client)


def test_network_egress_to_host_loopback_is_impossible(client):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port, connections, stop = listener.getsockname()[1], [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connections.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    program = (
        "import socket\n"
        "try:\n"
        f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    s.sendall(b'exfiltrated')\n"
        "    print('PWNED')\n"
        "except OSError as e:\n"
        "    print('blocked', e)"
    )
    try:
        result = score(client, program)
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert_attack_failed(result, "failed")
    assert connections == []
    assert_host_clean_and_serving(client)


def test_writing_outside_the_work_dir_fails(client):
    host_file = Path(f"/tmp/asyncrl-sandbox-escape-{uuid.uuid4().hex}")
    program = (
        "wrote = []\n"
        f"for path in ['{host_file}', '/usr/pwned', '/pwned', '/etc/pwned', '/proc/pwned', '/dev/pwned']:\n"
        "    try:\n"
        "        open(path, 'w').write('x'); wrote.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('PWNED' if wrote else 'nothing written')"
    )
    result = score(client, program)
    assert_attack_failed(result, "failed")
    assert not host_file.exists()
    assert not Path("/usr/pwned").exists() and not Path("/pwned").exists()
    assert_host_clean_and_serving(client)


def test_reading_another_concurrent_runs_files_fails(client):
    secret = uuid.uuid4().hex
    victim = f"import time\nopen('/work/secret.txt', 'w').write('{secret}')\ntime.sleep(2.5)\nprint('ok')"
    # The thief cannot see the victim to wait for its file: it searches again and again for 2 s
    # of the victim's 2.5 s life, so it has looked after the file was written.
    thief = (
        "import glob, os, time\n"
        f"needle = '{secret[::-1]}'[::-1]\n"  # the thief's own source must not contain the secret
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
        "deadline, searches = time.monotonic() + 2.0, 0\n"
        "while True:\n"
        "    found, n = search(); searches += 1\n"
        "    if found or time.monotonic() > deadline: break\n"
        "    time.sleep(0.05)\n"
        "print('PWNED' if found else f'not found in {n} files, {searches} searches')"
    )
    spec = {"verifier": "code", "timeout_s": 4}
    body = {
        "items": [
            {"id": "victim", "completion": victim, "spec": {**spec, "tests": [{"stdout": "ok"}]}},
            {"id": "thief", "completion": thief, "spec": {**spec, "tests": [{"stdout": "PWNED"}]}},
        ]
    }
    results = {r["id"]: r for r in client.post("/v1/rewards", json=body).json()["results"]}
    assert (results["victim"]["status"], results["victim"]["reward"]) == ("scored", 1.0), results
    assert_attack_failed(results["thief"], "failed")
    assert_host_clean_and_serving(client)


def test_killing_processes_outside_the_sandbox_fails(client):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        program = (
            "import os, signal\n"
            "killed = False\n"
            f"for pid in [{victim.pid}, {os.getpid()}, -1, 1]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL); killed = killed or pid not in (-1, 1)\n"
            "    except OSError:\n"
            "        pass\n"
            "print('PWNED' if killed else 'nothing killed')"
        )
        result = score(client, program)
        assert_attack_failed(result)
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        victim.kill()
        victim.wait()
    assert_host_clean_and_serving(client)


def test_background_process_does_not_outlive_the_run(client):
    marker = f"asyncrl-orphan-{uuid.uuid4().hex}"
    program = (
        "import os, subprocess\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    subprocess.Popen(['/usr/bin/python3', '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "    os._exit(0)\n"
        "print('PWNED')"  # the program itself "passes": the attack is the leftover process
    )
    result = score(client, program)
    assert result["status"] == "scored"
    time.sleep(0.5)  # time is the subject: a leaked process gets this long to show up
    survivors = [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker.encode() in _read(p)]
    assert survivors == []
    assert_host_clean_and_serving(client)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_service_environment_secrets_are_not_visible(client):
    assert os.environ.get(SECRET_ENV)  # the service (this process) holds the secret
    program = (
        "import os, glob\n"
        "seen = ' '.join(os.environ)\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        seen += open(path, 'rb').read().decode(errors='ignore')\n"
        "    except OSError:\n"
        "        pass\n"
        f"print('PWNED' if '{SECRET_ENV}' in seen else 'no secret')"
    )
    result = score(client, program)
    assert_attack_failed(result, "failed")
    assert_host_clean_and_serving(client)


def test_early_exit_cannot_fake_assert_code(client):
    # Split asserts (the calls run in the sandbox) and asserts run as written (a setup line).
    for assert_code, error in [
        ("assert add(2, 2) == 5", "no result line"),
        ("four = add(2, 2)\nassert four == 5", "sentinel missing"),
    ]:
        for exit_call in ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit(0)"]:
            spec = {"verifier": "code", "assert_code": assert_code, "timeout_s": 2}
            completion = f"def add(a, b):\n    return a + b\n{exit_call}"
            body = {"items": [{"id": "x", "completion": completion, "spec": spec}]}
            result = client.post("/v1/rewards", json=body).json()["results"][0]
            assert_attack_failed(result, "failed")
            assert error in result["details"]["tests"][0]["error"]
    honest = {"verifier": "code", "assert_code": "assert add(2, 2) == 4", "timeout_s": 2}
    body = {"items": [{"id": "y", "completion": "def add(a, b):\n    return a + b", "spec": honest}]}
    assert client.post("/v1/rewards", json=body).json()["results"][0]["reward"] == 1.0
    assert_host_clean_and_serving(client)


def test_raising_the_rlimits_back_fails(client):
    # The limits are set inside the sandbox by a bootstrap before the program runs: they must be
    # in force and the program must not be able to raise any of them again.
    program = (
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
    result = score(client, program)
    assert_attack_failed(result, "failed")
    assert_host_clean_and_serving(client)


def test_rewriting_the_assert_tests_fails(client):
    # solution.py runs before tests.py is read: overwriting (or replacing) tests.py must fail.
    completion = (
        "import os\n"
        "for attempt in (lambda: open('tests.py', 'w').write('pass\\n'),\n"
        "                lambda: os.replace('solution.py', 'tests.py'),\n"
        "                lambda: os.remove('tests.py')):\n"
        "    try:\n"
        "        attempt()\n"
        "    except OSError:\n"
        "        pass\n"
        "def add(a, b):\n"
        "    return a + b\n"
    )
    spec = {"verifier": "code", "assert_code": "assert add(2, 2) == 5", "timeout_s": 2}
    body = {"items": [{"id": "x", "completion": completion, "spec": spec}]}
    result = client.post("/v1/rewards", json=body).json()["results"][0]
    assert_attack_failed(result, "failed")
    assert_host_clean_and_serving(client)
