"""A real Prometheus, started with the scrape config `asyncrl up` wrote, finds every service.

The tiny demo topology (reward, reference engine, rollout, trainer, the launcher's own
/metrics) on free ports; then /usr/bin/prometheus (Debian package `prometheus`) with
`--config.file=run_dir/prometheus.yml`, unchanged, on a free port with a temporary TSDB. Its
/api/v1/targets must show one healthy target per started service, labelled with that
service, and `up{job=...}` must be 1 for each; the jobs must be exactly the kinds of
services started. Redis has no /metrics and is not a target.
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest
import tomli_w
from waiting import wait_until

from asyncrl.buffer.server import free_port
from asyncrl.services.ops.launcher import Launcher
from asyncrl.services.ops.run_config import RunConfig
from asyncrl.services.ops.scrape import main as check_targets
from asyncrl.services.ops.scrape import target_problems

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def _config(tmp_path: Path) -> Path:
    raw = tomllib.loads((REPO / "configs" / "demo.toml").read_text())
    raw["run"].update(id="prom", dir=str(tmp_path / "run"))
    raw["model"]["path"] = str(tmp_path / "run" / "base")
    raw["launch"].update(engine_port=free_port(), reward_port=free_port(), rollout_port=free_port(),
                         trainer_metrics_port=free_port(), metrics_port=free_port(),
                         health_timeout_s=120)  # fmt: skip
    raw.pop("submit", None)  # no work needed: only the endpoints
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def _active_targets(base: str) -> list[dict]:
    try:
        body = httpx.get(f"{base}/api/v1/targets", timeout=2.0).json()
    except httpx.HTTPError:
        return []
    return body["data"]["activeTargets"]


def _up(base: str, job: str) -> list[float]:
    body = httpx.get(f"{base}/api/v1/query", params={"query": f'up{{job="{job}"}}'}, timeout=2.0).json()
    return [float(r["value"][1]) for r in body["data"]["result"]]


@pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="apt-get install -y prometheus")
def test_prometheus_finds_every_service_of_asyncrl_up(tmp_path):
    path = _config(tmp_path)
    launcher = Launcher(RunConfig.model_validate(tomllib.loads(path.read_text())), path, echo=False)
    prom = None
    try:
        launcher.start()
        config = launcher.scrape_config
        assert config == launcher.run_dir / "prometheus.yml"
        started = {p.name for p in launcher.procs} | {"launcher"}
        assert started == {"reward-0", "engine-0", "rollout-0", "trainer", "launcher"}
        port = free_port()
        prom = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("wb"),
        )
        base = f"http://127.0.0.1:{port}"

        def all_up() -> list[dict] | None:
            targets = _active_targets(base)
            services = {t["labels"].get("service") for t in targets if t["health"] == "up"}
            return targets if services == started and len(targets) == len(started) else None

        targets = wait_until(
            all_up, message="every asyncrl target up in Prometheus", timeout=90, interval=0.5
        )
        jobs = {t["labels"]["job"] for t in targets}
        assert jobs == {"reward", "engine", "rollout", "trainer", "launcher"}
        for t in targets:  # the target is the port the launcher gave that service
            assert t["scrapeUrl"].endswith("/metrics")
        ports = {t["labels"]["service"]: int(t["scrapeUrl"].split(":")[2].split("/")[0]) for t in targets}
        ln = launcher.cfg.launch
        assert ports == {"reward-0": ln.reward_port, "engine-0": ln.engine_port, "rollout-0": ln.rollout_port,
                         "trainer": ln.trainer_metrics_port, "launcher": ln.metrics_port}  # fmt: skip
        assert target_problems(base, sorted(jobs)) == {}
        assert check_targets([base, *sorted(jobs)]) == 0
        # a job Prometheus has no target for is an error, not silence
        assert target_problems(base, ["rollout", "grader"]) == {"grader": "no target"}
        assert check_targets([base, "grader"]) == 1
        for job in jobs:  # the scrape landed in the TSDB as well
            assert wait_until(lambda j=job: _up(base, j), message=f"up{{job={job!r}}}", timeout=30) == [1.0]
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(15)
        launcher.stop()
