"""The backend's typed refusals: each message is user-facing (the service sends it back as is), and
the type says which HTTP status it becomes (services/tinker maps them)."""

from __future__ import annotations


class TinkerError(Exception):
    """Base of every refusal of the Tinker backend; its message names what was wrong."""


class InvalidInputError(TinkerError, ValueError):
    """The request is malformed (mismatched lengths, an unknown input name, a token id outside
    the vocabulary, a bad hyperparameter): HTTP 400."""


class UnsupportedError(TinkerError):
    """A well-formed request for something this backend does not do (a loss, full fine-tuning,
    LoRA on the unembedding, a rank past the limit): HTTP 400 naming it."""


class CapacityError(TinkerError):
    """Past a configured limit (models, tokens per call): HTTP 429/503, never an OOM."""


class UnknownModelError(TinkerError):
    """No model (or checkpoint) of that id here: HTTP 404."""
