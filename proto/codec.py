"""msgpack codec for buffer records. Never pickle.

Layout: a msgpack map `{"schema": 1, "type": "<group|sample|job|weights>", <fields>}` where
token ids and versions are little-endian int32 bytes and logprobs little-endian float32
bytes. `decode` is total: any byte string gives a record or raises `RecordDecodeError`
(wrong types, disagreeing lengths, NaN logprobs, unknown schema or type, truncated data).
"""

from __future__ import annotations

import typing
from enum import Enum
from typing import Any, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError

from proto.records import (
    ARRAYS_CHECKED,
    SCHEMA_VERSION,
    Group,
    GroupJob,
    Record,
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


def _to_wire(record: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, kind, arg in _PLANS[type(record)]:
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


def _from_wire(cls: type[Record], payload: Any, where: str) -> dict[str, Any]:
    """Turn array bytes into numpy views, recursively; pydantic validates the rest in one call."""
    if not isinstance(payload, dict):
        raise RecordDecodeError(f"{where}: expected a map, got {type(payload).__name__}")
    out = dict(payload)
    for name, dtype in _ARRAY_FIELDS.get(cls, {}).items():
        raw = out.get(name)
        if raw is None:
            continue  # pydantic reports the missing field
        if not isinstance(raw, bytes):
            raise RecordDecodeError(f"{where}.{name}: expected bytes, got {type(raw).__name__}")
        if len(raw) % dtype.itemsize:
            raise RecordDecodeError(f"{where}.{name}: {len(raw)} bytes is not a whole number of {dtype}")
        out[name] = np.frombuffer(raw, dtype=dtype).astype(_NATIVE[dtype], copy=False)
    for name, sub in _NESTED.get(cls, {}).items():
        value = out.get(name)
        if value is None or sub is Timings:
            continue  # Timings has no arrays
        if not isinstance(value, list):
            raise RecordDecodeError(f"{where}.{name}: expected a list, got {type(value).__name__}")
        out[name] = [_from_wire(sub, v, f"{where}.{name}[{i}]") for i, v in enumerate(value)]
    return out


def _check_group_arrays(fields: dict[str, Any]) -> None:
    """All samples' token arrays checked in three vector operations instead of 3 per sample."""
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


def _short(exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return f"{len(exc.errors())} error(s), first at '{loc}': {first.get('msg', '')}"[:MAX_DEPTH_ERROR]


def encode(record: Record) -> bytes:
    """Serialise a buffer record to msgpack bytes."""
    name = TYPE_NAMES.get(type(record))
    if name is None:
        raise RecordEncodeError(f"not a buffer record: {type(record).__name__}")
    body = {"schema": SCHEMA_VERSION, "type": name, **_to_wire(record)}
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordEncodeError(f"{name} is not msgpack-serialisable: {exc}") from exc


def decode(data: bytes, expected: type[R] | None = None) -> R:
    """Parse bytes made by `encode`. Raises `RecordDecodeError` for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordDecodeError(f"expected bytes, got {type(data).__name__}")
    try:
        payload = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # noqa: BLE001 — msgpack raises a zoo of types for bad input; all mean the same
        raise RecordDecodeError(f"malformed msgpack: {type(exc).__name__}: {exc}"[:MAX_DEPTH_ERROR]) from None
    if not isinstance(payload, dict):
        raise RecordDecodeError(f"expected a msgpack map, got {type(payload).__name__}")
    schema = payload.pop("schema", None)
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise RecordDecodeError(f"unknown schema {schema!r} (this build reads schema {SCHEMA_VERSION})")
    type_name = payload.pop("type", None)
    cls = TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise RecordDecodeError(f"unknown record type {type_name!r}")
    if expected is not None and cls is not expected:
        raise RecordDecodeError(f"expected a {TYPE_NAMES[expected]} record, got {type_name}")
    fields = _from_wire(cls, payload, type_name)
    context = None
    if cls is Group:
        _check_group_arrays(fields)
        context = {ARRAYS_CHECKED: True}
    try:
        return cls.model_validate(fields, context=context)  # type: ignore[return-value]
    except ValidationError as exc:
        raise RecordDecodeError(f"{type_name}: {_short(exc)}") from None
