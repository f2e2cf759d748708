"""Weight updates of the reference engine: from a safetensors directory and from a gloo
broadcast sent by a separate trainer process (rank 0). After either, the engine must answer
exactly like a fresh engine loaded from the new weights (greedy tokens and logprobs)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest
import torch
from engine_server import free_port, serve_in_thread
from waiting import wait_until

from asyncrl.services.engine.updates import REFUSED_PATH
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)

PROBES = [[1, 5, 6, 7], [1, 9, 9], [1, 12, 13, 14, 15, 16]]
PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    base = tmp_path_factory.mktemp("weights")
    dirs = {}
    for seed in (0, 1):
        dirs[seed] = str(base / f"w{seed}")
        build_tiny_model(dirs[seed], seed=seed)
    return dirs


@pytest.fixture(scope="module")
def engines(weights):
    updated = serve_in_thread(weights[0], max_new_tokens_cap=200)
    fresh_w1 = serve_in_thread(weights[1], max_new_tokens_cap=200)
    yield updated, fresh_w1
    updated.stop()
    fresh_w1.stop()


def probe(url: str) -> list[tuple[list[int], list[float], str]]:
    out = httpx.post(
        f"{url}/generate",
        json={"input_ids": PROBES, "sampling_params": PARAMS, "return_logprob": True},
        timeout=60,
    )
    assert out.status_code == 200, out.text
    return [
        (
            o["output_ids"],
            [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
            o["meta_info"]["weight_version"],
        )
        for o in out.json()
    ]


def assert_same_outputs(got, want):
    for (tokens_a, lps_a, _), (tokens_b, lps_b, _) in zip(got, want):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) <= 1e-6


@pytest.fixture(scope="module")
def fresh_w0_outputs(engines):
    return probe(engines[0].url)  # taken before any update: a fresh engine on w0


def test_update_from_disk_equals_fresh_load(engines, weights, fresh_w0_outputs):
    updated, fresh_w1 = engines
    want = probe(fresh_w1.url)
    assert [t for t, _, _ in want] != [t for t, _, _ in fresh_w0_outputs]  # the update is visible
    resp = httpx.post(
        f"{updated.url}/update_weights_from_disk",
        json={"model_path": weights[1], "weight_version": "1"},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    got = probe(updated.url)
    assert_same_outputs(got, want)
    assert {v for _, _, v in got} == {"1"}


def test_bad_disk_update_keeps_weights(engines, tmp_path):
    updated, _ = engines
    before = probe(updated.url)
    resp = httpx.post(
        f"{updated.url}/update_weights_from_disk",
        json={"model_path": str(tmp_path / "missing"), "weight_version": "9"},
    )
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert resp.json()["message"] == REFUSED_PATH  # the same for every refused path: no file-system probe
    other = tmp_path / "other"
    build_tiny_model(other, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    resp = httpx.post(
        f"{updated.url}/update_weights_from_disk", json={"model_path": str(other), "weight_version": "9"}
    )
    assert resp.status_code == 400 and "shape mismatch" in resp.json()["message"]
    after = probe(updated.url)
    assert_same_outputs(after, before)
    assert after[0][2] == before[0][2] != "9"


TRAINER = textwrap.dedent(
    """
    import sys, threading, httpx, torch
    torch.set_num_threads(1)
    from safetensors.torch import load_file
    from asyncrl.services.transport.weights.broadcast import broadcast_weights, http_announcer, init_weight_update_group

    url, weights_file, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "wsync", "backend": "gloo"}
    joined = {}
    t = threading.Thread(target=lambda: joined.update(r=httpx.post(url + "/init_weights_update_group", json=body, timeout=60)))
    t.start()
    group = init_weight_update_group("127.0.0.1", port, 0, 2, "wsync", "gloo", timeout_s=60)
    t.join()
    assert joined["r"].status_code == 200 and joined["r"].json()["success"], joined["r"].text

    named = sorted(load_file(weights_file).items())
    # Outside a weight-update session (SGLang 0.5.23) a bucket is drained, then refused.
    try:
        broadcast_weights(named[:1], group,
                          announce=http_announcer([url], weight_version="1", group_name="wsync", timeout_s=60))
    except RuntimeError as exc:
        print("outside:", exc)
    httpx.post(url + "/pause_generation", json={"mode": "retract"}, timeout=60).raise_for_status()
    httpx.post(url + "/begin_weight_update", json={}, timeout=60).raise_for_status()
    buckets = broadcast_weights(named, group, bucket_bytes=64 * 1024,
                                announce=http_announcer([url], weight_version="2", group_name="wsync", timeout_s=60))
    print("buckets", buckets)

    # A bucket the engine must refuse (unknown name): it still drains the broadcast, then says no.
    try:
        broadcast_weights([("not.a.parameter", torch.zeros(3))], group,
                          announce=http_announcer([url], weight_version="3", group_name="wsync", timeout_s=60))
    except RuntimeError as exc:
        print("refused:", exc)
    httpx.post(url + "/end_weight_update", json={}, timeout=60).raise_for_status()
    httpx.post(url + "/continue_generation", timeout=60).raise_for_status()
    """
)


def test_update_from_gloo_broadcast_equals_fresh_load(engines, weights, fresh_w0_outputs):
    updated, _ = engines
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            TRAINER,
            updated.url,
            os.path.join(weights[0], "model.safetensors"),
            str(port),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=os.getcwd(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    buckets = int(proc.stdout.split("buckets")[1].split()[0])
    assert buckets > 1  # 64 KiB buckets: several metadata calls
    assert "refused:" in proc.stdout and "unknown parameter names" in proc.stdout
    assert "outside: weight update failed" in proc.stdout
    assert "must run between begin_weight_update() and end_weight_update()" in proc.stdout
    got = probe(updated.url)
    assert_same_outputs(got, fresh_w0_outputs)
    assert {v for _, _, v in got} == {"2"}  # the refused bucket did not bump the version


def test_update_waits_for_running_requests(engines, weights):
    """Without pause or abort, an update lets running requests finish under the old weights."""
    updated, fresh_w1 = engines
    want_old = probe(updated.url)[0]
    box = {}
    body = {
        "input_ids": PROBES[0],
        "sampling_params": {**PARAMS, "max_new_tokens": 200},
        "return_logprob": True,
    }
    thread = threading.Thread(
        target=lambda: box.update(r=httpx.post(f"{updated.url}/generate", json=body, timeout=60))
    )
    thread.start()

    def running() -> bool:
        assert thread.is_alive(), "the request finished before the update was sent"
        return (
            httpx.get(f"{updated.url}/get_server_info").json()["internal_states"][0]["num_running_reqs"] > 0
        )

    wait_until(running, interval=0.005, message="the request is running")
    resp = httpx.post(
        f"{updated.url}/update_weights_from_disk",
        json={"model_path": weights[1], "weight_version": "4"},
        timeout=60,
    )
    assert resp.status_code == 200
    thread.join(30)
    out = box["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"][:12] == want_old[0]  # generated entirely under the old weights
    assert out["meta_info"]["weight_version"] == want_old[2] != "4"
    assert probe(updated.url)[0][0] == probe(fresh_w1.url)[0][0]


def test_distributed_update_without_a_group_is_refused(engines):
    updated, _ = engines
    body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2, 2]], "group_name": "nope"}
    resp = httpx.post(f"{updated.url}/update_weights_from_distributed", json=body)
    assert resp.status_code == 400 and "init_weights_update_group" in resp.json()["message"]
    bad = {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 2, "world_size": 2}
    resp = httpx.post(f"{updated.url}/init_weights_update_group", json=bad)
    assert resp.status_code == 422 and "rank_offset" in resp.text


def test_update_while_paused_recomputes_kv_under_new_weights(engines, weights):
    """Frozen (pause in_place) request + update: its old-weight KV is dropped, so the tokens after
    the update are exactly what the new weights give for prompt + tokens so far."""
    updated, fresh_w1 = engines
    url = updated.url
    assert (
        httpx.post(
            f"{url}/update_weights_from_disk", json={"model_path": weights[0], "weight_version": "10"}
        ).status_code
        == 200
    )
    total = 150
    body = {
        "input_ids": PROBES[2],
        "sampling_params": {**PARAMS, "max_new_tokens": total},
        "return_logprob": True,
    }
    w0_alone = httpx.post(f"{url}/generate", json=body, timeout=60).json()["output_ids"]

    def generated() -> int:
        return httpx.get(f"{url}/get_server_info").json()["internal_states"][0]["generated_tokens"]

    base = generated()
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(r=httpx.post(f"{url}/generate", json=body, timeout=60))
    )
    thread.start()

    def five_tokens_in() -> bool:
        assert thread.is_alive(), "the request finished before the pause"
        return generated() >= base + 5

    wait_until(five_tokens_in, interval=0.002, message="5 tokens are generated")
    assert httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    k = generated() - base  # tokens sampled under the old weights
    resp = httpx.post(
        f"{url}/update_weights_from_disk", json={"model_path": weights[1], "weight_version": "11"}, timeout=60
    )
    assert resp.status_code == 200 and resp.json()["num_paused_requests"] == 1
    assert httpx.post(f"{url}/continue_generation").status_code == 200
    thread.join(30)
    out = box["r"].json()
    tokens = out["output_ids"]
    assert 5 <= k < total and len(tokens) == total
    assert tokens[:k] == w0_alone[:k]
    cont = httpx.post(
        f"{fresh_w1.url}/generate",
        json={
            "input_ids": PROBES[2] + tokens[:k],
            "sampling_params": {**PARAMS, "max_new_tokens": total - k},
            "return_logprob": True,
        },
        timeout=60,
    ).json()
    assert tokens[k:] == cont["output_ids"]
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"][k:]]
    want = [lp for lp, _, _ in cont["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
    assert out["meta_info"]["weight_version"] == "11"
