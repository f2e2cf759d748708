"""msgpack codec for buffer records. Never pickle.

Layout: a msgpack map `{"schema": 3, "type": "<group|sample|job|weights>", <fields>}` where
token ids and versions are little-endian int32 bytes and logprobs little-endian float32
bytes. `decode` is total: any byte string gives a record or raises `RecordDecodeError`
(wrong types, disagreeing lengths, NaN logprobs, unknown schema or type, truncated data).

A group's map mirrors the record: its `samples` map holds the `Samples` columns, the three
token columns as `bin` and every other field as a list with one entry per sample. Encoding
copies each column once (msgspec writes it straight from the array); decoding a group reads
the columns in place and checks them in four vector passes. A payload of exactly the
shape `encode` writes is decoded by msgspec against typed mirrors of the records (types,
bounds, enums and unknown keys checked in C), and the rules that span fields (lengths, rewards
against statuses, the oldest version) are checked here; anything else goes through pydantic's
full validation, which gives the same record or the error (`tests/unit/test_codec.py` checks
the two paths agree). Groups of schema 1 (per-sample arrays) and 2 (three columns at the top
of the map, per-sample maps) are still read.
"""

from __future__ import annotations

import functools
import math
import operator
import types
import typing
from typing import Any, Literal, TypeVar

import annotated_types
import msgspec
import numpy as np
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic.types import Strict

from proto.records import (
    PER_SAMPLE,
    READABLE_SCHEMAS,
    SCHEMA_VERSION,
    TOKEN_COLUMNS,
    Group,
    GroupJob,
    Record,
    RewardStatus,
    Sample,
    Samples,
    SampleView,
    Timings,
    TimingsView,
    WeightsInfo,
    check_token_arrays,
    construct,
)

R = TypeVar("R", bound=Record)

TYPE_NAMES: dict[type[Record], str] = {Group: "group", Sample: "sample", GroupJob: "job", WeightsInfo: "weights"}
TYPES: dict[str, type[Record]] = {v: k for k, v in TYPE_NAMES.items()}
# Records read out of a group's columns travel, and are expected, as the records they view.
_BASE: dict[type[Record], type[Record]] = {SampleView: Sample, TimingsView: Timings}

# Wire dtype of every array field, per record type.
_TOKENS = {name: dtype.newbyteorder("<") for name, dtype in TOKEN_COLUMNS.items()}
assert {dtype.itemsize for dtype in _TOKENS.values()} == {4}, "schema 2 columns are sliced in 4-byte items"
_ARRAY_FIELDS: dict[type[Record], dict[str, np.dtype]] = {
    Sample: _TOKENS,
    Samples: _TOKENS,
    Group: {"prompt_ids": np.dtype("<i4")},
    GroupJob: {"prompt_ids": np.dtype("<i4")},
    WeightsInfo: {},
}
_NESTED: dict[type[Record], dict[str, type[Record]]] = {Sample: {"timings": Timings}, Group: {"samples": Samples}}
_NATIVE = {dtype: dtype.newbyteorder("=") for fields in _ARRAY_FIELDS.values() for dtype in fields.values()}

MAX_ERROR_CHARS = 200  # characters of a validation error kept in the message


