"""Delta versions over the broadcast: the trainer's BroadcastPublisher (rank 0 of a real gloo
group, in the test process) sends each version to real reference engines (uvicorn in threads,
each its own rank) as only the tensors that changed, with an anchor every few versions. After
every publish each engine's parameters must equal the trainer's full weights of that version
exactly. A delta whose bytes do not hash to the announced sha256, and an engine that does not
hold the delta's base, are refused by the engine (409), counted there and at the trainer, and
healed by the full version in the same pause."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch
from engine_server import free_port, serve_in_thread

from asyncrl.services.transport.weights.broadcast import plan_buckets
from asyncrl.trainer import publish as publish_mod
from asyncrl.trainer.publish import BroadcastPublisher

torch.set_num_threads(1)

ENGINE_COUNTS = {
    "applied": 'asyncrl_engine_weight_deltas_total{result="applied"}',
    "resynced": 'asyncrl_engine_weight_deltas_total{result="resynced"}',
    "base": 'asyncrl_engine_weight_resyncs_total{reason="base"}',
    "hash": 'asyncrl_engine_weight_resyncs_total{reason="hash"}',
}
BUCKET_COUNTS = {
    "buckets_ok": 'asyncrl_engine_weight_updates_total{result="ok",source="distributed"}',
    "buckets_failed": 'asyncrl_engine_weight_updates_total{result="error",source="distributed"}',
}
TRAINER_COUNTS = {
    "refused": 'asyncrl_trainer_weight_resyncs_total{reason="refused"}',
    "behind": 'asyncrl_trainer_weight_resyncs_total{reason="behind"}',
}


def counts(url: str, buckets: bool = False) -> dict[str, float]:
    """The engines' counters (one process: every engine here shares them) and the trainer's;
    with `buckets`, the engines' bucket outcomes too."""
    from prometheus_client import REGISTRY, generate_latest

    text = httpx.get(url + "/metrics").text + generate_latest(REGISTRY).decode()
    out = {}
    for key, sample in {**ENGINE_COUNTS, **TRAINER_COUNTS, **(BUCKET_COUNTS if buckets else {})}.items():
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(sample + " ")]
        out[key] = values[0] if values else 0.0
    return out


