"""The demo's progress reading: what it takes off the trainer's /metrics (a real HTTP server
on loopback serving Prometheus text)."""

from __future__ import annotations

import json
import time

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from rollout_server import free_port

from asyncrl.services.ops.demo_metrics import scrape_trainer
from asyncrl.services.ops.demo_report import History
from asyncrl.services.runtime.serving import serve_app_in_thread

TEXT = """# TYPE asyncrl_trainer_version gauge
asyncrl_trainer_version {version}
# TYPE asyncrl_trainer_reward_mean gauge
asyncrl_trainer_reward_mean {reward}
# TYPE asyncrl_trainer_entropy gauge
asyncrl_trainer_entropy {entropy}
# TYPE asyncrl_trainer_group_staleness histogram
asyncrl_trainer_group_staleness_bucket{{le="0.0"}} {fresh}
asyncrl_trainer_group_staleness_bucket{{le="1.0"}} {count}
asyncrl_trainer_group_staleness_bucket{{le="2.0"}} {count}
asyncrl_trainer_group_staleness_bucket{{le="+Inf"}} {count}
asyncrl_trainer_group_staleness_count {count}
asyncrl_trainer_group_staleness_sum {total}
"""


def test_before_the_first_step_there_is_no_reward_and_after_it_there_is():
    state = {"version": 0, "reward": 0.0, "entropy": 0.0, "fresh": 0.0, "count": 0.0, "total": 0.0}
    app = FastAPI()

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(TEXT.format(**state))

    server = serve_app_in_thread(app, free_port(), "fake-trainer")
    history = History()
    try:
        start = scrape_trainer(server.url, 0.0)
        history.add(start)
        state.update(version=3, reward=0.25, entropy=1.5, fresh=24.0, count=64.0, total=40.0)
        later = scrape_trainer(server.url, 0.0)
        history.add(later)
    finally:
        server.stop()
    # the gauges' initial 0 is not a reward of 0: the curve must not start at a fake point
    assert (start.version, start.reward, start.entropy) == (0, None, None)
    assert (later.version, later.reward, later.entropy) == (3, 0.25, 1.5)
    assert later.staleness_max_bucket == 1.0  # the first bucket that holds every observation
    assert [r["reward"] for r in history.rows] == [None, 0.25]
    assert history.rows[1]["staleness"] == 40.0 / 64.0
    # groups per staleness, from the cumulative buckets: 24 fresh, 40 one version old
    assert history.staleness_histogram == {"<=0": 24, "<=1": 40}


