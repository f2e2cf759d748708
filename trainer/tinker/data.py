"""A call's data: checked whole before any compute, then laid out as the trainer's micro-batches.

`check` refuses, naming the datum and the input: an unknown loss, an input the loss does not
take or one it needs missing, lengths that differ from the datum's tokens, a non-integer or
out-of-vocabulary token id, a non-finite number, a `loss_fn_config` key the loss does not
read. Nothing is dropped or defaulted silently: what a loss takes is `losses.LOSSES`.

`micro_batches` lays the data out as trainer/batch.py's `Batch` (padded rows, one per datum),
so the log-probs come from `token_logprobs`, the async trainer's chunked path: position i's
hidden state predicts target i, and a top-K target [N, K] repeats position i K times (its
hidden state goes through the LM head once per target, the gradients add up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.trainer.batch import Batch
from asyncrl.trainer.tinker.errors import CapacityError, InvalidInputError, UnsupportedError
from asyncrl.trainer.tinker.losses import LOSSES, LossSpec

# Tinker's loss names this backend does not compute (tinker.types.LossFnType of 0.38.0).
KNOWN_UNSUPPORTED = ("gspo", "stable_reinforce", "custom")


@dataclass
class Datum:
    """One tinker Datum as the service decodes it: `tokens` the model input (its text chunks
    concatenated), `inputs` its loss_fn_inputs by name, each len(tokens) long (target_tokens and
    weights may be [len(tokens), K] for cross_entropy)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class Chunk:
    """A micro-batch: which data (indices into the call's list) and their tensors."""

    index: list[int]
    batch: Batch
    inputs: dict[str, torch.Tensor]  # [n, T] float32 per loss input (target_tokens excluded)
    shapes: list[tuple[int, ...]]  # per datum, the shape its per-token outputs take


def loss_config(loss_fn: str, config: dict | None) -> tuple[LossSpec, dict[str, float]]:
    """The loss's spec and its config with defaults filled; refuses unknown losses and keys."""
    if loss_fn not in LOSSES:
        known = ", ".join(LOSSES)
        what = (
            "is a Tinker loss this backend does not compute" if loss_fn in KNOWN_UNSUPPORTED else "is unknown"
        )
        raise UnsupportedError(f"loss_fn {loss_fn!r} {what}; supported: {known}")
    spec = LOSSES[loss_fn][0]
    given = dict(config or {})
    unknown = sorted(set(given) - set(spec.config))
    if unknown:
        takes = ", ".join(spec.config) or "no keys"
        raise InvalidInputError(f"loss_fn_config {unknown} are not read by {loss_fn}; it takes {takes}")
    out: dict[str, float] = {}
    for key, default in spec.config.items():
        value = given.get(key, default)
        if value is None:
            raise InvalidInputError(
                f"{loss_fn} needs loss_fn_config[{key!r}] (the Tinker docs give no default)"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidInputError(f"loss_fn_config[{key!r}] must be a finite number, not {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out:
        low, high = out["clip_low_threshold"], out["clip_high_threshold"]
        if not 0.0 <= low <= high:
            raise InvalidInputError(
                f"{loss_fn} needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}"
            )
    return spec, out


def check(data: list[Datum], loss_fn: str, spec: LossSpec, vocab: int, max_tokens: int) -> int:
    """Refuse the call's data unless every datum fits the loss; returns the call's tokens."""
    if not data:
        raise InvalidInputError("no data: a call needs at least one Datum")
    total = sum(len(d.tokens) for d in data)
    if total > max_tokens:
        raise CapacityError(f"{total} tokens in one call; this service takes at most {max_tokens} per call")
    wanted = set(spec.inputs)
    for i, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise InvalidInputError(f"datum {i} has no tokens")
        _token_ids(np.asarray(d.tokens), vocab, f"datum {i} model_input")
        names = set(d.inputs)
        if names - wanted or wanted - names:
            raise InvalidInputError(
                f"datum {i}: {loss_fn} takes loss_fn_inputs {sorted(wanted)}"
                + (f"; unknown: {sorted(names - wanted)}" if names - wanted else "")
                + (f"; missing: {sorted(wanted - names)}" if wanted - names else "")
            )
        targets = np.asarray(d.inputs["target_tokens"])
        for name in spec.inputs:
            value = np.asarray(d.inputs[name])
            ok_shape = value.ndim == 1 or (spec.top_k and value.ndim == 2 and value.shape[1] > 0)
            if not ok_shape or value.shape[0] != n:
                raise InvalidInputError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}; {loss_fn} needs "
                    f"[{n}]{' or [' + str(n) + ', K]' if spec.top_k else ''} (one per model_input token)"
                )
            if name == "target_tokens":
                _token_ids(value, vocab, f"datum {i} target_tokens")
            else:
                if value.shape != targets.shape:
                    raise InvalidInputError(
                        f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(value.shape)}, "
                        f"target_tokens {list(targets.shape)}: they must match"
                    )
                if not np.issubdtype(value.dtype, np.number) or not np.isfinite(value).all():
                    raise InvalidInputError(f"datum {i}: loss_fn_inputs[{name!r}] must be finite numbers")
    return total


