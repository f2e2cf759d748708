"""msgpack codec: round trips of every record type, strict decoding, and properties."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from factories import edit_sample, make_group, make_job, make_sample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from asyncrl.proto import (
    SCHEMA_VERSION,
    FinishReason,
    Group,
    GroupJob,
    RecordDecodeError,
    RewardStatus,
    Sample,
    Samples,
    WeightsInfo,
    decode,
    encode,
)
from asyncrl.proto.codec import RecordEncodeError


def _wire(record) -> dict:
    """The record's map in its payload `[schema, map]`, read by msgspec's untyped reader."""
    schema, wire = msgspec.msgpack.decode(encode(record))
    assert schema == SCHEMA_VERSION
    return wire


def _pack(wire, schema=SCHEMA_VERSION) -> bytes:
    return msgspec.msgpack.encode([schema, wire])


@pytest.mark.parametrize(
    "record",
    [
        make_sample(),
        make_sample(status=RewardStatus.timeout, versions=[3, 3, 4, 4, 5]),
        make_group(n=3, n_tokens=7, version=2),
        make_job(),
        WeightsInfo(version=7, method="disk", path="/w/v7", published_at=1.5, extra={"bytes": 10}),
        WeightsInfo(version=8, method="distributed"),
        WeightsInfo(
            version=9, epoch=2, method="disk", path="/w/v00000009-e2", kind="lora", adapter_name="run-9@e2"
        ),
    ],
    ids=["sample", "sample-timeout", "group", "job", "weights-disk", "weights-broadcast", "weights-lora"],
)
def test_round_trip_every_record_type(record):
    back = decode(encode(record), type(record))
    assert back == record
    assert type(back) is type(record)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"method": "disk", "path": "/w/a", "kind": "lora"}, "with an adapter_name"),
        ({"method": "distributed", "kind": "lora", "adapter_name": "r-1"}, "published on disk"),
        ({"method": "disk", "path": "/w/a", "adapter_name": "r-1"}, "full weights have none"),
        ({"method": "disk", "path": "/w/a", "kind": "qlora", "adapter_name": "r-1"}, "kind"),
    ],
)
def test_a_lora_announcement_names_its_adapter_and_lives_on_disk(fields, match):
    """What the rollout needs to load and request a LoRA version (`path`, `adapter_name`) is
    always there, and a full version never carries an adapter name."""
    with pytest.raises(ValueError, match=match):
        WeightsInfo(version=1, **fields)


def test_arrays_are_little_endian_bytes_on_the_wire():
    s = make_sample(n_tokens=3, versions=[1, 2, 258])
    schema, wire = msgspec.msgpack.decode(encode(s))
    assert schema == SCHEMA_VERSION and wire["type"] == "sample"
    assert wire["versions"] == b"\x01\x00\x00\x00\x02\x00\x00\x00\x02\x01\x00\x00"
    assert np.frombuffer(wire["behavior_logprobs"], "<f4").tolist() == s.behavior_logprobs.tolist()


def test_a_sample_read_out_of_a_group_round_trips_as_a_sample():
    view = make_group(n=3).samples[1]
    back = decode(encode(view), Sample)
    assert type(back) is Sample and back == view and view == back


def _group_of(*samples: Sample, **fields) -> Group:
    return Group.build(group_id="g0", job_id="j0", prompt_tokens=np.array([1, 5, 6, 7], np.int32),
                       reward_spec={"verifier": "reverse"}, samples=list(samples), **{"submit_version": 0, **fields})  # fmt: skip


def test_group_travels_as_columns_in_sample_order():
    # given out of order, with lengths 4, 2, 4: the group holds them by index
    g = _group_of(make_sample("g0", 2, 4, seed=3), make_sample("g0", 0, 4), make_sample("g0", 1, 2, seed=9))
    assert [s.index for s in g.samples] == [0, 1, 2] and g.samples.lengths == [4, 2, 4]
    wire = _wire(g)["samples"]
    assert wire["lengths"] == [4, 2, 4] and wire["finish_reason"] == ["length"] * 3
    assert np.frombuffer(wire["completion_ids"], "<i4").tolist() == [
        t for s in g.samples for t in s.completion_ids.tolist()
    ]
    assert np.frombuffer(wire["behavior_logprobs"], "<f4").tolist() == [
        x for s in g.samples for x in s.behavior_logprobs.tolist()
    ]
    back = decode(encode(g), Group)
    assert back == g and [len(s.versions) for s in back.samples] == [4, 2, 4]
    assert back.samples[1] == make_sample("g0", 1, 2, seed=9) and back.samples[-1] == make_sample(
        "g0", 2, 4, seed=3
    )
    assert isinstance(back.samples.finish_reason[0], FinishReason)  # enums come back as members
    assert back.samples.reward_status == [RewardStatus.scored] * 3


def test_group_needs_samples_indexed_from_zero():
    with pytest.raises(ValueError, match="at least one sample"):
        _group_of()
    with pytest.raises(ValueError, match=r"indices must be 0..1, got \[0, 2\]"):
        _group_of(make_sample("g0", 0), make_sample("g0", 2))


def test_group_build_reports_bad_samples_as_a_value_error():
    with pytest.raises(ValueError, match="indices"):  # (the rollout counts these as failed groups)
        _group_of(make_sample("g0", 0), make_sample("g0", 0))
    assert _group_of(*(make_sample("g0", i, seed=i) for i in (1, 0))).samples.lengths == [5, 5]


def test_samples_index_like_a_sequence():
    g = make_group(n=3)
    assert [s.index for s in g.samples[1:]] == [1, 2] and g.samples[::-2][0].index == 2
    assert g.samples[np.int64(1)].index == 1 and type(g.samples[np.int64(1)].index) is int
    assert decode(encode(g.samples[np.int64(1)]), Sample) == g.samples[1]


def test_samples_columns_are_read_only_and_frozen():
    ids = np.array([5, 6, 7], np.int32)
    s = Sample(prompt_id="p", index=0, completion_ids=ids, behavior_logprobs=np.full(3, -1.0, np.float32),
               versions=np.zeros(3, np.int32), finish_reason="stop", reward=1.0, reward_status="scored")  # fmt: skip
    g = _group_of(s)
    with pytest.raises(AttributeError, match="immutable"):
        g.samples.reward = [0.0]
    with pytest.raises(AttributeError, match="immutable"):
        g.samples[0].timings.scored = 1.0
    ids[0] = 9  # the caller's arrays stay theirs: the group gathered a copy
    assert g.samples.completion_ids.tolist() == [5, 6, 7]
    mine = np.array([1, 2, 3], np.int32)
    built = replace(g.samples, completion_ids=mine)  # built from it directly
    assert not built.completion_ids.flags.writeable and mine.flags.writeable


def test_records_change_only_through_their_checks():
    """A record is never assigned to: `replace` builds a new one, checked like any other. Arrays
    of another dtype are converted when their values fit (casting must not wrap them)."""
    g = make_group()
    with pytest.raises(AttributeError, match="immutable"):
        g.prompt_tokens = np.array([1, 2, 3])
    wide = replace(g, prompt_tokens=np.array([1, 2, 3]))  # int64
    assert wide.prompt_tokens.dtype == np.int32 and decode(encode(wide), Group) == wide
    with pytest.raises(ValueError, match="do not fit in int32"):
        replace(g, prompt_tokens=np.array([1, 2**40]))
    with pytest.raises(ValueError, match="expected integers, got float64"):
        replace(g, prompt_tokens=[1.0, 2.5])
    with pytest.raises(ValueError, match="timings"):
        replace(make_sample(), timings=None)  # a nested record replaced by something else


def test_encode_refuses_arrays_in_free_form_maps():
    """Free-form maps hold plain values: an array has no place there; numpy scalars go out as
    their Python values."""
    for array in (
        np.array([1.5]),
        np.array([1], np.int32),
        np.array([0.5], np.float32),
    ):  # (int32/float32: token dtypes)
        with pytest.raises(RecordEncodeError, match="ndarray"):
            encode(replace(make_sample(), reward_details={"a": array}))
    with pytest.raises(RecordEncodeError, match="ndarray"):
        encode(replace(make_group(), reward_spec={"verifier": "x", "ids": np.array([1], np.int32)}))
    s = replace(make_sample(), reward_details={"a": np.float64(0.5), "n": np.int64(3)})
    assert decode(encode(s), Sample).reward_details == {"a": 0.5, "n": 3}


def test_decode_refuses_an_expected_type_that_is_not_a_record():
    with pytest.raises(TypeError, match="Samples is not a buffer record type"):
        decode(encode(make_group()), Samples)


def test_group_samples_are_read_only_views():
    g = make_group(n=2, n_tokens=3)
    s = g.samples[0]
    assert isinstance(s, Sample) and np.shares_memory(s.completion_ids, g.samples.completion_ids)
    with pytest.raises(AttributeError, match="immutable"):
        s.reward = 0.25
    with pytest.raises(ValueError, match="read-only"):
        s.behavior_logprobs[0] = 0.0
    with pytest.raises(IndexError):
        g.samples[2]
    edited = edit_sample(g, 0, reward=0.25)  # a change is a new group
    assert edited.rewards == [0.25, 0.5] and g.rewards == [0.0, 0.5]


def test_encoded_group_is_a_plain_msgpack_map_read_in_place():
    """Any msgpack reader reads the payload (here msgspec's untyped reader, not the codec's typed
    one), and decode's arrays are views of the payload (no copy), read-only like every decoded array."""
    g = make_group(n=3, n_tokens=6, version=4)
    data = encode(g)
    schema, plain = msgspec.msgpack.decode(data)
    assert schema == SCHEMA_VERSION and plain["type"] == "group" and plain["group_id"] == "g0"
    assert plain["samples"]["reward"] == g.rewards and plain["samples"]["reward_status"] == ["scored"] * 3
    back = decode(data, Group)
    assert back == g
    assert np.shares_memory(back.samples[1].completion_ids, np.frombuffer(data, np.uint8))
    assert not back.samples[0].behavior_logprobs.flags.writeable
    # the same map written by another writer, keys in another order, decodes to the same group
    reordered = {k: plain[k] for k in reversed(plain)}
    reordered["samples"] = {k: plain["samples"][k] for k in reversed(plain["samples"])}
    assert decode(_pack(reordered), Group) == g


