"""Delta versions (services/transport/weights/delta.py): which tensors and blocks a delta holds,
that applying it rebuilds the new version bit for bit, and that the hashes catch a wrong base
or altered data."""

from __future__ import annotations

import hashlib

import pytest
import torch

from asyncrl.services.transport.weights.delta import (
    DeltaError,
    DeltaManifest,
    apply_delta,
    compute_delta,
    tensor_sha256,
)

torch.set_num_threads(1)


def manifest_for(hashes: dict[str, str], granularity: str = "tensor", block_elems: int = 4) -> DeltaManifest:
    return DeltaManifest(
        version=2, epoch=0, base=1, anchor=1, granularity=granularity, block_elems=block_elems, sha256=hashes
    )


def states():
    prev = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(10, dtype=torch.float32),
        "c": torch.tensor([3, 4], dtype=torch.int64),
    }
    new = {k: v.clone() for k, v in prev.items()}
    new["b"][5] = 7.0
    new["b"][9] = -2.0
    return prev, new


def test_sha256_is_of_the_row_major_bytes():
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)
    want = hashlib.sha256(bytes(torch.tensor([1.0, 2.0, 3.0, 4.0]).numpy().tobytes())).hexdigest()
    assert tensor_sha256(t) == want
    assert tensor_sha256(t.t()) != want  # a transposed view hashes its own row-major order


def test_tensor_granularity_holds_exactly_the_changed_tensors():
    prev, new = states()
    delta, hashes = compute_delta(prev, new, granularity="tensor")
    assert list(delta) == ["b"]
    assert torch.equal(delta["b"], new["b"])
    assert hashes == {"b": tensor_sha256(new["b"])}
    touched = apply_delta(prev, delta, manifest_for(hashes))
    assert list(touched) == ["b"] and torch.equal(touched["b"], new["b"])


def test_block_granularity_holds_exactly_the_changed_blocks():
    prev, new = states()
    # b has 10 elements: blocks [0:4], [4:8], [8:10]; elements 5 and 9 changed → blocks 1 and 2
    delta, hashes = compute_delta(prev, new, granularity="block", block_elems=4)
    assert sorted(delta) == ["b::blocks", "b::data"]
    assert delta["b::blocks"].tolist() == [1, 2]
    assert delta["b::data"].tolist() == [1.0, 7.0, 1.0, 1.0, 1.0, -2.0]
    touched = apply_delta(prev, delta, manifest_for(hashes, "block"))
    assert torch.equal(touched["b"], new["b"])
    assert torch.equal(prev["b"], torch.ones(10))  # the base is not modified


def test_bf16_rounding_makes_small_updates_no_change_and_signed_zero_a_change():
    base = torch.linspace(1.0, 2.0, 64)
    prev = {"w": base.to(torch.bfloat16), "z": torch.zeros(3, dtype=torch.bfloat16)}
    new = {"w": (base + 1e-5).to(torch.bfloat16), "z": torch.tensor([0.0, -0.0, 0.0], dtype=torch.bfloat16)}
    assert torch.equal(prev["w"], new["w"])  # below half a bf16 ulp at 1..2 (2**-8)
    delta, hashes = compute_delta(prev, new, granularity="block", block_elems=2)
    assert sorted(delta) == ["z::blocks", "z::data"]
    assert delta["z::blocks"].tolist() == [0]  # -0.0 == 0.0 as numbers, not as bytes
    touched = apply_delta(prev, delta, manifest_for(hashes, "block", 2))
    assert touched["z"].view(torch.int16).tolist() == new["z"].view(torch.int16).tolist()


def test_fp32_engine_base_applies_a_bf16_delta():
    prev, new = states()
    prev16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in prev.items()}
    new16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in new.items()}
    delta, hashes = compute_delta(prev16, new16, granularity="block", block_elems=4)
    engine_params = {k: v.to(torch.float32) for k, v in prev16.items()}  # an fp32 engine holds bf16 values
    touched = apply_delta(engine_params, delta, manifest_for(hashes, "block"))
    assert touched["b"].dtype == torch.bfloat16 and torch.equal(touched["b"], new16["b"])


