"""The Tinker-compatible service (`asyncrl tinker`) in the deployments: docker compose with
deploy/compose.tinker.yml, and the k8s GPU topologies with the deploy/k8s/components/tinker
component. Each is built by its own tool (`docker-compose config`, `kubectl kustomize`) and
compared with what it is built on: the `tinker` service added, the engines given LoRA, nothing
else changed. The tinker command line is parsed by the service's own settings loader, so a renamed
flag or setting fails here, and held to the engines it samples on: they serve the model it
trains, load adapters of every rank and module it trains from where it writes them, and take the
token it sends them; the SDK's own key check takes the key it requires.

SGLang is not installed here: its LoRA flags are read with the reference engine's parser, which
takes SGLang 0.5.23's names and checks (services/engine/config.py)."""

from __future__ import annotations

import copy
import os
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    COMPOSE_TOKEN,
    ROOT,
    compose,
    flag,
    kustomize,
    lora_flags,
    named,
    resolve,
    unordered,
)
from tinker.lib._auth_token_provider import ApiKeyAuthProvider  # the SDK's check of a key

from asyncrl.services.engine.config import LORA_STACKED, EngineSettings
from asyncrl.services.ops.run_config import RunConfig
from asyncrl.services.runtime.auth import OPEN_PATHS
from asyncrl.services.runtime.config import load_settings
from asyncrl.trainer.tinker.models import ATTENTION, MLP

OVERLAY = ROOT / "deploy/compose.tinker.yml"
COMPOSE_TINKER = ("docker-compose.yml", "deploy/compose.tinker.yml")
PROFILE_ENGINE = {"cpu": "engine-cpu", "gpu": "engine"}
K8S_ROOT = ROOT / "deploy/k8s"
K8S_VERSION = "1.37.0"  # as tests/static/deploy/test_k8s_topologies.py
GPU_TOPOLOGIES = ("gpu-single", "multi-node")
K8S_TOKEN = "k8s-secret-api-token-4fQ9xZ"  # what the asyncrl-secrets Secret would hold
# Every module tinker trains an adapter on (attention and MLP), as the engines name them.
TRAINED = frozenset(LORA_STACKED.get(m, m) for m in (*ATTENTION, *MLP))


def engine_lora(model: str, argv: list[str]) -> EngineSettings:
    """SGLang's LoRA flags in `argv` as the reference engine's parser reads them."""
    return load_settings(EngineSettings, ["--model", model, *lora_flags(argv)], prog="sglang")


def covers(root: str | None, path: str) -> bool:
    """An engine with weights root `root` loads adapters from `path` (SGLang has no root: any)."""
    return root is None or PurePosixPath(path).is_relative_to(root)


# --- docker compose ----------------------------------------------------------------------------


def mounts(svc: dict) -> dict[str, tuple[str, str]]:
    """container path -> (source: a volume name or a host path, mode), as docker-compose 1.29 prints them."""
    return {parts[1]: (parts[0], parts[2]) for parts in (v.split(":") for v in svc.get("volumes", []))}


def names(name: str, svc: dict) -> set[str]:
    """What a service answers to on the compose network: its name and its aliases."""
    return {name, *((svc.get("networks") or {}).get("default") or {}).get("aliases", [])}


def volume_of(svc: dict, path: str) -> tuple[str, str]:
    """(source, container mount point) of the mount that holds container `path`."""
    held = [t for t in mounts(svc) if PurePosixPath(path).is_relative_to(t)]
    assert held, f"{path} is on no mount of {sorted(mounts(svc))}"
    target = max(held, key=len)
    return mounts(svc)[target][0], target


def compose_services(config: dict, profile: str, mp: pytest.MonkeyPatch) -> dict:
    """The tinker service's settings and a view of the profile's engine, from their command lines."""
    services = config["services"]
    svc = services["tinker"]
    tinker, _ = resolve(svc["command"], svc["environment"], {}, mp)
    name = PROFILE_ENGINE[profile]
    engine_svc = services[name]
    argv = engine_svc["command"]
    if profile == "cpu":
        files = {t: s for t, (s, _) in mounts(engine_svc).items() if s.startswith("/")}
        engine, _ = resolve(argv, engine_svc["environment"], files, mp)
        view = {"model": engine.model, "root": engine.weights_root, "token": engine.token, "lora": engine}
    else:
        model = flag(argv, "--model-path")
        view = {
            "model": model,
            "root": None,
            "token": flag(argv, "--api-key"),
            "lora": engine_lora(model, argv),
        }
    return {"tinker": tinker, "svc": svc, "engine": view, "engine_name": name, "engine_svc": engine_svc}


