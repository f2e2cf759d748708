"""deploy/k8s/base: PyYAML plus structural checks (kinds, fields, selectors, ports, references),
and every `asyncrl …` command line parsed by the service's own settings loader, as for compose
(test_deploy_configs.py). The overlays, built by kubectl and checked against the Kubernetes
schema: test_k8s_topologies.py.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_support import K8S, flag, listen, named, resolve

API_VERSIONS = {
    "Namespace": "v1", "ConfigMap": "v1", "Service": "v1", "PersistentVolumeClaim": "v1", "ServiceAccount": "v1",
    "StatefulSet": "apps/v1", "Deployment": "apps/v1", "Job": "batch/v1", "NetworkPolicy": "networking.k8s.io/v1",
    "Role": "rbac.authorization.k8s.io/v1", "RoleBinding": "rbac.authorization.k8s.io/v1",
}  # fmt: skip
WORKLOADS = ("StatefulSet", "Deployment", "Job")
ROUTER_FINDS_WORKERS = {
    "--worker-urls",
    "--service-discovery",
    "--selector",
    "--prefill-selector",
    "--decode-selector",
}
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # a label the Job controller adds


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    """The base's objects, and the ConfigMaps its kustomization generates from files (by their
    name before kustomize adds the content hash)."""
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in docs, f"{key} defined twice"
            docs[key] = doc
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for generated in kustomization.get("configMapGenerator", []):
        data = {name: (K8S / name).read_text() for name in generated["files"]}
        docs[("ConfigMap", generated["name"])] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generated["name"], "namespace": kustomization["namespace"]},
            "data": data,
        }
    return docs


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def containers(docs: dict) -> list[tuple[dict, dict]]:
    return [
        (doc, c) for (kind, _), doc in docs.items() if kind in WORKLOADS for c in pod_spec(doc)["containers"]
    ]


def test_k8s_manifests_are_well_formed(k8s):
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    for (kind, name), doc in k8s.items():
        assert doc["apiVersion"] == API_VERSIONS[kind], (kind, name)
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == kustomization["namespace"], (kind, name)
    for (kind, name), doc in k8s.items():
        if kind not in WORKLOADS:
            continue
        template_labels = doc["spec"]["template"]["metadata"]["labels"]
        if kind != "Job":
            assert doc["spec"]["selector"]["matchLabels"].items() <= template_labels.items(), name
        spec = pod_spec(doc)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes |= {t["metadata"]["name"]: t for t in doc["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in k8s, name
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in k8s, name
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", spec["serviceAccountName"]) in k8s, name
        for container in spec["containers"]:
            assert container["name"] and container["image"], name
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: volumeMount {mount['name']} has no volume"


def selected(k8s: dict, selector: dict) -> list[dict]:
    """Workloads whose pods carry the selector's labels (the Job controller adds the index label)."""
    found = []
    for (kind, _), doc in k8s.items():
        if kind not in WORKLOADS:
            continue
        labels = dict(doc["spec"]["template"]["metadata"]["labels"])
        if kind == "Job" and doc["spec"].get("completionMode") == "Indexed":
            labels[COMPLETION_INDEX] = selector.get(COMPLETION_INDEX, "0")
        if selector.items() <= labels.items():
            found.append(doc)
    return found


def test_k8s_services_select_pods_with_their_ports(k8s):
    for (kind, name), svc in k8s.items():
        if kind != "Service":
            continue
        (workload,) = selected(k8s, svc["spec"]["selector"])
        ports = [p for c in pod_spec(workload)["containers"] for p in c.get("ports", [])]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in (p.get("name"), p["containerPort"]) for p in ports), (name, target)


def k8s_reaches(k8s: dict, url: str) -> dict:
    """The workload a URL inside the namespace reaches: `<service>` or `<statefulset>-<i>.<service>`."""
    parts = urlsplit(url)
    host = parts.hostname.split(".")
    if len(host) == 2:  # a StatefulSet pod through its headless service
        pod, service = host
        (sts,) = [
            d for (k, _), d in k8s.items() if k == "StatefulSet" and d["spec"]["serviceName"] == service
        ]
        ordinal = pod.removeprefix(sts["metadata"]["name"] + "-")
        assert ordinal.isdigit() and int(ordinal) < sts["spec"]["replicas"], url
        workload = sts
    else:
        svc = k8s[("Service", host[0])]
        assert any(p["port"] == parts.port for p in svc["spec"]["ports"]), url
        (workload,) = selected(k8s, svc["spec"]["selector"])
    assert parts.port in ports_of(workload), url
    return workload


def container_env(container: dict) -> dict[str, str]:
    """Literal values; downward-API fields get a placeholder; optional secrets stay unset."""
    env = {}
    for var in container.get("env", []):
        if "secretKeyRef" not in var.get("valueFrom", {}):
            env[var["name"]] = var.get("value", "0")  # e.g. a pod name or a completion index
    return env


