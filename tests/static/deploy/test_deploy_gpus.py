"""GPU placement in the deployment files, checked with the launcher's own rules
(services/ops/placement.py): compose's `gpu` profile and the k8s manifests give the engines and the
trainer disjoint GPUs, as many as their tensor-parallel ranks and torchrun ranks need.

docker-compose.yml is read as Debian's `docker-compose` (1.29) interpolates it, in a clean
environment plus the variables a test sets, as in test_deploy_configs.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml
from deploy_support import K8S, ROOT, flag

from asyncrl.services.ops.placement import PlacementError, place

COMPOSE = ROOT / "docker-compose.yml"
TOKEN = "compose-check-token-Zq81xW"  # compose refuses to interpolate without one
GPU_VARS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


def compose_config(**env: str) -> dict:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("`docker-compose` is not installed; CI installs it: apt-get install -y docker-compose")
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "ASYNCRL_API_TOKEN": TOKEN}
    proc = subprocess.run([exe, "-f", str(COMPOSE), "config"], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def gpu_ids(svc: dict) -> list[int]:
    """The host GPUs a compose service reserves; NVIDIA_VISIBLE_DEVICES must name the same ones."""
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "count" not in device, device
    ids = [int(i) for entry in device["device_ids"] for i in str(entry).split(",")]
    assert svc["environment"]["NVIDIA_VISIBLE_DEVICES"] == ",".join(map(str, ids))
    return ids


def compose_placement(compose: dict):
    """The `gpu` profile's engine and trainer as the launcher would check them: one SGLang engine
    of --tp-size GPUs, a trainer of one torchrun rank per reserved GPU."""
    services = compose["services"]
    engine, trainer = gpu_ids(services["engine"]), gpu_ids(services["trainer-gpu"])
    tp = int(flag(services["engine"]["command"], "--tp-size"))
    assert flag(services["trainer-gpu"]["command"], "--nproc-per-node") == "gpu"  # ranks = its GPUs
    host = tuple(str(i) for i in range(max(engine + trainer) + 1))
    ranks = len(trainer)
    return place(host, engines=1, engine_tp=tp, trainer_nproc=ranks, engine_gpus=engine, trainer_gpus=trainer)


def test_compose_defaults_place_engine_and_trainer_on_disjoint_gpus():
    compose = compose_config()
    p = compose_placement(compose)
    assert p.engines == ((0,),) and p.trainer == (1,)
    # Inside a container its GPUs are numbered from 0: a host id in CUDA_VISIBLE_DEVICES would
    # point at a GPU the container does not have.
    for name, svc in compose["services"].items():
        assert "CUDA_VISIBLE_DEVICES" not in (svc.get("environment") or {}), name


def test_compose_gpu_variables_move_both_and_an_overlap_is_refused():
    moved = {"ASYNCRL_ENGINE_GPUS": "0,1", "ASYNCRL_ENGINE_TP": "2", "ASYNCRL_TRAINER_GPUS": "2,3"}
    p = compose_placement(compose_config(**moved))
    assert p.engines == ((0, 1),) and p.trainer == (2, 3)
    with pytest.raises(PlacementError, match="GPU 0 is given to engine-0 and trainer"):
        compose_placement(compose_config(ASYNCRL_TRAINER_GPUS="0"))
    with pytest.raises(PlacementError, match=r"engine_gpus lists 1 GPU\(s\); .*engine_tp 2 need 2"):
        compose_placement(compose_config(ASYNCRL_ENGINE_TP="2"))


def test_k8s_gpu_requests_match_the_ranks_and_leave_device_choice_to_the_plugin():
    gpu_containers = 0
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] not in ("StatefulSet", "Deployment", "Job"):
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                env = {e["name"] for e in c.get("env", [])}
                assert not env & set(GPU_VARS), f"{path.name}/{c['name']}: the device plugin sets the GPUs"
                gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
                if gpus is None:
                    continue
                gpu_containers += 1
                argv = [*c.get("command", []), *c.get("args", [])]
                if "sglang.launch_server" in argv:
                    assert int(flag(argv, "--tp-size")) == gpus, path.name
                else:
                    assert argv[:2] == ["asyncrl", "train"], argv
                    assert int(flag(argv, "--nproc-per-node")) == gpus, path.name
    assert gpu_containers == 2  # the SGLang engines and the trainer
