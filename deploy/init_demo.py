"""One-shot initialiser of the compose CPU demo (the `init` service of docker-compose.yml).

Reads the run config that every service of the stack reads (configs/demo.toml by default)
and writes, only when missing, into the shared weights volume:
* the tiny HF-format policy of its `[model]` table (`build_tiny_model`, the same call as
  `asyncrl up`: character tokenizer, nothing downloaded), which the engine serves, the rollout
  service tokenizes with and the trainer trains;
* the `reverse` task of its `[demo]` table as JSONL for `asyncrl submit` (the prompts
  `asyncrl demo` makes; the `reverse` verifier derives each target from its prompt).

Both are written to a temporary name and renamed, and re-running changes nothing, so a
restarted stack keeps its model and data.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

from asyncrl.services.ops.demo_jobs import make_prompts
from asyncrl.services.ops.run_config import DemoSection, ModelSection, RunConfigError, load_run_config


def load_config(path: Path) -> tuple[ModelSection, DemoSection]:
    """[model] and [demo], the whole file validated first (the services share it)."""
    config = load_run_config(path, require=("model",))
    return config.model, config.demo


def build_model(out: Path, model: ModelSection) -> None:
    import torch

    torch.set_num_threads(1)
    from asyncrl.services.ops.tinymodel import DEFAULT_CHARS, build_tiny_model

    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(
        tmp,
        chars=model.tiny_chars or DEFAULT_CHARS,
        hidden_size=model.tiny_hidden_size,
        num_layers=model.tiny_layers,
        seed=model.seed,
    )
    os.replace(tmp, out)  # all files or none: a lone config.json never passes for a model


def write_dataset(path: Path, demo: DemoSection, prompts: int) -> None:
    rows = make_prompts(prompts, demo, random.Random(demo.seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"prompt_id": f"reverse-{i}", **row}) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="init_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="run config TOML ([model], [demo])")
    parser.add_argument("--model", type=Path, required=True, help="directory of the tiny policy")
    parser.add_argument("--data", type=Path, required=True, help="JSONL file of reverse-task prompts")
    parser.add_argument(
        "--prompts", type=int, default=20_000, help="dataset rows (B = 32 per step: ~600 steps)"
    )
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error("--prompts must be at least 1")
    try:
        model, demo = load_config(args.config)
    except RunConfigError as exc:
        parser.exit(2, f"init_demo: {exc}\n")

    if (args.model / "config.json").exists():
        print(f"init_demo: model already at {args.model}", flush=True)
    else:
        build_model(args.model, model)
        print(f"init_demo: built the tiny model in {args.model}", flush=True)
    if args.data.exists():
        print(f"init_demo: dataset already at {args.data}", flush=True)
    else:
        write_dataset(args.data, demo, args.prompts)
        print(f"init_demo: wrote {args.prompts} prompts to {args.data}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
