"""Buffer records (docs/architecture.md §3): samples, groups, rollout jobs and weight locations.

Records are frozen `msgspec.Struct`s, checked once whichever way they are made. Read by
`proto.codec.decode`, msgspec checks every field against its annotation (types, `Meta` bounds,
enums, unknown keys) while it decodes; built in code, `__post_init__` has msgspec check the
fields the same way. Either way the rules that span fields (`_check`) then run. A record never
changes afterwards: to change one, build a new one (`msgspec.structs.replace` checks it too).

Token ids, logprobs and versions are read-only 1-D numpy arrays (int32 / float32 / int32); built
in code they may be given as lists or arrays of another numeric dtype whose values fit. Lengths
must agree, logprobs must be finite and ≤ `MAX_LOGPROB`, ids and versions non-negative; a
`scored` sample carries a finite reward and any other status none (`check_reward`).

Episodes (several turns with an environment between them, or a gateway session) put the
environment's tokens in the completion too: `loss_mask` (uint8, one per completion token) is 1
for a token the policy sampled and 0 for one it did not (an observation, a chat template's
glue). Environment tokens carry behaviour logprob 0 and, as version, that of the policy token
before them; they never count in a loss, an entropy, an importance weight or a staleness
(`min_version` is over policy tokens). An empty `loss_mask` means every token was sampled (one
turn). `turn_starts` are the offsets of the policy's turns in the completion and `turn_rewards`
what the environment said after each (empty when not an episode).

An episode whose chat template rewrote its history (a gateway session, `services/rollout/
gateway.py`) is stored as several samples, one per stretch of calls that extend each other:
each such piece has its own `prompt_ids` (empty: the group's `prompt_tokens`) and names the
first piece of its episode in `episode` (None: the sample is a whole episode). The pieces of an
episode carry its reward; advantages are computed per episode (`trainer/batch.py`).

A group holds its samples column-wise (`Samples`): the trainer and the codec work on whole
columns, and a `Sample` is built only when one is read.
"""

from __future__ import annotations

import contextvars
import math
import operator
import typing
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
from msgspec import Meta
from msgspec.structs import force_setattr

from asyncrl.proto.limits import MAX_GROUP_SIZE, MAX_LOGPROB

SCHEMA_VERSION = 5  # 5: episodes (`loss_mask`, turns, pieces); a payload is `[schema, record]`

Id = Annotated[str, Meta(min_length=1, max_length=256)]
Count = Annotated[int, Meta(ge=0)]
# A token array's field. msgspec decodes the wire's little-endian `bin` as a memoryview of the
# payload; `__post_init__` replaces it with a numpy array of this dtype reading it in place.
Int32Array = Annotated[memoryview, np.dtype("<i4")]
Float32Array = Annotated[memoryview, np.dtype("<f4")]
UInt8Array = Annotated[memoryview, np.dtype("u1")]

# True while msgspec builds records from fields it has checked (decoding, or `_check_fields`):
# they then only read their arrays and run `_check`.
FIELDS_CHECKED = contextvars.ContextVar("fields_checked", default=False)


class RewardStatus(StrEnum):
    """Outcome of scoring one sample: only `scored` carries a reward."""

    scored = "scored"
    timeout = "timeout"
    error = "error"
    invalid_input = "invalid_input"


class FinishReason(StrEnum):
    stop = "stop"
    length = "length"
    abort = "abort"


_SCORED = RewardStatus.scored  # (an enum member read from its class costs a lookup per call)


def check_reward(reward: float | None, status: RewardStatus | None, sample: int | None = None) -> None:
    """Only `scored` carries a reward, and a finite one: a failed verifier is never a silent 0."""
    if status is _SCORED:
        if reward is not None and math.isfinite(reward):
            return
        problem = "a scored sample needs a finite reward"
    elif reward is None:
        return
    else:
        problem = f"reward must be None when reward_status is {status and status.value}"
    raise ValueError(problem if sample is None else f"sample {sample}: {problem}")


