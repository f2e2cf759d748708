"""Compose, Prometheus and Grafana artefacts, checked by the real tools and against the code.

* docker-compose.yml: Debian's `docker-compose` (1.29) validates it (`config -q`; no Docker
  engine needed) and prints the normalised config (interpolated, anchors merged) that the
  other compose checks read.
* deploy/prometheus/prometheus.yml: `promtool check config`; every Grafana query goes through
  `promtool check rules` as a recording rule (PromQL syntax).
* Every `asyncrl …` command line in compose is parsed by the service's own settings loader
  with its run config TOML, so a renamed flag or field fails here; the ports, URLs and paths
  it resolves to must match the topology around it.
* Grafana panels may use only metric and label names the code registers: the metric modules
  are imported and the Prometheus registry is read, which also sees names built with
  f-strings (the trainer's per-step gauges), where a grep of the sources would not.

`docker-compose` and `promtool` come from Debian packages; when one is missing the test
fails with the install line (CI installs them), it does not skip. The k8s manifests are
checked in test_deploy_k8s.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_support import COMPOSE_TOKEN, ROOT, SETTINGS, flag, listen, resolve
from source_tree import module_name

COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy/prometheus/prometheus.yml"
DASHBOARD = ROOT / "deploy/grafana/dashboards/asyncrl.json"
PROVISIONING = ROOT / "deploy/grafana/provisioning"
APT_LINE = "apt-get install -y --no-install-recommends docker-compose prometheus"
# SGLang is not installed here, so its metric names cannot be read from code: the dashboard
# may use only these, from docs.sglang.io/references/production_metrics.
SGLANG_METRICS = {"sglang:generation_tokens_total", "sglang:num_running_reqs", "sglang:num_queue_reqs"}
PROFILES = {
    "cpu": {"redis", "init", "engine-cpu", "rollout", "reward", "trainer", "submit", "prometheus", "grafana"},
    "gpu": {"redis", "init", "engine", "rollout", "reward", "trainer-gpu", "prometheus", "grafana"},
}
# One-shot services, and trainers that exit 0 at max_steps and must then stay down.
RESTART = {
    "init": ("no",),
    "submit": ("on-failure",),
    "trainer": ("on-failure",),
    "trainer-gpu": ("on-failure",),
}
METRIC = re.compile(r"\b(asyncrl_[a-z0-9_]+|sglang:[a-z0-9_:]+)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHERS = re.compile(r"\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def run_tool(*argv: str, token: str | None = COMPOSE_TOKEN) -> subprocess.CompletedProcess:
    exe = shutil.which(argv[0])
    if exe is None:
        pytest.fail(f"`{argv[0]}` is not installed; CI installs it with: {APT_LINE}")
    # A clean environment: no ASYNCRL_*/COMPOSE_* variable of this machine leaks into interpolation.
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    if token is not None:
        env["ASYNCRL_API_TOKEN"] = token
    return subprocess.run(
        [exe, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )


# --- compose helpers ---------------------------------------------------------------------------


def exposed(svc: dict) -> set[int]:
    return {int(p) for p in svc.get("expose", [])}


def names(name: str, svc: dict) -> set[str]:
    nets = svc.get("networks") or {}
    return {name} | {a for net in nets.values() for a in ((net or {}).get("aliases") or [])}


def active(compose: dict, profile: str) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def mounts(svc: dict) -> dict[str, str]:
    """container path -> source (an absolute host path for binds, a volume name otherwise)."""
    out = {}
    for vol in svc.get("volumes", []):
        if isinstance(vol, dict):  # long syntax (docker compose v2 prints this)
            out[vol["target"]] = vol["source"]
        else:
            source, target = vol.split(":")[:2]
            out[target] = source
    return out


def answering(compose: dict, host: str, profile: str) -> list[str]:
    return [n for n, s in active(compose, profile).items() if host in names(n, s)]


def assert_reaches(compose: dict, url: str, profile: str) -> str:
    """Exactly one service of the profile answers the URL's host, and it exposes the URL's port."""
    parts = urlsplit(url)
    found = answering(compose, parts.hostname, profile)
    assert len(found) == 1, f"{url}: {found or 'no'} service answers {parts.hostname!r} in profile {profile}"
    assert parts.port in exposed(compose["services"][found[0]]), f"{url}: {found[0]} lacks port {parts.port}"
    return found[0]


@pytest.fixture(scope="module")
def compose() -> dict:
    proc = run_tool("docker-compose", "-f", str(COMPOSE), "config")
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr  # e.g. a variable without a default
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def compose_settings(compose) -> dict:
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, svc in compose["services"].items():
            cmd = svc.get("command")
            if isinstance(cmd, list) and cmd[:1] == ["asyncrl"] and cmd[1] in SETTINGS:
                out[name] = resolve(cmd, svc.get("environment"), mounts(svc), mp)
    return out


# --- docker compose ----------------------------------------------------------------------------


def test_compose_file_passes_docker_compose_config(tmp_path):
    proc = run_tool("docker-compose", "-f", str(COMPOSE), "config", "-q")
    assert (proc.returncode, proc.stderr) == (0, "")
    # The parser really validates: the same file with a misspelt dependency condition is refused.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("service_healthy", "service_healty", 1))
    proc = run_tool("docker-compose", "-f", str(broken), "config", "-q")
    assert proc.returncode != 0 and "service_healty" in proc.stderr


def test_compose_requires_the_api_token(compose):
    """No stack without a token: every service, the engines included, requires it."""
    proc = run_tool("docker-compose", "-f", str(COMPOSE), "config", "-q", token=None)
    assert proc.returncode != 0 and "set ASYNCRL_API_TOKEN" in proc.stderr, proc.stderr
    for name, svc in compose["services"].items():
        if svc.get("image", "").startswith(("asyncrl:", "asyncrl-reward:")):
            assert svc["environment"]["ASYNCRL_API_TOKEN"] == COMPOSE_TOKEN, name
    assert flag(compose["services"]["engine"]["command"], "--api-key") == COMPOSE_TOKEN  # SGLang's own flag


def test_profiles_select_the_demo_and_gpu_topologies(compose):
    listed = run_tool("docker-compose", "-f", str(COMPOSE), "--profile", "cpu", "config", "--services")
    assert listed.returncode == 0, listed.stderr
    # docker-compose 1.29 lists every service here whatever the profile; membership is read below.
    assert PROFILES["cpu"] <= set(listed.stdout.split())
    for profile, expected in PROFILES.items():
        services = active(compose, profile)
        assert set(services) == expected, profile
        for name, svc in services.items():  # `up --profile X` refuses dependencies outside X
            assert set(svc.get("depends_on") or {}) <= expected, (profile, name)
    for name in ("engine-cpu", "rollout", "trainer", "trainer-gpu", "engine"):
        init = compose["services"][name]["depends_on"]["init"]
        assert init["condition"] == "service_completed_successfully", name


def test_compose_health_restart_volumes_and_privileges(compose):
    services = compose["services"]
    for name, svc in services.items():
        assert svc["restart"] in RESTART.get(name, ("unless-stopped", "always")), name
        if name in ("init", "submit"):  # one-shot
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
        for port in re.findall(r"127\.0\.0\.1:(\d+)/", " ".join(test)):
            assert int(port) in exposed(svc), f"{name}'s health check probes a port it does not expose"

    redis = services["redis"]
    cmd = redis["command"]
    assert flag(cmd, "--appendonly") == "yes" and flag(cmd, "--appendfsync") == "always"
    assert mounts(redis)["/data"] in compose["volumes"]

    weights = mounts(services["trainer"])["/weights"]
    assert weights in compose["volumes"]
    for name in ("trainer-gpu", "engine", "engine-cpu", "init"):
        assert mounts(services[name])["/weights"] == weights, f"{name} must share the weights volume"

    gpus = {}
    for name in ("engine", "trainer-gpu"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert "count" not in device, f"{name}: explicit device_ids, not a count"
        gpus[name] = set(device["device_ids"])
    assert gpus["engine"] and gpus["trainer-gpu"] and not gpus["engine"] & gpus["trainer-gpu"], gpus
    assert not services["engine"]["image"].endswith(":latest"), "pin the SGLang image"

    # Only the reward service gets what bubblewrap needs; nothing is privileged.
    reward = services["reward"]
    assert set(reward["security_opt"]) == {
        f"{opt}=unconfined" for opt in ("seccomp", "apparmor", "systempaths")
    }
    assert reward["user"] == "0:0"
    for name, svc in services.items():
        assert not svc.get("privileged") and not svc.get("cap_add"), name
        if name != "reward":
            assert not svc.get("security_opt"), name


def test_compose_commands_parse_with_the_services_settings(compose, compose_settings):
    services = compose["services"]
    assert set(compose_settings) == {"engine-cpu", "rollout", "reward", "trainer", "trainer-gpu"}
    for name, (settings, _) in compose_settings.items():
        host, port = listen(settings)
        assert host == "0.0.0.0", f"{name} listens on {host}: unreachable from other containers"
        assert port in exposed(services[name]), f"{name} listens on {port}, exposes {exposed(services[name])}"

    rollout = compose_settings["rollout"][0]
    trainer, launch = compose_settings["trainer"]
    assert int(launch.nproc_per_node) >= 1
    for profile in PROFILES:
        assert [assert_reaches(compose, u, profile) for u in rollout.engine_url_list] == [
            "engine-cpu" if profile == "cpu" else "engine"
        ]
        assert assert_reaches(compose, rollout.reward_url, profile) == "reward"
        assert assert_reaches(compose, rollout.redis_url, profile) == "redis"
    assert trainer.redis_url == rollout.redis_url and trainer.run == rollout.run
    assert compose_settings["trainer-gpu"][0].model_dump() == trainer.model_dump()

    # One policy: init builds it, the engines serve it, rollout tokenizes with it, the trainer trains it.
    model = flag(services["init"]["command"], "--model")
    sglang = services["engine"]["command"]
    assert sglang[:3] == ["python3", "-m", "sglang.launch_server"] and "--enable-metrics" in sglang
    assert flag(sglang, "--port") == "30000" and flag(sglang, "--host") == "0.0.0.0"
    assert compose_settings["engine-cpu"][0].model == rollout.tokenizer == trainer.model_path == model
    assert flag(sglang, "--model-path") == model
    # Published versions land on the volume every engine mounts at the same path, and are the
    # only directories the reference engine loads (its weights_root); it requires the token.
    assert PurePosixPath(trainer.output_dir).is_relative_to("/weights")
    engine = compose_settings["engine-cpu"][0]
    assert PurePosixPath(engine.weights_root) == PurePosixPath(trainer.output_dir) / "weights"
    assert engine.token == COMPOSE_TOKEN


def test_demo_submission_is_a_valid_rollout_job(compose, tmp_path):
    from asyncrl.proto.rollout import RolloutRequest
    from asyncrl.services.reward.verifiers.toy import ReverseVerifier
    from asyncrl.services.rollout.submit import read_rows

    services = compose["services"]
    submit = services["submit"]["command"]
    assert submit[:2] == ["asyncrl", "submit"] and submit[2] == flag(services["init"]["command"], "--data")
    options = dict(zip(submit[3::2], submit[4::2]))
    assert assert_reaches(compose, options["--url"], "cpu") == "rollout"

    spec = importlib.util.spec_from_file_location("init_demo", ROOT / "deploy/init_demo.py")
    init_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(init_demo)
    init = services["init"]["command"]
    config = Path(mounts(services["init"])[flag(init, "--config")])
    model, demo = init_demo.load_config(config)  # the run config every service of the stack reads
    assert config == ROOT / "configs/demo.toml" and model.build_tiny
    init_demo.write_dataset(tmp_path / "reverse.jsonl", demo, 64)
    rows = list(read_rows(tmp_path / "reverse.jsonl"))  # the submit command's own reader
    request = RolloutRequest(
        prompts=rows,
        group_size=int(options["--group-size"]),
        sampling_params=json.loads(options["--sampling-params"]),
        reward_spec=json.loads(options["--reward-spec"]),
        idempotency_key=options["--idempotency-key"],
    )
    assert request.reward_spec.verifier == ReverseVerifier.name and request.group_size == demo.group_size
    # Fixed-length answers, as `asyncrl demo` asks: early EOS cannot collapse entropy; special
    # tokens stay in the text so the reward is exact per token.
    assert request.sampling_params.ignore_eos and request.sampling_params.max_new_tokens == demo.prompt_len
    assert request.sampling_params.skip_special_tokens is False
    assert len({row["prompt_id"] for row in rows}) == len(rows)
    for row in rows:
        target = row["reward_spec"]["target"]  # each prompt carries its own target, as in the demo
        assert row["reward_spec"]["verifier"] == ReverseVerifier.name
        assert len(target) == demo.prompt_len and set(target) <= set(demo.letters)
        assert row["text"] == "<bos>" + target[::-1] + ">"


def test_dockerfile_pins_cpu_torch_and_installs_bubblewrap(compose):
    text = (ROOT / "deploy/Dockerfile").read_text()
    pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pin)}$", text, re.MULTILINE), (
        "Dockerfile torch != pyproject pin"
    )
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    torch_at = re.search(
        r'^RUN pip install "torch==\$\{TORCH_VERSION\}" --index-url "\$\{TORCH_INDEX_URL\}"$',
        text,
        re.MULTILINE,
    )
    package_at = re.search(r"^RUN pip install '\.\[engine,rollout,trainer\]'", text, re.MULTILINE)
    assert torch_at and package_at and torch_at.start() < package_at.start(), "torch must be installed first"
    reward = text[text.index("FROM base AS reward") : text.index("FROM base AS full")]
    assert re.search(r"^RUN pip install '\.\[reward\]'", reward, re.MULTILINE), (
        "the reward image: its extra only"
    )

    assert re.search(r"apt-get install[^\n]*\bbubblewrap\b", text)
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]  # fmt: skip
    for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"COPY {path}: no such path"
            assert not any(PurePosixPath(path).match(p) or path.split("/")[0] == p for p in ignored), path
    for name, svc in compose["services"].items():
        if "build" in svc:
            assert (
                Path(svc["build"]["context"]) == ROOT and svc["build"]["dockerfile"] == "deploy/Dockerfile"
            ), name


# --- Prometheus and Grafana ----------------------------------------------------------------------


def test_prometheus_config_passes_promtool(tmp_path):
    proc = run_tool("promtool", "check", "config", str(PROMETHEUS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bad = tmp_path / "prometheus.yml"
    bad.write_text(PROMETHEUS.read_text().replace("scrape_interval: 5s", "scrape_interval: 5 parsecs"))
    assert run_tool("promtool", "check", "config", str(bad)).returncode != 0


def test_scrape_targets_are_compose_services_and_ports(compose):
    config = yaml.safe_load(PROMETHEUS.read_text())
    scraped = set()
    for job in config["scrape_configs"]:
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        targets += [f"{n}:{sd['port']}" for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
        assert targets, job["job_name"]
        for target in targets:
            host, port = target.rsplit(":", 1)
            if host == "localhost":  # Prometheus scraping itself
                assert job["job_name"] == "prometheus"
                host = "prometheus"
            for profile in PROFILES:
                scraped.add(assert_reaches(compose, f"http://{host}:{port}/metrics", profile))
    assert {"rollout", "reward", "trainer", "trainer-gpu", "engine", "engine-cpu"} <= scraped
    prometheus = compose["services"]["prometheus"]
    assert Path(mounts(prometheus)["/etc/prometheus/prometheus.yml"]) == PROMETHEUS
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


@pytest.fixture(scope="module")
def code_metrics() -> dict[str, set[str]]:
    """Every exposed sample name of the code's asyncrl_ metrics -> its label names."""
    from prometheus_client import REGISTRY

    for path in [
        *ROOT.glob("services/**/metrics.py"),
        *ROOT.glob("trainer/metrics.py"),
        *ROOT.glob("buffer/metrics.py"),
    ]:
        importlib.import_module(module_name(path))
    out: dict[str, set[str]] = {}
    # The registry keeps collectors -> exposed names only privately; there is no public listing.
    for collector, exposed_names in list(REGISTRY._collector_to_names.items()):
        labels = set(getattr(collector, "_labelnames", ()))
        for name in exposed_names:
            if name.startswith("asyncrl_"):
                out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return out


