"""Buffer records (docs/architecture.md §3): samples, groups, rollout jobs and weight locations.

A group holds its samples column-wise (`Samples`): the trainer and the codec work on whole
columns, and a `Sample` is built only when one is read.

Token ids, logprobs and versions are 1-D numpy arrays (int32 / float32 / int32). In JSON they
appear as plain lists; in Redis the codec stores them as little-endian bytes. Validation is
strict: lengths must agree, logprobs must be finite and ≤ 0, a `scored` sample must carry a
finite reward and any other status must carry none (a failed verifier is never a silent 0).
"""

from __future__ import annotations

import math
import operator
import typing
from enum import Enum
from typing import Annotated, Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 3  # 2: a group's sample arrays travel as three columns; 3: all its sample fields do
READABLE_SCHEMAS = (1, 2, 3)

# A sampled token's logprob is ≤ 0 in exact arithmetic; engines in bf16 can round a
# near-certain token to a hair above 0, so allow that much and no more.
MAX_LOGPROB = 1e-3


_MIN, _MAX = np.minimum.reduce, np.maximum.reduce


def _oldest(versions: np.ndarray) -> int | None:
    return int(_MIN(versions)) if len(versions) else None


def check_token_arrays(ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> int | None:
    """Content rules for token arrays (any length, possibly several samples concatenated).
    Returns the oldest version (None for no tokens), which the check computes anyway."""
    # min and max are NaN if any value is, and every comparison with NaN is False: two passes
    # decide the common case; the detailed checks run only to word the error.
    # (The ufunc reductions themselves: `ndarray.min` adds a Python-level wrapper per call.)
    if len(logprobs) and not (float(_MIN(logprobs)) > -math.inf and float(_MAX(logprobs)) <= MAX_LOGPROB):
        if not np.all(np.isfinite(logprobs)):
            raise ValueError("behavior_logprobs contain NaN or inf")
        raise ValueError(f"behavior_logprobs must be <= 0, found {float(logprobs.max())}")
    if len(ids) and int(_MIN(ids)) < 0:
        raise ValueError("negative token id")
    oldest = _oldest(versions)
    if oldest is not None and oldest < 0:
        raise ValueError("negative policy version")
    return oldest


class RewardStatus(str, Enum):
    """Outcome of scoring one sample: only `scored` carries a reward."""

    scored = "scored"
    timeout = "timeout"
    error = "error"
    invalid_input = "invalid_input"


class FinishReason(str, Enum):
    stop = "stop"
    length = "length"
    abort = "abort"


def _array_type(dtype: np.dtype, json_item: str) -> Any:
    dtype = np.dtype(dtype)
    integral = dtype.kind == "i"

    def validate(value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray):
            if value.ndim != 1:
                raise ValueError(f"expected a 1-D array, got shape {value.shape}")
            if value.dtype == dtype:
                return value
            if integral and value.dtype.kind not in "iu":
                raise ValueError(f"expected integer array, got dtype {value.dtype}")
            if not integral and value.dtype.kind not in "fiu":
                raise ValueError(f"expected numeric array, got dtype {value.dtype}")
            converted = value.astype(dtype)
            if integral and not np.array_equal(converted, value):
                raise ValueError(f"values do not fit in {dtype}")
            return converted
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, bool) or not isinstance(item, (int, float)):
                    # ValueError, not TypeError: pydantic turns only ValueError into a validation error
                    raise ValueError(f"expected a list of numbers, found {type(item).__name__}")  # noqa: TRY004
                if integral and not isinstance(item, int):
                    raise ValueError("expected a list of integers, found a float")
            try:
                return np.asarray(value, dtype=dtype).reshape(-1)
            except OverflowError as exc:
                raise ValueError(f"values do not fit in {dtype}") from exc
        raise ValueError(f"expected an array or a list, got {type(value).__name__}")

    return Annotated[
        np.ndarray,
        PlainValidator(validate),
        PlainSerializer(lambda a: a.tolist(), when_used="json"),
        WithJsonSchema({"type": "array", "items": {"type": json_item}}),
    ]


Int32Array = _array_type(np.int32, "integer")
Float32Array = _array_type(np.float32, "number")


