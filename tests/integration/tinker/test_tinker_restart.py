"""A restart of `asyncrl tinker` mid-session (the process killed with SIGKILL, a new one started on
the same Redis): futures issued by the dead process resolve or fail with a message saying why,
and no command is applied twice (the optimizer's step count says so). The SDK's session, its
training client and its seq ids go on across the restart.

Two restarts, each deterministic: a command held behind a missing seq id is unfinished when the
process dies. First with nothing applied since a clean checkpoint (the model is rebuilt from it
and the held command runs once); then with a forward_backward applied after it (that state is
gone: the held command fails naming the checkpoint to resume from, and the SDK resumes there)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tomli_w
from engine_server import free_port
from tinker import types
from tinker_stack import BASE, optim_body, wait_future
from waiting import wait_until

pytestmark = pytest.mark.extended  # three service processes, each importing torch: ~40 s


def start_service(config: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.services.ops.cli", "tinker", "--config", str(config)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )

    def up() -> bool:
        assert proc.poll() is None, f"the service exited: {log.read_text()[-2000:]}"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, message="the tinker service answers /healthz", timeout=120)
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_restart_resolves_or_fails_pending_futures_and_applies_nothing_twice(
    redis_server, tiny, tmp_path, run_id
):
    import tinker

    port = free_port()
    config = tmp_path / "tinker.toml"
    table = {
        "port": port, "redis_url": redis_server.url, "namespace": run_id, "base_models": {BASE: str(tiny)},
        "weights_root": str(tmp_path / "weights"), "checkpoints_root": str(tmp_path / "checkpoints"),
        "poll_hold_s": 2.0, "gap_timeout_s": 600.0,
    }  # fmt: skip
    config.write_text(tomli_w.dumps({"tinker": table}))
    log = tmp_path / "service.log"
    url = f"http://127.0.0.1:{port}"
    proc = start_service(config, port, log)
    sdk = tinker.ServiceClient(base_url=url, api_key="tml-restart-test")
    try:
        client = sdk.create_lora_training_client(base_model=BASE, rank=4, seed=21).result(timeout=120)
        mid = client.model_id
        tokens = client.get_tokenizer().encode("the cat sat on the mat")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        for _ in range(2):  # seq 1-4
            client.forward_backward([datum], "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
        checkpoint = client.save_state("ck").result(timeout=120).path  # seq 5: clean (no gradients pending)
        with httpx.Client(base_url=url, timeout=60) as http:
            held = http.post("/api/v1/optim_step", json=optim_body(mid, 7)).json()[
                "request_id"
            ]  # waits for 6
            assert wait_future(http, held, timeout=1).status_code == 408

        # Restart 1: nothing applied since the checkpoint -> rebuilt there; the held step runs once.
        kill(proc)
        proc = start_service(config, port, log)
        assert (
            client.forward_backward([datum], "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0
        )  # seq 6
        with httpx.Client(base_url=url, timeout=60) as http:
            assert wait_future(http, held).json()["metrics"]["step"] == 3.0  # 2 before the kill + this one
        assert (
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120).metrics["step"] == 3.0
        )  # seq 8: no gradients left, no step

        # Restart 2: a forward_backward applied after the checkpoint is lost with the process.
        client.forward_backward([datum], "cross_entropy").result(timeout=120)  # seq 9
        with httpx.Client(base_url=url, timeout=60) as http:
            held = http.post("/api/v1/optim_step", json=optim_body(mid, 11)).json()[
                "request_id"
            ]  # waits for 10
            kill(proc)
            proc = start_service(config, port, log)
            failed = wait_future(http, held).json()
            assert failed["category"] == "server"
            assert failed["error"].startswith(
                f"not applied: the tinker service restarted and the in-memory state of model {mid}"
            )
            assert checkpoint in failed["error"]
        with pytest.raises(tinker.APIStatusError) as refused:
            client.forward_backward([datum], "cross_entropy").result(timeout=120)  # seq 10: the model is gone
        assert refused.value.status_code == 410 and checkpoint in str(refused.value)
        # The SDK resumes from the checkpoint the message names: its weights and optimizer state.
        resumed = sdk.create_training_client_from_state_with_optimizer(checkpoint).result(timeout=120)
        resumed.forward_backward([datum], "cross_entropy")
        assert (
            resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120).metrics["step"]
            == 3.0
        )
    finally:
        sdk.close("success")
        kill(proc)