def test_group_min_version_is_the_oldest_token():
    g = edit_sample(make_group(n=2, version=5), 1, versions=np.array([3, 4, 5, 5, 5], dtype=np.int32))
    assert g.min_version == 3
    wire = _wire(g)
    wire["min_version"] = 5  # disagrees with the tokens
    with pytest.raises(RecordDecodeError, match="min_version"):
        decode(_pack(wire))


def _tamper(record, path, value) -> bytes:
    """The record's payload with one value changed: `("schema",)` is the payload's schema, any
    other path runs through the record's map."""
    if path == ("schema",):
        return _pack(_wire(record), schema=value)
    wire = _wire(record)
    target = wire
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return _pack(wire)


@pytest.mark.parametrize(
    "path,value,match",
    [
        (("samples", "behavior_logprobs"), np.array([-1.0] * 9 + [np.nan], "<f4").tobytes(), "NaN"),
        (("samples", "behavior_logprobs"), np.array([-1.0] * 9 + [0.5], "<f4").tobytes(), "must be <= 0.001"),
        (("samples", "behavior_logprobs"), np.zeros(9, "<f4").tobytes(), "9 logprobs for 10"),
        (("samples", "versions"), np.zeros(11, "<i4").tobytes(), "11 versions for 10"),
        (("samples", "versions"), np.full(10, -1, "<i4").tobytes(), "negative policy version"),
        (("samples", "completion_ids"), np.full(10, -1, "<i4").tobytes(), "negative token id"),
        (("samples", "completion_ids"), b"\x01\x02\x03", "whole number"),
        (("samples", "completion_ids"), [1, 2, 3, 4, 5], "Expected `bytes`"),
        (("samples", "completion_ids"), b"", "lengths add up to 10, the columns hold 0"),
        (("prompt_tokens",), b"", "empty prompt"),
        (("samples", "lengths"), [4, 5], "add up to 9"),
        (("samples", "lengths"), [-1, 11], ">= 0"),
        (("samples", "lengths"), ["5", 5], "lengths"),
        (("samples", "lengths"), [5, 5, 0], "2 prompt_id entries for 3 samples"),
        (("samples", "truncated"), [False], "1 truncated entries for 2 samples"),
        (("samples", "truncated"), [0, False], "truncated"),
        (("samples", "submitted"), ["soon", None], "submitted"),
        (("samples", "reward_status"), ["maybe", "scored"], "reward_status"),
        (("samples", "reward"), ["1.0", 0.5], "reward"),
        (("samples", "reward"), [None, 0.5], "sample 0: a scored sample needs a finite reward"),
        (("samples", "finish_reason"), ["exploded", "stop"], "finish_reason"),
        (("samples", "prompt_id"), ["", "g0"], "prompt_id"),
        (("samples", "reward_details"), [{}, "none"], "reward_details"),
        (("samples", "surprise"), [1, 2], "surprise"),
        (("samples",), [], "Expected `object`, got `array`"),
        (("samples",), {}, "lengths"),
        (("samples",), "columns", "Expected `object`, got `str`"),
        (("submit_version",), -1, "submit_version"),
        (("group_id",), 17, "group_id"),
        (("schema",), 99, "unknown schema 99"),
        (("schema",), 3, "unknown schema 3"),  # the previous layout is not read (no deployments)
        (("schema",), "1", "unknown schema"),
        (("type",), "gruop", "unknown record type"),
        (("surprise",), 1, "surprise"),
    ],
)
def test_strict_decode_rejects_bad_records(path, value, match):
    data = _tamper(make_group(n=2), path, value)
    with pytest.raises(RecordDecodeError, match=match):
        decode(data, Group)