class RecordDecodeError(ValueError):
    """Bytes that are not a valid record of the current schema. `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RecordEncodeError(ValueError):
    """A record that cannot be put on the wire (e.g. a non-msgpack value in a free-form dict)."""


def _to_wire(record: Record) -> dict[str, Any]:
    """A record as the map msgspec writes: its fields (enum members go out as their values),
    each array as its wire bytes, read in place, each nested record as its own map."""
    if not isinstance(record, Record):  # (a field assigned without validation)
        raise TypeError(f"expected a record, found a {type(record).__name__}")
    cls = _BASE.get(type(record), type(record))
    out = dict(record.__dict__)  # exactly the model's fields
    for name, dtype in _ARRAY_FIELDS.get(cls, {}).items():
        out[name] = _wire_bytes(out[name], dtype, name)
    for name in _NESTED.get(cls, ()):
        out[name] = _to_wire(out[name])
    return out


def _wire_bytes(array: np.ndarray, dtype: np.dtype, name: str) -> memoryview:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} holds a {type(array).__name__}, not an array")
    if array.dtype != dtype or not array.flags.c_contiguous:
        if array.dtype.kind != dtype.kind or array.dtype.itemsize != dtype.itemsize:
            # (a field assigned without validation: casting could wrap values silently)
            raise TypeError(f"{name} holds {array.dtype} values, the wire takes {dtype}")
        array = np.ascontiguousarray(array, dtype=dtype)  # byte order or layout only
    return memoryview(array)


def _scalar(value: Any) -> Any:
    """msgspec's hook for values it cannot write itself: numpy scalars (in free-form maps) as
    the Python number they hold; anything else is refused."""
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    raise TypeError(f"cannot put a {type(value).__name__} on the wire")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_scalar)
_UNTYPED = msgspec.msgpack.Decoder()


def encode(record: Record) -> bytes:
    """Serialise a buffer record to msgpack bytes."""
    name = TYPE_NAMES.get(_BASE.get(type(record), type(record)))
    if name is None:
        raise RecordEncodeError(f"not a buffer record: {type(record).__name__}")
    try:
        return _ENCODER.encode({"schema": SCHEMA_VERSION, "type": name, **_to_wire(record)})
    except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError) as exc:
        raise RecordEncodeError(f"{name} is not msgpack-serialisable: {exc}") from exc


# ---------------------------------------------------------------- the usual path
def _wire_array(raw: Any, dtype: np.dtype, where: str) -> np.ndarray:
    """Array bytes from the wire (or a view of them) as a native-order numpy view."""
    if not isinstance(raw, (bytes, memoryview)):
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
        if out.get(name) is not None:  # a missing field: pydantic reports it
            out[name] = _from_wire(sub, out[name], f"{where}.{name}")
    return out


def _legacy_group(payload: dict[str, Any], schema: int) -> dict[str, Any]:
    """A group of schema 1 (each sample map with its arrays) or 2 (the three token columns at the
    top of the group map, each sample map with its length `n`) as pydantic takes it: a list of
    sample maps, which the group gathers into columns."""
    samples = payload.get("samples")
    if not isinstance(samples, list):
        raise RecordDecodeError(f"group.samples: expected a list, got {type(samples).__name__}")
    if not all(isinstance(s, dict) for s in samples):
        raise RecordDecodeError("group.samples: expected a list of maps")
    if schema == 2:
        columns = {name: payload.pop(name, None) for name in _TOKENS}
        tokens = [len(_wire_array(raw, dtype, f"group.{name}")) for (name, raw), dtype in zip(columns.items(), _TOKENS.values())]
        samples, start = [dict(s) for s in samples], 0
        for i, sample in enumerate(samples):
            n = sample.pop("n", None)
            if type(n) is not int or n < 0 or start + n > tokens[0]:
                raise RecordDecodeError(f"group.samples[{i}].n: {n!r} is not a length within the {tokens[0]} tokens")
            sample.update({name: raw[4 * start : 4 * (start + n)] for name, raw in columns.items()})  # 4-byte items
            start += n
        if any(count != start for count in tokens):
            raise RecordDecodeError(f"group: the samples' lengths add up to {start}, the columns hold {tokens}")
    samples = [_from_wire(Sample, s, f"group.samples[{i}]") for i, s in enumerate(samples)]
    return _from_wire(Group, {**payload, "samples": None}, "group") | {"samples": samples}


# ---------------------------------------------------------------- the fast path
# Typed mirrors of a group's wire map: msgspec checks every field's type and bounds while it
# decodes (strict like the models: no bool for int, int accepted for float), reads the `bin`
# columns as views of the payload and turns enum values into members. The mirrors are built
# from the models' annotations and constraints; a constraint with no msgspec spelling, a new
# validator or a model hook that `construct` would skip stops the import.
_BOUNDS = {annotated_types.MinLen: "min_length", annotated_types.MaxLen: "max_length", annotated_types.Ge: "ge",
           annotated_types.Gt: "gt", annotated_types.Le: "le", annotated_types.Lt: "lt"}  # fmt: skip


def _msgspec_type(annotation: Any, metadata: list[Any] = ()) -> Any:
    """The msgspec spelling of a pydantic annotation and its field-level constraints."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        base, *extra = args
        flat = [c for m in extra for c in (m.metadata if isinstance(m, FieldInfo) else [m])]
        return _msgspec_type(base, [*flat, *metadata])
    if origin is list:
        annotation = list[_msgspec_type(args[0])]
    elif origin in (typing.Union, types.UnionType):
        annotation = functools.reduce(operator.or_, map(_msgspec_type, args))
    bounds = {}
    for c in metadata:
        if type(c) in _BOUNDS:
            bounds[_BOUNDS[type(c)]] = getattr(c, _BOUNDS[type(c)])
        elif not (isinstance(c, Strict) and c.strict is False):  # lax enums: msgspec reads values, as pydantic does
            raise TypeError(f"no msgspec spelling for the constraint {c!r}")
    return typing.Annotated[annotation, msgspec.Meta(**bounds)] if bounds else annotation


def _mirror(cls: type[Record], head: list[tuple[str, Any]], **nested: Any) -> Any:
    fields = list(head)
    for name, info in cls.model_fields.items():
        if name in _ARRAY_FIELDS[cls]:
            fields.append((name, memoryview))
        else:
            fields.append((name, nested.get(name) or _msgspec_type(info.annotation, info.metadata)))
    return msgspec.defstruct(f"_Wire{cls.__name__}", fields, forbid_unknown_fields=True)


# What the fast path re-checks by hand (`_fast_group`), per model: its validators.
_VALIDATORS = {Group: ({"_check"}, {"_gather_samples"}), Samples: ({"_check"}, {"_read_only"})}
for _cls, (_model, _field) in _VALIDATORS.items():
    _decorators = _cls.__pydantic_decorators__
    assert (set(_decorators.model_validators), set(_decorators.field_validators)) == (_model, _field), _cls
