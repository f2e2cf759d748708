"""The trainer backend of the Tinker-compatible API (services/tinker serves it over HTTP): the
async trainer's model, LoRA, log-probs, checkpoints and adapter publishing, driven one command
at a time by Tinker clients (backend.py)."""

from asyncrl.trainer.tinker.backend import ForwardResult, TinkerSettings, TinkerTrainer
from asyncrl.trainer.tinker.data import Datum
from asyncrl.trainer.tinker.errors import (
    CapacityError,
    InvalidInputError,
    TinkerError,
    UnknownModelError,
    UnsupportedError,
)

__all__ = [
    "CapacityError",
    "Datum",
    "ForwardResult",
    "InvalidInputError",
    "TinkerError",
    "TinkerSettings",
    "TinkerTrainer",
    "UnknownModelError",
    "UnsupportedError",
]