class Record(BaseModel):
    """Base of all buffer records: strict, no unknown fields, array-aware equality."""

    model_config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True, frozen=False)

    def __eq__(self, other: object) -> bool:
        if not (isinstance(other, type(self)) or isinstance(self, type(other))):
            return NotImplemented  # (a `SampleView` equals the `Sample` it was built from)
        return all(_field_equal(getattr(self, k), getattr(other, k)) for k in type(self).model_fields)

    __hash__ = None  # mutable records are not hashable


def _field_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_field_equal(x, y) for x, y in zip(a, b))
    return a == b


class Timings(Record):
    """Wall-clock stamps (unix seconds) of one sample's life; None until the event happens."""

    submitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    scored: float | None = None


class Sample(Record):
    """One completion of a prompt, with what the engine and the reward service said of it."""

    prompt_id: str = Field(min_length=1, max_length=256)
    index: int = Field(ge=0, description="position of this sample in its group")
    completion_ids: Int32Array
    behavior_logprobs: Float32Array = Field(description="log μ of each completion token, from the engine")
    versions: Int32Array = Field(description="policy version that sampled each completion token")
    finish_reason: Annotated[FinishReason, Field(strict=False)]
    truncated: bool = False
    text: str = ""
    reward: float | None = None
    reward_status: Annotated[RewardStatus | None, Field(strict=False)] = None
    reward_details: dict[str, Any] = Field(default_factory=dict)
    timings: Timings = Field(default_factory=Timings)

    @model_validator(mode="after")
    def _check(self) -> Sample:
        n = len(self.completion_ids)
        if len(self.behavior_logprobs) != n:
            raise ValueError(f"{len(self.behavior_logprobs)} logprobs for {n} completion tokens")
        if len(self.versions) != n:
            raise ValueError(f"{len(self.versions)} versions for {n} completion tokens")
        if n:
            check_token_arrays(self.completion_ids, self.behavior_logprobs, self.versions)
        _check_reward(self.reward, self.reward_status)
        return self

    @property
    def min_version(self) -> int | None:
        return _oldest(self.versions)


class TimingsView(Timings):
    """A sample's timings read out of a group's columns: frozen, like the sample."""

    model_config = ConfigDict(frozen=True)


class SampleView(Sample):
    """A sample read out of a group's columns: its arrays are read-only views of them, and it is
    frozen (assigning to it raises), since a change could never reach the group. Its
    `reward_details` is the group's own dict: treat it as read-only too."""

    model_config = ConfigDict(frozen=True)