class _Struct(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of records and their parts: frozen, strict, array-aware equality."""

    _arrays: ClassVar[dict[str, np.dtype]] = {}  # token array fields and their wire dtypes

    def __post_init__(self) -> None:
        if not FIELDS_CHECKED.get():
            self._check_fields()
            return
        for name, dtype in self._arrays.items():
            force_setattr(self, name, _read_array(getattr(self, name), dtype, name))
        self._check()

    def _check_fields(self) -> None:
        """Check a record built in code as `decode` would: msgspec converts its fields (arrays as
        their wire bytes) into a twin, whose `_check` runs; the record takes the twin's values."""
        values = {name: getattr(self, name) for name in self.__struct_fields__}
        for name, dtype in self._arrays.items():
            values[name] = _wire_array(values[name], dtype, name)
        token = FIELDS_CHECKED.set(True)
        try:
            twin = msgspec.convert(values, type(self))
        finally:
            FIELDS_CHECKED.reset(token)
        for name in self.__struct_fields__:
            force_setattr(self, name, getattr(twin, name))

    def _check(self) -> None:
        """The rules that span fields."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_equal(getattr(self, name), getattr(other, name)) for name in self.__struct_fields__)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def _wire_array(value: Any, dtype: np.dtype, name: str) -> memoryview:
    """A token array given in code (a 1-D array or a list of numbers) as its wire bytes."""
    if not isinstance(value, (np.ndarray, list, tuple)):
        raise ValueError(f"{name}: expected an array or a list, got {type(value).__name__}")
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {array.shape}")
    if array.dtype != dtype:
        integral = dtype.kind in "iu"
        if array.size and array.dtype.kind not in ("iu" if integral else "iuf"):  # (an empty list is float64)
            raise ValueError(f"{name}: expected {'integers' if integral else 'numbers'}, got {array.dtype}")
        converted = array.astype(dtype)
        if integral and not np.array_equal(converted, array):
            raise ValueError(f"{name}: values do not fit in {dtype}")
        array = converted
    return memoryview(np.ascontiguousarray(array)).cast("B")


def _read_array(raw: memoryview | np.ndarray | list, dtype: np.dtype, name: str) -> np.ndarray:
    """Wire bytes as a read-only native-order array viewing them (an array: already one)."""
    if isinstance(raw, np.ndarray):  # a slice of a group's column, read as a `Sample`
        return raw
    if isinstance(raw, list):  # an optional array's default (empty)
        raw = memoryview(bytes(raw))
    if raw.nbytes % dtype.itemsize:
        raise ValueError(f"{name}: {raw.nbytes} bytes is not a whole number of {dtype}")
    array = np.frombuffer(raw, dtype)
    if not dtype.isnative:  # (a big-endian host)
        array = array.astype(dtype.newbyteorder("="))
    if not raw.readonly:  # (bytes of an array given in code)
        array.flags.writeable = False
    return array


_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # (`ndarray.min` adds a Python-level wrapper per call)


def _oldest(versions: np.ndarray, loss_mask: np.ndarray | None = None) -> int | None:
    """The oldest version of the policy's tokens (`loss_mask` 1, or all when it is empty; None
    for no such token); a negative version anywhere is refused."""
    if len(versions) and int(_MIN(versions)) < 0:
        raise ValueError("negative policy version")
    if loss_mask is not None and len(loss_mask):
        versions = versions[loss_mask.view(bool)]
    return int(_MIN(versions)) if len(versions) else None


def _check_episode(loss_mask: np.ndarray, tokens: int, behavior_logprobs: np.ndarray) -> None:
    """`loss_mask` is empty or one 0/1 per token, with behaviour logprob 0 where it is 0."""
    if not len(loss_mask):
        return
    if len(loss_mask) != tokens:
        raise ValueError(f"{len(loss_mask)} loss_mask entries for {tokens} completion tokens")
    if int(_MAX(loss_mask)) > 1:
        raise ValueError("loss_mask entries must be 0 or 1")
    if np.any(behavior_logprobs[loss_mask == 0]):
        raise ValueError("tokens the policy did not sample (loss_mask 0) must have behaviour logprob 0")


def _check_turns(turn_starts: list[int], turn_rewards: list[float], tokens: int, where: str = "") -> None:
    """Turn offsets ascending inside the completion; a finite reward per turn, or none at all."""
    if any(b <= a for a, b in zip(turn_starts, turn_starts[1:])) or (
        turn_starts and turn_starts[-1] >= max(tokens, 1)
    ):
        raise ValueError(
            f"{where}turn_starts must ascend within the {tokens} completion tokens, got {turn_starts[:8]}"
        )
    if turn_rewards and len(turn_rewards) != len(turn_starts):
        raise ValueError(f"{where}{len(turn_rewards)} turn_rewards for {len(turn_starts)} turns")
    if not all(math.isfinite(r) for r in turn_rewards):
        raise ValueError(f"{where}turn_rewards must be finite")


def _check_tokens(ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray) -> None:
    """Content rules for token arrays (one sample's, or a group's columns), but the versions'
    sign: `_oldest` checks it where the oldest version is needed anyway."""
    n = len(ids)
    if len(logprobs) != n:
        raise ValueError(f"{len(logprobs)} logprobs for {n} completion tokens")
    if len(versions) != n:
        raise ValueError(f"{len(versions)} versions for {n} completion tokens")
    if not n:
        return
    # min and max are NaN if any value is, and every comparison with NaN is False: two passes
    # decide the common case; the detailed check runs only to word the error.
    if not (float(_MIN(logprobs)) > -math.inf and float(_MAX(logprobs)) <= MAX_LOGPROB):
        if not np.all(np.isfinite(logprobs)):
            raise ValueError("behavior_logprobs contain NaN or inf")
        raise ValueError(
            f"behavior_logprobs must be <= {MAX_LOGPROB} (0, up to rounding), found {float(logprobs.max())}"
        )
    if int(_MIN(ids)) < 0:
        raise ValueError("negative token id")


class Timings(_Struct):
    """Wall-clock stamps (unix seconds) of one sample's life; None until the event happens."""

    submitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    scored: float | None = None