def _token_ids(ids: np.ndarray, vocab: int, what: str) -> None:
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidInputError(f"{what}: token ids must be integers, not {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise InvalidInputError(f"{what}: token id {bad} is outside the model's vocabulary [0, {vocab})")


def micro_batches(data: list[Datum], spec: LossSpec, max_tokens: int, pad_id: int) -> list[Chunk]:
    """The data, longest first, in padded micro-batches of at most `max_tokens` positions
    (rows × longest row; a datum longer than that is a micro-batch of its own)."""
    order = sorted(range(len(data)), key=lambda i: len(data[i].tokens), reverse=True)
    chunks, current = [], []
    for i in order:
        rows = len(current) + 1
        if current and rows * len(data[current[0]].tokens) > max_tokens:
            chunks.append(_collate(data, current, spec, pad_id))
            current = []
        current.append(i)
    chunks.append(_collate(data, current, spec, pad_id))
    return chunks


def _collate(data: list[Datum], index: list[int], spec: LossSpec, pad_id: int) -> Chunk:
    n, length = len(index), max(len(data[i].tokens) for i in index)
    shapes = [tuple(np.asarray(data[i].inputs["target_tokens"]).shape) for i in index]
    width = max(math.prod(s) for s in shapes)
    input_ids = np.full((n, length), pad_id, dtype=np.int64)
    attention = np.zeros((n, length), dtype=np.int64)
    token_index = np.zeros((n, width), dtype=np.int64)
    present = np.zeros((n, width), dtype=bool)
    targets = np.zeros((n, width), dtype=np.int64)
    floats = {name: np.zeros((n, width), dtype=np.float32) for name in spec.inputs if name != "target_tokens"}
    for row, (i, shape) in enumerate(zip(index, shapes)):
        d, k = data[i], (shape[1] if len(shape) == 2 else 1)
        tokens, width_i = len(d.tokens), math.prod(shape)
        input_ids[row, :tokens] = d.tokens
        attention[row, :tokens] = 1
        token_index[row, :width_i] = row * length + np.repeat(np.arange(tokens), k)  # row-major [N, K]
        present[row, :width_i] = True
        targets[row, :width_i] = np.asarray(d.inputs["target_tokens"]).reshape(-1)
        for name, out in floats.items():
            out[row, :width_i] = np.asarray(d.inputs[name], dtype=np.float32).reshape(-1)
    zeros = torch.zeros((n, width), dtype=torch.float32)
    batch = Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        position_ids=None,
        token_index=torch.from_numpy(token_index),
        present=torch.from_numpy(present),
        targets=torch.from_numpy(targets),
        mask=torch.from_numpy(present.astype(np.float32)),
        behavior_logprobs=zeros,
        advantages=zeros,
        real_rows=n,
    )
    return Chunk(index, batch, {k: torch.from_numpy(v) for k, v in floats.items()}, shapes)