def test_group_without_samples_is_refused():
    wire = _wire(make_group(n=2))
    wire["samples"] = {k: b"" if isinstance(v, bytes) else [] for k, v in wire["samples"].items()}
    with pytest.raises(RecordDecodeError, match="lengths"):
        decode(_pack(wire))


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
    s = replace(make_sample(), reward_details={"v": value})
    with pytest.raises(RecordEncodeError):
        encode(s)
    with pytest.raises(RecordEncodeError):
        encode(_group_of(s))


def test_failed_verifier_is_never_a_silent_zero():
    with pytest.raises(ValueError, match="reward must be None"):
        replace(make_sample(status=RewardStatus.error), reward=0.0)


def test_free_form_maps_need_string_keys():
    with pytest.raises(ValueError, match="reward_details"):
        replace(make_sample(), reward_details={1.5: "float key"})


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
        reward_details=draw(
            st.dictionaries(
                st.text(max_size=8),
                st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8)),
                max_size=3,
            )
        ),
    )


@st.composite
def groups(draw):
    k = draw(st.integers(1, 5))
    return Group.build(
        group_id=draw(st.text(min_size=1, max_size=20)),
        job_id="job",
        prompt_tokens=np.array(draw(st.lists(st.integers(0, 1000), min_size=1, max_size=20)), np.int32),
        reward_spec={
            "verifier": draw(st.sampled_from(["math", "code", "reverse"])),
            "answer": draw(st.text(max_size=10)),
        },
        samples=draw(st.permutations([draw(samples("p", i)) for i in range(k)])),  # any order: held by index
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


@settings(max_examples=300, deadline=None)
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


_ODD_VALUES = st.one_of(
    st.sampled_from([None, True, False, 0, 1, 2, -1, 0.0, 1.0, -0.5, float("inf"), 2**40]),
    st.integers(-3, 300), st.floats(allow_nan=False), st.text(max_size=3),
    st.sampled_from(["stop", "length", "scored", "timeout", "p", "", "x" * 257, "reverse"]),
    st.binary(max_size=12), st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["verifier", "submitted", "scored", 1, b"k"]), st.one_of(st.none(), st.floats(0, 9), st.text(max_size=2)), max_size=2),
)  # fmt: skip