def test_compose_tinker_adds_the_service_and_the_engines_lora_and_nothing_else():
    base, overlay = compose("docker-compose.yml"), compose(*COMPOSE_TINKER)
    services, before = overlay["services"], base["services"]
    sglang = services["engine"]["command"]
    assert sglang == before["engine"]["command"] + lora_flags(sglang) and lora_flags(sglang)
    # The reference engine: its command, the LoRA flags added, its weights root alone changed.
    cpu, was = services["engine-cpu"]["command"], before["engine-cpu"]["command"]
    head, at = cpu[: cpu.index("--enable-lora")], was.index("--weights-root") + 1
    assert head[:at] + head[at + 1 :] == was[:at] + was[at + 1 :]
    assert set(services) == set(before) | {"tinker"}
    del services["tinker"]
    services["engine"]["command"], services["engine-cpu"]["command"] = (
        sglang[: len(sglang) - len(lora_flags(sglang))],
        was,
    )
    assert unordered(overlay) == unordered(base)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_tinker_samples_on_the_profiles_engine(profile):
    config = compose(*COMPOSE_TINKER)
    with pytest.MonkeyPatch.context() as mp:
        got = compose_services(config, profile, mp)
    tinker, svc, engine, services = got["tinker"], got["svc"], got["engine"], config["services"]
    # Runs in every profile, next to what it needs there, listening where it is published.
    assert "profiles" not in svc and set(svc["depends_on"]) <= {
        n for n, s in services.items() if not s.get("profiles")
    }
    assert (tinker.host, str(tinker.port)) == ("0.0.0.0", svc["expose"][0])
    assert svc["ports"] == [f"127.0.0.1:{tinker.port}:{tinker.port}/tcp"]  # loopback only, like the others
    probe = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(svc["healthcheck"]["test"]))
    assert int(probe.group(1)) == tinker.port and probe.group(2) in OPEN_PATHS  # no token on a probe
    assert svc["image"] == services["rollout"]["image"] and svc["build"] == services["rollout"]["build"]
    assert svc["restart"] == "unless-stopped" and not svc.get("privileged") and not svc.get("security_opt")
    redis = urlsplit(tinker.redis_url)
    assert (redis.hostname, str(redis.port)) == ("redis", services["redis"]["expose"][0])
    assert tinker.redis_url == flag(services["rollout"]["command"], "--redis-url")
    # Samples on this profile's engine, which serves the model tinker trains.
    (url,) = tinker.engine_urls
    parts = urlsplit(url)
    active = {n: s for n, s in services.items() if not s.get("profiles") or profile in s["profiles"]}
    answering = [n for n, s in active.items() if parts.hostname in names(n, s)]
    assert answering == [got["engine_name"]] and str(parts.port) in got["engine_svc"]["expose"]
    assert list(tinker.base_models.values()) == [engine["model"]]
    # Adapters: where tinker writes them, on the volume the engine mounts at the same path, inside
    # its weights root, of every rank tinker accepts and every module it trains.
    assert volume_of(svc, tinker.weights_root) == volume_of(got["engine_svc"], tinker.weights_root)
    assert volume_of(svc, tinker.weights_root)[0] == "weights" == volume_of(svc, tinker.checkpoints_root)[0]
    assert mounts(svc)[volume_of(svc, tinker.weights_root)[1]][1] == "rw"
    assert covers(engine["root"], tinker.weights_root)
    lora = engine["lora"]
    assert lora.enable_lora and lora.max_lora_rank == tinker.max_lora_rank and lora.lora_targets >= TRAINED
    # The trainer's versions still load on the reference engine, as docker-compose.yml has it.
    trainer = flag(services["trainer"]["command"], "--output-dir")
    assert covers(engine["root"], f"{trainer}/weights")
    # One secret: the engine's token is the stack's, which tinker sends it; clients send tml- + it.
    assert engine["token"] == svc["environment"]["ASYNCRL_API_TOKEN"] == COMPOSE_TOKEN
    assert tinker.api_token == f"tml-{COMPOSE_TOKEN}" and ApiKeyAuthProvider(tinker.api_token).api_key


