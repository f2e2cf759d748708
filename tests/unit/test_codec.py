"""msgpack codec: round trips of every record type, strict decoding, and properties."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from factories import edit_sample, make_group, make_job, make_sample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from proto import (
    SCHEMA_VERSION,
    FinishReason,
    Group,
    GroupJob,
    RecordDecodeError,
    RewardStatus,
    Sample,
    Samples,
    SampleView,
    Timings,
    WeightsInfo,
    codec,
    decode,
    encode,
)
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
    assert wire["schema"] == SCHEMA_VERSION and wire["type"] == "sample"
    assert wire["versions"] == b"\x01\x00\x00\x00\x02\x00\x00\x00\x02\x01\x00\x00"
    assert np.frombuffer(wire["behavior_logprobs"], "<f4").tolist() == s.behavior_logprobs.tolist()


def test_a_sample_read_out_of_a_group_round_trips_as_a_sample():
    view = make_group(n=3).samples[1]
    back = decode(encode(view), Sample)
    assert type(back) is Sample and back == view and view == back


def _group_of(*samples: Sample, **fields) -> Group:
    return Group.build(group_id="g0", job_id="j0", prompt_ids=np.array([1, 5, 6, 7], np.int32),
                       reward_spec={"verifier": "reverse"}, samples=list(samples), **{"submit_version": 0, **fields})  # fmt: skip


def test_group_travels_as_columns_in_sample_order():
    # given out of order, with lengths 4, 2, 4: the group holds them by index
    g = _group_of(make_sample("g0", 2, 4, seed=3), make_sample("g0", 0, 4), make_sample("g0", 1, 2, seed=9))
    assert [s.index for s in g.samples] == [0, 1, 2] and g.samples.lengths == [4, 2, 4]
    wire = _wire(g)["samples"]
    assert wire["lengths"] == [4, 2, 4] and wire["finish_reason"] == ["length"] * 3
    assert np.frombuffer(wire["completion_ids"], "<i4").tolist() == [t for s in g.samples for t in s.completion_ids.tolist()]
    assert np.frombuffer(wire["behavior_logprobs"], "<f4").tolist() == [x for s in g.samples for x in s.behavior_logprobs.tolist()]
    back = decode(encode(g), Group)
    assert back == g and [len(s.versions) for s in back.samples] == [4, 2, 4]
    assert back.samples[1] == make_sample("g0", 1, 2, seed=9) and back.samples[-1] == make_sample("g0", 2, 4, seed=3)


def test_group_needs_samples_indexed_from_zero():
    with pytest.raises(ValueError, match="at least one sample"):
        _group_of()
    with pytest.raises(ValueError, match=r"indices must be 0..1, got \[0, 2\]"):
        _group_of(make_sample("g0", 0), make_sample("g0", 2))


def test_group_build_reports_bad_samples_as_a_validation_error():
    with pytest.raises(ValidationError, match="indices"):  # (the rollout counts these as failed groups)
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
    with pytest.raises(ValueError, match="frozen"):
        g.samples.reward = [0.0]
    with pytest.raises(ValueError, match="frozen"):
        g.samples[0].timings.scored = 1.0
    ids[0] = 9  # the caller's arrays stay theirs: the group gathered a copy
    assert g.samples.completion_ids.tolist() == [5, 6, 7]
    mine = np.array([1, 2, 3], np.int32)
    built = Samples.model_validate({**g.samples.model_dump(), "completion_ids": mine})  # built from it directly
    assert not built.completion_ids.flags.writeable and mine.flags.writeable


def test_encode_refuses_arrays_of_another_dtype():
    """A field assigned without validation can hold any array: casting it could wrap values, so
    encode refuses it; arrays and records have no place in free-form maps either."""
    g = make_group()
    g.prompt_ids = np.array([1, 2, 3])  # int64
    with pytest.raises(RecordEncodeError, match="int64"):
        encode(g)
    s = make_sample()
    s.reward_details = {"a": np.array([1.5])}
    with pytest.raises(RecordEncodeError):
        encode(s)
    s.reward_details = {"a": make_sample().timings}
    with pytest.raises(RecordEncodeError):
        encode(s)
    s.reward_details = {"a": np.float64(0.5), "n": np.int64(3)}  # numpy scalars: their Python values
    assert decode(encode(s), Sample).reward_details == {"a": 0.5, "n": 3}
    s.timings = None  # a nested record replaced by something else
    with pytest.raises(RecordEncodeError, match="expected a record"):
        encode(s)
    g.prompt_ids = [1, 2, 3]
    with pytest.raises(RecordEncodeError, match="not an array"):
        encode(g)


def test_fast_path_mirrors_follow_the_models_constraints():
    """The msgspec mirrors are built from the models' constraints; one with no msgspec spelling
    stops the import instead of being dropped (the fast path would then accept more)."""
    from typing import Annotated

    import msgspec
    from pydantic import Field

    assert codec._msgspec_type(Annotated[str, Field(min_length=2, max_length=9)]) == Annotated[
        str, msgspec.Meta(min_length=2, max_length=9)]  # fmt: skip
    assert codec._msgspec_type(list[Annotated[int, Field(ge=0)]]) == list[Annotated[int, msgspec.Meta(ge=0)]]
    with pytest.raises(TypeError, match="no msgspec spelling"):
        codec._msgspec_type(Annotated[str, Field(pattern="^a")])


def test_decode_refuses_an_expected_type_that_is_not_a_record():
    with pytest.raises(TypeError, match="Samples is not a buffer record type"):
        decode(encode(make_group()), Samples)
    assert decode(encode(make_sample()), SampleView) == make_sample()


def test_group_samples_are_read_only_views():
    g = make_group(n=2, n_tokens=3)
    s = g.samples[0]
    assert isinstance(s, Sample) and np.shares_memory(s.completion_ids, g.samples.completion_ids)
    with pytest.raises(ValueError, match="frozen"):
        s.reward = 0.25
    with pytest.raises(ValueError, match="read-only"):
        s.behavior_logprobs[0] = 0.0
    with pytest.raises(IndexError):
        g.samples[2]
    edited = edit_sample(g, 0, reward=0.25)  # a change is a new group
    assert edited.rewards == [0.25, 0.5] and g.rewards == [0.0, 0.5]


def test_encoded_group_is_a_plain_msgpack_map_read_in_place():
    """Any msgpack reader reads the payload (here the `msgpack` package, not the codec's msgspec),
    and decode's arrays are views of the payload (no copy), read-only like every decoded array."""
    g = make_group(n=3, n_tokens=6, version=4)
    data = encode(g)
    plain = msgpack.unpackb(data, raw=False)
    assert plain["schema"] == SCHEMA_VERSION and plain["type"] == "group" and plain["group_id"] == "g0"
    assert plain["samples"]["reward"] == g.rewards and plain["samples"]["reward_status"] == ["scored"] * 3
    back = decode(data, Group)
    assert back == g
    assert np.shares_memory(back.samples[1].completion_ids, np.frombuffer(data, np.uint8))
    assert not back.samples[0].behavior_logprobs.flags.writeable
    # the same map written by another writer, keys in another order, decodes to the same group
    reordered = {k: plain[k] for k in reversed(plain)}
    reordered["samples"] = {k: plain["samples"][k] for k in reversed(plain["samples"])}
    assert decode(msgpack.packb(reordered, use_bin_type=True), Group) == g


def _legacy_wire(g: Group, schema: int) -> dict:
    """`g` as an earlier release wrote it: schema 2 kept the token columns and gave each sample a
    map with its length `n`; schema 1 put each sample's arrays in its map."""
    wire = _wire(g)
    columns = {name: getattr(g.samples, name).tobytes() for name in ("completion_ids", "behavior_logprobs", "versions")}
    samples = []
    for s in g.samples:
        m = {"prompt_id": s.prompt_id, "index": s.index, "finish_reason": s.finish_reason.value,
             "truncated": s.truncated, "text": s.text, "reward": s.reward,
             "reward_status": s.reward_status.value if s.reward_status else None,
             "reward_details": s.reward_details, "timings": s.timings.model_dump()}  # fmt: skip
        if schema == 2:
            m["n"] = len(s.completion_ids)
        else:
            m.update(completion_ids=s.completion_ids.tobytes(), behavior_logprobs=s.behavior_logprobs.tobytes(),
                     versions=s.versions.tobytes())  # fmt: skip
        samples.append(m)
    wire.update(schema=schema, samples=samples)
    return {**columns, **wire} if schema == 2 else wire


@pytest.mark.parametrize("schema", [1, 2])
def test_earlier_schemas_still_decode(schema):
    """A buffer written by an earlier release drains after an upgrade, checked as strictly."""
    g = edit_sample(make_group(n=3, n_tokens=4, version=2), 1, timings=Timings(submitted=3.5), text="abc")
    wire = _legacy_wire(g, schema)
    assert decode(msgpack.packb(wire, use_bin_type=True), Group) == g
    if schema == 1:
        wire["samples"][0]["behavior_logprobs"] = np.array([np.nan] * 4, "<f4").tobytes()
    else:
        wire["behavior_logprobs"] = np.array([-1.0] * 11 + [np.nan], "<f4").tobytes()
    with pytest.raises(RecordDecodeError, match="NaN"):
        decode(msgpack.packb(wire, use_bin_type=True), Group)
    wire = _legacy_wire(g, schema)
    wire["samples"][2]["index"] = 0
    with pytest.raises(RecordDecodeError, match="indices"):
        decode(msgpack.packb(wire, use_bin_type=True), Group)


def test_fast_path_records_are_pydantic_records():
    """The group decoder builds records without pydantic when the payload is encode's shape:
    they must be indistinguishable from validated ones (fields, fields_set, dumps, assignment)."""
    g = edit_sample(make_group(n=3), 2, timings=Timings(submitted=12.5), reward_details={"detail": [1, 2]})
    data = encode(g)
    fast = decode(data, Group)
    codec.FAST_PATH = False
    try:
        slow = decode(data, Group)
    finally:
        codec.FAST_PATH = True
    assert fast == slow == g
    for a, b in [(fast, slow), (fast.samples, slow.samples), *zip(fast.samples, slow.samples)]:
        assert a.model_fields_set == b.model_fields_set, type(a)
        assert a.model_dump(mode="json") == b.model_dump(mode="json")
    assert fast.samples.submitted == [None, None, 12.5] and fast.samples[2].timings.submitted == 12.5
    fast.job_id = "j1"  # assignment works as on any model
    assert fast.job_id == "j1" and fast != slow
    assert isinstance(fast.samples.finish_reason[0], FinishReason)
    assert fast.samples.reward_status == [RewardStatus.scored] * 3


def test_group_min_version_is_the_oldest_token():
    g = edit_sample(make_group(n=2, version=5), 1, versions=np.array([3, 4, 5, 5, 5], dtype=np.int32))
    assert g.min_version == 3
    wire = _wire(g)
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
        (("samples", "behavior_logprobs"), np.array([-1.0] * 9 + [np.nan], "<f4").tobytes(), "NaN"),
        (("samples", "behavior_logprobs"), np.array([-1.0] * 9 + [0.5], "<f4").tobytes(), "must be <= 0"),
        (("samples", "behavior_logprobs"), np.zeros(9, "<f4").tobytes(), "9 logprobs for 10"),
        (("samples", "versions"), np.zeros(11, "<i4").tobytes(), "11 versions for 10"),
        (("samples", "versions"), np.full(10, -1, "<i4").tobytes(), "negative policy version"),
        (("samples", "completion_ids"), np.full(10, -1, "<i4").tobytes(), "negative token id"),
        (("samples", "completion_ids"), b"\x01\x02\x03", "whole number"),
        (("samples", "completion_ids"), [1, 2, 3, 4, 5], "expected bytes"),
        (("samples", "completion_ids"), b"", "lengths add up to 10, the columns hold 0"),
        (("prompt_ids",), b"", "empty prompt"),
        (("samples", "lengths"), [4, 5], "add up to 9"),
        (("samples", "lengths"), [-1, 11], "greater than or equal to 0"),
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
        (("samples",), [], "expected a map, got list"),
        (("samples",), {}, "lengths"),
        (("samples",), "columns", "expected a map"),
        (("submit_version",), -1, "submit_version"),
        (("group_id",), 17, "group_id"),
        (("reward_spec",), {"target": "x"}, "verifier"),
        (("schema",), 99, "unknown schema 99"),
        (("schema",), 2, "expected a list"),  # schema 2 kept a list of sample maps
        (("schema",), 1, "samples"),  # schema 1 kept the arrays in those maps
        (("schema",), "1", "unknown schema"),
        (("type",), "gruop", "unknown record type"),
        (("surprise",), 1, "surprise"),
    ],
)
def test_strict_decode_rejects_bad_records(path, value, match):
    data = _tamper(make_group(n=2), path, value)
    with pytest.raises(RecordDecodeError, match=match):
        decode(data, Group)