def _edit_targets(wire: dict) -> list:
    """Every container a tamper can reach: the group map, its `samples` map and that map's lists."""
    samples = wire.get("samples")
    if not isinstance(samples, dict):
        return [wire]
    return [wire, samples, *(v for v in samples.values() if isinstance(v, list) and v)]


def _record_or_typed_error(payload: bytes) -> bool:
    """True when `payload` decodes; a record that does round-trips. Any other failure than
    `RecordDecodeError` fails the test."""
    try:
        record = decode(payload)
    except RecordDecodeError:
        return False
    assert decode(encode(record)) == record
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_edited_payloads_decode_to_a_record_or_a_typed_error(data):
    """Tamper with any field (group level, a column, or one sample's entry of a column, or drop
    it): decode builds a record that round-trips, or refuses the payload with its typed error."""
    wire = _wire(make_group(n=3, n_tokens=2))
    wire["samples"]["submitted"][1] = 1.5
    for _ in range(data.draw(st.integers(1, 3))):
        target = data.draw(st.sampled_from(_edit_targets(wire)))
        if isinstance(target, list):
            target[data.draw(st.integers(0, len(target) - 1))] = data.draw(_ODD_VALUES)
            continue
        key = data.draw(st.sampled_from(sorted({*target, "surprise"}, key=str)))
        if data.draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = data.draw(_ODD_VALUES)
    _record_or_typed_error(_pack(wire))


