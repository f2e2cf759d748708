"""One test per attack on the code sandbox, each through the real service (HTTP, bubblewrap).

Pattern: an attack program (`attacks.py`) prints PWNED only if the attack worked, and the test's
expected stdout is that marker; so "the attack failed" reads as reward 0 with a per-test status, and a
sandbox that let the attack through would score 1. Each test also checks the host directly
(files, processes, listener, disk) and that the service then answers a normal request right.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import attacks
from sandbox_host import SECRET_ENV, loopback_listener, sandbox_pids
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
    result = score(client, attacks.infinite_loop(), timeout_s=1)
    assert_attack_failed(result, "timeout")
    assert time.monotonic() - started < 10
    assert_host_clean_and_serving(client)


def test_fork_bomb_is_capped_by_the_process_limit(client):
    result = score(client, attacks.fork_bomb())
    assert_attack_failed(result, "failed", "timeout")
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    assert_host_clean_and_serving(client)


def test_memory_bomb_hits_the_address_space_limit(client):
    result = score(client, attacks.memory_bomb(), memory_mb=256)
    assert_attack_failed(result, "memory")
    assert_host_clean_and_serving(client)


def test_disk_fill_is_capped_and_leaves_the_host_disk_alone(client):
    free_before = shutil.disk_usage("/tmp").free
    result = score(client, attacks.disk_fill(), timeout_s=5)
    assert_attack_failed(result, "failed")
    assert free_before - shutil.disk_usage("/tmp").free < 100 << 20
    assert_host_clean_and_serving(client)


def test_output_bomb_is_cut_at_the_cap(client):
    result = score(client, attacks.output_bomb("PWNED"))
    assert_attack_failed(result, "output_limit")
    assert_host_clean_and_serving(client)


def test_network_egress_to_host_loopback_is_impossible(client):
    with loopback_listener() as (port, connections):
        result = score(client, attacks.loopback_egress(port))
    assert_attack_failed(result, "failed")
    assert connections == []
    assert_host_clean_and_serving(client)


def test_writing_outside_the_work_dir_fails(client):
    host_file = Path(f"/tmp/asyncrl-sandbox-escape-{uuid.uuid4().hex}")
    result = score(client, attacks.write_outside_workdir(str(host_file)))
    assert_attack_failed(result, "failed")
    assert not host_file.exists()
    assert not Path("/usr/pwned").exists() and not Path("/pwned").exists()
    assert_host_clean_and_serving(client)


def test_reading_another_concurrent_runs_files_fails(client):
    secret = uuid.uuid4().hex
    victim = attacks.write_secret_and_wait(secret, 2.5)
    # The thief cannot see the victim to wait for its file: it searches again and again for 2 s
    # of the victim's 2.5 s life, so it has looked after the file was written.
    thief = attacks.find_concurrent_runs_file(secret, 2.0)
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
        result = score(client, attacks.kill_host_processes([victim.pid, os.getpid()]))
        assert_attack_failed(result)
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        victim.kill()
        victim.wait()
    assert_host_clean_and_serving(client)


def test_background_process_does_not_outlive_the_run(client):
    marker = f"asyncrl-orphan-{uuid.uuid4().hex}"
    # the program itself "passes" (prints PWNED): the attack is the leftover process
    result = score(client, attacks.leave_background_process(marker, then_print="PWNED"))
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
    result = score(client, attacks.read_service_secrets(SECRET_ENV))
    assert_attack_failed(result, "failed")
    assert_host_clean_and_serving(client)


def test_early_exit_cannot_fake_assert_code(client):
    # Split asserts (the calls run in the sandbox) and asserts run as written (a bare call).
    for assert_code, error in [
        ("assert add(2, 2) == 5", "no result line"),
        ("print(add(2, 2))\nassert add(2, 2) == 5", "sentinel missing"),
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
    result = score(client, attacks.raise_rlimits())
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