def test_evaluations_are_read_once_per_version_and_summarised(tmp_path):
    """The demo reads finished evaluations off a (real, loopback) `/v1/evaluations` listing, one
    row per version, and its summary states base, last and best accuracy and the gains, and the
    format rate and accuracy among formatted answers at the base and the last version."""
    from asyncrl.services.ops.demo_report import Evals, _eval_line, eval_summary, plot

    listing = {"evaluations": [
        {"eval_id": "a", "state": "done", "version": 0, "accuracy": 0.25, "mean_reward": 0.25, "mean_length": 100.0,
         "format_rate": 0.25, "formatted_accuracy": 1.0, "prompts": 4, "started_at": 1000.0, "finished_at": 1010.0},
        {"eval_id": "b", "state": "done", "version": 10, "accuracy": 0.5, "mean_reward": 0.5, "mean_length": 80.0,
         "format_rate": 0.5, "formatted_accuracy": 1.0, "prompts": 4, "started_at": 1100.0, "finished_at": 1130.0},
        {"eval_id": "c", "state": "running", "version": 20, "accuracy": None, "mean_reward": None, "mean_length": None,
         "format_rate": None, "formatted_accuracy": None, "prompts": 4, "started_at": 1200.0, "finished_at": None},
    ]}  # fmt: skip
    app = FastAPI()
    asked: list[str | None] = []

    @app.get("/v1/evaluations")
    def evaluations(name: str | None = None) -> dict:
        asked.append(name)
        return listing

    server = serve_app_in_thread(app, free_port(), "fake-rollout")
    try:
        evals = Evals(server.url, "heldout", t0_wall=1000.0)
        first = evals.poll(every_s=0.0)
        assert [r["version"] for r in first] == [0, 10] and asked == ["heldout"]
        assert first[1]["t"] == 130.0 and first[1]["eval_s"] == 30.0
        assert (first[1]["name"], first[1]["format_rate"], first[1]["formatted_accuracy"]) == (
            "heldout",
            0.5,
            1.0,
        )
        listing["evaluations"][2].update(state="done", accuracy=0.375, mean_reward=0.375, mean_length=70.0,
                                         format_rate=0.5, formatted_accuracy=0.75, finished_at=1250.0)  # fmt: skip
        second = evals.poll(every_s=0.0)
        assert [r["version"] for r in second] == [20]  # versions already read are not repeated
    finally:
        server.stop()
    s = eval_summary(evals.sorted())
    assert (
        s["eval_base_accuracy"] == 0.25 and s["eval_last_accuracy"] == 0.375 and s["eval_last_version"] == 20
    )
    assert s["eval_best_accuracy"] == 0.5 and s["eval_best_version"] == 10
    assert s["eval_gain_last"] == 0.125 and s["eval_gain_best"] == 0.25
    # the gain up to v10 was all format (1 of 4 boxed and right -> 2 of 4); v20 boxed as many and got fewer right
    assert (s["eval_base_format_rate"], s["eval_last_format_rate"]) == (0.25, 0.5)
    assert (s["eval_base_formatted_accuracy"], s["eval_last_formatted_accuracy"]) == (1.0, 0.75)
    assert s["eval_formatted_gain_last"] == -0.25
    assert _eval_line(s) == "0.250 / 0.375 (v20); format 0.250 / 0.500, among formatted 1.000 / 0.750"
    history = History()
    for v, reward in ((1, 0.2), (2, 0.3)):
        history.rows.append({"t": 10.0 * v, "version": v, "reward": reward, "staleness": 1.0})
    hard = [{**r, "name": "heldout-hard", "accuracy": r["accuracy"] / 2} for r in evals.sorted()]
    plot(history, tmp_path / "demo.png", None, 1, evals.sorted(), "math", {"heldout-hard": hard})
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_the_scrape_reads_what_prometheus_client_writes():
    """The demo's own line parser against prometheus_client's exposition of the trainer's real
    metrics (labelled outcomes, histogram buckets), value for value."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from asyncrl.services.ops.demo_metrics import SCRAPED, _samples

    reg = CollectorRegistry()
    Gauge("asyncrl_trainer_version", "v", registry=reg).set(7)
    Gauge("asyncrl_trainer_reward_mean", "r", registry=reg).set(0.625)
    groups = Counter("asyncrl_trainer_groups_total", "g", ["outcome"], registry=reg)
    groups.labels("trained").inc(64)
    groups.labels("dropped").inc(3)
    hist = Histogram("asyncrl_trainer_group_staleness", "s", buckets=(0, 1, 2), registry=reg)
    for x in (0, 1, 1, 2):
        hist.observe(x)
    Gauge("asyncrl_trainer_other", "not read", ["phase"], registry=reg).labels('a "quoted" phase').set(1)
    text = generate_latest(reg).decode()
    expected = sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in text_string_to_metric_families(text)
                      for s in f.samples if s.name in SCRAPED)  # fmt: skip
    got = sorted(
        (name, tuple(sorted(labels.items())), value) for name, labels, value in _samples(text, SCRAPED)
    )
    assert got == expected
    assert ("asyncrl_trainer_groups_total", (("outcome", "dropped"),), 3.0) in got
    assert ("asyncrl_trainer_group_staleness_bucket", (("le", "1.0"),), 3.0) in got


def test_the_target_is_the_mean_of_the_last_steps_each_counted_once(tmp_path):
    """The demo's target window is over trainer steps (its log's `step` events), not over its
    scrapes: 5 steps at 1.0 after rewards of 0.5 reach 0.9 at the 5th step's time, whether or
    not a scrape saw them; a line still being written is read at the next poll."""
    import json

    from asyncrl.services.ops.demo_report import StepRewards

    log = tmp_path / "trainer.log"
    lines = ['{"ts": 100.5, "level": "info", "msg": "compute dtype"}']
    lines += [json.dumps({"ts": 100.0 + v, "msg": "step", "version": v, "reward_mean": 0.5 if v < 3 else 1.0})
              for v in range(1, 8)]  # fmt: skip
    log.write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    steps = StepRewards(log, t0_wall=100.0)
    steps.poll()
    assert [v for v, _, _ in steps.rewards] == [1, 2, 3, 4]
    assert steps.windowed(5) is None and steps.reached(5, 0.9) is None
    log.write_text("\n".join(lines) + "\n")
    steps.poll()
    assert [v for v, _, _ in steps.rewards] == [1, 2, 3, 4, 5, 6, 7]
    # windows: v1-5 = (0.5*2 + 1*3)/5 = 0.8; v2-6 = (0.5 + 4)/5 = 0.9 -> reached at v6, t = 106 - 100
    assert steps.reached(5, 0.9) == 6.0
    assert steps.windowed(5) == 1.0


def test_the_final_evaluation_is_found_when_its_version_was_already_evaluated(tmp_path, monkeypatch):
    """The run's last point: the demo evaluates the served version when the time limit passes.
    That version may already have its periodic evaluation (every `eval_every` versions), which
    the demo has read; the final one must still be found, by its id, not waited for until the
    timeout (the listing keeps one row per version). A real loopback server plays the rollout."""
    from asyncrl.services.ops import demo_report
    from asyncrl.services.ops.demo_report import Evals

    monkeypatch.setattr(demo_report, "FINAL_POLL_S", 0.05)

    def record(eval_id: str, accuracy: float, finished_at: float) -> dict:
        return {"eval_id": eval_id, "name": "heldout", "state": "done", "version": 10, "accuracy": accuracy,
                "mean_reward": accuracy, "mean_length": 20.0, "format_rate": 1.0, "formatted_accuracy": accuracy,
                "prompts": 2, "started_at": finished_at - 30.0, "finished_at": finished_at}  # fmt: skip

    periodic, final = record("periodic", 0.5, 1100.0), record("final", 1.0, 1300.0)
    items = [{"prompt_id": f"p{i}", "reward_status": "scored", "reward": 1.0, "formatted": True,
              "completion_tokens": 20} for i in range(2)]  # fmt: skip
    app = FastAPI()
    submitted: list[dict] = []

    @app.get("/v1/evaluations")
    def listing(name: str | None = None) -> dict:
        return {"evaluations": [periodic, final] if submitted else [periodic]}

    @app.post("/v1/evaluations", status_code=202)
    def submit(body: dict) -> dict:
        submitted.append(body)
        return {"eval_id": "final", "name": "heldout", "state": "queued"}

    @app.get("/v1/evaluations/{eval_id}")
    def one(eval_id: str) -> dict:
        return {**{"periodic": periodic, "final": final}[eval_id], "items": items}

    server = serve_app_in_thread(app, free_port(), "fake-rollout")
    try:
        evals = Evals(server.url, "heldout", t0_wall=1000.0, items_dir=tmp_path / "evals")
        evals.final_body = {"name": "heldout", "prompts": [{"text": "1+1"}]}
        assert [r["eval_id"] for r in evals.poll(every_s=0.0)] == ["periodic"]
        started = time.monotonic()
        row = evals.run_final(timeout_s=20.0)
        waited = time.monotonic() - started
    finally:
        server.stop()
    assert row is not None and waited < 10.0, waited
    assert (row["eval_id"], row["version"], row["accuracy"], row["t"]) == ("final", 10, 1.0, 300.0)
    assert submitted == [{"name": "heldout", "prompts": [{"text": "1+1"}]}]
    assert evals.sorted() == [row]  # the version's row is the later evaluation
    saved = (tmp_path / "evals" / "heldout-v10.jsonl").read_text().splitlines()
    assert [json.loads(line)["prompt_id"] for line in saved] == ["p0", "p1"]
