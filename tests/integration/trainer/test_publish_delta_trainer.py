"""`[trainer] publish_delta` through the trainer's own parts and loop (`trainer.parts.build` +
`trainer.loop.train_steps`, one-rank gloo world, real Redis buffer): each version the trainer
publishes (bf16, Adam at lr 1e-7: a few elements change per step) is loaded by a real reference engine (HTTP on loopback) right after it is announced,
and the engine must then hold exactly that step's weights in the publish dtype."""

from __future__ import annotations

import httpx
import numpy as np
import torch
from engine_server import serve_in_thread

from asyncrl.buffer import Buffer, Groups, PolicyVersions
from asyncrl.proto import Group, Sample
from asyncrl.services.engine import metrics as em
from asyncrl.trainer.config import TrainerSettings

torch.set_num_threads(1)
B, STEPS = 2, 4


def groups(n: int, seed: int) -> list[Group]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        samples = [Sample(prompt_id=f"p{g}", index=i, completion_ids=rng.integers(3, 40, 4).astype(np.int32),
                          behavior_logprobs=np.full(4, -3.0, np.float32), versions=np.zeros(4, np.int32),
                          finish_reason="length", reward=float(i % 2), reward_status="scored")
                   for i in range(4)]  # fmt: skip
        out.append(Group.build(group_id=f"g{seed}-{g}", job_id="job", prompt_tokens=np.array([1, 5, 6, 7], np.int32),
                               reward_spec={"verifier": "reverse"}, samples=samples, submit_version=0))  # fmt: skip
    return out


def test_every_trainer_version_reaches_the_engine_exactly(
    tiny, tmp_path, redis_url, run_id, one_rank, monkeypatch
):
    from asyncrl.trainer.loop import train_steps
    from asyncrl.trainer.model import full_state_dict
    from asyncrl.trainer.parts import Parts, build

    engine = serve_in_thread(str(tiny), max_new_tokens_cap=20)
    Groups(Buffer(redis_url, run=run_id)).put(groups(B * STEPS, seed=4))
    held: dict[int, bool] = {}
    anchors: dict[int, bool] = {}
    publish = Parts.publish

    def publish_then_load(self, version, rollback=False):
        want = {k: v.to(torch.bfloat16) for k, v in full_state_dict(self.model).items()}
        publish(self, version, rollback)
        path = PolicyVersions(Buffer(redis_url, run=run_id)).latest().path
        anchors[version] = (tmp_path / "weights" / f"v{version:08d}" / "model.safetensors").is_file()
        resp = httpx.post(
            f"{engine.url}/update_weights_from_disk",
            json={"model_path": path, "weight_version": str(version)},
            timeout=120,
        )
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        params = engine.engine.runner.model.state_dict()
        held[version] = all(torch.equal(params[k], w.to(torch.float32)) for k, w in want.items())

    monkeypatch.setattr(Parts, "publish", publish_then_load)
    cfg = TrainerSettings(
        redis_url=redis_url,
        run=run_id,
        model_path=str(tiny),
        output_dir=str(tmp_path),
        batch_groups=B,
        max_steps=STEPS,
        max_staleness=100,
        checkpoint_every=100,
        metrics_port=0,
        device="cpu",
        publish="disk",
        publish_dtype="bfloat16",
        publish_background=False,
        publish_delta=True,
        delta_anchor_every=3,
        delta_granularity="block",
        delta_block_elems=1,
        lr=1e-7,
        block_ms=100,
    )
    applied = em.WEIGHT_DELTAS.labels(result="applied")._value.get()
    resynced = em.WEIGHT_DELTAS.labels(result="resynced")._value.get()
    try:
        assert train_steps(build(cfg, one_rank)) == 0
    finally:
        engine.stop()
    assert held == {1: True, 2: True, 3: True, 4: True}
    assert anchors == {1: True, 2: False, 3: False, 4: True}  # an anchor every 3rd version
    # 2 and 3 were applied on top of the version the engine held, none rebuilt from the anchor
    assert em.WEIGHT_DELTAS.labels(result="applied")._value.get() == applied + 2
    assert em.WEIGHT_DELTAS.labels(result="resynced")._value.get() == resynced
