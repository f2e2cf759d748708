"""`[launch] core_share` (services/ops/launcher.py `Launcher.core_share`, `core_share_env`): which
topologies share cores, the one file the engine and the trainer are pointed at, and that the
settings each of them reads from its environment name that file. Built without starting
anything; the machine's core count is set per test (`launcher.cpu_count`), and no GPU is
visible (CUDA_VISIBLE_DEVICES=""), so the results hold on any machine."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from asyncrl.services.engine.config import EngineSettings
from asyncrl.services.ops import launcher as launcher_module
from asyncrl.services.ops.launcher import AUTO_CORE_SHARE_MAX_CORES, Launcher
from asyncrl.services.ops.run_config import load_run_config, validate_run_config
from asyncrl.trainer.config import TrainerSettings

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo.toml"
ENGINE_VAR, TRAINER_VAR = "ASYNCRL_ENGINE_CORE_SHARE", "ASYNCRL_TRAINER_CORE_SHARE"


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A CPU machine of `machine(cores)` cores, the demo's relative run directory under tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: placement asks no nvidia-smi
    for var in (ENGINE_VAR, TRAINER_VAR):
        monkeypatch.delenv(var, raising=False)

    def cores(n: int) -> None:
        monkeypatch.setattr(launcher_module, "cpu_count", lambda: n)

    return cores


def demo_launcher(tmp_path, **launch) -> Launcher:
    raw = tomllib.loads(DEMO.read_text())
    raw["launch"].update({"core_share": "auto", **launch})  # the demo's own setting is off (measured)
    path = tmp_path / "run.toml"
    return Launcher(validate_run_config(raw, path), path, echo=False)


def process_env(launcher: Launcher) -> dict[str, dict[str, str]]:
    """Per process `plan()` would start: the core-share variables its environment gets."""
    return {
        p.name: {k: v for k, v in p.env.items() if k in (ENGINE_VAR, TRAINER_VAR)}
        for stage in launcher.plan()
        for p in stage
    }


def test_the_demo_on_a_small_machine_points_engine_and_trainer_at_one_file(tmp_path, machine, monkeypatch):
    machine(2)
    cfg = load_run_config(DEMO)
    assert cfg.launch.core_share == "off"  # measured slower on the tiny model (benchmarks/RESULTS.md)
    assert Launcher(cfg, DEMO, echo=False).core_share is False
    cfg.launch.core_share = "auto"
    up = Launcher(cfg, DEMO, echo=False)
    assert up.core_share is True
    cores = str(tmp_path / "runs" / "demo" / "cores")  # [run] dir = "runs/demo", from the working directory
    assert up.core_share_env() == {"engine": {ENGINE_VAR: cores}, "trainer": {TRAINER_VAR: cores}}
    env = process_env(up)
    assert env == {
        "reward-0": {},
        "engine-0": {ENGINE_VAR: cores},
        "rollout-0": {},
        "trainer": {TRAINER_VAR: cores},
    }
    # Each process's settings read the file from the variable it is given.
    monkeypatch.setenv(ENGINE_VAR, cores)
    monkeypatch.setenv(TRAINER_VAR, cores)
    assert EngineSettings(model="m").core_share == cores
    assert TrainerSettings(model_path="m").core_share == cores


@pytest.mark.parametrize(
    ("cores", "shared"),
    [(1, True), (AUTO_CORE_SHARE_MAX_CORES, True), (AUTO_CORE_SHARE_MAX_CORES + 1, False)],
)
def test_auto_shares_only_on_a_machine_of_at_most_four_cores(tmp_path, machine, cores, shared):
    machine(cores)
    up = demo_launcher(tmp_path)
    assert up.core_share is shared
    assert bool(up.core_share_env()) is shared
    assert {k: v for k, v in process_env(up).items() if v} == (
        {
            "engine-0": {ENGINE_VAR: str(up.run_dir / "cores")},
            "trainer": {TRAINER_VAR: str(up.run_dir / "cores")},
        }
        if shared
        else {}
    )


def test_off_shares_nothing_and_on_shares_on_any_machine(tmp_path, machine):
    machine(2)
    up = demo_launcher(tmp_path, core_share="off")
    assert up.core_share is False and up.core_share_env() == {}
    assert all(v == {} for v in process_env(up).values())
    machine(64)
    up = demo_launcher(tmp_path, core_share="on")
    assert up.core_share is True and set(up.core_share_env()) == {"engine", "trainer"}


@pytest.mark.parametrize(
    "launch",
    [
        {"engines": 2},
        {"trainer_nproc_per_node": 2},
        {"engine_urls": ["http://10.0.0.2:30000"]},
        {"trainer": False},
    ],
    ids=["two_engines", "two_trainer_ranks", "external_engine", "no_trainer"],
)
def test_on_is_refused_where_there_is_not_one_engine_and_one_trainer_rank(tmp_path, machine, launch):
    machine(2)
    up = demo_launcher(tmp_path, core_share="on", **launch)
    with pytest.raises(
        RuntimeError, match=r"core_share = on needs one reference engine and a one-rank trainer"
    ):
        up.core_share_env()
    with pytest.raises(RuntimeError, match="core_share"):
        up.plan()
    # auto, on the same machine, simply does not share
    assert demo_launcher(tmp_path, core_share="auto", **launch).core_share is False
