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
