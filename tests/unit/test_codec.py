"""msgpack codec: round trips of every record type, strict decoding, and properties."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from factories import make_group, make_job, make_sample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import Group, GroupJob, RecordDecodeError, RewardStatus, Sample, WeightsInfo, decode, encode
from proto.codec import RecordEncodeError


def _wire(record) -> dict:
    return msgpack.unpackb(encode(record), raw=False)


@pytest.mark.parametrize(
    "record",
    [
        make_sample(),
        make_sample(status=RewardStatus.timeout, versions=[3, 3, 4, 4, 5]),
        make_group(n=3, n_tokens=7, version=2),
        make_job(),
        WeightsInfo(version=7, method="disk", path="/w/v7", published_at=1.5, extra={"bytes": 10}),
        WeightsInfo(version=8, method="distributed"),
    ],
    ids=["sample", "sample-timeout", "group", "job", "weights-disk", "weights-broadcast"],
)
def test_round_trip_every_record_type(record):
    back = decode(encode(record), type(record))
    assert back == record
    assert type(back) is type(record)


def test_arrays_are_little_endian_bytes_on_the_wire():
    s = make_sample(n_tokens=3, versions=[1, 2, 258])
    wire = _wire(s)
    assert wire["schema"] == 1 and wire["type"] == "sample"
    assert wire["versions"] == b"\x01\x00\x00\x00\x02\x00\x00\x00\x02\x01\x00\x00"
    assert np.frombuffer(wire["behavior_logprobs"], "<f4").tolist() == s.behavior_logprobs.tolist()


def test_group_min_version_is_the_oldest_token():
    g = make_group(n=2, version=5)
    g.samples[1].versions = np.array([3, 4, 5, 5, 5], dtype=np.int32)
    g2 = Group.build(**{k: getattr(g, k) for k in ("group_id", "job_id", "prompt_ids", "reward_spec", "samples",
                                                   "submit_version")})  # fmt: skip
    assert g2.min_version == 3
    wire = _wire(g2)
    wire["min_version"] = 5  # disagrees with the tokens
    with pytest.raises(RecordDecodeError, match="min_version"):
        decode(msgpack.packb(wire))


def _tamper(record, path, value) -> bytes:
    wire = _wire(record)
    target = wire
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return msgpack.packb(wire, use_bin_type=True)


@pytest.mark.parametrize(
    "path,value,match",
    [
        (("samples", 0, "behavior_logprobs"), np.array([np.nan] * 5, "<f4").tobytes(), "NaN"),
        (("samples", 0, "behavior_logprobs"), np.zeros(4, "<f4").tobytes(), "4 logprobs for 5"),
        (("samples", 0, "versions"), np.zeros(6, "<i4").tobytes(), "6 versions for 5"),
        (("samples", 0, "completion_ids"), b"\x01\x02\x03", "whole number"),
        (("samples", 0, "completion_ids"), [1, 2, 3, 4, 5], "expected bytes"),
        (("samples", 0, "reward"), "1.0", "reward"),
        (("samples", 0, "reward"), None, "finite reward"),
        (("samples", 0, "index"), True, "index"),
        (("samples", 0, "finish_reason"), "exploded", "finish_reason"),
        (("submit_version",), -1, "submit_version"),
        (("group_id",), 17, "group_id"),
        (("reward_spec",), {"target": "x"}, "verifier"),
        (("schema",), 99, "unknown schema 99"),
        (("schema",), "1", "unknown schema"),
        (("type",), "gruop", "unknown record type"),
        (("samples",), [], "samples"),
        (("surprise",), 1, "surprise"),
    ],
)
def test_strict_decode_rejects_bad_records(path, value, match):
    data = _tamper(make_group(n=2), path, value)
    with pytest.raises(RecordDecodeError, match=match):
        decode(data, Group)


def test_decode_checks_expected_type():
    with pytest.raises(RecordDecodeError, match="expected a group record, got job"):
        decode(encode(make_job()), Group)


@pytest.mark.parametrize("cut", [1, 5, 17, 100])
def test_truncated_payload_is_a_typed_error(cut):
    data = encode(make_group())
    with pytest.raises(RecordDecodeError):
        decode(data[: len(data) - cut])


@pytest.mark.parametrize("value", [object(), 2**64, -(2**63) - 1])
def test_encode_refuses_unserialisable_details(value):
    s = make_sample()
    s.reward_details = {"v": value}
    with pytest.raises(RecordEncodeError):
        encode(s)


def test_failed_verifier_is_never_a_silent_zero():
    with pytest.raises(ValueError, match="reward must be None"):
        make_sample(status=RewardStatus.error).model_copy(update={}).__class__.model_validate(
            {**make_sample(status=RewardStatus.error).model_dump(), "reward": 0.0}
        )


def test_free_form_maps_need_string_keys():
    with pytest.raises(ValueError, match="reward_details"):
        Sample.model_validate({**make_sample().model_dump(), "reward_details": {1.5: "float key"}})


# ---------------------------------------------------------------- properties
finite_logprobs = st.floats(min_value=-50, max_value=0, allow_nan=False, width=32)


@st.composite
def samples(draw, prompt_id="p", index=0):
    n = draw(st.integers(0, 40))
    status = draw(st.sampled_from(list(RewardStatus)))
    reward = draw(st.floats(-10, 10, allow_nan=False)) if status is RewardStatus.scored else None
    return Sample(
        prompt_id=prompt_id,
        index=index,
        completion_ids=np.array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), np.int32),
        behavior_logprobs=np.array(draw(st.lists(finite_logprobs, min_size=n, max_size=n)), np.float32),
        versions=np.array(draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n)), np.int32),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        truncated=draw(st.booleans()),
        text=draw(st.text(max_size=30)),
        reward=reward,
        reward_status=status,
        reward_details=draw(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8)), max_size=3)),
    )


@st.composite
def groups(draw):
    k = draw(st.integers(1, 5))
    return Group.build(
        group_id=draw(st.text(min_size=1, max_size=20)),
        job_id="job",
        prompt_ids=np.array(draw(st.lists(st.integers(0, 1000), min_size=1, max_size=20)), np.int32),
        reward_spec={"verifier": draw(st.sampled_from(["math", "code", "reverse"])), "answer": draw(st.text(max_size=10))},
        samples=[draw(samples("p", i)) for i in range(k)],
        submit_version=draw(st.integers(0, 10_000)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_property_encode_decode_is_identity(group):
    assert decode(encode(group), Group) == group


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_property_any_bytes_decode_to_a_record_or_a_typed_error(data):
    try:
        record = decode(data)
    except RecordDecodeError:
        return
    assert isinstance(record, (Group, Sample, GroupJob, WeightsInfo))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_property_corrupted_valid_payloads_never_crash(data):
    payload = bytearray(encode(make_group(n=2, n_tokens=3)))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] = data.draw(st.integers(0, 255))
    try:
        record = decode(bytes(payload))
    except RecordDecodeError:
        return
    if isinstance(record, Group):  # a surviving record still satisfies every invariant
        for s in record.samples:
            assert len(s.completion_ids) == len(s.behavior_logprobs) == len(s.versions)
            assert all(math.isfinite(x) for x in s.behavior_logprobs.tolist())
