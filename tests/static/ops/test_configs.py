"""Every shipped run config validates whole (services/ops/run_config.py) and against every
service's own settings loader, so a config and the code cannot drift apart unnoticed."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from asyncrl.services.ops.launcher import Launcher
from asyncrl.services.ops.run_config import RunConfig, load_run_config, validate_run_config
from asyncrl.services.runtime.config import load_settings

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
RUN_CONFIGS = [c for c in CONFIGS if "example" not in c.name]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates_whole(path):
    config = load_run_config(path)
    if path in RUN_CONFIGS:  # what `asyncrl up` and `asyncrl demo` read
        assert load_run_config(path, require=("model",)).model == config.model is not None


def test_the_k8s_run_config_validates_whole():
    configmap = yaml.safe_load((ROOT / "deploy/k8s/base/configmap.yaml").read_text())
    config = validate_run_config(tomllib.loads(configmap["data"]["run.toml"]), "configmap run.toml")
    assert config.model is None and config.trainer.device == "cuda"


def test_the_three_run_configs_ship():
    assert {c.name for c in RUN_CONFIGS} >= {"demo.toml", "math.toml", "code.toml"}


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_run_config_validates_for_every_service(path):
    from asyncrl.services.reward.config import RewardSettings
    from asyncrl.services.rollout.config import RolloutSettings
    from asyncrl.trainer.config import TrainerSettings

    up = load_run_config(path, require=("model",))
    trainer = load_settings(TrainerSettings, ["--config", str(path), "--model-path", up.model.path], prog="t",
                            section="trainer")  # fmt: skip
    reward = load_settings(RewardSettings, ["--config", str(path)], prog="r", section="reward")
    load_settings(
        RolloutSettings, ["--config", str(path), "--tokenizer", up.model.path], prog="r", section="rollout"
    )
    assert trainer.batch_groups >= 1 and trainer.max_staleness >= 0
    if path.name in ("demo-lora.toml", "smollm2-math-lora.toml"):  # LoRA variants: their bases, plus LoRA
        lora_of = {"demo-lora.toml": "demo.toml", "smollm2-math-lora.toml": "smollm2-math.toml"}[path.name]
        base = load_run_config(ROOT / "configs" / lora_of, require=("model",))
        # the same task and evaluations; the batch is a training setting, like the lr
        same_demo = up.demo.model_copy(update={"prompts_per_step": base.demo.prompts_per_step})
        assert up.launch == base.launch and same_demo == base.demo and up.reward == base.reward
        assert trainer.lora.enabled and up.engine.enable_lora and not base.trainer.lora.enabled
        assert trainer.lr > base.trainer.lr  # LoRA's adapters need a larger step than a full fine-tune
    elif path.name in ("demo.toml", "demo-tools.toml"):  # the CPU demos
        assert up.launch.engine_kind == "reference" and up.model.build_tiny and not reward.code_enabled
        if path.name == "demo-tools.toml":
            from asyncrl.services.ops.run_config import DemoSection

            demo = DemoSection.model_validate(tomllib.loads(path.read_text())["demo"])
            assert demo.task == "secret" and demo.tools and demo.max_turns >= 2
    elif path.name == "smollm2-math.toml":  # the pretrained model on the CPU, through `asyncrl demo`
        from asyncrl.services.ops.run_config import DemoSection

        demo = DemoSection.model_validate(tomllib.loads(path.read_text())["demo"])
        assert up.launch.engine_kind == "reference" and not up.model.build_tiny and demo.task == "math"
        assert trainer.device != "cuda" and trainer.max_staleness >= 1 and demo.eval_size >= 100
        # strict rewards pay only a marked answer: the worked exchange makes the base model mark them
        assert reward.math_strict and demo.worked_example
        # the engine samples in fp32, so the trainer computes in fp32 too (bypass: μ is the engine's)
        assert trainer.mixed_precision == "float32" and up.engine.dtype == "float32"
        hard = demo.eval_sets["heldout-hard"]  # where the base model formats and computes badly
        assert (hard.level, hard.worked_example, hard.size) == ("hard", True, 100)
    else:  # the GPU configs: SGLang engines, a dataset, a real model path
        assert up.launch.engine_kind == "sglang" and up.submit is not None and not up.model.build_tiny
        assert trainer.device == "cuda" and trainer.mixed_precision == "bfloat16"


def test_launcher_plans_the_topology_in_start_order(tmp_path):
    raw = tomllib.loads((ROOT / "configs" / "math.toml").read_text())
    raw["launch"].update(
        engines=2, rollout_replicas=2, reward_replicas=1, gpus=0
    )  # any machine: no GPU placement
    raw["run"]["redis_url"] = "redis://127.0.0.1:1/0"
    launcher = Launcher(RunConfig.model_validate(raw), tmp_path / "x.toml", echo=False)
    stages = [[p.name for p in stage] for stage in launcher.plan()]
    assert stages == [["reward-0"], ["engine-0", "engine-1"], ["rollout-0", "rollout-1"], ["trainer"]]
    engine = launcher.plan()[1][1]
    assert engine.cmd[1:4] == ["-m", "sglang.launch_server", "--model-path"] and "30001" in engine.cmd
    rollout = launcher.plan()[2][1].cmd
    urls = rollout[rollout.index("--engine-urls") + 1]
    assert urls == "http://127.0.0.1:30000,http://127.0.0.1:30001"
    assert rollout[rollout.index("--replica") + 1] == "rollout-1"
