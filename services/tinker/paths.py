"""The ids and `tinker://` paths this service hands out, in the shapes the SDK builds or parses
itself: a model created from a checkpoint is `{session}:train:{n}` (the SDK computes it), and a
checkpoint path is `tinker://{training run}/{weights|sampler_weights}/{name}`
(`types/checkpoint.py` splits it in three on "/")."""

from __future__ import annotations

from asyncrl.proto.tinker import CHECKPOINT_NAME


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"


def training_path(mid: str, name: str) -> str:
    return f"tinker://{mid}/weights/{name}"


def sampler_path(mid: str, name: str) -> str:
    return f"tinker://{mid}/sampler_weights/{name}"


def check_name(name: str | None) -> str | None:
    """`name` if it is one safe path segment (or None); ValueError otherwise."""
    if name is not None and not CHECKPOINT_NAME.fullmatch(name):
        raise ValueError(
            f"checkpoint name {name[:64]!r} must be 1-128 of A-Z a-z 0-9 _ . -, starting with a letter or digit"
        )
    return name


def backend_id(mid: str) -> str:
    """The model's id in the backend, whose ids are file names (no ':'): `s…:train:0` -> `s….train.0`."""
    return mid.replace(":", ".")


def public_id(bid: str) -> str:
    return bid.replace(".", ":")