_EDGE_VALUES = [None, True, False, 0, 1, 2, 3, -1, 0.0, 1.0, -0.5, float("inf"), 2**40, "", "x", "x" * 257, "stop",
                "scored", "timeout", b"", b"\x00\x00\x00\x00", [], [0], {}, {"verifier": "v"}, {"submitted": 1.0},
                {1: 2}, {b"k": 1}, {"submitted": "x"}]  # fmt: skip


def test_every_single_field_edit_decodes_to_a_record_or_a_typed_error():
    """Every field at every level (group, column, one sample's entry of a column), set to each
    edge value or removed: a record that round-trips, or `RecordDecodeError`."""
    base = _wire(make_group(n=3, n_tokens=2, version=1))
    base["samples"]["submitted"][1] = 1.5
    paths = (
        [(k,) for k in base]
        + [("samples", k) for k in base["samples"]]
        + [("surprise",), ("samples", "surprise")]
    )
    paths += [("samples", k, i) for k, column in base["samples"].items() if isinstance(column, list)
              for i in range(len(column))]  # fmt: skip
    accepted = 0
    for path in paths:
        for value in [*_EDGE_VALUES, "<delete>"]:
            if value == "<delete>" and len(path) == 3:
                continue  # (an entry cannot be removed from the middle of a column without shifting)
            wire = msgspec.msgpack.decode(_pack(base))[1]
            target = wire
            for key in path[:-1]:
                target = target[key]
            if value == "<delete>":
                target.pop(path[-1], None)
            else:
                target[path[-1]] = value
            accepted += _record_or_typed_error(_pack(wire))
    assert accepted > 50  # the edits include many valid ones (other texts, rewards, timings…)


def test_decode_reads_bytes_in_place_and_copies_a_mutable_payload():
    data = encode(make_group(n=3, n_tokens=6))
    viewed = decode(data, Group)  # bytes cannot change: the columns view them
    assert np.shares_memory(viewed.samples.completion_ids, np.frombuffer(data, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        viewed.samples.versions[0] = 7
    mutable = bytearray(data)
    copied = decode(mutable, Group)  # a caller's bytearray may change later: it is copied
    assert not np.shares_memory(copied.samples.completion_ids, np.frombuffer(mutable, np.uint8))
    assert viewed == copied == make_group(n=3, n_tokens=6)
