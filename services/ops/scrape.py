"""The Prometheus scrape config of a topology `asyncrl up` launched, written into its run dir.

The shipped deploy/prometheus/prometheus.yml finds its targets by compose DNS names; outside
compose it would find none, and Prometheus reports no error for a job with no target. So the
launcher writes, for the ports it was configured with, `run_dir/prometheus.yml` (one scrape job
per kind of service) and one file_sd JSON per job under `run_dir/prometheus/`:

    prometheus --config.file=runs/<run>/prometheus.yml

or add the `file_sd_configs` of the jobs to an existing Prometheus. Every service keeps its port
across restarts (the launcher restarts it with the same command), so the files are written once,
before the first process starts. The embedded Redis has no /metrics and is not a target; the
buffer's state is on the rollout and trainer /metrics.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

CONFIG_NAME = "prometheus.yml"
SD_DIR = "prometheus"


def targets_of(urls: dict[str, str]) -> dict[str, list[dict]]:
    """{service name -> base URL} -> {job -> file_sd target groups}: the job is the name before
    its replica index (`reward-1` -> `reward`), and each group labels its `service`."""
    jobs: dict[str, list[dict]] = {}
    for service, url in urls.items():
        job = service.rsplit("-", 1)[0] if service.rsplit("-", 1)[-1].isdigit() else service
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"{service}: {url!r} has no host:port to scrape")
        group = {"targets": [f"{parts.hostname}:{parts.port}"], "labels": {"service": service}}
        jobs.setdefault(job, []).append(group)
    return jobs


def write_scrape_config(run_dir: Path, urls: dict[str, str], *, run_id: str,
                        scrape_interval_s: float = 5.0) -> Path:  # fmt: skip
    """Write run_dir/prometheus.yml and run_dir/prometheus/<job>.json; return the config's path.
    Each file is replaced atomically: a Prometheus watching it never reads half of one."""
    sd_dir = run_dir / SD_DIR
    sd_dir.mkdir(parents=True, exist_ok=True)
    interval = f"{max(int(scrape_interval_s * 1000), 100)}ms"
    scrape_configs = []
    for job, groups in sorted(targets_of(urls).items()):
        sd_file = sd_dir / f"{job}.json"
        _atomic_write(sd_file, json.dumps(groups, indent=2) + "\n")
        scrape_configs.append({"job_name": job, "file_sd_configs": [{"files": [str(sd_file)]}]})
    config = {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "external_labels": {"deployment": "asyncrl-up", "run": run_id},
        },
        "scrape_configs": scrape_configs,
    }
    path = run_dir / CONFIG_NAME
    # JSON is YAML: no YAML library needed at run time
    header = "# written by `asyncrl up` for this run (services/ops/scrape.py)\n"
    _atomic_write(path, header + json.dumps(config, indent=2) + "\n")
    return path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def target_problems(prometheus_url: str, jobs: list[str], *, timeout: float = 5.0) -> dict[str, str]:
    """{job -> what is wrong} for each of `jobs` a running Prometheus does not scrape healthily:
    no active target at all (the case promtool cannot see), or a target not `up` (its last
    error). Empty when every job has targets and all are up. For CI checks of a deployment
    (e.g. compose-ci) as much as for tests."""
    import httpx

    body = httpx.get(f"{prometheus_url.rstrip('/')}/api/v1/targets", timeout=timeout).json()
    active = body["data"]["activeTargets"]
    problems = {}
    for job in jobs:
        mine = [t for t in active if t["labels"].get("job") == job]
        down = [t for t in mine if t["health"] != "up"]
        if not mine:
            problems[job] = "no target"
        elif down:
            problems[job] = "; ".join(
                f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}".strip() for t in down
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    """`python -m asyncrl.services.ops.scrape PROMETHEUS_URL JOB...`: exit 1, naming each job
    that has no target or a target down."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("prometheus_url")
    parser.add_argument("jobs", nargs="+")
    args = parser.parse_args(argv)
    problems = target_problems(args.prometheus_url, args.jobs)
    for job, why in problems.items():
        print(f"prometheus job {job}: {why}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