class Record(_Struct, tag_field="type"):
    """A record the buffer stores on its own; its `type` tag names it on the wire."""


class Sample(Record, tag="sample"):
    """One completion of a prompt, with what the engine and the reward service said of it."""

    prompt_id: Id
    index: Count  # position of this sample in its group
    completion_ids: Int32Array
    behavior_logprobs: Float32Array  # log μ of each completion token, from the engine
    versions: Int32Array  # policy version that sampled each completion token
    finish_reason: FinishReason
    truncated: bool = False
    text: str = ""
    reward: float | None = None
    reward_status: RewardStatus | None = None
    reward_details: dict[str, Any] = {}
    timings: Timings = msgspec.field(default_factory=Timings)
    loss_mask: UInt8Array = msgspec.field(default_factory=list)  # 1: sampled by the policy; empty: all
    turn_starts: list[Count] = []  # offset of each policy turn in the completion (episodes)
    turn_rewards: list[float] = []  # the environment's reward after each turn (episodes)
    prompt_ids: Int32Array = msgspec.field(default_factory=list)  # this piece's prompt; empty: the group's
    episode: Count | None = None  # index of the first piece of this sample's episode; None: itself

    def _check(self) -> None:
        _check_tokens(self.completion_ids, self.behavior_logprobs, self.versions)
        if len(self.prompt_ids) and int(_MIN(self.prompt_ids)) < 0:
            raise ValueError("negative token id in prompt_ids")
        _check_episode(self.loss_mask, len(self.completion_ids), self.behavior_logprobs)
        _check_turns(self.turn_starts, self.turn_rewards, len(self.completion_ids))
        _oldest(self.versions)  # refuses a negative version
        check_reward(self.reward, self.reward_status)

    @property
    def min_version(self) -> int | None:
        return _oldest(self.versions, self.loss_mask)

    @property
    def policy_mask(self) -> np.ndarray:
        """1 for each completion token the policy sampled (all of them outside episodes)."""
        return self.loss_mask if len(self.loss_mask) else np.ones(len(self.completion_ids), dtype=np.uint8)