class Samples(Record):
    """A group's samples, column-wise: the unit the buffer stores, the codec moves in one copy
    and the trainer reads.

    Sample i is `samples[i]` and its `index` is i. Its tokens are `completion_ids[o:o + lengths[i]]`
    with `o = sum(lengths[:i])` (likewise `behavior_logprobs`, `versions`); every other column
    is a list with one entry per sample (`submitted` … `scored` are its `Timings`). Indexing and
    iterating give read-only `SampleView`s, built on access. `Samples.of(samples)` gathers
    `Sample`s (in any order) into columns. The record is frozen and its arrays read-only; its
    lists are shared with the views and the wire: to change a group, build a new one.
    """

    model_config = ConfigDict(frozen=True)

    lengths: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, description="completion tokens per sample")
    completion_ids: Int32Array
    behavior_logprobs: Float32Array = Field(description="log μ of each completion token, from the engine")
    versions: Int32Array = Field(description="policy version that sampled each completion token")
    prompt_id: list[Annotated[str, Field(min_length=1, max_length=256)]]
    finish_reason: list[Annotated[FinishReason, Field(strict=False)]]
    truncated: list[bool]
    text: list[str]
    reward: list[float | None]
    reward_status: list[Annotated[RewardStatus | None, Field(strict=False)]]
    reward_details: list[dict[str, Any]]
    submitted: list[float | None]
    first_token: list[float | None]
    finished: list[float | None]
    scored: list[float | None]

    @field_validator("completion_ids", "behavior_logprobs", "versions")
    @classmethod
    def _read_only(cls, column: np.ndarray) -> np.ndarray:
        """A read-only view: the column is shared by every view of the group's samples (the
        caller's own array stays as it was)."""
        column = column.view()
        column.flags.writeable = False
        return column

    @model_validator(mode="after")
    def _check(self) -> Samples:
        n, tokens = len(self.lengths), len(self.completion_ids)
        for name in PER_SAMPLE:
            if len(getattr(self, name)) != n:
                raise ValueError(f"{len(getattr(self, name))} {name} entries for {n} samples")
        if sum(self.lengths) != tokens:
            raise ValueError(f"lengths add up to {sum(self.lengths)}, the columns hold {tokens} tokens")
        if len(self.behavior_logprobs) != tokens:
            raise ValueError(f"{len(self.behavior_logprobs)} logprobs for {tokens} completion tokens")
        if len(self.versions) != tokens:
            raise ValueError(f"{len(self.versions)} versions for {tokens} completion tokens")
        check_token_arrays(self.completion_ids, self.behavior_logprobs, self.versions)
        for i, (reward, status) in enumerate(zip(self.reward, self.reward_status)):
            _check_reward(reward, status, f"sample {i}: ")
        return self

    @classmethod
    def of(cls, samples: list[Any]) -> Samples:
        """Gather `Sample`s (or maps that validate as one) into columns, ordered by `index`,
        which must run 0..n−1."""
        rows = sorted((s if isinstance(s, Sample) else Sample.model_validate(s) for s in samples),
                      key=lambda s: s.index)  # fmt: skip
        if not rows:
            raise ValueError("a group needs at least one sample")
        if [s.index for s in rows] != list(range(len(rows))):
            raise ValueError(f"sample indices must be 0..{len(rows) - 1}, got {sorted(s.index for s in rows)}")
        columns = {name: _gather([getattr(s, name) for s in rows], dtype) for name, dtype in TOKEN_COLUMNS.items()}
        timings = {name: [getattr(s.timings, name) for s in rows] for name in _TIMINGS}
        per_sample = {name: [getattr(s, name) for s in rows] for name in PER_SAMPLE if name not in timings}
        return cls.model_validate({"lengths": [len(s.completion_ids) for s in rows], **columns, **per_sample, **timings})

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):  # type: ignore[override]  (a model iterates its samples, not its fields)
        start = 0
        for i, n in enumerate(self.lengths):
            yield self._view(i, start, start + n)
            start += n

    @typing.overload
    def __getitem__(self, i: int) -> SampleView: ...
    @typing.overload
    def __getitem__(self, i: slice) -> list[SampleView]: ...
    def __getitem__(self, i: int | slice) -> SampleView | list[SampleView]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.lengths)))]
        i = operator.index(i)
        if not -len(self.lengths) <= i < len(self.lengths):
            raise IndexError(f"sample {i} of {len(self.lengths)}")
        i %= len(self.lengths)
        start = sum(self.lengths[:i])
        return self._view(i, start, start + self.lengths[i])

    def _view(self, i: int, start: int, end: int) -> SampleView:
        """Sample i, its fields in `Sample`'s order (as pydantic would lay them out)."""
        values: dict[str, Any] = {}
        for name in Sample.model_fields:
            if name in TOKEN_COLUMNS:
                values[name] = getattr(self, name)[start:end]
            elif name == "index":
                values[name] = i
            elif name == "timings":
                values[name] = construct(TimingsView, {t: getattr(self, t)[i] for t in _TIMINGS})
            else:
                values[name] = getattr(self, name)[i]
        return construct(SampleView, values)

    @property
    def min_version(self) -> int | None:
        return _oldest(self.versions)


TOKEN_COLUMNS = {"completion_ids": np.dtype(np.int32), "behavior_logprobs": np.dtype(np.float32),
                  "versions": np.dtype(np.int32)}  # fmt: skip
PER_SAMPLE = tuple(name for name in Samples.model_fields if name not in TOKEN_COLUMNS and name != "lengths")  # lists
_TIMINGS = tuple(Timings.model_fields)
assert set(_TIMINGS) < set(PER_SAMPLE), "a sample's timings are columns of their own"
assert {*TOKEN_COLUMNS, *PER_SAMPLE} - set(_TIMINGS) == Sample.model_fields.keys() - {"index", "timings"}


