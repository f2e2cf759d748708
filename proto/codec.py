"""msgpack codec for buffer records. Never pickle.

Layout: a msgpack map `{"schema": 2, "type": "<group|sample|job|weights>", <fields>}` where
token ids and versions are little-endian int32 bytes and logprobs little-endian float32
bytes. `decode` is total: any byte string gives a record or raises `RecordDecodeError`
(wrong types, disagreeing lengths, NaN logprobs, unknown schema or type, truncated data).

A group (schema 3) travels as its `Samples` columns: the three token columns (`completion_ids`,
`behavior_logprobs`, `versions`) first in the map as `bin 32`, then the group's fields, whose
`samples` map holds the other columns as lists (`lengths`, `prompt_id`, `finish_reason`, …).
Encoding copies the token columns once; decoding reads them in place and checks them in three
vector operations. When the payload has exactly the shape `encode` writes, decoding checks every
field itself and builds the two records (`Group`, `Samples`) without pydantic; anything else
goes through pydantic's full validation, which gives the same record or the error
(`tests/unit/test_codec.py` checks the two paths agree). Schemas 1 (per-sample arrays) and 2
(token columns, per-sample maps) are still read.
"""

from __future__ import annotations

import math
import typing
from enum import Enum
from itertools import chain
from typing import Any, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError

from proto.records import (
    READABLE_SCHEMAS,
    SCHEMA_VERSION,
    FinishReason,
    Group,
    GroupJob,
    Record,
    RewardStatus,
    Sample,
    Samples,
    SampleView,
    Timings,
    WeightsInfo,
    check_token_arrays,
    construct,
)

R = TypeVar("R", bound=Record)

TYPE_NAMES: dict[type[Record], str] = {Group: "group", Sample: "sample", GroupJob: "job", WeightsInfo: "weights"}
TYPES: dict[str, type[Record]] = {v: k for k, v in TYPE_NAMES.items()}
TYPE_NAMES[SampleView] = "sample"  # a sample read out of a group is put on the wire as a sample

# Wire dtype of every array field, per record type.
_ARRAY_FIELDS: dict[type[Record], dict[str, np.dtype]] = {
    Sample: {"completion_ids": np.dtype("<i4"), "behavior_logprobs": np.dtype("<f4"), "versions": np.dtype("<i4")},
    Group: {"prompt_ids": np.dtype("<i4")},
    GroupJob: {"prompt_ids": np.dtype("<i4")},
    WeightsInfo: {},
}
_NESTED: dict[type[Record], dict[str, type[Record]]] = {Sample: {"timings": Timings}}
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
_PLANS[SampleView] = _PLANS[Sample]


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


# Schema 3 groups: the token columns first, as `bin 32`, then the rest of the map.
_COLUMNS = tuple(_ARRAY_FIELDS[Sample].items())
_PROMPT_DTYPE = _ARRAY_FIELDS[Group]["prompt_ids"]
_GROUP_HEAD = [entry for entry in _PLANS[Group] if entry[0] != "samples"]
_SAMPLE_LISTS = tuple(name for name in Samples.model_fields if name not in dict(_COLUMNS))  # the `samples` map
_ENUM_LISTS = {name for name in _SAMPLE_LISTS if _is_enum(Samples.model_fields[name].annotation)}
assert dict(_COLUMNS).keys() < Samples.model_fields.keys()
assert _ENUM_LISTS == {"finish_reason", "reward_status"}, "the group encoder writes these two as their values"
assert len(_GROUP_HEAD) + 3 + len(_COLUMNS) < 16, "the group encoder writes a one-byte fixmap header"


_BIN32 = b"\xc6"  # msgpack: bin 32 header byte, then the length as big-endian uint32
_PACKED_NAMES = {name: msgpack.packb(name) for name, _ in _COLUMNS}
_COLUMN_KEYS = {name: packed + _BIN32 for name, packed in _PACKED_NAMES.items()}  # then the length, 4 bytes