class Samples(_Struct):
    """A group's samples, column-wise: the unit the buffer stores, the codec moves in one copy
    and the trainer reads.

    Sample i is `samples[i]` and its `index` is i. Its tokens are `completion_ids[o:o + lengths[i]]`
    with `o = sum(lengths[:i])` (likewise `behavior_logprobs`, `versions`); every other column
    is a list with one entry per sample (`submitted` … `scored` are its `Timings`). Indexing and
    iterating give `Sample`s viewing the columns, built on access. `Samples.of(samples)` gathers
    `Sample`s (in any order) into columns.
    """

    lengths: Annotated[list[Count], Meta(min_length=1)]  # completion tokens per sample
    completion_ids: Int32Array
    behavior_logprobs: Float32Array  # log μ of each completion token, from the engine
    versions: Int32Array  # policy version that sampled each completion token
    prompt_id: list[Id]
    finish_reason: list[FinishReason]
    truncated: list[bool]
    text: list[str]
    reward: list[float | None]
    reward_status: list[RewardStatus | None]
    reward_details: list[dict[str, Any]]
    submitted: list[float | None]
    first_token: list[float | None]
    finished: list[float | None]
    scored: list[float | None]
    # Episodes (see the module's docstring); each empty when no sample of the group has any.
    loss_mask: UInt8Array = msgspec.field(default_factory=list)  # one per token of the columns
    turn_starts: list[list[Count]] = []  # one list per sample
    turn_rewards: list[list[float]] = []  # one list per sample
    prompt_ids: Int32Array = msgspec.field(default_factory=list)  # the pieces' own prompts, back to back
    prompt_lengths: list[Count] = []  # tokens of each sample's own prompt (0: the group's)
    episode: list[Count | None] = []  # one per sample

    def _check(self) -> None:
        n, tokens = len(self.lengths), len(self.completion_ids)
        for name in PER_SAMPLE:
            if len(getattr(self, name)) != n and not (name in EPISODE and not getattr(self, name)):
                raise ValueError(f"{len(getattr(self, name))} {name} entries for {n} samples")
        if sum(self.lengths) != tokens:
            raise ValueError(f"lengths add up to {sum(self.lengths)}, the columns hold {tokens} tokens")
        _check_tokens(self.completion_ids, self.behavior_logprobs, self.versions)  # (versions: by the group)
        _check_episode(self.loss_mask, tokens, self.behavior_logprobs)
        if self.turn_starts or self.turn_rewards:
            for i, length in enumerate(self.lengths):
                _check_turns(
                    self.turn_starts[i] if self.turn_starts else [],
                    self.turn_rewards[i] if self.turn_rewards else [],
                    length,
                    f"sample {i}: ",
                )
        for i, (reward, status) in enumerate(zip(self.reward, self.reward_status)):
            check_reward(reward, status, i)
        if self.prompt_lengths and len(self.prompt_lengths) != n:
            raise ValueError(f"{len(self.prompt_lengths)} prompt_lengths entries for {n} samples")
        if sum(self.prompt_lengths) != len(self.prompt_ids):
            raise ValueError(
                f"prompt_lengths add up to {sum(self.prompt_lengths)}, prompt_ids holds {len(self.prompt_ids)}"
            )
        if len(self.prompt_ids) and int(_MIN(self.prompt_ids)) < 0:
            raise ValueError("negative token id in prompt_ids")
        for i, first in enumerate(self.episode):
            if first is None:
                continue
            if first > i or self.episode[first] not in (None, first):
                raise ValueError(
                    f"sample {i}: episode {first} is not the first piece of an episode before it"
                )
            if (self.reward[i], self.reward_status[i]) != (self.reward[first], self.reward_status[first]):
                raise ValueError(f"sample {i}: the pieces of an episode carry its reward (sample {first}'s)")

    @classmethod
    def of(cls, samples: typing.Iterable[Sample]) -> Samples:
        """Gather `Sample`s into columns, ordered by `index`, which must run 0..n−1."""
        rows = sorted(samples, key=lambda s: s.index)
        if not rows:
            raise ValueError("a group needs at least one sample")
        if [s.index for s in rows] != list(range(len(rows))):
            raise ValueError(f"sample indices must be 0..{len(rows) - 1}, got {[s.index for s in rows]}")
        columns = {name: [getattr(s, name) for s in rows] for name in PER_SAMPLE if name not in TIMINGS}
        columns |= {name: [getattr(s.timings, name) for s in rows] for name in TIMINGS}
        for name, default in EPISODE.items():
            if all(v == default for v in columns[name]):
                columns[name] = []
        tokens = {name: np.concatenate([getattr(s, name) for s in rows]) for name in TOKEN_COLUMNS}
        if any(len(s.loss_mask) for s in rows):
            tokens["loss_mask"] = np.concatenate([s.policy_mask for s in rows])
        if any(len(s.prompt_ids) for s in rows):
            tokens["prompt_ids"] = np.concatenate([s.prompt_ids for s in rows])
            columns["prompt_lengths"] = [len(s.prompt_ids) for s in rows]
        return cls(lengths=[len(s.completion_ids) for s in rows], **tokens, **columns)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> typing.Iterator[Sample]:
        start = 0
        for i, n in enumerate(self.lengths):
            yield self._view(i, start, start + n)
            start += n

    @typing.overload
    def __getitem__(self, i: int) -> Sample: ...
    @typing.overload
    def __getitem__(self, i: slice) -> list[Sample]: ...
    def __getitem__(self, i: int | slice) -> Sample | list[Sample]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.lengths)))]
        i = operator.index(i)
        if not -len(self.lengths) <= i < len(self.lengths):
            raise IndexError(f"sample {i} of {len(self.lengths)}")
        i %= len(self.lengths)
        start = sum(self.lengths[:i])
        return self._view(i, start, start + self.lengths[i])

    def _view(self, i: int, start: int, end: int) -> Sample:
        """Sample i: its arrays view the columns and its `reward_details` is the group's own dict."""
        values = {
            name: getattr(self, name)[i] for name in PER_SAMPLE if name not in TIMINGS and name not in EPISODE
        }
        values |= {name: getattr(self, name)[i] for name in EPISODE if getattr(self, name)}
        tokens = {name: getattr(self, name)[start:end] for name in TOKEN_COLUMNS}
        if len(self.loss_mask):
            tokens["loss_mask"] = self.loss_mask[start:end]
        if self.prompt_lengths:
            p = sum(self.prompt_lengths[:i])
            tokens["prompt_ids"] = self.prompt_ids[p : p + self.prompt_lengths[i]]
        token = FIELDS_CHECKED.set(True)  # the columns were checked
        try:
            timings = Timings(**{name: getattr(self, name)[i] for name in TIMINGS})
            return Sample(index=i, timings=timings, **tokens, **values)
        finally:
            FIELDS_CHECKED.reset(token)

    @property
    def min_version(self) -> int | None:
        return _oldest(self.versions, self.loss_mask)

    @property
    def policy_mask(self) -> np.ndarray:
        """1 for each token of the columns the policy sampled (all of them outside episodes)."""
        return self.loss_mask if len(self.loss_mask) else np.ones(len(self.completion_ids), dtype=np.uint8)