def test_compose_tinker_variables_move_the_service_and_the_engine_together():
    config = compose(*COMPOSE_TINKER, ASYNCRL_LORA_RANK="64", ASYNCRL_MODEL="/models/Qwen3-8B",
                     ASYNCRL_MODEL_NAME="Qwen/Qwen3-8B", ASYNCRL_API_TOKEN="another-token-8hT2pW0q")  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        got = compose_services(config, "gpu", mp)
    assert got["tinker"].max_lora_rank == got["engine"]["lora"].max_lora_rank == 64
    assert got["tinker"].base_models == {"Qwen/Qwen3-8B": "/models/Qwen3-8B"}
    assert got["engine"]["model"] == "/models/Qwen3-8B" and "/models" in mounts(got["svc"])
    assert got["tinker"].api_token == "tml-another-token-8hT2pW0q" == f"tml-{got['engine']['token']}"


def header_command() -> list[str]:
    """The `docker compose … up` command in compose.tinker.yml's header, its lines joined."""
    lines = [
        line.removeprefix("#").strip() for line in OVERLAY.read_text().splitlines() if line.startswith("#")
    ]
    start = next(i for i, line in enumerate(lines) if line.startswith("ASYNCRL_") or "docker compose" in line)
    text = ""
    for line in lines[start:]:
        text += line.removesuffix("\\") + " "
        if not line.endswith("\\"):
            break
    return shlex.split(text)


def test_the_header_command_starts_a_lora_run_that_leaves_the_engines_base_alone(tmp_path):
    argv = header_command()
    env = dict(a.split("=", 1) for a in argv[: argv.index("docker")])
    assert argv[argv.index("docker") :][:2] == ["docker", "compose"] and "up" in argv
    files = [argv[i + 1] for i, a in enumerate(argv) if a == "-f"]
    assert files == list(COMPOSE_TINKER) and flag(argv, "--profile") == "cpu"
    config = compose(*files, **env)
    # The run config it names trains adapters: its versions never replace the engine's base.
    raw = tomllib.loads((ROOT / env["ASYNCRL_CONFIG"]).read_text())
    raw["run"]["dir"] = str(tmp_path / "run")
    run = RunConfig.model_validate(raw)
    assert run.trainer.lora.enabled
    with pytest.MonkeyPatch.context() as mp:
        got = compose_services(config, "cpu", mp)
    tinker, engine = got["tinker"], got["engine"]["lora"]
    assert (
        Path(mounts(got["engine_svc"])["/etc/asyncrl/run.toml"][0])
        == (ROOT / env["ASYNCRL_CONFIG"]).resolve()
    )
    assert run.trainer.lora.rank <= engine.max_lora_rank
    # The engine holds the rollout's adapters and tinker's at once.
    assert run.rollout.max_loaded_adapters + tinker.max_loaded_adapters <= engine.max_loaded_loras
    # What the header points the SDK at: the published port, a key the SDK and the service take,
    # a model the service trains.
    header = OVERLAY.read_text()
    base_url = re.search(r"TINKER_BASE_URL=(\S+)", header).group(1)
    key = re.search(r'TINKER_API_KEY="([^"]+)"', header).group(1).replace("$ASYNCRL_API_TOKEN", COMPOSE_TOKEN)
    assert f"{urlsplit(base_url).hostname}:{urlsplit(base_url).port}:{tinker.port}/tcp" in got["svc"]["ports"]
    assert ApiKeyAuthProvider(key).api_key == tinker.api_token
    assert re.search(r'base_model="([^"]+)"', header).group(1) in tinker.base_models


# --- kubernetes --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def topologies(tmp_path_factory) -> dict[str, tuple[list[dict], list[dict]]]:
    """Each GPU topology as shipped, and in a kustomization of its own with the component, as the
    component's header says to use it."""
    built = {}
    for topology in GPU_TOPOLOGIES:
        here = tmp_path_factory.mktemp(topology)
        up = Path(os.path.relpath(K8S_ROOT, here))  # kustomize refuses absolute paths
        (here / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [str(up / "overlays" / topology)],
                    "components": [str(up / "components" / "tinker")],
                }
            )
        )
        built[topology] = (kustomize(K8S_ROOT / "overlays" / topology), kustomize(here))
    return built


