"""Delta weight versions end to end: the trainer's DiskPublisher writes a run of versions (full
anchors and deltas) and a real reference engine (HTTP on loopback) loads each with
`/update_weights_from_disk`. After every update the engine's parameters must equal the
trainer's full weights of that version exactly; an engine that missed a delta resyncs from the
anchor (counted), and a corrupted delta is refused by hash (counted) with the engine left on
its version."""

from __future__ import annotations

import os

import httpx
import pytest
import torch
from engine_server import serve_in_thread
from safetensors.torch import load_file, save_file

from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.trainer.publish import DiskPublisher

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-delta")
    build_tiny_model(path, seed=3)
    return path


@pytest.fixture(scope="module")
def running(tiny_dir):
    engine = serve_in_thread(str(tiny_dir), max_new_tokens_cap=50)
    with httpx.Client(base_url=engine.url, timeout=120) as client:
        yield engine, client
    engine.stop()


def metric(client: httpx.Client, sample: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def counts(client: httpx.Client) -> dict[str, float]:
    names = {
        "applied": 'asyncrl_engine_weight_deltas_total{result="applied"}',
        "resynced": 'asyncrl_engine_weight_deltas_total{result="resynced"}',
        "failed": 'asyncrl_engine_weight_deltas_total{result="failed"}',
        "base": 'asyncrl_engine_weight_resyncs_total{reason="base"}',
        "hash": 'asyncrl_engine_weight_resyncs_total{reason="hash"}',
    }
    return {k: metric(client, v) for k, v in names.items()}


def trainer_versions(tiny_dir, n: int, dtype: torch.dtype, seed: int):
    """Weights of versions 1..n as a training run would make them: fp32 master weights moved
    by an Adam-sized step (~lr = 1e-6 per element) each version, published in `dtype`: in bf16
    most elements round to the same value (~5% change here), in fp32 every moved tensor
    changes, so fp32 runs move every third tensor only."""
    from transformers import AutoModelForCausalLM

    master = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).state_dict()
    master.pop("lm_head.weight")  # tied: the trainer publishes it once
    g = torch.Generator().manual_seed(seed)
    names = sorted(master)
    out = []
    for v in range(1, n + 1):
        for i, name in enumerate(names):
            if dtype == torch.bfloat16 or (i + v) % 3 == 0:
                master[name] = master[name] + 1e-6 * torch.randn(master[name].shape, generator=g)
        out.append({k: t.to(dtype).contiguous() for k, t in master.items()})
    return out


def load(client: httpx.Client, path: str, version: int) -> httpx.Response:
    return client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": str(version)})


