"""Verifiers of the reward service. Each module defines one `Verifier` subclass; the app
builds the enabled ones from settings (`services.reward.app.build_verifiers`). Their spec
models live in `proto.verifiers`, where the rollout service checks specs with them too.

`BUILTIN` names every verifier class this package defines. A module is imported on first use
only: a process that uses only `reverse` never imports the math pool or the sandbox.
"""

from __future__ import annotations

import importlib

from asyncrl.services.reward.verifiers.base import Verdict, Verifier

__all__ = ["BUILTIN", "Verdict", "Verifier", "verifier_class"]

BUILTIN: dict[str, str] = {
    "reverse": "asyncrl.services.reward.verifiers.toy:ReverseVerifier",
    "arith": "asyncrl.services.reward.verifiers.toy:ArithVerifier",
    "math": "asyncrl.services.reward.verifiers.math:MathVerifier",
    "code": "asyncrl.services.reward.verifiers.code:CodeVerifier",
    "judge": "asyncrl.services.reward.verifiers.judge:JudgeVerifier",
    "nemo_gym": "asyncrl.services.reward.verifiers.nemo_gym:NemoGymVerifier",
    "reasoning_gym": "asyncrl.services.reward.verifiers.rgym:ReasoningGymVerifier",
}


def verifier_class(name: str) -> type[Verifier] | None:
    """The class of the built-in verifier `name`; None for a name this package does not define."""
    path = BUILTIN.get(name)
    if path is None:
        return None
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
