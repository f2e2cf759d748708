"""LoRA runs' engine flags wherever engines are started: `asyncrl up` (the launcher adds them from
`[trainer.lora]` when `[engine]` does not turn LoRA on), docker compose's `gpu` profile with
deploy/compose.lora.yml, and the k8s GPU topologies with the deploy/k8s/components/lora
component. Each is built by its own tool (the launcher's code, `docker-compose config`, `kubectl
kustomize`) and compared with what it is built on: the LoRA flags added, nothing else changed.
The run configs' refusals of an engine that could not serve the trainer's adapters too."""

from __future__ import annotations

import copy
import os
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import tomli_w
import yaml
from deploy_support import ROOT, compose, flag, kustomize, lora_flags, resolve, unordered

from asyncrl.services.ops.launcher import Launcher
from asyncrl.services.ops.run_config import RunConfig, RunConfigError, validate_run_config

LORA_CONFIGS = ("demo-lora.toml", "smollm2-math-lora.toml")
GPU_TOPOLOGIES = ("gpu-single", "multi-node")
COMPOSE_LORA = ("docker-compose.yml", "deploy/compose.lora.yml")
K8S_ROOT = ROOT / "deploy/k8s"
K8S_VERSION = "1.37.0"  # as tests/static/deploy/test_k8s_topologies.py


def raw_config(name: str, tmp_path: Path) -> dict:
    raw = tomllib.loads((ROOT / "configs" / name).read_text())
    raw["run"]["dir"] = str(tmp_path / "run")
    return raw


def trainer_ranks() -> list[int]:
    return [
        tomllib.loads((ROOT / "configs" / n).read_text())["trainer"]["lora"]["rank"] for n in LORA_CONFIGS
    ]


# --- asyncrl up --------------------------------------------------------------------------------


def test_the_launcher_gives_a_reference_engine_the_trainers_lora_when_engine_does_not(tmp_path):
    raw = raw_config("demo-lora.toml", tmp_path)
    for key in ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loaded_loras"):
        del raw["engine"][key]
    launcher = Launcher(RunConfig.model_validate(raw), ROOT / "configs" / "demo-lora.toml", echo=False)
    argv = launcher._engine_cmd("runs/model", 30000)
    assert argv[argv.index("--enable-lora") :][:5] == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all",
    ]  # fmt: skip
    # what the engine makes of its command line (its [engine] table from the same file, LoRA off)
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(raw))
    argv[argv.index("--config") + 1] = str(config)
    with pytest.MonkeyPatch.context() as mp:
        settings, _ = resolve(["asyncrl", *argv[argv.index("engine") :]], {}, {}, mp)
    assert settings.enable_lora and settings.max_lora_rank == 16 and settings.lora_target_modules == "all"


@pytest.mark.parametrize("name", LORA_CONFIGS)
def test_a_shipped_lora_config_turns_lora_on_in_engine_itself(name, tmp_path):
    config = RunConfig.model_validate(raw_config(name, tmp_path))
    assert config.trainer.lora.enabled and config.engine.enable_lora
    assert config.engine.max_lora_rank >= config.trainer.lora.rank
    assert config.rollout.max_loaded_adapters <= config.engine.max_loaded_loras
    launcher = Launcher(config, ROOT / "configs" / name, echo=False)
    assert "--enable-lora" not in launcher._engine_cmd("m", 30000)  # [engine] has it: nothing added


def test_the_launcher_gives_sglang_the_trainers_lora(tmp_path):
    raw = raw_config("smollm2-math-lora.toml", tmp_path)
    raw["launch"]["engine_kind"] = "sglang"
    raw["trainer"]["lora"]["target_modules"] = ["q_proj", "model.layers.0.self_attn.v_proj", "down_proj"]
    launcher = Launcher(RunConfig.model_validate(raw), ROOT / "configs" / "x.toml", echo=False)
    argv = launcher._engine_cmd("m", 30000)
    assert lora_flags(argv) == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj", "down_proj",
        "--max-loras-per-batch", "4", "--max-loaded-loras", "8",
    ]  # fmt: skip
    raw["trainer"].pop("lora")  # a full fine-tune: no LoRA on the engines
    launcher = Launcher(RunConfig.model_validate(raw), ROOT / "configs" / "x.toml", echo=False)
    assert lora_flags(launcher._engine_cmd("m", 30000)) == []


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (
            lambda raw: raw["engine"].update(max_lora_rank=8),
            r"max_lora_rank 8 is below \[trainer.lora\] rank 16",
        ),
        (lambda raw: raw["rollout"].update(max_loaded_adapters=9), "max_loaded_adapters 9 exceeds"),
        (lambda raw: raw["trainer"]["lora"].update(target_modules=["qkv"]), "the engines adapt only"),
    ],
    ids=["rank", "loaded", "targets"],
)
def test_a_run_config_whose_engines_cannot_serve_the_adapters_is_refused(change, refusal, tmp_path):
    raw = raw_config("demo-lora.toml", tmp_path)
    validate_run_config(copy.deepcopy(raw))
    change(raw)
    with pytest.raises(RunConfigError, match=refusal):
        validate_run_config(raw)


# --- docker compose ----------------------------------------------------------------------------


def test_compose_lora_file_adds_sglangs_lora_flags_to_the_gpu_engine_and_nothing_else():
    base, lora = compose("docker-compose.yml"), compose(*COMPOSE_LORA)
    engine = lora["services"]["engine"]["command"]
    flags = lora_flags(engine)
    assert engine == base["services"]["engine"]["command"] + flags
    assert flags[:1] == ["--enable-lora"] and flag(flags, "--lora-target-modules") == "all"
    assert int(flag(flags, "--max-lora-rank")) >= max(trainer_ranks())
    assert int(flag(flags, "--max-loras-per-batch")) >= 2  # an adapter and the base in one batch
    wider = compose(*COMPOSE_LORA, ASYNCRL_LORA_RANK="64")["services"]["engine"]["command"]
    assert flag(wider, "--max-lora-rank") == "64"
    lora["services"]["engine"]["command"] = base["services"]["engine"]["command"]
    assert unordered(lora) == unordered(base)


# --- kubernetes --------------------------------------------------------------------------------


def sglang_args(docs: list[dict]) -> list[str]:
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "sglang"]
    (container,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "sglang"]
    return container["args"]


@pytest.mark.parametrize("topology", GPU_TOPOLOGIES)
def test_the_k8s_lora_component_adds_the_flags_to_the_engines_and_nothing_else(topology, tmp_path):
    here = Path(os.path.relpath(K8S_ROOT, tmp_path))  # kustomize refuses absolute paths
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [str(here / "overlays" / topology)],
                "components": [str(here / "components" / "lora")],
            }
        )
    )
    base, lora = kustomize(K8S_ROOT / "overlays" / topology), kustomize(tmp_path)
    flags = lora_flags(sglang_args(lora))
    assert sglang_args(lora) == sglang_args(base) + flags
    assert flags[:1] == ["--enable-lora"] and flag(flags, "--lora-target-modules") == "all"
    assert int(flag(flags, "--max-lora-rank")) >= max(trainer_ranks())
    assert int(flag(flags, "--max-loras-per-batch")) >= 2
    for doc in lora:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if doc["kind"] == "StatefulSet" and doc["metadata"]["name"] == "sglang":
            doc["spec"]["template"]["spec"]["containers"][0]["args"] = sglang_args(base)
    assert lora == base
