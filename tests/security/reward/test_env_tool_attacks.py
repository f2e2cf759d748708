"""The sandbox attacks of `test_sandbox_attacks.py`, made as `python` tool calls through the
environment endpoint (`POST /v1/environments/python/step`) of the same real service (HTTP,
bubblewrap; `conftest.py`).

Same pattern and the same programs (`attacks.py`): an attack prints PWNED only if it worked, so "contained" reads as an observation
without PWNED and the status the limit gives; each test also checks the host directly, and
that the service then answers both a normal tool call and a normal code item right. The tool's
sandbox has host uids of its own, right after the code verifier's (`build_environments`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import attacks
import pytest
from sandbox_host import SECRET_ENV, SLOTS, UID_BASE, loopback_listener, pids_with_uids
from test_sandbox_attacks import _read, assert_host_clean_and_serving
from waiting import wait_until

from asyncrl.services.reward.config import RewardSettings

# conftest.py's service keeps the defaults of the tool's settings
TOOL_SLOTS = RewardSettings.model_fields["env_python_concurrency"].default
TOOL_TIMEOUT_S = RewardSettings.model_fields["env_python_timeout_s"].default


def run_tool(client, code: str) -> dict:
    action = {"tool_call": {"name": "python", "arguments": {"code": code}}}
    body = {"episode_id": "attack", "turn": 0, "action": action}
    reply = client.post("/v1/environments/python/step", json=body)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert not result["mask_sample"], (
        result
    )  # an attack is the program's doing, never the environment's failure
    return result


def assert_contained(result: dict, *statuses: str) -> None:
    assert "PWNED" not in result["observation"], result
    assert not result["done"] and result["reward"] is None
    if statuses:
        assert result["status"] in statuses, result


def tool_sandbox_pids() -> list[int]:
    """Host processes running as one of the tool sandbox's uids."""
    return pids_with_uids(UID_BASE + SLOTS, TOOL_SLOTS)


def assert_clean_and_serving(client) -> None:
    wait_until(
        lambda: not tool_sandbox_pids(), timeout=5, interval=0.05, message="the tool's processes are gone"
    )
    ok = run_tool(client, "print(sum(range(10)))")
    assert (ok["status"], ok["observation"]) == ("ok", "45\n"), ok
    assert_host_clean_and_serving(client)


def test_tool_runs_as_its_own_unprivileged_host_uid(client):
    if os.geteuid() != 0:
        pytest.skip("the uid drop happens only when the service runs as root")
    seen: list[dict] = []
    sleeper = "import time\ntime.sleep(2)\nprint('done')"
    call = threading.Thread(target=lambda: seen.append(run_tool(client, sleeper)))
    call.start()
    try:
        pids = wait_until(tool_sandbox_pids, timeout=10, interval=0.02, message="the tool's program runs")
        assert pids, "the tool's program is not running under a tool sandbox uid"
    finally:
        call.join()
    assert seen[0]["observation"] == "done\n"
    assert_clean_and_serving(client)


def test_infinite_loop_is_killed_at_the_deadline(client):
    started = time.monotonic()
    result = run_tool(client, attacks.infinite_loop())
    assert_contained(result, "timeout")
    assert result["observation"] == f"[killed: time limit of {TOOL_TIMEOUT_S:g} s]"
    assert time.monotonic() - started < TOOL_TIMEOUT_S + 10
    assert_clean_and_serving(client)


def test_fork_bomb_is_capped_by_the_process_limit(client):
    result = run_tool(client, attacks.fork_bomb())
    assert_contained(result, "ok", "timeout")
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    assert_clean_and_serving(client)


def test_memory_bomb_hits_the_address_space_limit(client):
    result = run_tool(client, attacks.memory_bomb())
    assert_contained(result, "tool_error")
    assert "MemoryError" in result["observation"]
    assert_clean_and_serving(client)


def test_output_bomb_is_cut_at_the_cap(client):
    result = run_tool(client, attacks.output_bomb())
    assert_contained(result, "tool_error")
    assert "[killed: output past" in result["observation"] and len(result["observation"]) < 64 * 1024
    assert_clean_and_serving(client)


def test_disk_fill_is_capped_and_leaves_the_host_disk_alone(client):
    free_before = shutil.disk_usage("/tmp").free
    result = run_tool(client, attacks.disk_fill())
    assert_contained(result, "ok")
    assert free_before - shutil.disk_usage("/tmp").free < 100 << 20
    assert_clean_and_serving(client)


def test_network_egress_to_host_loopback_is_impossible(client):
    with loopback_listener() as (port, connections):
        result = run_tool(client, attacks.loopback_egress(port))
    assert_contained(result, "ok")
    assert result["observation"].startswith("blocked")
    assert connections == []
    assert_clean_and_serving(client)


def test_writing_outside_the_work_dir_fails(client):
    host_file = Path(f"/tmp/asyncrl-tool-escape-{uuid.uuid4().hex}")
    result = run_tool(client, attacks.write_outside_workdir(str(host_file)))
    assert_contained(result, "ok")
    assert result["observation"] == "nothing written\n"
    assert not host_file.exists() and not Path("/usr/pwned").exists() and not Path("/pwned").exists()
    assert_clean_and_serving(client)


def test_service_environment_secrets_are_not_visible(client):
    assert os.environ.get(SECRET_ENV)  # the service (this process) holds the secret
    result = run_tool(client, attacks.read_service_secrets(SECRET_ENV))
    assert_contained(result, "ok")
    assert result["observation"] == "no secret\n"
    assert_clean_and_serving(client)


def test_killing_processes_outside_the_sandbox_fails(client):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        result = run_tool(client, attacks.kill_host_processes([victim.pid, os.getpid()]))
        assert_contained(result)
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        victim.kill()
        victim.wait()
    assert_clean_and_serving(client)


def test_background_process_does_not_outlive_the_call(client):
    marker = f"asyncrl-tool-orphan-{uuid.uuid4().hex}"
    result = run_tool(client, attacks.leave_background_process(marker, then_print="spawned"))
    assert result["status"] == "ok"
    time.sleep(0.5)  # time is the subject: a leaked process gets this long to show up
    survivors = [p for p in Path("/proc").glob("[0-9]*/cmdline") if marker.encode() in _read(p)]
    assert survivors == []
    assert_clean_and_serving(client)


def test_a_call_cannot_see_an_earlier_calls_files(client):
    secret = uuid.uuid4().hex
    first = run_tool(client, attacks.leave_secret_file(secret))
    assert first["observation"] == "written\n"
    result = run_tool(client, attacks.find_earlier_calls_file(secret))
    assert_contained(result, "ok")
    assert result["observation"] == "not found\n"
    assert_clean_and_serving(client)