TOKEN_COLUMNS = ("completion_ids", "behavior_logprobs", "versions")
# per-sample columns that may be empty (no episode in the group), and their samples' defaults
EPISODE = {"turn_starts": [], "turn_rewards": [], "episode": None}
PER_SAMPLE = tuple(
    name
    for name in Samples.__struct_fields__
    if name not in TOKEN_COLUMNS and name not in ("lengths", "loss_mask", "prompt_ids", "prompt_lengths")
)
TIMINGS = Timings.__struct_fields__
assert {*PER_SAMPLE, *TOKEN_COLUMNS, "loss_mask", "prompt_ids"} - set(TIMINGS) == set(
    Sample.__struct_fields__
) - {"index", "timings"}


class Group(Record, tag="group"):
    """All samples of one prompt: the unit of admission, storage and advantage estimation."""

    group_id: Id  # idempotency key
    job_id: Id
    prompt_tokens: Int32Array
    reward_spec: dict[str, Any]  # a `proto.rewards.RewardSpec`, checked when its job was submitted
    samples: Samples
    submit_version: Count  # trainer version when generation was admitted
    min_version: Count  # oldest token version in the group
    # epoch -> newest version that sampled a token under it (proto/lineage.py); empty: all epoch 0
    lineage: dict[int, int] = {}

    def _check(self) -> None:
        if not len(self.prompt_tokens):
            raise ValueError("empty prompt")
        oldest = self.samples.min_version
        expected = self.submit_version if oldest is None else oldest
        if self.min_version != expected:
            raise ValueError(f"min_version {self.min_version} but the oldest token version is {expected}")

    @classmethod
    def build(cls, *, samples: Samples | typing.Iterable[Sample], **fields: Any) -> Group:
        """A group of `samples` (`Samples`, or `Sample`s in any order), its `min_version`
        derived from their token versions."""
        samples = samples if isinstance(samples, Samples) else Samples.of(samples)
        oldest = samples.min_version
        fields.setdefault("min_version", fields["submit_version"] if oldest is None else oldest)
        return cls(samples=samples, **fields)

    @property
    def rewards(self) -> list[float | None]:
        return list(self.samples.reward)

    @property
    def scored(self) -> bool:
        """True when every sample has been through the reward service (whatever the outcome)."""
        return None not in self.samples.reward_status