def grew(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def trainer_versions(tiny_dir, n: int, dtype: torch.dtype, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """Versions 1..n of the tiny model's weights, tied weights once as the trainer publishes
    them: each version moves every third tensor (a different third each time), so a tensor
    delta holds about a third of the bytes."""
    from transformers import AutoModelForCausalLM

    master = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    master.pop("lm_head.weight")
    g = torch.Generator().manual_seed(seed)
    out = []
    for v in range(1, n + 1):
        for i, name in enumerate(sorted(master)):
            if (i + v) % 3 == 0:
                master[name] = master[name] + 0.01 * torch.randn(master[name].shape, generator=g)
        out.append({k: t.to(dtype).contiguous() for k, t in master.items()})
    return out


def assert_holds(engine, state: dict[str, torch.Tensor]) -> None:
    params = engine.engine.runner.model.state_dict()
    for name, want in state.items():
        assert torch.equal(params[name], want.to(params[name].dtype)), name  # bf16 is exact in fp32
    assert torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def engines(tiny):
    pair = [serve_in_thread(str(tiny), device="cpu", dtype="float32") for _ in range(2)]
    yield pair
    for engine in pair:
        engine.stop()


def publisher(engines, **kwargs) -> BroadcastPublisher:
    """A publisher on a fresh group of `engines` (a new name each: the engines keep old ones)."""
    return BroadcastPublisher(
        [e.url for e in engines],
        "127.0.0.1",
        free_port(),
        "gloo",
        bucket_bytes=kwargs.pop("bucket_bytes", 16 << 10),
        group_name=f"delta-{free_port()}",
        timeout_s=60,
        delta=True,
        **kwargs,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_each_version_equals_the_trainers_full_weights(engines, tiny, dtype):
    engine = engines[0]
    pub = publisher([engine], anchor_every=3)
    versions = trainer_versions(tiny, 5, dtype)
    full_bytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    before = counts(engine.url)
    sent = []
    for v, state in enumerate(versions, start=1):
        out = pub.publish(v, state)
        sent.append((out.delta, out.nbytes))
        assert_holds(engine, state)
        assert engine.engine.weight_version == str(v)
    # anchors at 1 and 4; versions 2, 3 and 5 carry only the changed tensors
    assert [d for d, _ in sent] == [False, True, True, False, True]
    for (is_delta, nbytes), (prev, state) in zip(sent[1:], zip(versions, versions[1:])):
        changed = sum(t.numel() * t.element_size() for k, t in state.items() if not torch.equal(t, prev[k]))
        assert nbytes == (changed if is_delta else full_bytes)
        assert not is_delta or 0 < nbytes < full_bytes
    assert grew(before, counts(engine.url)) == {"applied": 3}
    pub.close()


def test_a_hash_that_differs_is_refused_counted_and_healed_by_the_full_version(engines, tiny, monkeypatch):
    engine = engines[0]
    pub = publisher([engine], anchor_every=10, bucket_bytes=2 << 10)  # a delta of several buckets
    versions = trainer_versions(tiny, 3, torch.bfloat16, seed=8)
    pub.publish(1, versions[0])
    real = publish_mod.compute_delta

    sent = {}

    def corrupting(*args, **kwargs):
        tensors, hashes = real(*args, **kwargs)
        sent.update(tensors)
        last = list(tensors)[-1]  # in the delta's last bucket: the buckets before it are applied
        return tensors, {**hashes, last: "0" * 64}

    monkeypatch.setattr(publish_mod, "compute_delta", corrupting)
    before = counts(engine.url, buckets=True)
    out = pub.publish(2, versions[1])
    assert not out.delta and out.nbytes == sum(t.numel() * 2 for t in versions[1].values())
    assert_holds(engine, versions[1])
    delta_buckets = len(list(plan_buckets(sent.items(), 2 << 10)))
    full_buckets = len(list(plan_buckets(versions[1].items(), 2 << 10)))
    assert delta_buckets > 1
    assert grew(before, counts(engine.url, buckets=True)) == {
        "hash": 1,
        "refused": 1,
        "resynced": 1,
        "buckets_ok": delta_buckets - 1 + full_buckets,  # half the delta applied, then the full version
        "buckets_failed": 1,
    }
    monkeypatch.setattr(publish_mod, "compute_delta", real)
    out = pub.publish(3, versions[2])  # the resync was a new anchor: the chain goes on from it
    assert out.delta
    assert_holds(engine, versions[2])
    pub.close()


def test_an_engine_off_the_base_is_refused_and_resynced_with_the_full_version(engines, tiny, caplog):
    """Engine B's weights are moved by a disk load between two versions (an operator's reload):
    it no longer holds the base, says so (409 naming what it serves), and both engines end on
    the full version."""
    a, b = engines
    pub = publisher(engines, anchor_every=10)
    versions = trainer_versions(tiny, 4, torch.bfloat16, seed=9)
    before = counts(a.url)
    for v in (1, 2):
        pub.publish(v, versions[v - 1])
    resp = httpx.post(
        b.url + "/update_weights_from_disk", json={"model_path": str(tiny), "weight_version": "reloaded"}
    )
    assert resp.status_code == 200, resp.text
    with caplog.at_level(logging.WARNING, logger="asyncrl.trainer"):
        out = pub.publish(3, versions[2])
    assert not out.delta
    (refusal,) = [r.fields["error"] for r in caplog.records if r.name == "asyncrl.trainer"]
    assert (
        "HTTP 409" in refusal and "delta on base '2' refused: this engine holds no whole version" in refusal
    )
    assert "serving weight_version 'reloaded'" in refusal
    for engine in engines:
        assert_holds(engine, versions[2])
        assert engine.engine.weight_version == "3"
    assert pub.publish(4, versions[3]).delta  # both hold 3 whole: the chain goes on
    for engine in engines:
        assert_holds(engine, versions[3])
    # version 2 applied on both and version 4 on both; B's refusal of 3, resynced
    assert grew(before, counts(a.url)) == {"applied": 4, "base": 1, "refused": 1, "resynced": 1}
    pub.close()


def test_an_sglang_engine_gets_sglang_fields_only_and_a_full_version_when_off_the_base(engines, tiny):
    """An engine the publisher takes for SGLang (here a reference engine marked so) is sent the
    changed tensors without the delta extension, which it loads as a plain subset; before each
    delta its served weight_version must be the base, else the version goes out whole."""
    engine = engines[1]
    pub = publisher([engine], anchor_every=10)
    versions = trainer_versions(tiny, 3, torch.bfloat16, seed=10)
    pub.publish(1, versions[0])
    pub.reference = [False]
    before = counts(engine.url)
    assert pub.publish(2, versions[1]).delta
    assert_holds(engine, versions[1])
    httpx.post(
        engine.url + "/update_weights_from_disk", json={"model_path": str(tiny), "weight_version": "x"}
    )
    assert not pub.publish(3, versions[2]).delta
    assert_holds(engine, versions[2])
    # no extension reached the engine: it counted no delta, and the trainer counted the resync
    assert grew(before, counts(engine.url)) == {"behind": 1}
    pub.close()
