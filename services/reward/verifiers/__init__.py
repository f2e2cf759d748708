"""Verifiers of the reward service. Each module defines one `Verifier` subclass; the app
builds the enabled ones from settings (`services.reward.app.build_verifiers`).

`BUILTIN` names every verifier class this package defines, so another process (the rollout
service) can check a reward spec's arguments with the very model the verifier parses it with
(`spec_model`), without building the verifier. A module is imported on first use only: a
rollout that sees only `reverse` specs never imports the math pool or the sandbox.
"""

from __future__ import annotations

import importlib

from pydantic import BaseModel

from asyncrl.services.reward.verifiers.base import SpecError, Verdict, Verifier, validate_spec

__all__ = ["BUILTIN", "SpecError", "Verdict", "Verifier", "spec_model", "validate_spec", "verifier_class"]

BUILTIN: dict[str, str] = {
    "reverse": "asyncrl.services.reward.verifiers.toy:ReverseVerifier",
    "arith": "asyncrl.services.reward.verifiers.toy:ArithVerifier",
    "math": "asyncrl.services.reward.verifiers.math:MathVerifier",
    "code": "asyncrl.services.reward.verifiers.code:CodeVerifier",
    "judge": "asyncrl.services.reward.verifiers.judge:JudgeVerifier",
}


def verifier_class(name: str) -> type[Verifier] | None:
    """The class of the built-in verifier `name`; None for a name this package does not define."""
    path = BUILTIN.get(name)
    if path is None:
        return None
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def spec_model(name: str) -> type[BaseModel] | None:
    """The pydantic model of `name`'s spec arguments (the spec minus `verifier`), as the verifier
    itself validates them; None for a verifier this package does not define."""
    cls = verifier_class(name)
    return cls.Spec if cls is not None else None
