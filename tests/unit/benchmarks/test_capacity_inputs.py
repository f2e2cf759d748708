"""benchmarks/capacity_inputs.py's `capacity()`: the arithmetic of docs/scaling.md, on a small
scenario whose every figure is worked out by hand below."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "capacity_inputs.py"
spec = importlib.util.spec_from_file_location("capacity_inputs", PATH)
bench = importlib.util.module_from_spec(spec)
sys.modules["capacity_inputs"] = bench  # dataclasses look their module up while the class is built
spec.loader.exec_module(bench)

# 1B parameters, 10 layers of attention width 1,000 and one KV head of 100; 16 GPUs, 4 a node;
# answers of 1,000 tokens, no prompt; G = 10, B = 10, η = 1, a checkpoint every 2 steps; TP 2.
SCENARIO = bench.Scenario(
    params=1e9, layers=10, attn_width=1000, kv_heads=1, head_dim=100, gpus=16, gpus_per_node=4,
    answer_tokens=1000, prompt_tokens=0, group_size=10, batch_groups=10, max_staleness=1,
    checkpoint_every=2, engine_tp=2,
)  # fmt: skip
ANCHORS = bench.Anchors(
    gpu_flops=1e15, hbm_bytes_s=3e11, gpu_memory=3e9, net_bytes_s=1e10, train_mfu=0.606,
    prefill_mfu=0.201, decode_hbm_efficiency=1.0, mem_fraction=1.0, delta_fraction=0.1,
)  # fmt: skip
MEASURED = bench.Measured(
    group_bytes=1e6, redis_bytes_per_group=2e6, redis_residue_per_group=100, redis_us_per_group=1000,
    redis_meta_us_per_group=100, commands_per_group=5, put_bytes_s=1e8, take_bytes_s=1e8,
    encode_s_per_group=1e-3, decode_s_per_group=2e-3, rollout_s_per_group=0.1, cast_bytes_s=1e9,
    delta_s_per_byte=1e-9,
)  # fmt: skip


@pytest.fixture(scope="module")
def d() -> dict[str, float]:
    return bench.capacity(SCENARIO, ANCHORS, MEASURED)


def test_work_per_step_and_the_trainers_rate(d):
    # 10 groups × 10 samples × 1,000 tokens; rows are the answers alone (no prompt).
    assert d["completion_tokens_per_step"] == d["train_tokens_per_step"] == 100_000
    # 6 × 1e9 + 6 × 10 layers × 1,000 width × 1,000 tokens = 6e9 + 6e7
    assert d["train_flops_per_token"] == pytest.approx(6.06e9)
    # 1e15 × 0.606 / 6.06e9 = 100,000 tokens/s a GPU
    assert d["train_tokens_s_per_gpu"] == pytest.approx(1e5)


def test_an_engine_is_memory_bound(d):
    # K and V × 10 layers × 1 head × 100 × 2 bytes = 4,000 B a token
    assert d["kv_bytes_per_token"] == 4000
    # pool = 2 GPUs × 3e9 × 1.0 − 2e9 of bf16 weights = 4e9 B = 1e6 tokens; a request holds 500
    assert d["engine_kv_tokens"] == pytest.approx(1e6)
    assert d["engine_concurrency"] == pytest.approx(2000)
    # a step reads weights + pool: 6e9 B / (2 × 3e11 B/s) = 0.01 s; 2,000 tokens a step
    assert d["engine_step_s"] == pytest.approx(0.01)
    assert d["engine_tokens_s"] == pytest.approx(2e5)
    assert d["decode_tokens_s_per_gpu"] == pytest.approx(1e5)


def test_the_gpus_split_so_both_sides_take_one_step(d):
    # generation and training each need 1 GPU-second a step: half the 16 GPUs each, whole nodes
    assert (d["trainer_gpus"], d["engine_gpus"], d["engines"], d["engine_nodes"]) == (8, 8, 4, 2)
    assert d["generation_s"] == d["training_s"] == d["step_s"] == pytest.approx(0.125)


def test_rollout_and_buffer_rates(d):
    # 4 engines × 2,000 requests / G = 800 groups in flight, against (η + 1) · B = 20 slots
    assert d["groups_in_flight_needed"] == pytest.approx(800)
    assert d["admission_window_groups"] == 20
    # 10 groups / 0.125 s = 80 groups/s: 8e7 B/s, 400 commands/s, 8 cores of rollout at 0.1 s each
    assert d["groups_s"] == pytest.approx(80)
    assert d["buffer_bytes_s"] == pytest.approx(8e7)
    assert d["commands_s"] == pytest.approx(400)
    assert d["rollout_cores"] == pytest.approx(8)
    # 80 × 1,000 µs = 8% of a Redis core (1,000 groups/s); the metadata 80 × 100 µs = 0.8% (10,000/s)
    assert d["redis_core_share"] == pytest.approx(0.08)
    assert d["redis_groups_s_per_core"] == pytest.approx(1000)
    assert d["redis_meta_core_share"] == pytest.approx(0.008)
    assert d["cluster_meta_groups_s"] == pytest.approx(10_000)


def test_redis_memory(d):
    # (η + 1 + checkpoint_every) · B = 4 × 10 groups hold payloads: 40 × 2e6 B
    assert d["payload_groups_max"] == 40
    assert d["redis_bytes_max"] == pytest.approx(8e7)
    assert d["take_reply_bytes"] == pytest.approx(1e7)  # one MGET of B payloads
    assert d["stale_stream_bytes_max"] == pytest.approx(10_000 * 2e6)  # STALE_STREAM_MAXLEN entries
    assert d["redis_residue_per_step"] == pytest.approx(1000)  # B × 100 B that stay


def test_rank_zeros_serial_work(d):
    assert d["rank0_take_s"] == pytest.approx(0.1)  # 1e7 B / 1e8 B/s
    assert d["rank0_encode_s"] == pytest.approx(0.01)  # 10 × 1 ms
    assert d["rank_decode_s"] == pytest.approx(0.02)  # 10 × 2 ms


def test_weights(d):
    assert d["publish_bytes"] == 2e9  # bf16
    assert d["gather_wire_s"] == pytest.approx(0.4)  # 4e9 B of fp32 / 1e10 B/s
    assert d["cast_s"] == pytest.approx(4.0)  # 4e9 / 1e9
    assert d["broadcast_wire_s"] == pytest.approx(0.2)  # 2e9 / 1e10
    # 2 engine nodes read 2e9 each per version; a version every 0.125 s
    assert d["disk_read_bytes_per_version"] == pytest.approx(4e9)
    assert d["disk_read_bytes_s"] == pytest.approx(3.2e10)
    assert d["delta_bytes"] == pytest.approx(2e8)
    assert d["delta_read_bytes_s"] == pytest.approx(3.2e9)
    assert d["delta_compute_s"] == pytest.approx(2.0)  # 2e9 B × 1 ns
    # prefill: 2e9 + 2 × 10 × 1,000 × 500 = 2.01e9 FLOP a token; 2 × 1e15 × 0.201 / 2.01e9 =
    # 200,000 tokens/s; the 1e6 tokens of the pool take 5 s, 40 steps of 0.125 s
    assert d["kv_recompute_s"] == pytest.approx(5.0)
    assert d["kv_recompute_share"] == pytest.approx(40.0)


def test_a_version_today_and_an_answers_span(d):
    # 0.125 + 0.4 + 4 + 0.1 + 0.01 + 0.02
    assert d["trainer_version_s"] == pytest.approx(4.655)
    assert d["engine_version_s"] == pytest.approx(5.125)  # 0.125 + 5
    # 1,000 tokens × 0.01 s = 10 s of decoding, 80 versions of 0.125 s of generation
    assert d["answer_decode_s"] == pytest.approx(10.0)
    assert d["answer_versions"] == pytest.approx(80.0)
