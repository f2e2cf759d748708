"""msgpack codec for buffer records. Never pickle.

Layout: a msgpack map `{"schema": 2, "type": "<group|sample|job|weights>", <fields>}` where
token ids and versions are little-endian int32 bytes and logprobs little-endian float32
bytes. `decode` is total: any byte string gives a record or raises `RecordDecodeError`
(wrong types, disagreeing lengths, NaN logprobs, unknown schema or type, truncated data).

Groups (schema 2) carry their samples' arrays as three group-level columns
(`completion_ids`, `behavior_logprobs`, `versions`, samples in order; the encoder writes them
first in the map) and each sample map its length `n`: encoding copies the arrays once, decoding
reads them in place, and their checks are three vector operations per group, not per sample.
Decoding a group checks every field itself and builds the records without pydantic when the
payload has exactly the shape `encode` writes; anything else goes through pydantic's full
validation, which gives the same record or the error (`tests/unit/test_codec.py` checks the
two paths agree). Schema 1 (per-sample arrays) is still read.
"""

from __future__ import annotations

import math
import typing
from enum import Enum
from typing import Any, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError

from proto.records import (
    ARRAYS_CHECKED,
    READABLE_SCHEMAS,
    SCHEMA_VERSION,
    FinishReason,
    Group,
    GroupJob,
    Record,
    RewardStatus,
    Sample,
    Timings,
    WeightsInfo,
    check_token_arrays,
)

R = TypeVar("R", bound=Record)

TYPE_NAMES: dict[type[Record], str] = {Group: "group", Sample: "sample", GroupJob: "job", WeightsInfo: "weights"}
TYPES: dict[str, type[Record]] = {v: k for k, v in TYPE_NAMES.items()}

# Wire dtype of every array field, per record type.
_ARRAY_FIELDS: dict[type[Record], dict[str, np.dtype]] = {
    Sample: {"completion_ids": np.dtype("<i4"), "behavior_logprobs": np.dtype("<f4"), "versions": np.dtype("<i4")},
    Group: {"prompt_ids": np.dtype("<i4")},
    GroupJob: {"prompt_ids": np.dtype("<i4")},
    WeightsInfo: {},
}
_NESTED: dict[type[Record], dict[str, type[Record]]] = {Group: {"samples": Sample}, Sample: {"timings": Timings}}
_PLANS: dict[type[BaseModel], list[tuple[str, str, Any]]] = {}
_NATIVE = {dtype: dtype.newbyteorder("=") for fields in _ARRAY_FIELDS.values() for dtype in fields.values()}

MAX_DEPTH_ERROR = 200  # characters of a validation error kept in the message


