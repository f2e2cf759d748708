"""msgpack codec for buffer records. Never pickle.

A payload is the msgpack array `[5, {"type": "<group|sample|job|weights>", <fields>}]`: the
schema version, then the record's map, in which token ids and versions are little-endian int32
`bin` and logprobs little-endian float32 `bin`. A group's `samples` map holds its `Samples`
columns: the three token columns and one list per other field. Encoding writes each column
straight from its array; decoding is one typed msgspec decode that checks every field and reads
the columns in place, then the records' own rules (`proto/records.py`). `decode` is total: any
byte string gives a record or raises `RecordDecodeError`.
"""

from __future__ import annotations

import contextvars
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

from asyncrl.proto.records import FIELDS_CHECKED, SCHEMA_VERSION, Group, GroupJob, Record, Sample, WeightsInfo

R = TypeVar("R", bound=Record)

TYPES: dict[str, type[Record]] = {
    cls.__struct_config__.tag: cls for cls in (Group, Sample, GroupJob, WeightsInfo)
}
MAX_ERROR_CHARS = 200  # characters of a decode error kept in the message


class RecordDecodeError(ValueError):
    """Bytes that are not a valid record of the current schema. `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RecordEncodeError(ValueError):
    """A record that cannot be put on the wire (e.g. a non-msgpack value in a free-form map)."""


# The token arrays of the record being encoded (by id): the only arrays that go on the wire. An
# array anywhere else (a free-form map) would come back as bytes.
_TOKEN_ARRAYS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "token_arrays", default=frozenset()
)


def _enc_hook(value: Any) -> Any:
    """What msgspec cannot write itself: the record's token arrays as little-endian bytes (read in
    place), numpy scalars (in free-form maps) as the Python number they hold; anything else is
    refused."""
    if isinstance(value, np.ndarray) and id(value) in _TOKEN_ARRAYS.get():
        return memoryview(np.ascontiguousarray(value, value.dtype.newbyteorder("<")))
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    raise TypeError(f"cannot put a {type(value).__name__} on the wire")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(tuple[Literal[SCHEMA_VERSION], Group | Sample | GroupJob | WeightsInfo])


def encode(record: Record) -> bytes:
    """Serialise a buffer record to msgpack bytes."""
    if not isinstance(record, Record):
        raise RecordEncodeError(f"not a buffer record: {type(record).__name__}")
    parts = (record, record.samples) if isinstance(record, Group) else (record,)
    token = _TOKEN_ARRAYS.set(frozenset(id(getattr(part, name)) for part in parts for name in part._arrays))
    try:
        return _ENCODER.encode((SCHEMA_VERSION, record))
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError) as exc:
        raise RecordEncodeError(f"{type(record).__name__} is not msgpack-serialisable: {exc}") from exc
    finally:
        _TOKEN_ARRAYS.reset(token)


def decode(data: bytes | bytearray | memoryview, expected: type[R] | None = None) -> R:
    """Parse bytes made by `encode`. Raises `RecordDecodeError` for anything else.

    Records view their payload, which must not change under them: a payload that is not
    `bytes` (immutable) is copied first."""
    if expected is not None and expected not in TYPES.values():
        raise TypeError(f"{expected.__name__} is not a buffer record type: expected one of {list(TYPES)}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordDecodeError(f"expected bytes, got {type(data).__name__}")
    if not isinstance(data, bytes):
        data = bytes(data)
    token = FIELDS_CHECKED.set(True)
    try:
        _, record = _DECODER.decode(data)
    except (ValueError, RecursionError) as exc:  # msgspec's errors and bad UTF-8 are ValueErrors
        raise RecordDecodeError(_reason(data, exc)[:MAX_ERROR_CHARS]) from None
    finally:
        FIELDS_CHECKED.reset(token)
    if expected is not None and type(record) is not expected:
        raise RecordDecodeError(
            f"expected a {expected.__struct_config__.tag} record, got {record.__struct_config__.tag}"
        )
    return record  # type: ignore[return-value]


def _reason(data: bytes | memoryview, exc: Exception) -> str:
    """Why `data` is no record: an unknown schema or type said as such, else msgspec's words."""
    try:
        payload = msgspec.msgpack.decode(data)
    except (ValueError, RecursionError):
        return f"malformed msgpack: {exc}"
    schema, record = payload if isinstance(payload, list) and len(payload) == 2 else (SCHEMA_VERSION, None)
    if type(schema) is not int or schema != SCHEMA_VERSION:
        return f"unknown schema {schema!r} (this build reads schema {SCHEMA_VERSION})"
    type_name = record.get("type") if isinstance(record, dict) else None
    if isinstance(record, dict) and not (isinstance(type_name, str) and type_name in TYPES):
        return f"unknown record type {type_name!r}"
    return str(exc)
