"""Background weight publishing (`[trainer] publish_background`): the trainer's own parts and
loop (`trainer.parts.build` + `trainer.loop.train_steps`) on a one-rank gloo world in this
process, over the real Redis buffer, with the disk writer slowed down so that the next step's
optimizer updates the model while a version is still being written."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asyncrl.buffer import Buffer, Groups, PolicyVersions
from asyncrl.proto import Group, Sample
from asyncrl.trainer.config import TrainerSettings
from asyncrl.trainer.publish import DiskPublisher, detach_from

torch.set_num_threads(1)
B, STEPS = 2, 3
SLOW_WRITE_S = 0.3  # longer than a step of the tiny model: each write overlaps the next step


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


def settings(tiny, tmp_path, redis_url, run_id, **over) -> TrainerSettings:
    return TrainerSettings(**{"redis_url": redis_url, "run": run_id, "model_path": str(tiny), "output_dir": str(tmp_path),
                              "batch_groups": B, "max_steps": STEPS, "max_staleness": 100, "checkpoint_every": 100,
                              "metrics_port": 0, "device": "cpu", "publish": "disk", "publish_dtype": "float32",
                              "lr": 1e-2, "block_ms": 100, **over})  # fmt: skip


def slowed(monkeypatch, fail_at: int | None = None) -> list[tuple[int, float]]:
    """DiskPublisher.write sleeps first (and raises for version `fail_at`); returns its calls
    as (version, start time)."""
    calls = []
    write = DiskPublisher.write

    def slow_write(self, version, state, epoch=0):
        calls.append((version, time.monotonic()))
        time.sleep(SLOW_WRITE_S)
        if version == fail_at:
            raise OSError(28, "No space left on device")
        return write(self, version, state, epoch)

    monkeypatch.setattr(DiskPublisher, "write", slow_write)
    return calls


def test_each_version_holds_its_own_steps_weights(tiny, tmp_path, redis_url, run_id, one_rank, monkeypatch):
    from asyncrl.trainer.loop import train_steps
    from asyncrl.trainer.model import full_state_dict
    from asyncrl.trainer.parts import Parts, build

    Groups(Buffer(redis_url, run=run_id)).put(groups(B * STEPS, seed=1))
    calls = slowed(monkeypatch)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    returned: dict[int, float] = {}
    publish = Parts.publish

    def recording(self, version, rollback=False):
        expected[version] = {k: v.clone() for k, v in full_state_dict(self.model).items()}
        publish(self, version, rollback)
        returned[version] = time.monotonic()

    monkeypatch.setattr(Parts, "publish", recording)
    parts = build(settings(tiny, tmp_path, redis_url, run_id), one_rank)
    assert train_steps(parts) == 0

    assert sorted(expected) == [1, 2, 3]
    # The steps ran while the writes slept: each publish returned before its write finished.
    for version, started in calls:
        assert returned[version] < started + SLOW_WRITE_S, version
    assert not torch.equal(
        expected[1]["model.norm.weight"], expected[2]["model.norm.weight"]
    )  # the model moved
    weights = PolicyVersions(Buffer(redis_url, run=run_id))
    assert weights.version() == STEPS  # the last write was waited for before train_steps returned
    for version in (1, 2, 3):
        written = load_file(str(tmp_path / "weights" / f"v{version:08d}" / "model.safetensors"))
        assert set(written) == set(expected[version])
        for name, tensor in written.items():  # the weights after step `version`, not a later step's
            assert torch.equal(tensor, expected[version][name]), (version, name)
    assert weights.latest().path == str(tmp_path / "weights" / f"v{STEPS:08d}")


def test_a_failed_background_write_stops_the_trainer(
    tiny, tmp_path, redis_url, run_id, one_rank, monkeypatch
):
    """The write of version 2 fails (disk full): the trainer raises it at its next publish, and
    version 2 is never announced."""
    from asyncrl.trainer import metrics as tm
    from asyncrl.trainer.loop import train_steps
    from asyncrl.trainer.parts import build

    Groups(Buffer(redis_url, run=run_id)).put(groups(B * STEPS, seed=2))
    calls = slowed(monkeypatch, fail_at=2)
    failures = tm.PUBLISH_FAILURES._value.get()
    with pytest.raises(OSError, match="No space left"):
        train_steps(build(settings(tiny, tmp_path, redis_url, run_id), one_rank))
    assert tm.PUBLISH_FAILURES._value.get() == failures + 1  # counted (and logged) when it failed
    assert [v for v, _ in calls] == [1, 2]  # version 3 was not written after the failure
    weights = PolicyVersions(Buffer(redis_url, run=run_id))
    assert weights.version() == 1
    assert not (tmp_path / "weights" / f"v{2:08d}").exists()


def test_foreground_publishing_waits_for_each_write(tiny, tmp_path, redis_url, run_id, one_rank, monkeypatch):
    """`publish_background = false`: the step does not end before its version is written."""
    from asyncrl.trainer.loop import train_steps
    from asyncrl.trainer.parts import Parts, build

    Groups(Buffer(redis_url, run=run_id)).put(groups(B * STEPS, seed=3))
    calls = slowed(monkeypatch)
    returned: dict[int, float] = {}
    publish = Parts.publish

    def recording(self, version, rollback=False):
        publish(self, version, rollback)
        returned[version] = time.monotonic()

    monkeypatch.setattr(Parts, "publish", recording)
    train_steps(build(settings(tiny, tmp_path, redis_url, run_id, publish_background=False), one_rank))
    for version, started in calls:
        assert returned[version] >= started + SLOW_WRITE_S, version


def test_detach_from_copies_only_what_aliases_the_model(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    state = dict(model.state_dict())
    fresh = state["model.norm.weight"].clone()
    state["model.norm.weight"] = fresh  # e.g. a gathered or cast tensor: not the model's
    snapshot = detach_from(state, model)
    assert snapshot["model.norm.weight"] is fresh
    live = dict(model.named_parameters())["model.embed_tokens.weight"]
    assert snapshot["model.embed_tokens.weight"].data_ptr() != live.data_ptr()
    before = live.detach().clone()
    with torch.no_grad():
        live.add_(1.0)  # what the optimizer does in place
    assert torch.equal(snapshot["model.embed_tokens.weight"], before)