for _cls in (Group, Samples):
    assert _cls.__pydantic_post_init__ is None and not _cls.__private_attributes__, "construct would skip them"
assert SCHEMA_VERSION == 3, "the fast path reads the current schema: update its Literal with it"
_WireGroup = _mirror(Group, [("schema", Literal[3]), ("type", Literal["group"])], samples=_mirror(Samples, []))
_GROUP_DECODER = msgspec.msgpack.Decoder(_WireGroup)
_per_sample = operator.attrgetter(*PER_SAMPLE)
# Native dtypes the fast path reads columns as (it runs on little-endian machines only).
_I4, _F4 = _NATIVE[_TOKENS["completion_ids"]], _NATIVE[_TOKENS["behavior_logprobs"]]
_LITTLE_ENDIAN = all(dtype == _NATIVE[dtype] for dtype in _TOKENS.values()) and _I4 == _ARRAY_FIELDS[Group]["prompt_ids"]
_SCORED = RewardStatus.scored


def _fast_group(data: bytes | memoryview) -> Group | None:
    """The group in `data` when it has exactly the shape `encode` writes and is valid; None
    means "not sure": the caller then decodes it the usual way (which also words the error).
    (Written for few interpreted steps: most run in C, over whole columns.)"""
    try:
        w = _GROUP_DECODER.decode(data)
    except Exception:  # noqa: BLE001 — msgspec's errors, or bad UTF-8: the usual path words them
        return None
    s = w.samples
    n, lengths, rewards = len(s.lengths), s.lengths, s.reward
    ids, logprobs, versions, prompt = s.completion_ids, s.behavior_logprobs, s.versions, w.prompt_ids
    if not (n and set(map(len, _per_sample(s))) == {n} and prompt and not len(prompt) % 4
            and len(ids) == len(logprobs) == len(versions) == 4 * sum(lengths)
            # a scored sample has a finite reward, any other none
            and [status is _SCORED for status in s.reward_status] == [r is not None for r in rewards]
            and all(math.isfinite(r) for r in rewards if r is not None)
            and type(w.reward_spec.get("verifier")) is str):  # fmt: skip
        return None
    ids, logprobs, versions = np.frombuffer(ids, _I4), np.frombuffer(logprobs, _F4), np.frombuffer(versions, _I4)
    try:
        oldest = check_token_arrays(ids, logprobs, versions)
    except ValueError:
        return None
    if w.min_version != (w.submit_version if oldest is None else oldest):
        return None
    columns = msgspec.structs.asdict(s)  # in the model's field order, as pydantic lays them out
    columns.update(completion_ids=ids, behavior_logprobs=logprobs, versions=versions)
    fields = msgspec.structs.asdict(w)
    del fields["schema"], fields["type"]
    fields.update(prompt_ids=np.frombuffer(prompt, _I4), samples=construct(Samples, columns))
    return construct(Group, fields)


# ---------------------------------------------------------------- decode
def _short(exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return f"{len(exc.errors())} error(s), first at '{loc}': {first.get('msg', '')}"[:MAX_ERROR_CHARS]


FAST_PATH = True  # tests turn it off to compare the two paths


def decode(data: bytes | bytearray | memoryview, expected: type[R] | None = None, *, owned: bool = False) -> R:
    """Parse bytes made by `encode`. Raises `RecordDecodeError` for anything else.

    Records may view their payload, which must not change under them: a payload that is not
    `bytes` is copied first, unless `owned` says the caller hands a `bytearray` over and
    never touches it again (the buffer's payload fetches); it is then read in place."""
    expected = _BASE.get(expected, expected)  # type: ignore[arg-type]
    if expected is not None and expected not in TYPES.values():
        raise TypeError(f"{expected.__name__} is not a buffer record type: expected one of {list(TYPES)}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordDecodeError(f"expected bytes, got {type(data).__name__}")
    if owned and isinstance(data, bytearray):
        data = memoryview(data).toreadonly()  # arrays viewing it are read-only, like views of bytes
    elif not isinstance(data, bytes):
        data = bytes(data)
    if FAST_PATH and _LITTLE_ENDIAN and expected in (None, Group):
        group = _fast_group(data)
        if group is not None:
            return group  # type: ignore[return-value]
    try:
        payload = _UNTYPED.decode(data)
    except Exception as exc:  # noqa: BLE001 — bad input can fail in several ways; all mean the same
        raise RecordDecodeError(f"malformed msgpack: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]) from None
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
    if cls is Group and schema < 3:
        fields = _legacy_group(payload, schema)
    else:
        fields = _from_wire(cls, payload, type_name)
    try:
        return cls.model_validate(fields)  # type: ignore[return-value]
    except ValidationError as exc:
        raise RecordDecodeError(f"{type_name}: {_short(exc)}") from None
