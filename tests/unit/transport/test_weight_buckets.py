"""Buckets of a weight broadcast (services/transport/weights/broadcast.py `plan_buckets`): every tensor once,
in order, bucket by bucket, and drawn lazily, so a trainer that moves each tensor to the GPU as
it is drawn holds one bucket there, not a second copy of the model."""

from __future__ import annotations

import torch

from asyncrl.services.transport.weights.broadcast import plan_buckets


def named(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [(f"p{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]


def test_buckets_hold_every_tensor_once_in_order_up_to_the_size():
    items = named([10, 30, 5, 60, 1, 1, 100])
    buckets = list(plan_buckets(items, bucket_bytes=40 * 4))
    names = [n for _, b in buckets for n in b.names]
    assert names == [n for n, _ in items]
    assert [b.last for _, b in buckets] == [False] * (len(buckets) - 1) + [True]
    for tensors, b in buckets:
        assert [list(t.shape) for t in tensors] == b.shapes and b.dtypes == ["float32"] * len(tensors)
        assert (
            sum(t.numel() * 4 for t in tensors[:-1]) < 40 * 4
        )  # a bucket closes at the first tensor past the size
    for (n, t), got in zip(items, [t for ts, _ in buckets for t in ts]):
        assert torch.equal(t, got), n
    assert [b.names for _, b in buckets] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5", "p6"]]
    assert list(plan_buckets([], 1024)) == []
    (only,) = plan_buckets(named([3]), 1024)
    assert only[1].last and only[1].names == ["p0"]


def test_tensors_are_drawn_one_bucket_at_a_time():
    drawn = []

    def lazily():
        for n, t in named([16] * 12):
            drawn.append(n)
            yield n, t

    sent = 0
    for tensors, _ in plan_buckets(lazily(), bucket_bytes=3 * 16 * 4):
        assert len(tensors) == 3
        sent += len(tensors)
        assert len(drawn) <= sent + 1  # this bucket and, at most, the next tensor
    assert sent == len(drawn) == 12


def test_a_delta_bucket_carries_its_hashes_to_reference_engines_and_sglang_fields_only_otherwise():
    """`delta` is asyncrl's extension: the reference engine's request model reads it, SGLang's
    (0.5.23, whose fields are vendored in tests/data) does not have it, so a body without it
    holds SGLang's fields alone."""
    import json
    from pathlib import Path

    from asyncrl.proto.sglang import ReferenceUpdateWeightsFromDistributedReqInput
    from asyncrl.services.transport.weights.broadcast import DeltaAnnouncement, bucket_request

    contract = json.loads((Path(__file__).parents[2] / "data" / "sglang_0_5_23_contract.json").read_text())
    (_, bucket), (_, last) = plan_buckets(named([8, 8]), bucket_bytes=8 * 4)
    hashes = {"p0": "a" * 64, "p1": "b" * 64}
    plain = bucket_request(bucket, weight_version="7", group_name="g")
    assert set(plain) <= set(contract["update_weights_from_distributed_req_input"])
    assert plain["weight_version"] is None  # not the last bucket
    body = bucket_request(last, weight_version="7", group_name="g", delta=DeltaAnnouncement("6", hashes))
    assert body["delta"] == {"base": "6", "sha256": {"p1": "b" * 64}}  # this bucket's tensors only
    assert body["weight_version"] == "7"
    read = ReferenceUpdateWeightsFromDistributedReqInput.model_validate(body)
    assert (read.delta.base, read.delta.sha256, read.names) == ("6", {"p1": "b" * 64}, ["p1"])
    assert ReferenceUpdateWeightsFromDistributedReqInput.model_validate(plain).delta is None
