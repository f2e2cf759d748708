"""The demo's progress reading: what it takes off the trainer's /metrics (a real HTTP server
on loopback serving Prometheus text)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from services.common.serving import serve_app_in_thread
from services.demo import History, scrape_trainer
from services.rollout.testing import free_port

TEXT = """# TYPE asyncrl_trainer_version gauge
asyncrl_trainer_version {version}
# TYPE asyncrl_trainer_reward_mean gauge
asyncrl_trainer_reward_mean {reward}
# TYPE asyncrl_trainer_entropy gauge
asyncrl_trainer_entropy {entropy}
# TYPE asyncrl_trainer_group_staleness histogram
asyncrl_trainer_group_staleness_bucket{{le="0.0"}} 0.0
asyncrl_trainer_group_staleness_bucket{{le="1.0"}} {count}
asyncrl_trainer_group_staleness_bucket{{le="2.0"}} {count}
asyncrl_trainer_group_staleness_bucket{{le="+Inf"}} {count}
asyncrl_trainer_group_staleness_count {count}
asyncrl_trainer_group_staleness_sum {total}
"""


def test_before_the_first_step_there_is_no_reward_and_after_it_there_is():
    state = {"version": 0, "reward": 0.0, "entropy": 0.0, "count": 0.0, "total": 0.0}
    app = FastAPI()

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(TEXT.format(**state))

    server = serve_app_in_thread(app, free_port(), "fake-trainer")
    history = History()
    try:
        start = scrape_trainer(server.url, 0.0)
        history.add(start)
        state.update(version=3, reward=0.25, entropy=1.5, count=64.0, total=40.0)
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


def test_evaluations_are_read_once_per_version_and_summarised(tmp_path):
    """The demo reads finished evaluations off a (real, loopback) `/v1/evaluations` listing, one
    row per version, and its summary states base, last and best accuracy and the gains."""
    from services.demo import Evals, eval_summary, plot

    listing = {"evaluations": [
        {"eval_id": "a", "state": "done", "version": 0, "accuracy": 0.25, "mean_reward": 0.25, "mean_length": 100.0,
         "prompts": 4, "started_at": 1000.0, "finished_at": 1010.0},
        {"eval_id": "b", "state": "done", "version": 10, "accuracy": 0.5, "mean_reward": 0.5, "mean_length": 80.0,
         "prompts": 4, "started_at": 1100.0, "finished_at": 1130.0},
        {"eval_id": "c", "state": "running", "version": 20, "accuracy": None, "mean_reward": None, "mean_length": None,
         "prompts": 4, "started_at": 1200.0, "finished_at": None},
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
        listing["evaluations"][2].update(state="done", accuracy=0.375, mean_reward=0.375, mean_length=70.0,
                                         finished_at=1250.0)  # fmt: skip
        second = evals.poll(every_s=0.0)
        assert [r["version"] for r in second] == [20]  # versions already read are not repeated
    finally:
        server.stop()
    s = eval_summary(evals.sorted())
    assert s["eval_base_accuracy"] == 0.25 and s["eval_last_accuracy"] == 0.375 and s["eval_last_version"] == 20
    assert s["eval_best_accuracy"] == 0.5 and s["eval_best_version"] == 10
    assert s["eval_gain_last"] == 0.125 and s["eval_gain_best"] == 0.25
    history = History()
    for v, reward in ((1, 0.2), (2, 0.3)):
        history.rows.append({"t": 10.0 * v, "version": v, "reward": reward, "staleness": 1.0})
    plot(history, tmp_path / "demo.png", None, 1, evals.sorted())
    assert (tmp_path / "demo.png").stat().st_size > 10_000
