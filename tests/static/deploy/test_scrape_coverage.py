"""Every shipped way to scrape asyncrl reaches every asyncrl service, or CI fails.

`promtool check config` says SUCCESS for a job that finds no target, so it cannot tell. Here:
* deploy/prometheus/prometheus.yml (compose): a job for each service that serves /metrics;
  that each target is a compose service and port is test_deploy_configs.py's check.
* deploy/k8s: Prometheus finds pods by their `prometheus.io/*` annotations; each asyncrl
  workload that serves /metrics carries them, on one of its container's ports.
* `asyncrl up` (services/ops/scrape.py): the config it writes passes promtool, and has a job,
  and a target on the configured port, for every service the launcher plans to start.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from deploy_support import K8S, ROOT

from asyncrl.services.ops.launcher import Launcher
from asyncrl.services.ops.run_config import RunConfig
from asyncrl.services.ops.scrape import targets_of, write_scrape_config

SERVICES = {"rollout", "reward", "engine", "trainer"}  # each serves /metrics (Redis does not)
K8S_NAMES = {"rollout": "rollout", "reward": "reward", "engine": "sglang", "trainer": "trainer"}


def test_compose_scrape_config_has_a_job_for_every_service():
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {}
    for job in config["scrape_configs"]:
        sd = job.get("static_configs", []) + job.get("dns_sd_configs", [])
        jobs[job["job_name"]] = [t for c in sd for t in c.get("targets", []) + c.get("names", [])]
    assert set(jobs) >= SERVICES, f"no scrape job for {SERVICES - set(jobs)}"
    assert all(jobs[s] for s in SERVICES), {s: jobs[s] for s in SERVICES}


def test_k8s_workloads_are_annotated_for_scraping():
    scraped = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            template = doc["spec"]["template"]
            notes = template["metadata"].get("annotations", {})
            if notes.get("prometheus.io/scrape") != "true":
                continue
            ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            assert int(notes["prometheus.io/port"]) in ports, (path.name, notes, ports)
            assert notes.get("prometheus.io/path", "/metrics") == "/metrics"
            scraped[template["metadata"]["labels"]["app.kubernetes.io/name"]] = int(
                notes["prometheus.io/port"]
            )
    missing = {s for s in SERVICES if K8S_NAMES[s] not in scraped}
    assert not missing, f"k8s workloads not annotated for scraping: {missing} (scraped: {scraped})"


def _launcher(tmp_path: Path, **launch) -> Launcher:
    raw = tomllib.loads((ROOT / "configs/demo.toml").read_text())
    raw["run"].update(id="scrape", dir=str(tmp_path / "run"))
    raw["launch"].update(launch)
    return Launcher(RunConfig.model_validate(raw), tmp_path / "config.toml", echo=False)


def test_asyncrl_up_scrape_config_targets_every_planned_service(tmp_path):
    launcher = _launcher(tmp_path, reward_replicas=2, rollout_replicas=2, rollout_port=9101,
                         reward_port=9201, engine_port=9301, trainer_metrics_port=9401, metrics_port=9501)  # fmt: skip
    path = write_scrape_config(launcher.run_dir, launcher.scrape_urls(), run_id="scrape")
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("`promtool` is not installed; CI installs it with: apt-get install -y prometheus")
    check = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr
    config = yaml.safe_load(path.read_text())
    found = {}
    for job in config["scrape_configs"]:
        (sd,) = job["file_sd_configs"]
        for group in json.loads(Path(sd["files"][0]).read_text()):
            (target,) = group["targets"]
            found[group["labels"]["service"]] = (job["job_name"], target)
    assert found == {
        "reward-0": ("reward", "127.0.0.1:9201"), "reward-1": ("reward", "127.0.0.1:9202"),
        "engine-0": ("engine", "127.0.0.1:9301"),
        "rollout-0": ("rollout", "127.0.0.1:9101"), "rollout-1": ("rollout", "127.0.0.1:9102"),
        "trainer": ("trainer", "127.0.0.1:9401"), "launcher": ("launcher", "127.0.0.1:9501"),
    }  # fmt: skip


def test_asyncrl_up_scrape_config_follows_the_topology(tmp_path):
    """External engines are scraped where they are; no trainer, no launcher /metrics: no job."""
    launcher = _launcher(tmp_path, trainer=False, metrics_port=0, engines=0,
                         engine_urls=["http://10.0.0.7:30000"])  # fmt: skip
    assert set(targets_of(launcher.scrape_urls())) == {"reward", "rollout", "engine"}
    assert targets_of(launcher.scrape_urls())["engine"][0]["targets"] == ["10.0.0.7:30000"]


def test_a_url_without_a_port_is_refused():
    with pytest.raises(ValueError, match="engine-0.*host:port"):
        targets_of({"engine-0": "http://engine"})