def _encode_group(group: Group) -> bytes:
    """A schema 3 group in one copy of its token columns: the map starts with them as `bin 32`
    entries written straight from their buffers, then msgpack packs the small fields. Any
    msgpack reader reads it as a plain map; `decode` reads the columns in place."""
    samples = group.samples
    lists = {name: getattr(samples, name) for name in _SAMPLE_LISTS}
    for name in _ENUM_LISTS:
        lists[name] = [None if e is None else e.value for e in lists[name]]
    head = {"schema": SCHEMA_VERSION, "type": "group", **_to_wire(group, _GROUP_HEAD), "samples": lists}
    parts: list[Any] = [bytes([0x80 | (len(head) + len(_COLUMNS))])]  # fixmap header
    for name, dtype in _COLUMNS:
        column = np.ascontiguousarray(getattr(samples, name), dtype=dtype)
        parts += [_PACKED_NAMES[name], _BIN32, column.nbytes.to_bytes(4, "big"), column]
    parts.append(memoryview(msgpack.packb(head, use_bin_type=True))[1:])  # its pairs, without its fixmap header
    return b"".join(parts)


def _split_columns(data: bytes) -> dict[str, Any] | None:
    """The map of a group laid out as `_encode_group` writes it, its columns as zero-copy
    views of `data`; None for any other layout (the caller then unpacks it the usual way)."""
    if not data or data[0] & 0xF0 != 0x80 or (data[0] & 0x0F) < len(_COLUMNS):
        return None
    view, count, pos, columns = memoryview(data), data[0] & 0x0F, 1, {}
    for name, _ in _COLUMNS:
        key = _COLUMN_KEYS[name]
        start = pos + len(key) + 4
        if not data.startswith(key, pos) or start > len(data):
            return None
        end = start + int.from_bytes(data[start - 4 : start], "big")
        if end > len(data):
            return None
        columns[name] = view[start:end]
        pos = end
    try:
        head = msgpack.unpackb(bytes([0x80 | (count - len(_COLUMNS))]) + data[pos:], raw=False, strict_map_key=True)
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


def _group_fields(payload: dict[str, Any], ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray,
                 schema: int) -> dict:  # fmt: skip
    """A schema 2 or 3 group as pydantic takes it: the token columns go back into `samples`
    (schema 3: its map of columns; schema 2: a view of them in each sample's map)."""
    samples = payload.get("samples")
    if schema >= 3:
        if not isinstance(samples, dict):
            raise RecordDecodeError(f"group.samples: expected a map, got {type(samples).__name__}")
        if samples.keys() & dict(_COLUMNS).keys():
            raise RecordDecodeError("group.samples: the token columns travel at the top of the group map")
        samples = dict(samples, completion_ids=ids, behavior_logprobs=logprobs, versions=versions)
    else:
        samples = _schema2_samples(samples, ids, logprobs, versions)
    fields = dict(payload, samples=samples)
    if fields.get("prompt_ids") is not None:  # missing: pydantic reports it
        fields["prompt_ids"] = _wire_array(fields["prompt_ids"], _PROMPT_DTYPE, "group.prompt_ids")
    return fields