def test_wrong_base_and_altered_data_fail_the_hash():
    prev, new = states()
    delta, hashes = compute_delta(prev, new, granularity="block", block_elems=4)
    other_base = {k: v.clone() for k, v in prev.items()}
    other_base["b"][0] = 5.0  # a block the delta does not carry
    with pytest.raises(DeltaError) as wrong:
        apply_delta(other_base, delta, manifest_for(hashes, "block"))
    assert wrong.value.reason == "hash"
    altered = dict(delta)
    altered["b::data"] = delta["b::data"].clone()
    altered["b::data"][1] = 8.0
    with pytest.raises(DeltaError) as bad:
        apply_delta(prev, altered, manifest_for(hashes, "block"))
    assert bad.value.reason == "hash"


def test_malformed_deltas_are_refused():
    prev, new = states()
    delta, hashes = compute_delta(prev, new, granularity="block", block_elems=4)
    out_of_range = {**delta, "b::blocks": torch.tensor([1, 3])}
    with pytest.raises(DeltaError, match="block 3 out of range") as exc:
        apply_delta(prev, out_of_range, manifest_for(hashes, "block"))
    assert exc.value.reason == "malformed"
    with pytest.raises(DeltaError, match="different tensors"):
        apply_delta(prev, delta, manifest_for({**hashes, "a": "0" * 64}, "block"))
    with pytest.raises(DeltaError, match="unknown tensor"):
        apply_delta(prev, {"zz": torch.ones(1)}, manifest_for({"zz": "0" * 64}))
    with pytest.raises(DeltaError, match="unknown delta format"):
        DeltaManifest.from_json('{"format": "other"}')
    with pytest.raises(ValueError, match="shape or dtype changed"):
        compute_delta(prev, {**new, "b": torch.ones(11)})


def test_manifest_round_trips():
    m = manifest_for({"b": "ab" * 32}, "block")
    assert DeltaManifest.from_json(m.to_json()) == m


def test_a_delta_over_max_bytes_is_none():
    prev, new = states()
    # b changed: 10 fp32 elements = 40 bytes as a whole tensor
    assert compute_delta(prev, new, granularity="tensor", max_bytes=39) is None
    delta, _ = compute_delta(prev, new, granularity="tensor", max_bytes=40)
    assert list(delta) == ["b"]
    # blocks of 4: 2 int32 indices (8 bytes) + 6 values (24 bytes)
    assert compute_delta(prev, new, granularity="block", block_elems=4, max_bytes=31) is None
    assert compute_delta(prev, new, granularity="block", block_elems=4, max_bytes=32) is not None
    single, _ = compute_delta(prev, new, granularity="block", block_elems=1)
    assert single["b::blocks"].tolist() == [5, 9] and single["b::data"].tolist() == [7.0, -2.0]


def test_a_delta_where_every_element_moved_stops_at_the_sample():
    prev = {"w": torch.arange(100_000, dtype=torch.float32)}
    new = {"w": prev["w"] + 0.5}  # every element changed: the sampled estimate is 400 kB
    assert compute_delta(prev, new, granularity="block", block_elems=1, max_bytes=200_000) is None
    delta, _ = compute_delta(prev, new, granularity="block", block_elems=1, max_bytes=800_000)
    assert torch.equal(delta["w::data"], new["w"]) and delta["w::blocks"].tolist() == list(range(100_000))


def test_a_tensor_delta_stops_at_a_sampled_lower_bound():
    """Tensor granularity: a tensor with a changed element among the sampled ones (every
    100_000 // 4096 = 24th, from 0) counts whole; an unsampled change does not (a lower bound)."""
    from asyncrl.services.transport.weights.delta import _sampled_changed_bytes

    prev = {k: torch.zeros(100_000) for k in ("u", "v", "w")}
    new = {k: t.clone() for k, t in prev.items()}
    new["u"][0] = 1.0  # sampled
    new["v"][48] = 1.0  # sampled
    new["w"][1] = 1.0  # not sampled
    assert _sampled_changed_bytes(prev, new, whole_tensors=True) == 800_000
    assert _sampled_changed_bytes(prev, new) == pytest.approx(2 * 4 * 100_000 / 4167)  # 1 of 4167 each
    assert compute_delta(prev, new, granularity="tensor", max_bytes=799_999) is None
    delta, _ = compute_delta(prev, new, granularity="tensor", max_bytes=1_200_000)
    assert sorted(delta) == ["u", "v", "w"]
