"""msgpack codec for buffer records. Never pickle.

Layout: a msgpack map `{"schema": 1, "type": "<group|sample|job|weights>", <fields>}` where
token ids and versions are little-endian int32 bytes and logprobs little-endian float32
bytes. `decode` is total: any byte string gives a record or raises `RecordDecodeError`
(wrong types, disagreeing lengths, NaN logprobs, unknown schema or type, truncated data).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError

from proto.records import SCHEMA_VERSION, Group, GroupJob, Record, Sample, Timings, WeightsInfo

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

MAX_DEPTH_ERROR = 200  # characters of a validation error kept in the message


class RecordDecodeError(ValueError):
    """Bytes that are not a valid record of the current schema. `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RecordEncodeError(ValueError):
    """A record that cannot be put on the wire (e.g. a non-msgpack value in a free-form dict)."""


def _to_wire(record: BaseModel) -> dict[str, Any]:
    arrays = _ARRAY_FIELDS.get(type(record), {})
    nested = _NESTED.get(type(record), {})
    out: dict[str, Any] = {}
    for name in type(record).model_fields:
        value = getattr(record, name)
        if name in arrays:
            out[name] = np.ascontiguousarray(value, dtype=arrays[name]).tobytes()
        elif name in nested:
            out[name] = [_to_wire(v) for v in value] if isinstance(value, list) else _to_wire(value)
        elif isinstance(value, Enum):
            out[name] = value.value
        else:
            out[name] = value
    return out


def _from_wire(cls: type[Record], payload: Any, where: str) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise RecordDecodeError(f"{where}: expected a map, got {type(payload).__name__}")
    arrays = _ARRAY_FIELDS.get(cls, {})
    nested = _NESTED.get(cls, {})
    out = dict(payload)
    for name, dtype in arrays.items():
        if name not in out:
            continue  # pydantic reports the missing field
        raw = out[name]
        if not isinstance(raw, bytes):
            raise RecordDecodeError(f"{where}.{name}: expected bytes, got {type(raw).__name__}")
        if len(raw) % dtype.itemsize:
            raise RecordDecodeError(f"{where}.{name}: {len(raw)} bytes is not a whole number of {dtype}")
        out[name] = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=False)
    for name, sub in nested.items():
        if name not in out:
            continue
        value = out[name]
        if sub is Timings:
            try:
                out[name] = Timings.model_validate(_from_wire(Timings, value, f"{where}.{name}"))
            except ValidationError as exc:
                raise RecordDecodeError(f"{where}.{name}: {_short(exc)}") from None
        elif isinstance(value, list):
            out[name] = [_from_wire(sub, v, f"{where}.{name}[{i}]") for i, v in enumerate(value)]
        else:
            raise RecordDecodeError(f"{where}.{name}: expected a list, got {type(value).__name__}")
    if cls is Group and isinstance(out.get("samples"), list):
        try:
            out["samples"] = [Sample.model_validate(s) for s in out["samples"]]
        except ValidationError as exc:
            raise RecordDecodeError(f"{where}.samples: {_short(exc)}") from None
    return out


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
    except Exception as exc:  # msgpack raises a zoo of types for bad input; all mean the same
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
    try:
        return cls.model_validate(fields)  # type: ignore[return-value]
    except ValidationError as exc:
        raise RecordDecodeError(f"{type_name}: {_short(exc)}") from None