class RecordDecodeError(ValueError):
    """Bytes that are not a valid record of the current schema. `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RecordEncodeError(ValueError):
    """A record that cannot be put on the wire (e.g. a non-msgpack value in a free-form dict)."""


def _plan(cls: type[BaseModel]) -> list[tuple[str, str, Any]]:
    """How to put each field of `cls` on the wire: computed once per record type."""
    arrays, nested = _ARRAY_FIELDS.get(cls, {}), _NESTED.get(cls, {})
    plan = []
    for name, info in cls.model_fields.items():
        if name in arrays:
            plan.append((name, "array", arrays[name]))
        elif name in nested:
            plan.append((name, "list" if typing.get_origin(info.annotation) is list else "record", nested[name]))
        elif _is_enum(info.annotation):
            plan.append((name, "enum", None))
        else:
            plan.append((name, "plain", None))
    return plan


def _is_enum(annotation: Any) -> bool:
    """True for an Enum type, an Optional/Annotated one, or a union containing one."""
    args = typing.get_args(annotation) or (annotation,)
    return any(_is_enum(a) if typing.get_args(a) else isinstance(a, type) and issubclass(a, Enum) for a in args)


_PLANS.update({cls: _plan(cls) for cls in (Group, Sample, GroupJob, WeightsInfo, Timings)})


def _to_wire(record: BaseModel, plan=None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kind, arg in plan or _PLANS[type(record)]:
        value = getattr(record, name)
        if kind == "array":
            out[name] = value.astype(arg, copy=False).tobytes()
        elif kind == "list":
            out[name] = [_to_wire(v) for v in value]
        elif kind == "record":
            out[name] = _to_wire(value)
        elif kind == "enum" and value is not None:
            out[name] = value.value
        else:
            out[name] = value
    return out


# Schema 2 groups: the samples' arrays as group-level columns, in sample order.
_COLUMNS = tuple(_ARRAY_FIELDS[Sample].items())
_PROMPT_DTYPE = _ARRAY_FIELDS[Group]["prompt_ids"]
_GROUP_HEAD = [entry for entry in _PLANS[Group] if entry[0] != "samples"]
assert len(_GROUP_HEAD) + 3 + len(_COLUMNS) < 16, "the group encoder writes a one-byte fixmap header"


_BIN32 = b"\xc6"  # msgpack: bin 32 header byte, then the length as big-endian uint32
_PACKED_NAMES = {name: msgpack.packb(name) for name, _ in _COLUMNS}


def _encode_group(group: Group) -> bytes:
    """A schema 2 group in one copy of its arrays: the map starts with the three columns as
    `bin 32` entries gathered straight from the samples' buffers, then msgpack packs the small
    fields. Any msgpack reader reads it as a plain map; `decode` reads the columns in place."""
    samples = group.samples
    head = {"schema": SCHEMA_VERSION, "type": "group", **_to_wire(group, _GROUP_HEAD),
            "samples": [_sample_head(s) for s in samples]}  # fmt: skip
    parts: list[Any] = [bytes([0x80 | (len(head) + len(_COLUMNS))])]  # fixmap header
    for name, dtype in _COLUMNS:
        arrays = [np.ascontiguousarray(getattr(s, name), dtype=dtype) for s in samples]
        parts += [_PACKED_NAMES[name], _BIN32, sum(a.nbytes for a in arrays).to_bytes(4, "big"), *arrays]
    parts.append(memoryview(msgpack.packb(head, use_bin_type=True))[1:])  # its pairs, without its fixmap header
    return b"".join(parts)


def _sample_head(s: Sample) -> dict[str, Any]:
    """A sample's fields but its arrays, and their length `n` (the fields are checked against
    the model in the fast-construction section)."""
    t, status = s.timings, s.reward_status
    return {"n": len(s.completion_ids), "prompt_id": s.prompt_id, "index": s.index,
            "finish_reason": s.finish_reason.value, "truncated": s.truncated, "text": s.text, "reward": s.reward,
            "reward_status": None if status is None else status.value, "reward_details": s.reward_details,
            "timings": {"submitted": t.submitted, "first_token": t.first_token, "finished": t.finished,
                        "scored": t.scored}}  # fmt: skip


def _split_columns(data: bytes | bytearray | memoryview) -> dict[str, Any] | None:
    """The map of a group laid out as `_encode_group` writes it, its columns as zero-copy
    views of `data`; None for any other layout (the caller then unpacks it the usual way)."""
    mv = memoryview(data)
    if mv.ndim != 1 or mv.format != "B" or len(mv) < 1 or mv[0] & 0xF0 != 0x80 or (mv[0] & 0x0F) < len(_COLUMNS):
        return None
    count, pos, columns = mv[0] & 0x0F, 1, {}
    for name, _ in _COLUMNS:
        key = _PACKED_NAMES[name]
        header = pos + len(key)
        if mv[pos:header] != key or mv[header : header + 1] != _BIN32 or header + 5 > len(mv):
            return None
        start = header + 5
        end = start + int.from_bytes(mv[header + 1 : start], "big")
        if end > len(mv):
            return None
        columns[name] = mv[start:end]
        pos = end
    try:
        head = msgpack.unpackb(bytes([0x80 | (count - len(_COLUMNS))]) + mv[pos:], raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 — the usual path reports it
        return None
    if not isinstance(head, dict) or head.keys() & columns.keys():
        return None  # a repeated key: let the usual path decide which one wins
    head.update(columns)
    return head


def _wire_array(raw: Any, dtype: np.dtype, where: str) -> np.ndarray:
    """Array bytes from the wire (or a view of them) as a native-order numpy view."""
    if not isinstance(raw, (bytes, memoryview)):  # memoryview: a column `_split_columns` reads in place
        raise RecordDecodeError(f"{where}: expected bytes, got {type(raw).__name__}")
    if len(raw) % dtype.itemsize:
        raise RecordDecodeError(f"{where}: {len(raw)} bytes is not a whole number of {dtype}")
    return np.frombuffer(raw, dtype=dtype).astype(_NATIVE[dtype], copy=False)


def _from_wire(cls: type[Record], payload: Any, where: str) -> dict[str, Any]:
    """Turn array bytes into numpy views, recursively; pydantic validates the rest in one call."""
    if not isinstance(payload, dict):
        raise RecordDecodeError(f"{where}: expected a map, got {type(payload).__name__}")
    out = dict(payload)
    for name, dtype in _ARRAY_FIELDS.get(cls, {}).items():
        raw = out.get(name)
        if raw is not None:  # a missing field: pydantic reports it
            out[name] = _wire_array(raw, dtype, f"{where}.{name}")
    for name, sub in _NESTED.get(cls, {}).items():
        value = out.get(name)
        if value is None or sub is Timings:
            continue  # Timings has no arrays
        if not isinstance(value, list):
            raise RecordDecodeError(f"{where}.{name}: expected a list, got {type(value).__name__}")
        out[name] = [_from_wire(sub, v, f"{where}.{name}[{i}]") for i, v in enumerate(value)]
    return out


def _check_group_arrays(fields: dict[str, Any]) -> None:
    """Schema 1: all samples' token arrays checked in three vector operations."""
    samples = fields.get("samples")
    if not isinstance(samples, list) or not samples:
        return
    arrays = {name: [s.get(name) for s in samples] for name in ("completion_ids", "behavior_logprobs", "versions")}
    if any(not isinstance(a, np.ndarray) for values in arrays.values() for a in values):
        return  # a missing field: leave the message to pydantic
    try:
        check_token_arrays(*(np.concatenate(arrays[n]) for n in ("completion_ids", "behavior_logprobs", "versions")))
    except ValueError as exc:
        raise RecordDecodeError(f"group.samples: {exc}") from None