def dashboard_targets() -> list[tuple[dict, dict]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(panel, target) for panel in dash["panels"] for target in panel.get("targets", [])]


def test_dashboard_metric_and_label_names_exist_in_the_code(code_metrics):
    assert len(code_metrics) > 50  # the modules were found and imported
    for panel, target in dashboard_targets():
        used = set(METRIC.findall(target["expr"]))
        assert used, f"{panel['title']}: no asyncrl_/sglang: metric in {target['expr']}"
        unknown = {m for m in used if m not in code_metrics and m not in SGLANG_METRICS}
        assert not unknown, f"panel {panel['title']!r} uses metrics no code registers: {sorted(unknown)}"
        allowed = {"instance", "job"} | {label for m in used for label in code_metrics.get(m, ())}
        if used & SGLANG_METRICS:
            allowed |= {"le", "model_name"}
        labels = {s.strip() for g in GROUPING.findall(target["expr"]) for s in g.split(",") if s.strip()}
        labels |= {label for g in MATCHERS.findall(target["expr"]) for label in MATCHER_LABEL.findall(g)}
        labels |= set(LEGEND_LABEL.findall(target.get("legendFormat", "")))
        assert labels <= allowed, f"panel {panel['title']!r}: labels {sorted(labels - allowed)} do not exist"


