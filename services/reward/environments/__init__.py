"""Environments of the reward service (`proto/environments.py`, docs/architecture.md §12). Each module defines
one `Environment` subclass; the app builds the enabled ones from settings
(`services.reward.app.build_environments`).

`BUILTIN` names every environment class this package defines, so another process (the rollout
service) can check a job's `env_args` with the very model the environment parses them with
(`args_model`), without building the environment. A module is imported on first use only.
"""

from __future__ import annotations

import importlib

from pydantic import BaseModel

from asyncrl.services.reward.environments.base import Environment

__all__ = ["BUILTIN", "Environment", "args_model", "environment_class"]

BUILTIN: dict[str, str] = {
    "secret": "asyncrl.services.reward.environments.secret:SecretEnvironment",
    "calculator": "asyncrl.services.reward.environments.calculator:CalculatorEnvironment",
    "python": "asyncrl.services.reward.environments.python:PythonEnvironment",
}


def environment_class(name: str) -> type[Environment] | None:
    """The class of the built-in environment `name`; None for a name this package does not define."""
    path = BUILTIN.get(name)
    if path is None:
        return None
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def args_model(name: str) -> type[BaseModel] | None:
    """The pydantic model of `name`'s task arguments; None for an environment not defined here."""
    cls = environment_class(name)
    return cls.Args if cls is not None else None