def test_group_without_samples_is_refused_by_both_decoders():
    wire = _wire(make_group(n=2))
    wire["samples"] = {k: b"" if isinstance(v, bytes) else [] for k, v in wire["samples"].items()}
    fast, slow = _both_decoders(msgpack.packb(wire, use_bin_type=True))
    assert fast == slow == "error"


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
    with pytest.raises(RecordEncodeError):
        encode(_group_of(s))


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
    fast, slow = _both_decoders(bytes(payload))
    assert fast == slow  # the in-place reader agrees byte for byte
    try:
        record = decode(bytes(payload))
    except RecordDecodeError:
        return
    if isinstance(record, Group):  # a surviving record still satisfies every invariant
        for s in record.samples:
            assert len(s.completion_ids) == len(s.behavior_logprobs) == len(s.versions)
            assert all(math.isfinite(x) for x in s.behavior_logprobs.tolist())


def _decode_outcome(data: bytes):
    try:
        record = decode(data)
    except RecordDecodeError:
        return "error"
    if not isinstance(record, Group):
        return repr(record)
    # repr: a NaN inside a free-form field compares equal to itself; the types: a dump shows an
    # int in a float field as a float
    types = {k: [type(x) for x in v] if isinstance(v, list) else type(v) for k, v in vars(record.samples).items()}
    return (repr(record.model_dump(mode="json")), record.model_fields_set, record.samples.model_fields_set,
            {k: type(v) for k, v in vars(record).items()}, types)  # fmt: skip