def _schema2_samples(samples: Any, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> list[dict]:
    """Schema 2: each sample map with its length `n` gets its views of the columns."""
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
    return out


# ---------------------------------------------------------------- fast construction
# Exactly what pydantic would accept and build, for payloads shaped as `encode` writes them;
# None means "not sure": the caller then validates with pydantic.
_GROUP_WIRE_KEYS = frozenset(Group.model_fields)
_SAMPLES_WIRE_KEYS = frozenset(_SAMPLE_LISTS)
_SAMPLES_FIELDS = tuple(Samples.model_fields)
_PER_SAMPLE = tuple(name for name in _SAMPLE_LISTS if name != "lengths")
_TIMING_FIELDS = tuple(Timings.model_fields)
assert set(_TIMING_FIELDS) < _SAMPLES_WIRE_KEYS
_OPTIONAL_FLOAT, _OPTIONAL_STR = {float, type(None)}, {str, type(None)}
_LIST, _INT, _STR, _BOOL, _DICT = {list}, {int}, {str}, {bool}, {dict}
_FINISH = {e.value: e for e in FinishReason}
_STATUS: dict[str | None, RewardStatus | None] = {e.value: e for e in RewardStatus}
_STATUS[None] = None
_SCORED = RewardStatus.scored


def _max_length(cls: type[Record], name: str) -> int:
    return next(m.max_length for m in cls.model_fields[name].metadata if getattr(m, "max_length", None))


_MAX_ID = _max_length(Group, "group_id")  # the ids' max_length in records.py
assert _MAX_ID == _max_length(Group, "job_id") == _max_length(Sample, "prompt_id"), "the fast path checks ids alike"


def _is_id(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= _MAX_ID


def _str_keyed(value: Any) -> bool:
    return type(value) is dict and all(type(k) is str for k in value)


def _fast_group(f: dict[str, Any], ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray,
                oldest: int | None) -> Group | None:  # fmt: skip
    """`f` is the freshly unpacked map: its lists and dicts become the records' own, uncopied."""
    if f.keys() != _GROUP_WIRE_KEYS:
        return None
    spec, s, prompt = f["reward_spec"], f["samples"], f["prompt_ids"]
    submit, min_version = f["submit_version"], f["min_version"]
    if oldest is None:
        oldest = submit
    if not (_is_id(f["group_id"]) and _is_id(f["job_id"]) and type(prompt) is bytes and prompt and len(prompt) % 4 == 0
            and _str_keyed(spec) and type(spec.get("verifier")) is str and type(submit) is int and submit >= 0
            and type(min_version) is int and min_version == oldest
            and type(s) is dict and s.keys() == _SAMPLES_WIRE_KEYS):  # fmt: skip
        return None
    # Type checks of whole columns at C speed: `set(map(type, column))` is the set of its item types.
    lengths, finish, status, reward = s["lengths"], s["finish_reason"], s["reward_status"], s["reward"]
    per_sample = [s[name] for name in _PER_SAMPLE]
    if not (type(lengths) is list and lengths and set(map(type, per_sample)) == _LIST
            and set(map(len, per_sample)) == {len(lengths)}):  # fmt: skip
        return None
    prompt_ids, details = s["prompt_id"], s["reward_details"]
    if not (set(map(type, lengths)) == _INT and min(lengths) >= 0 and sum(lengths) == len(ids)
            and set(map(type, prompt_ids)) == _STR and min(map(len, prompt_ids)) > 0
            and max(map(len, prompt_ids)) <= _MAX_ID
            and set(map(type, finish)) == _STR and _FINISH.keys() >= set(finish)
            and set(map(type, status)) <= _OPTIONAL_STR and _STATUS.keys() >= set(status)
            and set(map(type, s["truncated"])) == _BOOL and set(map(type, s["text"])) == _STR
            and set(map(type, details)) == _DICT and set(map(type, chain.from_iterable(details))) <= _STR
            and set(map(type, chain.from_iterable(s[name] for name in _TIMING_FIELDS))) <= _OPTIONAL_FLOAT):  # fmt: skip
        return None
    status = [_STATUS[x] for x in status]
    for r, st in zip(reward, status):
        if st is _SCORED:
            if type(r) is not float or not math.isfinite(r):
                return None
        elif r is not None:
            return None
    s.update(completion_ids=ids, behavior_logprobs=logprobs, versions=versions,
             finish_reason=[_FINISH[x] for x in finish], reward_status=status)  # fmt: skip
    return construct(Group, {
        "group_id": f["group_id"], "job_id": f["job_id"], "prompt_ids": _wire_array(prompt, _PROMPT_DTYPE, ""),
        "reward_spec": spec, "samples": construct(Samples, {name: s[name] for name in _SAMPLES_FIELDS}),
        "submit_version": submit, "min_version": min_version})  # fmt: skip


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
    if cls is Group and schema >= 2:
        *columns, oldest = _read_columns(payload)
        group = _fast_group(payload, *columns, oldest) if FAST_PATH and schema == SCHEMA_VERSION else None
        if group is not None:
            return group  # type: ignore[return-value]
        fields = _group_fields(payload, *columns, schema)
    elif cls is Group:  # schema 1: each sample map carries its arrays
        fields = _from_wire(Group, payload, type_name)
        samples = fields.get("samples")
        if isinstance(samples, list):
            fields["samples"] = [_from_wire(Sample, v, f"group.samples[{i}]") for i, v in enumerate(samples)]
    else:
        fields = _from_wire(cls, payload, type_name)
    try:
        return cls.model_validate(fields)  # type: ignore[return-value]
    except ValidationError as exc:
        raise RecordDecodeError(f"{type_name}: {_short(exc)}") from None