def assert_engine_holds(engine, state: dict[str, torch.Tensor]) -> None:
    params = engine.engine.runner.model.state_dict()
    for name, want in state.items():
        got = params[name]
        assert got.dtype == torch.float32
        assert torch.equal(got, want.to(torch.float32)), name  # bf16 values are exact in fp32
    assert torch.equal(params["lm_head.weight"], params["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    "dtype,granularity",
    [(torch.bfloat16, "block"), (torch.float32, "tensor")],
    ids=["bf16-blocks", "fp32-tensors"],
)
def test_each_update_equals_the_trainers_full_weights(running, tiny_dir, tmp_path, dtype, granularity):
    engine, client = running
    pub = DiskPublisher(
        tmp_path / "w", tiny_dir, keep=2, delta=True, anchor_every=4, granularity=granularity, block_elems=16
    )
    versions = trainer_versions(tiny_dir, 9, dtype, seed=11)
    before = counts(client)
    sizes = []
    for v, state in enumerate(versions, start=1):
        out = pub.write(v, state)
        sizes.append(out.nbytes)
        resp = load(client, out.path, v)
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        assert_engine_holds(engine, state)
        assert engine.engine.weight_version == str(v)
    after = counts(client)
    # anchors at 1, 5, 9; the six versions between are deltas applied on their base
    assert after["applied"] - before["applied"] == 6
    assert after["base"] - before["base"] == 0 and after["hash"] - before["hash"] == 0
    full = sizes[0]
    assert sizes[4] == sizes[8] == full
    assert all(0 < s < full for i, s in enumerate(sizes) if i not in (0, 4, 8))


def test_a_missed_delta_resyncs_from_the_anchor(running, tiny_dir, tmp_path):
    engine, client = running
    pub = DiskPublisher(
        tmp_path / "w", tiny_dir, keep=1, delta=True, anchor_every=10, granularity="block", block_elems=16
    )
    versions = trainer_versions(tiny_dir, 5, torch.bfloat16, seed=12)
    outs = [pub.write(v, s) for v, s in enumerate(versions, start=1)]
    assert [os.path.isfile(f"{o.path}/model.safetensors") for o in outs] == [True, False, False, False, False]
    first = load(client, outs[0].path, 1)
    assert first.status_code == 200, first.text  # the anchor
    assert load(client, outs[1].path, 2).status_code == 200  # a delta on 1
    before = counts(client)
    resp = load(client, outs[4].path, 5)  # 3 and 4 missed: v5's base is 4, the engine holds 2
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert_engine_holds(engine, versions[4])
    after = counts(client)
    assert after["base"] - before["base"] == 1
    assert after["resynced"] - before["resynced"] == 1
    assert after["applied"] - before["applied"] == 0


def test_a_corrupted_delta_is_refused_and_the_engine_stays(running, tiny_dir, tmp_path):
    engine, client = running
    pub = DiskPublisher(
        tmp_path / "w", tiny_dir, keep=3, delta=True, anchor_every=10, granularity="block", block_elems=16
    )
    versions = trainer_versions(tiny_dir, 2, torch.bfloat16, seed=13)
    first = pub.write(1, versions[0])
    assert load(client, first.path, 1).status_code == 200
    second = pub.write(2, versions[1])
    delta_file = f"{second.path}/delta.safetensors"
    tensors = load_file(delta_file)
    data_name = sorted(k for k in tensors if k.endswith("::data"))[0]
    tensors[data_name][0] = tensors[data_name][0] + 1.0  # one value flipped on disk
    save_file(tensors, delta_file)
    before = counts(client)
    resp = load(client, second.path, 2)
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert "delta refused (hash)" in resp.json()["message"]
    after = counts(client)
    # the hash failed on top of v1, then again while rebuilding from the anchor: refused
    assert after["hash"] - before["hash"] == 1
    assert after["failed"] - before["failed"] == 1
    assert engine.engine.weight_version == "1"
    assert_engine_holds(engine, versions[0])
    # a later anchor (a full version) heals it
    third = pub.write(4, versions[1])  # a gap: written whole
    assert load(client, third.path, 4).status_code == 200
    assert_engine_holds(engine, versions[1])


def test_an_unreadable_delta_manifest_is_refused_and_counted(running, tiny_dir, tmp_path):
    engine, client = running
    pub = DiskPublisher(
        tmp_path / "w", tiny_dir, keep=3, delta=True, anchor_every=10, granularity="block", block_elems=16
    )
    versions = trainer_versions(tiny_dir, 2, torch.bfloat16, seed=14)
    first = pub.write(1, versions[0])
    assert load(client, first.path, 1).status_code == 200
    second = pub.write(2, versions[1])
    with open(f"{second.path}/delta.json", "w") as f:
        f.write('{"format": "asyncrl-delta/1", "version": "two"')  # truncated
    before = metric(client, 'asyncrl_engine_weight_resyncs_total{reason="malformed"}')
    failed = counts(client)["failed"]
    resp = load(client, second.path, 2)
    assert resp.status_code == 400 and "delta refused (malformed)" in resp.json()["message"]
    assert metric(client, 'asyncrl_engine_weight_resyncs_total{reason="malformed"}') == before + 1
    assert counts(client)["failed"] == failed + 1
    assert engine.engine.weight_version == "1"
    assert_engine_holds(engine, versions[0])
