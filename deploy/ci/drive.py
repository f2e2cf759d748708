"""Drive the compose stack the way a user does, from the host, and check what comes back.

Run by `deploy/ci/compose-up.sh` once the images exist (`DOCKER_HOST`, `COMPOSE_PROJECT_NAME`
and `ASYNCRL_API_TOKEN` set). Standard library only: it runs on the bare CI host.

  1. `docker compose --profile cpu up -d` of every service but Grafana; every healthcheck
     passes, `init` and `submit` exit 0;
  2. a job POSTed to the rollout service's published port (and POSTed again: a duplicate);
  3. the trainer reaches `--steps` steps with the mean reward of the last steps above the first;
  4. `/metrics` answers on every published port; Prometheus lists every target `up`;
  5. `docker kill` of the trainer, then the rollout service, then Redis, each brought back with
     `docker compose up -d SERVICE`: training goes on past where it was, and the group
     accounting is exact (below);
  6. the trainer is stopped, the rollout service left to settle; the accounting again.

Accounting, per job (HTTP `GET /v1/rollouts/{id}`): no group is counted twice by the trainer
(`trained + dropped + withheld + zero_spread + other ≤ buffered`), the trainer's audit log
(`trained.jsonl`) holds every trained group id once and as many as the jobs say were trained,
and the buffer's own counters (`asyncrl buffer stats`) agree with the jobs' totals.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

SERVICES = ["redis", "init", "engine-cpu", "rollout", "reward", "trainer", "submit", "prometheus"]
ONE_SHOT = {"init", "submit"}
ROLLOUT = "http://127.0.0.1:8001"
PUBLISHED_METRICS = {
    "rollout": f"{ROLLOUT}/metrics",
    "reward": "http://127.0.0.1:8002/metrics",
    "prometheus": "http://127.0.0.1:9090/metrics",
}
PROM_JOBS = {"prometheus", "rollout", "reward", "trainer", "engine"}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[drive {time.time() - T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


class Failed(Exception):
    pass


def compose(*args: str, check: bool = True, capture: bool = True) -> str:
    cmd = ["docker", "compose", "--profile", "cpu", *args]
    out = subprocess.run(cmd, check=False, capture_output=capture, text=True, timeout=600)
    if check and out.returncode != 0:
        raise Failed(f"{' '.join(cmd)} exited {out.returncode}: {(out.stderr or '')[-2000:]}")
    return out.stdout or ""


def http(
    method: str, url: str, body: dict | None = None, auth: bool = True, timeout: float = 10
) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if auth:
        req.add_header("Authorization", f"Bearer {os.environ['ASYNCRL_API_TOKEN']}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def ps() -> dict[str, dict]:
    rows = [json.loads(line) for line in compose("ps", "-a", "--format", "json").splitlines() if line.strip()]
    return {r["Service"]: r for r in rows}


def wait_healthy(services: list[str], timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while True:
        state = ps()
        waiting = []
        for s in services:
            row = state.get(s)
            if row is None:
                waiting.append(f"{s}: no container")
            elif s in ONE_SHOT:
                if row["State"] == "exited" and row.get("ExitCode") != 0:
                    raise Failed(f"{s} exited {row.get('ExitCode')}:\n{compose('logs', '--tail', '40', s)}")
                if row["State"] != "exited":
                    waiting.append(f"{s}: {row['State']}")
            elif row["State"] != "running" or row.get("Health") not in ("healthy", ""):
                waiting.append(f"{s}: {row['State']}/{row.get('Health')}")
        if not waiting:
            return
        if time.time() > deadline:
            logs = "\n".join(compose("logs", "--tail", "30", w.split(":")[0], check=False) for w in waiting)
            raise Failed(f"not healthy after {timeout_s:.0f}s: {waiting}\n{logs}")
        time.sleep(3)


def buffer_stats() -> dict:
    return json.loads(
        compose("exec", "-T", "rollout", "asyncrl", "buffer", "stats", "--json", "--run", "demo")
    )


def version() -> int:
    return int(buffer_stats()["admission"]["version"])


def wait_version(target: int, timeout_s: float = 600) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            v = version()
        except Failed:
            v = -1  # the rollout container restarting
        if v >= target:
            return v
        time.sleep(5)
    raise Failed(
        f"trainer did not reach version {target} in {timeout_s:.0f}s:\n{compose('logs', '--tail', '40', 'trainer')}"
    )


def steps_from_logs() -> list[dict]:
    out = compose("logs", "--no-log-prefix", "trainer")
    steps = []
    for line in out.splitlines():
        try:
            event = json.loads(line[line.index("{") :])
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("msg") == "step":
            steps.append(event)
    return steps


def job_ids() -> list[str]:
    """Every job of the run: the `submit` service prints one JSON line per job."""
    ids = []
    for line in compose("logs", "--no-log-prefix", "submit").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "job_id" in row:
            ids.append(row["job_id"])
    return ids


def accounting(jobs: list[str], settled: bool) -> dict[str, int]:
    totals: dict[str, int] = {}
    for job in jobs:
        status, raw = http("GET", f"{ROLLOUT}/v1/rollouts/{job}")
        if status != 200:
            raise Failed(f"GET /v1/rollouts/{job}: {status} {raw[:300]!r}")
        p = json.loads(raw)
        phases = ("queued", "generating", "scoring", "buffered", "failed", "cancelled")
        if min(p[k] for k in phases) < 0 or sum(p[k] for k in phases) != p["groups"]:
            raise Failed(f"job {job}: phases do not add up to its groups: {p}")
        consumed = p["trained"] + p["dropped"] + p["withheld"] + p["zero_spread"] + sum(p["other"].values())
        if consumed > p["buffered"]:
            raise Failed(
                f"job {job}: the trainer consumed {consumed} groups of {p['buffered']} buffered: {p}"
            )
        if settled and consumed + p["in_buffer"] != p["buffered"]:
            raise Failed(
                f"job {job}: buffered {p['buffered']} != consumed {consumed} + in buffer {p['in_buffer']}"
            )
        for k in (*phases, "groups", "trained", "dropped", "withheld", "zero_spread", "in_buffer"):
            totals[k] = totals.get(k, 0) + p[k]
    audit = compose("exec", "-T", "trainer", "cat", "/weights/trainer/trained.jsonl", check=False)
    if not audit:  # the trainer is stopped: read the volume through the rollout container
        audit = compose("exec", "-T", "rollout", "cat", "/weights/trainer/trained.jsonl", check=False)
    # The surviving lineage: a resume at version r discards the steps above r (redone after it).
    steps: list[tuple[int, list[str]]] = []
    checkpointed = 0
    for line in audit.splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        if event["event"] == "resume":
            steps = [(v, ids) for v, ids in steps if v <= event["version"]]
        elif event["event"] == "step":
            steps.append((event["version"], event["groups"]))
        elif event["event"] == "checkpoint":
            checkpointed = event["version"]
    trained_ids = [g for v, ids in steps if v <= checkpointed for g in ids]
    dupes = len(trained_ids) - len(set(trained_ids))
    if dupes:
        raise Failed(f"{dupes} groups trained twice in the surviving lineage (trained.jsonl)")
    totals["audit_acked"] = len(trained_ids)
    totals["audit_checkpoint"] = checkpointed
    if settled and len(trained_ids) != totals["trained"]:
        raise Failed(
            f"trained.jsonl: {len(trained_ids)} groups up to checkpoint v{checkpointed}, "
            f"the jobs say {totals['trained']} were trained (acked)"
        )
    log(f"accounting over {len(jobs)} jobs: {totals}")
    return totals


def check_metrics() -> None:
    for name, url in PUBLISHED_METRICS.items():
        status, body = http("GET", url, auth=False)
        if status != 200 or b"# TYPE" not in body:
            raise Failed(f"{name} /metrics: {status}")
    deadline = time.time() + 60
    while True:
        status, body = http("GET", "http://127.0.0.1:9090/api/v1/targets", auth=False)
        targets = json.loads(body)["data"]["activeTargets"] if status == 200 else []
        health = {t["labels"]["job"]: t["health"] for t in targets}
        if set(health) >= PROM_JOBS and all(h == "up" for h in health.values()):
            log(f"prometheus targets up: {sorted(health)}")
            return
        if time.time() > deadline:
            raise Failed(f"prometheus targets not all up: {health}")
        time.sleep(5)


def host_job_body(tag: str, prompts: int, key: str) -> dict:
    """A job of the first `prompts` reverse-task prompts, their ids prefixed by `tag`."""
    rows = [
        json.loads(line)
        for line in compose(
            "exec", "-T", "rollout", "head", "-n", str(prompts), "/weights/data/reverse.jsonl"
        ).splitlines()
    ]
    return {
        "prompts": [{**r, "prompt_id": f"{tag}-{r['prompt_id']}"} for r in rows],
        "group_size": 8,
        "sampling_params": {
            "temperature": 1.0,
            "max_new_tokens": 3,
            "ignore_eos": True,
            "skip_special_tokens": False,
        },
        "reward_spec": {"verifier": "reverse"},
        "idempotency_key": key,
    }


def post_job(body: dict, what: str) -> dict:
    status, raw = http("POST", f"{ROLLOUT}/v1/rollouts", body)
    if status != 202:
        raise Failed(f"POST /v1/rollouts ({what}): {status} {raw[:500]!r}")
    return json.loads(raw)


def submit_from_host() -> str:
    body = host_job_body("host", 16, "ci-from-host")
    accepted = post_job(body, "from the host")
    status, raw = http("POST", f"{ROLLOUT}/v1/rollouts", body)
    if status != 202 or not json.loads(raw)["duplicate"]:
        raise Failed(f"the same POST again is not a duplicate: {status} {raw[:300]!r}")
    status, _ = http("POST", f"{ROLLOUT}/v1/rollouts", body, auth=False)
    if status != 401:
        raise Failed(f"POST without the token: {status}, expected 401")
    log(f"host job {accepted['job_id']}: {accepted['groups']} groups (repeat: duplicate; no token: 401)")
    return accepted["job_id"]


TOP_UP_PROMPTS = 256  # groups enough for ~8 steps of 32 past a restart, whatever was left


def top_up(tag: str) -> str:
    """Submit another job from the host. The submitted jobs are finite and a fast machine can
    train all of them before the last kill; the steps asked for after a restart then need new
    groups. The job is counted in the accounting like the others."""
    accepted = post_job(host_job_body(tag, TOP_UP_PROMPTS, f"ci-{tag}"), tag)
    log(f"{tag} job {accepted['job_id']}: {accepted['groups']} groups")
    return accepted["job_id"]


def kill_and_restart(service: str, jobs: list[str], resume: int) -> None:
    before = version()
    cid = compose("ps", "-q", service).strip()
    subprocess.run(["docker", "kill", cid], check=True, capture_output=True, timeout=60)
    log(f"docker kill {service} at version {before}")
    time.sleep(3)
    compose("up", "-d", "--no-build", "--pull", "never", service)
    wait_healthy([s for s in SERVICES if s != "submit"], timeout_s=300)
    jobs.append(top_up(f"after-{service}"))
    v = wait_version(before + resume)
    log(f"{service} back; trainer at version {v}")
    accounting(jobs, settled=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", default=os.environ.get("COMPOSE_PROJECT_NAME", "asyncrl-ci"))
    parser.add_argument("--steps", type=int, default=30, help="trainer steps before the kills")
    parser.add_argument("--resume-steps", type=int, default=3, help="steps past each kill")
    args = parser.parse_args()
    os.environ["COMPOSE_PROJECT_NAME"] = args.project

    compose("up", "-d", "--no-build", "--pull", "never", *SERVICES, capture=False)
    wait_healthy(SERVICES, timeout_s=420)
    log("every service healthy; init and submit exited 0")
    host_job = submit_from_host()
    jobs = [*job_ids(), host_job]

    v = wait_version(args.steps, timeout_s=900)
    steps = steps_from_logs()
    rewards = [s["reward_mean"] for s in steps]
    k = max(len(rewards) // 5, 1)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    log(f"trainer at version {v}: mean reward of the first {k} steps {first:.3f}, of the last {k} {last:.3f}")
    if not last > first:
        raise Failed(f"reward did not rise: {rewards}")
    check_metrics()
    accounting(jobs, settled=False)

    for service in ("trainer", "rollout", "redis"):
        kill_and_restart(service, jobs, args.resume_steps)
    check_metrics()

    compose("stop", "trainer")
    time.sleep(10)  # admission fills up without a trainer; let in-flight groups land
    totals = accounting(jobs, settled=True)
    stats = buffer_stats()
    log(f"buffer stats: depth {stats['depth']} pending {stats['pending']} counters {stats['counters']}")
    c = stats["counters"]
    pairs = {"jobs_enqueued": "groups", "put": "buffered", "trained": "trained", "dropped": "dropped"}
    wrong = {k: (c.get(k, 0), totals[v]) for k, v in pairs.items() if c.get(k, 0) != totals[v]}
    if wrong:
        raise Failed(f"buffer counters disagree with the jobs' totals (counter, jobs): {wrong}")
    log("passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failed as exc:
        log(f"FAIL: {exc}")
        sys.exit(1)