def _read_columns(payload: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int | None]:
    """Schema 2 group: pop the three columns and check them whole (lengths, contents); with
    them, the oldest token version (None for no tokens)."""
    ids, logprobs, versions = (_wire_array(payload.pop(name, None), dtype, f"group.{name}")
                               for name, dtype in _COLUMNS)  # fmt: skip
    if len(logprobs) != len(ids):
        raise RecordDecodeError(f"group: {len(logprobs)} logprobs for {len(ids)} completion tokens")
    if len(versions) != len(ids):
        raise RecordDecodeError(f"group: {len(versions)} versions for {len(ids)} completion tokens")
    try:
        oldest = check_token_arrays(ids, logprobs, versions)
    except ValueError as exc:
        raise RecordDecodeError(f"group.samples: {exc}") from None
    return ids, logprobs, versions, oldest


def _group_fields(payload: dict[str, Any], ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> dict:
    """Schema 2 group as pydantic takes it: each sample map gets its views of the columns."""
    samples = payload.get("samples")
    if not isinstance(samples, list):
        raise RecordDecodeError(f"group.samples: expected a list, got {type(samples).__name__}")
    out, start = [], 0
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            raise RecordDecodeError(f"group.samples[{i}]: expected a map, got {type(sample).__name__}")
        sample = dict(sample)
        n = sample.pop("n", None)
        if type(n) is not int or n < 0 or start + n > len(ids):
            raise RecordDecodeError(f"group.samples[{i}].n: {n!r} is not a length within the {len(ids)} tokens")
        end = start + n
        sample.update(completion_ids=ids[start:end], behavior_logprobs=logprobs[start:end], versions=versions[start:end])
        out.append(sample)
        start = end
    if start != len(ids):
        raise RecordDecodeError(f"group.samples: lengths add up to {start}, the columns hold {len(ids)} tokens")
    fields = dict(payload, samples=out)
    if fields.get("prompt_ids") is not None:  # missing: pydantic reports it
        fields["prompt_ids"] = _wire_array(fields["prompt_ids"], _PROMPT_DTYPE, "group.prompt_ids")
    return fields


# ---------------------------------------------------------------- fast construction
# Exactly what pydantic would accept and build, for payloads shaped as `encode` writes them;
# None means "not sure": the caller then validates with pydantic. Field names are spelled out
# (checked against the models below) so a record is one dict literal in pydantic's field order.
_GROUP_WIRE_KEYS = frozenset({"group_id", "job_id", "prompt_ids", "reward_spec", "samples", "submit_version",
                              "min_version"})  # fmt: skip
_SAMPLE_WIRE_KEYS = frozenset({"n", "prompt_id", "index", "finish_reason", "truncated", "text", "reward",
                               "reward_status", "reward_details", "timings"})  # fmt: skip
_TIMING_FIELDS = ("submitted", "first_token", "finished", "scored")
assert _GROUP_WIRE_KEYS == Group.model_fields.keys()
assert _SAMPLE_WIRE_KEYS - {"n"} | {name for name, _ in _COLUMNS} == Sample.model_fields.keys()
assert _TIMING_FIELDS == tuple(Timings.model_fields)
_OPTIONAL_FLOAT = (float, type(None))
_FINISH = {e.value: e for e in FinishReason}
_STATUS = {e.value: e for e in RewardStatus}
_STATUS[None] = None


def _max_length(cls: type[Record], name: str) -> int:
    return next(m.max_length for m in cls.model_fields[name].metadata if getattr(m, "max_length", None))


_MAX_ID = _max_length(Group, "group_id")  # the ids' max_length in records.py
assert _MAX_ID == _max_length(Group, "job_id") == _max_length(Sample, "prompt_id"), "the fast path checks ids alike"


def _is_id(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= _MAX_ID


def _str_keyed(value: Any) -> bool:
    return type(value) is dict and all(type(k) is str for k in value)


def _construct(cls: type[Record], values: dict[str, Any]) -> Any:
    """`cls.model_construct(**values)` for every field, already valid and in field order,
    without its per-field loop. The test suite checks the result equals pydantic's record."""
    record = cls.__new__(cls)
    object.__setattr__(record, "__dict__", values)
    object.__setattr__(record, "__pydantic_fields_set__", set(values))
    object.__setattr__(record, "__pydantic_extra__", None)
    object.__setattr__(record, "__pydantic_private__", None)
    return record


def _fast_group(f: dict[str, Any], ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray,
                oldest: int | None) -> Group | None:  # fmt: skip
    """`f` is the freshly unpacked map: its dicts become the records' own, uncopied."""
    if f.keys() != _GROUP_WIRE_KEYS:
        return None
    spec, wire_samples, prompt = f["reward_spec"], f["samples"], f["prompt_ids"]
    submit, min_version = f["submit_version"], f["min_version"]
    if oldest is None:
        oldest = submit
    if not (_is_id(f["group_id"]) and _is_id(f["job_id"]) and type(prompt) is bytes and prompt and len(prompt) % 4 == 0
            and _str_keyed(spec) and type(spec.get("verifier")) is str and type(submit) is int and submit >= 0
            and type(min_version) is int and min_version == oldest
            and type(wire_samples) is list and wire_samples):  # fmt: skip
        return None
    samples, start = [], 0
    for i, w in enumerate(wire_samples):
        if type(w) is not dict or w.keys() != _SAMPLE_WIRE_KEYS:
            return None
        n, finish, status, reward, timings, details = (
            w["n"], w["finish_reason"], w["reward_status"], w["reward"], w["timings"], w["reward_details"])
        if not (type(n) is int and n >= 0 and _is_id(w["prompt_id"]) and w["index"] == i and type(w["index"]) is int
                and type(w["truncated"]) is bool and type(w["text"]) is str and _str_keyed(details)
                and type(finish) is str and finish in _FINISH and (status is None or type(status) is str)
                and status in _STATUS and type(timings) is dict and tuple(timings) == _TIMING_FIELDS
                and type(timings["submitted"]) in _OPTIONAL_FLOAT and type(timings["first_token"]) in _OPTIONAL_FLOAT
                and type(timings["finished"]) in _OPTIONAL_FLOAT and type(timings["scored"]) in _OPTIONAL_FLOAT):  # fmt: skip
            return None  # (timings in any other key order: pydantic puts them in field order)
        status = _STATUS[status]
        if status is RewardStatus.scored:
            if type(reward) is not float or not math.isfinite(reward):
                return None
        elif reward is not None:
            return None
        end = start + n
        samples.append(_construct(Sample, {
            "prompt_id": w["prompt_id"], "index": i, "completion_ids": ids[start:end],
            "behavior_logprobs": logprobs[start:end], "versions": versions[start:end],
            "finish_reason": _FINISH[finish], "truncated": w["truncated"], "text": w["text"], "reward": reward,
            "reward_status": status, "reward_details": details, "timings": _construct(Timings, timings)}))  # fmt: skip
        start = end
    if start != len(ids):
        return None
    return _construct(Group, {
        "group_id": f["group_id"], "job_id": f["job_id"], "prompt_ids": _wire_array(prompt, _PROMPT_DTYPE, ""),
        "reward_spec": spec, "samples": samples, "submit_version": submit, "min_version": min_version})  # fmt: skip


def _short(exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return f"{len(exc.errors())} error(s), first at '{loc}': {first.get('msg', '')}"[:MAX_DEPTH_ERROR]


def encode(record: Record) -> bytes:
    """Serialise a buffer record to msgpack bytes."""
    name = TYPE_NAMES.get(type(record))
    if name is None:
        raise RecordEncodeError(f"not a buffer record: {type(record).__name__}")
    try:
        if name == "group":
            return _encode_group(record)  # type: ignore[arg-type]
        return msgpack.packb({"schema": SCHEMA_VERSION, "type": name, **_to_wire(record)}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordEncodeError(f"{name} is not msgpack-serialisable: {exc}") from exc


FAST_PATH = True  # tests turn it off to compare the two paths


def decode(data: bytes, expected: type[R] | None = None) -> R:
    """Parse bytes made by `encode`. Raises `RecordDecodeError` for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordDecodeError(f"expected bytes, got {type(data).__name__}")
    if not isinstance(data, bytes):
        data = bytes(data)  # records may view their payload: it must not change under them
    payload = _split_columns(data) if FAST_PATH else None
    if payload is None:
        try:
            payload = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # noqa: BLE001 — msgpack raises a zoo of types for bad input; all mean the same
            raise RecordDecodeError(f"malformed msgpack: {type(exc).__name__}: {exc}"[:MAX_DEPTH_ERROR]) from None
    if not isinstance(payload, dict):
        raise RecordDecodeError(f"expected a msgpack map, got {type(payload).__name__}")
    schema = payload.pop("schema", None)
    if type(schema) is not int or schema not in READABLE_SCHEMAS:
        raise RecordDecodeError(f"unknown schema {schema!r} (this build reads schemas {READABLE_SCHEMAS})")
    type_name = payload.pop("type", None)
    cls = TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise RecordDecodeError(f"unknown record type {type_name!r}")
    if expected is not None and cls is not expected:
        raise RecordDecodeError(f"expected a {TYPE_NAMES[expected]} record, got {type_name}")
    context = None
    if cls is Group and schema >= 2:
        *columns, oldest = _read_columns(payload)
        group = _fast_group(payload, *columns, oldest) if FAST_PATH else None
        if group is not None:
            return group  # type: ignore[return-value]
        fields = _group_fields(payload, *columns)
        context = {ARRAYS_CHECKED: True}
    else:
        fields = _from_wire(cls, payload, type_name)
        if cls is Group:
            _check_group_arrays(fields)
            context = {ARRAYS_CHECKED: True}
    try:
        return cls.model_validate(fields, context=context)  # type: ignore[return-value]
    except ValidationError as exc:
        raise RecordDecodeError(f"{type_name}: {_short(exc)}") from None
