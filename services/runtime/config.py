"""Config layering for every service: defaults → TOML file → env (`ASYNCRL_…`) → CLI flags.

Each service declares one `ServiceSettings` subclass with a docstring and bounds on every
field. `load_settings(cls, argv)` builds it; `--print-config` prints the resolved values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic_settings import BaseSettings, SettingsConfigDict

S = TypeVar("S", bound="ServiceSettings")

PLACEHOLDER_SECRETS = {"changeme", "change-me", "secret", "password", "token", "xxx"}


class ServiceSettings(BaseSettings):
    """Base of all service settings; subclasses set `model_config` with their env prefix."""

    model_config = SettingsConfigDict(env_prefix="ASYNCRL_", extra="forbid", env_nested_delimiter="__")

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        # CLI/init values beat env, env beats the TOML file (passed as init values below).
        return (init_settings, env_settings)


def _scalar_fields(cls: type[BaseModel]) -> dict[str, Any]:
    return {
        name: field
        for name, field in cls.model_fields.items()
        if typing.get_origin(field.annotation) not in (dict, list) and not _is_model(field.annotation)
    }


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def load_settings(cls: type[S], argv: list[str] | None, *, prog: str, section: str | None = None) -> S:
    """Parse `--config FILE` (TOML; a `[section]` table if given), env and `--field value` flags."""
    args = settings_parser(cls, prog).parse_args(argv)
    file_values: dict[str, Any] = {}
    if args.config:
        data = tomllib.loads(args.config.read_text())
        file_values = data.get(section, {}) if section else data
    cli_values = flag_values(args)
    # Init values beat env in pydantic-settings; drop file values that env overrides so
    # the order is defaults → file → env → CLI.
    env_set = {k for k in cls.model_fields if _env_has(cls, k)}
    merged = {**{k: v for k, v in file_values.items() if k not in env_set}, **cli_values}
    settings = cls(**merged)
    if args.print_config:
        print(json.dumps(settings.model_dump(mode="json"), indent=2))
        sys.exit(0)
    return settings


def settings_parser(cls: type[ServiceSettings], prog: str) -> argparse.ArgumentParser:
    """The command line of a service's settings: `--config`, `--print-config` and one
    `--field-name value` flag per scalar field (`--x` / `--no-x` for a bool)."""
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    parser.add_argument("--config", type=Path, help="TOML file with these settings")
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings and exit")
    for name, field in _scalar_fields(cls).items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=field.description
            )
        else:
            parser.add_argument(flag, dest=name, default=None, help=field.description)
    return parser


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The settings fields given on the command line, by name."""
    return {k: v for k, v in vars(args).items() if k not in ("config", "print_config") and v is not None}


def _env_has(cls: type[ServiceSettings], field: str) -> bool:
    prefix = cls.model_config.get("env_prefix", "")
    return (prefix + field).upper() in {k.upper() for k in os.environ}


def refuse_placeholder_secret(value: str | None, name: str, development: bool) -> None:
    if value and value.lower() in PLACEHOLDER_SECRETS and not development:
        raise ValueError(f"{name} is a placeholder ({value!r}); set a real secret or enable development mode")
