"""`asyncrl up` refuses to start a topology when another process already listens on one of
its planned ports (this test holds a real listening socket)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from asyncrl.services.ops.launcher import Launcher
from asyncrl.services.ops.run_config import RunConfig


def test_launcher_refuses_a_port_another_process_holds(tmp_path):
    """A leftover service on a planned port would answer the health check for the new one."""
    import socket

    raw = tomllib.loads((Path(__file__).resolve().parents[3] / "configs" / "demo.toml").read_text())
    raw["run"].update(redis_url="redis://127.0.0.1:1/0", dir=str(tmp_path / "run"))
    raw["model"]["path"] = str(tmp_path / "base")
    from rollout_server import free_port

    raw["launch"].update(engine_port=free_port(), reward_port=free_port(), rollout_port=free_port())
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        raw["launch"]["trainer_metrics_port"] = held.getsockname()[1]
        launcher = Launcher(RunConfig.model_validate(raw), tmp_path / "x.toml", echo=False)
        with pytest.raises(RuntimeError, match=f"port {held.getsockname()[1]} for trainer is already in use"):
            launcher.start()
    assert launcher.procs == [] and not (tmp_path / "base").exists()  # refused before anything ran
