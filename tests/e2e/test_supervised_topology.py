"""`asyncrl up` heals itself: the tiny demo topology trains while the test SIGKILLs, one after
the other, the engine, the reward service, the rollout service, the trainer's worker and the
embedded Redis. Nobody restarts anything by hand: the launcher restarts each service (Redis in
place from its AOF), torchrun restarts the worker (which resumes from its checkpoint), the
clients wait for Redis. Each kill must be followed by progress, and the run must end by itself
when the trainer reaches its last version (exit 0).

Then, read back from the run's Redis (restarted from its AOF once more), the accounting is
exact: the surviving lineage trained every one of its groups once (max_steps · B distinct
groups, each acked); every group put in the buffer left it once (acked, dropped for staleness,
lost with a lost history, …) or is still there, none pending; every submitted job is done,
failed, cancelled or still queued.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import tomli_w

from asyncrl.buffer import Buffer
from asyncrl.buffer import stats as buffer_stats
from asyncrl.buffer.server import RedisServer, embedded_binary, free_port
from asyncrl.services.ops.demo_jobs import submit
from asyncrl.services.ops.demo_metrics import scrape_trainer
from asyncrl.services.ops.launcher import Launcher
from asyncrl.services.ops.run_config import DemoSection, RunConfig

# `make test-extended` (.ci/run's second stage): each service killed in turn, ~2 min
pytestmark = [pytest.mark.slow, pytest.mark.extended]
REPO = Path(__file__).resolve().parents[2]
B = 4  # groups per step
STEPS = 80  # the trainer's max_steps: the run's target (room for five kills at ~0.1 s a step)
PROMPTS = 3 * STEPS * B  # plenty: kills waste groups (stale, lost, in flight)
VICTIMS = ("engine-0", "reward-0", "rollout-0", "trainer worker", "redis")
PROGRESS = 2  # versions the trainer must gain after a victim is back before the next kill


def _config(tmp_path: Path) -> tuple[dict, Path]:
    raw = tomllib.loads((REPO / "configs" / "demo.toml").read_text())
    raw["run"].update(id="heal", dir=str(tmp_path / "run"))
    raw["model"]["path"] = str(tmp_path / "run" / "base")
    raw["launch"].update(engine_port=free_port(), reward_port=free_port(), rollout_port=free_port(),
                         trainer_metrics_port=free_port(), metrics_port=free_port(), health_timeout_s=120,
                         max_restarts=2, restart_backoff_s=0.5, restart_backoff_max_s=2.0,
                         trainer_max_restarts=2)  # fmt: skip
    raw["trainer"].update(max_steps=STEPS, batch_groups=B, max_staleness=2, checkpoint_every=3, block_ms=200)
    # a restarted engine is noticed within a second; a dead replica's jobs are recovered in 6 s
    raw["rollout"].update(
        weights_poll_s=1.0, recover_idle_s=6.0, heartbeat_s=1.0, local_verifiers=[]
    )  # every item scored by the reward service: killing it matters
    raw["demo"].update(prompts_per_step=B, group_size=4)
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(raw))
    return raw, path


def _descendants(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out += [int(entry.name), *_descendants(int(entry.name))]
    return out


def _trainer_worker(launcher: Launcher) -> int:
    for pid in _descendants(launcher.find("trainer").popen.pid):
        try:
            if b"--worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError("no trainer worker process")


def _kill(launcher: Launcher, victim: str) -> None:
    if victim == "redis":
        pid = launcher.redis.proc.pid
    elif victim == "trainer worker":
        pid = _trainer_worker(launcher)
    else:
        pid = launcher.find(victim).popen.pid
    os.kill(pid, signal.SIGKILL)


def _back(launcher: Launcher, victim: str, resumes: int) -> bool:
    if victim == "redis":
        return launcher.redis_proc.restarts == 1 and launcher.redis.alive
    if victim == "trainer worker":  # torchrun's restart: the new worker resumed from its checkpoint
        return resumes >= 2
    proc = launcher.find(victim)
    return proc.restarts == 1 and proc.healthy


def _audit(run_dir: Path) -> list[dict]:
    path = run_dir / "trainer" / "trained.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


@pytest.mark.timeout(420)
def test_each_service_killed_in_turn_the_run_heals_and_accounts_exactly(tmp_path):
    raw, path = _config(tmp_path)
    run_dir = Path(raw["run"]["dir"])
    launcher = Launcher(RunConfig.model_validate(raw), path, echo=False)
    demo = DemoSection.model_validate(raw["demo"])
    timeline: list[tuple[str, int, float]] = []  # (victim, version when killed, seconds until back)
    outcome = None
    try:
        launcher.start()
        submit(launcher.rollout_urls()[0], demo, PROMPTS, random.Random(0))
        t0 = time.monotonic()
        pending = list(VICTIMS)
        killed: tuple[str, int, float] | None = None
        ready_at = 3  # first kill once the trainer is at this version
        version = 0
        while (outcome := launcher.supervise()) is None:
            assert time.monotonic() - t0 < 330, (
                f"stuck: version {version}, timeline {timeline}, pending {pending}"
            )
            s = scrape_trainer(launcher.trainer_url, t0)
            version = s.version if s is not None else version
            if killed is not None:
                victim, at_version, at = killed
                resumes = sum(e["event"] == "resume" for e in _audit(run_dir))
                if _back(launcher, victim, resumes):
                    timeline.append((victim, at_version, round(time.monotonic() - at, 1)))
                    # progress past the kill (a resumed trainer redoes the steps since its checkpoint)
                    killed, ready_at = None, max(version, at_version) + PROGRESS
            elif pending and version >= ready_at:
                victim = pending.pop(0)
                _kill(launcher, victim)
                killed = (victim, version, time.monotonic())
            time.sleep(0.2)  # the supervision tick: this loop is `asyncrl up`'s own, with kills added
        metrics = httpx.get(f"http://127.0.0.1:{raw['launch']['metrics_port']}/metrics", timeout=5).text
    finally:
        launcher.stop()

    assert outcome == 0 and launcher.stop_reason == "trainer finished (exit 0)", launcher.stop_reason
    assert [v for v, *_ in timeline] == list(VICTIMS) and not pending, timeline
    for name in ("engine-0", "reward-0", "rollout-0", "redis"):
        assert f'asyncrl_launcher_restarts_total{{service="{name}"}} 1.0' in metrics, name
    assert 'asyncrl_launcher_restarts_total{service="trainer"}' not in metrics  # torchrun did it

    # ---- exactly once in the surviving lineage (a version's last step entry wins)
    events = _audit(run_dir)
    assert [e["event"] for e in events if e["event"] == "resume"] == ["resume", "resume"]
    lineage: dict[int, dict] = {}
    for e in events:
        if e["event"] == "step":
            lineage[e["version"]] = e
    assert sorted(lineage) == list(range(1, STEPS + 1))
    trained = [gid for v in sorted(lineage) for gid in lineage[v]["groups"]]
    assert len(trained) == len(set(trained)) == STEPS * B

    # ---- the buffer's books, from the AOF the run left behind
    with RedisServer(run_dir / "redis", binary=embedded_binary()) as server:
        buf = Buffer(server.url, "heal")
        stats = buffer_stats(buf)
        states = buf.redis.hmget(buf.keys.group_state, trained)
        buf.close()
    c = stats["counters"]
    assert all(s == b"trained" for s in states), "a trained group is not recorded as trained"
    assert c["trained"] == STEPS * B and stats["pending"]["groups"] == 0
    exits = sum(c.get(reason, 0) for reason in ("trained", "dropped", "withheld", "zero_spread", "lost"))
    assert c.get("dead_lettered", 0) == 0
    assert c["put"] == exits + stats["depth"]["groups"], c
    assert c["jobs_enqueued"] == PROMPTS
    done, failed, cancelled = (c.get(f"jobs_{s}", 0) for s in ("buffered", "failed", "cancelled"))
    assert done + failed + cancelled + stats["depth"]["jobs"] == PROMPTS, c
    assert done <= c["put"] <= done + stats["depth"]["jobs"], (
        c
    )  # a put whose job ack was cut short by the stop
    print(f"timeline (victim, version when killed, seconds until back): {timeline}; counters {c}")