def keyed(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container(doc: dict, name: str) -> dict:
    return named(doc["spec"]["template"]["spec"]["containers"], name)


def pod_env(spec: dict) -> dict[str, str]:
    """A container's environment as the kubelet makes it: a secret as K8S_TOKEN, `$(VAR)`
    expanded from the variables before it."""
    env: dict[str, str] = {}
    for var in spec.get("env", []):
        if "secretKeyRef" in var.get("valueFrom", {}):
            env[var["name"]] = K8S_TOKEN
        else:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
    return env


@pytest.mark.parametrize("topology", GPU_TOPOLOGIES)
def test_the_k8s_tinker_component_adds_the_service_and_the_engines_lora_and_nothing_else(
    topologies, topology
):
    base, docs = topologies[topology][0], copy.deepcopy(topologies[topology][1])
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    objects, before = keyed(docs), keyed(base)
    assert set(objects) == set(before) | {("Deployment", "tinker"), ("Service", "tinker")}
    engine = container(objects[("StatefulSet", "sglang")], "sglang")
    args, was = engine["args"], container(before[("StatefulSet", "sglang")], "sglang")["args"]
    assert args == was + lora_flags(args) and lora_flags(args)
    engine["args"] = was
    assert [d for d in docs if d["metadata"]["name"] != "tinker"] == base


@pytest.mark.parametrize("topology", GPU_TOPOLOGIES)
def test_the_k8s_tinker_service_samples_on_the_engines(topologies, topology):
    objects = keyed(topologies[topology][1])
    deployment, service = objects[("Deployment", "tinker")], objects[("Service", "tinker")]
    spec = deployment["spec"]["template"]["spec"]
    (main,) = spec["containers"]
    env = pod_env(main)
    with pytest.MonkeyPatch.context() as mp:
        tinker, _ = resolve(main["args"], env, {}, mp)
    # One process per Redis namespace, never two, not even during a rollout.
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    # Listens where its Service, its probes and Prometheus look; trains on the CPU it asks for.
    (port,) = main["ports"]
    assert tinker.host == "0.0.0.0" and tinker.port == port["containerPort"]
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(tinker.port, port["name"])]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": main[probe]["httpGet"]["path"], "port": port["name"]}
        assert main[probe]["httpGet"]["path"] in OPEN_PATHS
    notes = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(notes["prometheus.io/port"]) == tinker.port and notes["prometheus.io/scrape"] == "true"
    rollout = container(objects[("Deployment", "rollout")], "rollout")
    assert main["image"] == rollout["image"] and "nvidia.com/gpu" not in str(main["resources"])
    assert tinker.threads == int(main["resources"]["requests"]["cpu"])
    assert tinker.redis_url == flag(rollout["args"], "--redis-url")
    # Samples on engine pods that exist, by their stable names, on the engines' port.
    sglang = objects[("StatefulSet", "sglang")]
    engine = container(sglang, "sglang")
    headless = sglang["spec"]["serviceName"]
    assert objects[("Service", headless)]["spec"]["clusterIP"] == "None"
    for url in tinker.engine_urls:
        parts = urlsplit(url)
        pod, _, host = parts.hostname.partition(".")
        ordinal = pod.removeprefix("sglang-")
        assert host == headless and ordinal.isdigit() and int(ordinal) < sglang["spec"]["replicas"], url
        assert str(parts.port) == flag(engine["args"], "--port")
    assert tinker.engine_urls and list(tinker.base_models.values()) == [flag(engine["args"], "--model-path")]
    # Adapters on the claim both mount at the same path; every rank and module tinker trains loads.
    held = {}
    for workload, name in ((deployment, "tinker"), (sglang, "sglang")):
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        (mount,) = [
            m
            for m in container(workload, name)["volumeMounts"]
            if PurePosixPath(tinker.weights_root).is_relative_to(m["mountPath"])
        ]
        claim = named(volumes, mount["name"])["persistentVolumeClaim"]["claimName"]
        held[name] = (claim, mount["mountPath"], mount.get("readOnly", False))
    assert (
        held["tinker"] == (held["sglang"][0], held["sglang"][1], False)
        and held["tinker"][0] == "asyncrl-weights"
    )
    assert PurePosixPath(tinker.checkpoints_root).is_relative_to(held["tinker"][1])
    lora = engine_lora(flag(engine["args"], "--model-path"), engine["args"])
    assert lora.enable_lora and lora.max_lora_rank == tinker.max_lora_rank and lora.lora_targets >= TRAINED
    # One secret: the engines check the api-token tinker sends them; clients send tml- + it.
    source = named(main["env"], "ASYNCRL_API_TOKEN")["valueFrom"]["secretKeyRef"]
    assert source == named(rollout["env"], "ASYNCRL_API_TOKEN")["valueFrom"]["secretKeyRef"]
    assert source == named(engine["env"], "ASYNCRL_API_TOKEN")["valueFrom"]["secretKeyRef"]
    assert (
        flag(engine["args"], "--api-key") == "$(ASYNCRL_API_TOKEN)" and env["ASYNCRL_API_TOKEN"] == K8S_TOKEN
    )
    assert tinker.api_token == f"tml-{K8S_TOKEN}" and ApiKeyAuthProvider(tinker.api_token).api_key