def _gather(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _check_reward(reward: float | None, status: RewardStatus | None, where: str = "") -> None:
    if status is RewardStatus.scored:
        if reward is None or not math.isfinite(reward):
            raise ValueError(f"{where}a scored sample needs a finite reward")
    elif reward is not None:
        raise ValueError(f"{where}reward must be None when reward_status is {status}")


def construct(cls: type[BaseModel], values: dict[str, Any]) -> Any:
    """`cls.model_construct(**values)` for a record whose every field is given, already valid
    and in field order, without its per-field loop (the codec and `Samples` build many)."""
    record = cls.__new__(cls)
    object.__setattr__(record, "__dict__", values)
    object.__setattr__(record, "__pydantic_fields_set__", set(values))
    object.__setattr__(record, "__pydantic_extra__", None)
    object.__setattr__(record, "__pydantic_private__", None)
    return record


class Group(Record):
    """All samples of one prompt: the unit of admission, storage and advantage estimation.
    `samples` is column-wise (`Samples`); a list of `Sample`s is gathered into it."""

    group_id: str = Field(min_length=1, max_length=256, description="idempotency key")
    job_id: str = Field(min_length=1, max_length=256)
    prompt_ids: Int32Array
    reward_spec: dict[str, Any]
    samples: Samples
    submit_version: int = Field(ge=0, description="trainer version when generation was admitted")
    min_version: int = Field(ge=0, description="oldest token version in the group")
    lineage: dict[int, int] = Field(
        default_factory=dict,
        description="epoch -> newest version that sampled a token under it (proto/lineage.py); "
        "empty: every token is from epoch 0",
    )

    @field_validator("samples", mode="before")
    @classmethod
    def _gather_samples(cls, value: Any) -> Any:
        return Samples.of(list(value)) if isinstance(value, (list, tuple)) else value

    @model_validator(mode="after")
    def _check(self) -> Group:
        if len(self.prompt_ids) == 0:
            raise ValueError("empty prompt")
        if "verifier" not in self.reward_spec or not isinstance(self.reward_spec["verifier"], str):
            raise ValueError("reward_spec needs a string 'verifier'")
        oldest = self.samples.min_version
        expected = self.submit_version if oldest is None else oldest
        if self.min_version != expected:
            raise ValueError(f"min_version {self.min_version} but the oldest token version is {expected}")
        return self

    @classmethod
    def build(cls, **fields: Any) -> Group:
        """Construct a group, deriving `min_version` from the samples' token versions."""
        samples = fields["samples"]
        if isinstance(samples, Samples):
            oldest = samples.min_version
        else:  # a list of `Sample`s: the group gathers it while it validates
            oldest = min((v for v in (s.min_version for s in samples) if v is not None), default=None)
        fields.setdefault("min_version", fields["submit_version"] if oldest is None else oldest)
        return cls(**fields)

    @property
    def rewards(self) -> list[float | None]:
        return list(self.samples.reward)

    @property
    def scored(self) -> bool:
        """True when every sample has been through the reward service (whatever the outcome)."""
        return None not in self.samples.reward_status

    def num_bytes(self) -> int:
        s = self.samples
        return self.prompt_ids.nbytes + s.completion_ids.nbytes + s.behavior_logprobs.nbytes + s.versions.nbytes


class GroupJob(Record):
    """One entry of the `jobs` stream: a prompt to sample `group_size` completions of."""

    job_id: str = Field(min_length=1, max_length=256)
    group_id: str = Field(min_length=1, max_length=256)
    prompt_id: str = Field(min_length=1, max_length=256)
    prompt_ids: Int32Array
    prompt_text: str = ""
    group_size: int = Field(ge=1, le=4096)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    reward_spec: dict[str, Any]
    submitted_at: float = 0.0

    @model_validator(mode="after")
    def _check(self) -> GroupJob:
        if len(self.prompt_ids) == 0:
            raise ValueError("empty prompt")
        if "verifier" not in self.reward_spec or not isinstance(self.reward_spec["verifier"], str):
            raise ValueError("reward_spec needs a string 'verifier'")
        return self


class WeightsInfo(Record):
    """Where the weights of policy version `version` can be loaded from."""

    version: int = Field(ge=0)
    epoch: int = Field(0, ge=0, description="the trainer history it belongs to (proto/lineage.py)")
    method: str = Field(pattern="^(disk|distributed)$")
    path: str | None = None
    published_at: float = 0.0
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> WeightsInfo:
        if self.method == "disk" and not self.path:
            raise ValueError("disk weights need a path")
        return self