def test_dashboard_queries_pass_promtool(tmp_path):
    rules = [{"record": f"asyncrl:dashboard_{panel['id']}_{target['refId']}",
              "expr": target["expr"].replace("$__rate_interval", "1m")}
             for panel, target in dashboard_targets()]  # fmt: skip
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = run_tool("promtool", "check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(rules)} rules found" in proc.stdout


def test_dashboard_has_the_required_panels():
    exprs_by_kind: dict[str, str] = {}
    for panel, target in dashboard_targets():
        exprs_by_kind[panel["type"]] = exprs_by_kind.get(panel["type"], "") + "\n" + target["expr"]
    every = "\n".join(exprs_by_kind.values())
    required = {
        "reward": ["asyncrl_trainer_reward_mean"],
        "buffer depth": ["asyncrl_buffer_depth"],
        "IS weight and mismatch KL": ["asyncrl_trainer_is_weight_mean", "asyncrl_trainer_mismatch_kl"],
        "tokens/s per engine": ["by (instance) (rate(asyncrl_engine_generated_tokens_total",
                                "by (instance) (rate(sglang:generation_tokens_total"],
        "reward latency and failures": ["asyncrl_reward_verify_seconds_bucket", "asyncrl_reward_verifier_failures_total"],
        "trainer step time split": ["by (phase) (rate(asyncrl_trainer_phase_seconds_sum"],
        "idle ratios": ["asyncrl_trainer_idle_ratio", "asyncrl_engine_running_requests > bool 0"],
    }  # fmt: skip
    for topic, needles in required.items():
        for needle in needles:
            assert needle in every, f"no panel for {topic}: {needle!r} not queried"
    assert "asyncrl_trainer_group_staleness_bucket" in exprs_by_kind.get("heatmap", ""), "staleness histogram"


def test_grafana_provisioning_matches_compose_and_dashboard(compose):
    grafana, prometheus = compose["services"]["grafana"], compose["services"]["prometheus"]
    (datasource,) = yaml.safe_load((PROVISIONING / "datasources/prometheus.yml").read_text())["datasources"]
    url = urlsplit(datasource["url"])
    assert (
        datasource["type"] == "prometheus"
        and url.hostname == "prometheus"
        and url.port in exposed(prometheus)
    )
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards/asyncrl.yml").read_text())["providers"]
    grafana_mounts = mounts(grafana)
    assert Path(grafana_mounts[provider["options"]["path"]]) == DASHBOARD.parent
    assert Path(grafana_mounts["/etc/grafana/provisioning"]) == PROVISIONING
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"

    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            uids = {panel["datasource"]["uid"]} | {t["datasource"]["uid"] for t in panel["targets"]}
            assert uids == {datasource["uid"]}, panel["title"]