def _both_decoders(payload: bytes) -> tuple:
    """The outcome of the fast decoder, then of msgpack's own unpacking + pydantic validation."""
    fast = _decode_outcome(payload)
    codec.FAST_PATH = False
    try:
        return fast, _decode_outcome(payload)
    finally:
        codec.FAST_PATH = True


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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_fast_and_pydantic_decoders_agree(data):
    """Tamper with any field (group level, a column, or one sample's entry of a column, or drop
    it): the fast decoder and pydantic's validation either both refuse the payload or build the
    very same record."""
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
    try:
        payload = msgpack.packb(wire, use_bin_type=True)
    except (TypeError, ValueError):
        return
    fast, slow = _both_decoders(payload)
    assert fast == slow


_EDGE_VALUES = [None, True, False, 0, 1, 2, 3, -1, 0.0, 1.0, -0.5, float("inf"), 2**40, "", "x", "x" * 257, "stop",
                "scored", "timeout", b"", b"\x00\x00\x00\x00", [], [0], {}, {"verifier": "v"}, {"submitted": 1.0},
                {1: 2}, {b"k": 1}, {"submitted": "x"}]  # fmt: skip


def test_fast_and_pydantic_decoders_agree_on_every_single_field_edit(monkeypatch):
    """Every field at every level (group, column, one sample's entry of a column), set to each
    edge value or removed: both decoders agree."""
    base = _wire(make_group(n=3, n_tokens=2, version=1))
    base["samples"]["submitted"][1] = 1.5
    fast_built = []
    fast_group = codec._fast_group
    monkeypatch.setattr(codec, "_fast_group", lambda *a: fast_built.append(fast_group(*a)) or fast_built[-1])
    paths = [(k,) for k in base] + [("samples", k) for k in base["samples"]] + [("surprise",), ("samples", "surprise")]
    paths += [("samples", k, i) for k, column in base["samples"].items() if isinstance(column, list)
              for i in range(len(column))]  # fmt: skip
    accepted = 0
    for path in paths:
        for value in [*_EDGE_VALUES, "<delete>"]:
            if value == "<delete>" and len(path) == 3:
                continue  # (an entry cannot be removed from the middle of a column without shifting)
            wire = msgpack.unpackb(msgpack.packb(base, use_bin_type=True), raw=False)
            target = wire
            for key in path[:-1]:
                target = target[key]
            if value == "<delete>":
                target.pop(path[-1], None)
            else:
                target[path[-1]] = value
            payload = msgpack.packb(wire, use_bin_type=True)
            fast, slow = _both_decoders(payload)
            assert fast == slow, (path, value)
            accepted += fast != "error"
    assert accepted > 50  # the edits include many valid ones (other texts, rewards, timings…)
    assert sum(g is not None for g in fast_built) > 50  # …and the fast path built them, not only pydantic
