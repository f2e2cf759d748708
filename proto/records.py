"""Buffer records (DESIGN.md §3): samples, groups, rollout jobs and weight locations.

Token ids, logprobs and versions are 1-D numpy arrays (int32 / float32 / int32). In JSON they
appear as plain lists; in Redis the codec stores them as little-endian bytes. Validation is
strict: lengths must agree, logprobs must be finite and ≤ 0, a `scored` sample must carry a
finite reward and any other status must carry none (a failed verifier is never a silent 0).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated, Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

SCHEMA_VERSION = 2  # 2: a group's sample arrays travel as three columns (codec)
READABLE_SCHEMAS = (1, 2)

# A sampled token's logprob is ≤ 0 in exact arithmetic; engines in bf16 can round a
# near-certain token to a hair above 0, so allow that much and no more.
MAX_LOGPROB = 1e-3


ARRAYS_CHECKED = "asyncrl.arrays_checked"


def check_token_arrays(ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> int | None:
    """Content rules for token arrays (any length, possibly several samples concatenated).
    Returns the oldest version (None for no tokens), which the check computes anyway."""
    # min and max are NaN if any value is, and every comparison with NaN is False: two passes
    # decide the common case; the detailed checks run only to word the error.
    if len(logprobs) and not (float(logprobs.min()) > -math.inf and float(logprobs.max()) <= MAX_LOGPROB):
        if not np.all(np.isfinite(logprobs)):
            raise ValueError("behavior_logprobs contain NaN or inf")
        raise ValueError(f"behavior_logprobs must be <= 0, found {float(logprobs.max())}")
    if len(ids) and int(ids.min()) < 0:
        raise ValueError("negative token id")
    oldest = int(versions.min()) if len(versions) else None
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
        if type(other) is not type(self):
            return NotImplemented
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
    def _check(self, info: ValidationInfo) -> Sample:
        n = len(self.completion_ids)
        if len(self.behavior_logprobs) != n:
            raise ValueError(f"{len(self.behavior_logprobs)} logprobs for {n} completion tokens")
        if len(self.versions) != n:
            raise ValueError(f"{len(self.versions)} versions for {n} completion tokens")
        # The codec checks array contents of a whole group at once and says so in the context.
        if n and not (info.context or {}).get(ARRAYS_CHECKED):
            check_token_arrays(self.completion_ids, self.behavior_logprobs, self.versions)
        if self.reward_status is RewardStatus.scored:
            if self.reward is None or not math.isfinite(self.reward):
                raise ValueError("a scored sample needs a finite reward")
        elif self.reward is not None:
            raise ValueError(f"reward must be None when reward_status is {self.reward_status}")
        return self

    @property
    def min_version(self) -> int | None:
        return int(self.versions.min()) if len(self.versions) else None


class Group(Record):
    """All samples of one prompt: the unit of admission, storage and advantage estimation."""

    group_id: str = Field(min_length=1, max_length=256, description="idempotency key")
    job_id: str = Field(min_length=1, max_length=256)
    prompt_ids: Int32Array
    reward_spec: dict[str, Any]
    samples: list[Sample] = Field(min_length=1)
    submit_version: int = Field(ge=0, description="trainer version when generation was admitted")
    min_version: int = Field(ge=0, description="oldest token version in the group")

    @model_validator(mode="after")
    def _check(self) -> Group:
        if len(self.prompt_ids) == 0:
            raise ValueError("empty prompt")
        if "verifier" not in self.reward_spec or not isinstance(self.reward_spec["verifier"], str):
            raise ValueError("reward_spec needs a string 'verifier'")
        indices = [s.index for s in self.samples]
        if sorted(indices) != list(range(len(indices))):
            raise ValueError(f"sample indices must be 0..{len(indices) - 1}, got {indices}")
        oldest = _oldest_version(self.samples)
        expected = self.submit_version if oldest is None else oldest
        if self.min_version != expected:
            raise ValueError(f"min_version {self.min_version} but the oldest token version is {expected}")
        return self

    @classmethod
    def build(cls, **fields: Any) -> Group:
        """Construct a group, deriving `min_version` from the samples' token versions."""
        samples = fields["samples"]
        oldest = _oldest_version(samples)
        fields.setdefault("min_version", fields["submit_version"] if oldest is None else oldest)
        return cls(**fields)

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]

    @property
    def scored(self) -> bool:
        """True when every sample has been through the reward service (whatever the outcome)."""
        return all(s.reward_status is not None for s in self.samples)

    def num_bytes(self) -> int:
        return self.prompt_ids.nbytes + sum(
            s.completion_ids.nbytes + s.behavior_logprobs.nbytes + s.versions.nbytes for s in self.samples
        )


def _oldest_version(samples: list[Sample]) -> int | None:
    versions = [s.min_version for s in samples if s.min_version is not None]
    return min(versions) if versions else None


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
    method: str = Field(pattern="^(disk|distributed)$")
    path: str | None = None
    published_at: float = 0.0
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> WeightsInfo:
        if self.method == "disk" and not self.path:
            raise ValueError("disk weights need a path")
        return self