def ports_of(workload: dict) -> set[int]:
    return {p["containerPort"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def test_k8s_asyncrl_commands_parse_and_wire_up(k8s, tmp_path):
    parsed = {}
    with pytest.MonkeyPatch.context() as mp:
        for doc, container in containers(k8s):
            args = container.get("command", []) + container.get("args", [])
            if args[:1] != ["asyncrl"]:
                continue
            name, env, files = doc["metadata"]["name"], container_env(container), {}
            volumes = {v["name"]: v for v in pod_spec(doc).get("volumes", [])}
            for mount in container.get("volumeMounts", []):
                if "configMap" in volumes.get(mount["name"], {}):
                    data = k8s[("ConfigMap", volumes[mount["name"]]["configMap"]["name"])]["data"]
                    for key, text in data.items():
                        (tmp_path / key).write_text(text)
                        files[f"{mount['mountPath']}/{key}"] = str(tmp_path / key)
            settings, launch = resolve([expand(a, env) for a in args], env, files, mp)
            host, port = listen(settings)
            assert host == "0.0.0.0" and port in {p["containerPort"] for p in container["ports"]}, name
            parsed[name] = (settings, launch, args, container)
    assert set(parsed) == {"rollout", "reward", "trainer"}

    rollout, trainer = parsed["rollout"][0], parsed["trainer"][0]
    sglang = k8s[("StatefulSet", "sglang")]
    # An engine fleet behind the router: generation goes to the router, and no engine is listed
    # (each engine pod joins through POST /v1/engines: test_k8s_topologies.py).
    assert k8s_reaches(k8s, rollout.router_url)["metadata"]["name"] == "sglang-router"
    assert rollout.engine_url_list == [rollout.router_url] and rollout.admin_url_list == []
    assert k8s_reaches(k8s, rollout.reward_url)["metadata"]["name"] == "reward"
    assert k8s_reaches(k8s, rollout.redis_url)["metadata"]["name"] == "redis"
    assert trainer.redis_url == rollout.redis_url
    engine = named(pod_spec(sglang)["containers"], "sglang")
    assert flag(engine["args"], "--model-path") == rollout.tokenizer == trainer.model_path
    assert "--enable-metrics" in engine["args"] and engine["resources"]["limits"]["nvidia.com/gpu"] >= 1

    # torchrun across the Indexed Job's pods, rank 0 on pod 0 of the headless service.
    job = k8s[("Job", "trainer")]
    launch, container = parsed["trainer"][1], parsed["trainer"][3]
    assert job["spec"]["completionMode"] == "Indexed"
    assert int(launch.nnodes) == job["spec"]["completions"] == job["spec"]["parallelism"] >= 2
    assert int(launch.nproc_per_node) == container["resources"]["limits"]["nvidia.com/gpu"]
    subdomain = pod_spec(job)["subdomain"]
    headless = k8s[("Service", subdomain)]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"].get("publishNotReadyAddresses")
    assert selected(k8s, headless["spec"]["selector"]) == [job]
    assert launch.master_addr == f"{job['metadata']['name']}-0.{subdomain}"
    assert int(launch.master_port) in {p["port"] for p in headless["spec"]["ports"]}
    rank_var = flag(parsed["trainer"][2], "--node-rank")
    rank_env = next(e for e in container["env"] if f"$({e['name']})" == rank_var)
    assert COMPLETION_INDEX in rank_env["valueFrom"]["fieldRef"]["fieldPath"]
    assert k8s[("Service", "trainer-metrics")]["spec"]["selector"][COMPLETION_INDEX] == "0"

    # Published weights: on the ReadWriteMany volume both the trainer and the engines mount at /weights.
    claim = k8s[("PersistentVolumeClaim", "asyncrl-weights")]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for workload in (job, sglang):
        spec = pod_spec(workload)
        mounted = {m["mountPath"]: m["name"] for c in spec["containers"] for m in c["volumeMounts"]}
        volume = next(v for v in spec["volumes"] if v["name"] == mounted["/weights"])
        assert volume["persistentVolumeClaim"]["claimName"] == "asyncrl-weights"
    assert PurePosixPath(trainer.output_dir).is_relative_to("/weights")


def secret_source(container: dict, var: str) -> dict:
    return named(container["env"], var)["valueFrom"]["secretKeyRef"]


def test_k8s_router_redis_and_reward_sandbox(k8s):
    router_spec = pod_spec(k8s[("Deployment", "sglang-router")])
    (router,) = router_spec["containers"]
    assert router["command"][-1] == "sglang_router.launch_router"
    # Its workers are the rollout's alone: none at launch, none discovered, and /workers takes
    # the API token (the one the rollout sends), so nothing else can add one.
    assert not set(router["args"]) & ROUTER_FINDS_WORKERS
    assert "serviceAccountName" not in router_spec and router_spec["automountServiceAccountToken"] is False
    assert not {kind for kind, _ in k8s} & {"ServiceAccount", "Role", "RoleBinding"}
    _, _, role, key = flag(router["args"], "--control-plane-api-keys").split(":", 3)
    assert (role, key) == ("admin", "$(ASYNCRL_API_TOKEN)")
    rollout = named(pod_spec(k8s[("Deployment", "rollout")])["containers"], "rollout")
    assert secret_source(router, "ASYNCRL_API_TOKEN") == secret_source(rollout, "ASYNCRL_API_TOKEN")
    # The rollout's router calls carry the engine token, which is ASYNCRL_API_TOKEN unless set apart.
    assert "ASYNCRL_ENGINE_API_TOKEN" not in {e["name"] for e in rollout["env"]}

    redis = k8s[("StatefulSet", "redis")]
    (container,) = pod_spec(redis)["containers"]
    args = container["args"]
    assert flag(args, "--appendonly") == "yes" and flag(args, "--appendfsync") == "always"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounted[flag(args, "--dir")] == claim["metadata"]["name"]

    reward = k8s[("Deployment", "reward")]
    (container,) = pod_spec(reward)["containers"]
    ctx = container["securityContext"]
    assert ctx["seccompProfile"]["type"] == ctx["appArmorProfile"]["type"] == "Unconfined"
    assert ctx["procMount"] == "Unmasked" and pod_spec(reward)["hostUsers"] is False
    assert not ctx.get("privileged") and not ctx.get("capabilities", {}).get("add")
    for doc, other in containers(k8s):
        if doc is not reward:
            assert "securityContext" not in other, doc["metadata"]["name"]