class GroupJob(Record, tag="job"):
    """One entry of the `jobs` stream: a prompt to sample `group_size` completions of."""

    job_id: Id
    group_id: Id
    prompt_id: Id
    prompt_tokens: Int32Array
    group_size: Annotated[int, Meta(ge=1, le=MAX_GROUP_SIZE)]
    reward_spec: dict[str, Any]  # a `proto.rewards.RewardSpec`, checked at submission
    prompt_text: str = ""
    sampling_params: dict[str, Any] = {}
    submitted_at: float = 0.0
    episode: dict[str, Any] = {}  # a `proto.rollout.EpisodeSpec` (empty: one turn), checked at submission
    # The prompt is a chat rendered without its generation prompt (an episode's `messages`): the
    # episode appends the environment's first observation as a user message and the assistant header.
    chat: bool = False

    def _check(self) -> None:
        if not len(self.prompt_tokens):
            raise ValueError("empty prompt")


class WeightsInfo(Record, tag="weights"):
    """Where the weights of policy version `version` can be loaded from.

    `kind="lora"` (a `[trainer.lora]` run): `path` is a PEFT adapter directory, not weights; the
    engine keeps its base model and loads the adapter beside it under `adapter_name`
    (SGLang: `/load_lora_adapter {lora_name: adapter_name, lora_path: path}`), and requests name
    it (`lora_path: adapter_name`) to be sampled by this version (services/transport/weights)."""

    version: Count
    method: Literal["disk", "distributed"]
    epoch: Count = 0  # the trainer history it belongs to (proto/lineage.py)
    path: str | None = None
    published_at: float = 0.0
    extra: dict[str, Any] = {}
    kind: Literal["full", "lora"] = "full"  # the whole model's weights, or a LoRA adapter on the base
    adapter_name: Id | None = None  # lora: the name to load and request it by, unique per version

    def _check(self) -> None:
        if self.method == "disk" and not self.path:
            raise ValueError("disk weights need a path")
        if self.kind == "lora" and (self.method != "disk" or not self.adapter_name):
            raise ValueError("a LoRA adapter is published on disk, with an adapter_name")
        if self.kind == "full" and self.adapter_name is not None:
            raise ValueError("adapter_name names a LoRA adapter: full weights have none")


def _token_arrays(cls: type[_Struct]) -> dict[str, np.dtype]:
    """The fields annotated `Int32Array` / `Float32Array`, with their wire dtypes."""
    hints = ((f.name, typing.get_args(f.type)) for f in msgspec.structs.fields(cls))
    return {name: args[1] for name, args in hints if args[:1] == (memoryview,)}


for _cls in (Sample, Samples, Group, GroupJob):
    _cls._arrays = _token_arrays(_cls)
