"""`asyncrl submit FILE --url URL [--group-size N] [--sampling-params JSON] [--reward-spec JSON]
[--idempotency-key KEY] [--batch N]`: post a dataset as rollout jobs.

FILE is JSONL (one prompt object per line: `text` | `messages` | `input_ids`, optional
`reward_spec`, `prompt_id`; other columns are refused) or, when `pyarrow` is installed,
parquet with the same columns. Rows are sent in batches of `--batch` prompts; with an
idempotency key each batch gets `KEY-<n>`, so re-running the same command submits nothing twice.
Prints one JSON line per job (`job_id`, `groups`, `duplicate`).

Instead of FILE, `--reasoning-gym NAME --size N [--seed S] [--config JSON]` generates the
prompts from a reasoning-gym dataset (`pip install 'asyncrl[reasoning-gym]'`): each entry's
question as chat `messages` after reasoning-gym's own system prompt (`--system-prompt`, default
`default`: "answer in <answer> tags"; `none` for none), scored by the `reasoning_gym`
verifier, which regenerates the entry from (NAME, config, index) and checks its digest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROMPT_FIELDS = ("text", "messages", "input_ids", "reward_spec", "prompt_id")
DEFAULT_BATCH = 1024


class DatasetError(ValueError):
    pass


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{n}: not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{n}: expected an object, got {type(row).__name__}")
            yield _prompt(row, f"{path}:{n}")


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(
            "parquet needs pyarrow (`pip install 'asyncrl[parquet]'`); or convert the file to JSONL"
        ) from exc
    for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
        yield _prompt({k: v for k, v in row.items() if v is not None}, f"{path}: row {n}")


def _prompt(row: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(row) - set(PROMPT_FIELDS))
    if unknown:
        raise DatasetError(f"{where}: unknown columns {unknown}; allowed: {list(PROMPT_FIELDS)}")
    return row


def reasoning_gym_rows(
    name: str,
    size: int,
    seed: int,
    config: dict[str, Any] | None = None,
    system_prompt: str | None = "default",
    boxed_fallback: bool = False,
) -> list[dict[str, Any]]:
    """The prompts of reasoning-gym dataset `name` (`size` entries from `seed`), each with the
    `reasoning_gym` spec that names it. `DatasetError` for a name or config reasoning-gym refuses."""
    from asyncrl.proto.reasoning_gym import DATASETS, RELEASE, ReasoningGymSpec, entry_digest
    from asyncrl.proto.verifiers import SpecError, validate_spec

    try:
        import reasoning_gym
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError as exc:
        raise DatasetError(f"--reasoning-gym needs `pip install 'asyncrl[reasoning-gym]'`: {exc}") from exc
    if name not in DATASETS:
        raise DatasetError(f"unknown reasoning-gym {RELEASE} dataset {name!r}")
    config = dict(config or {})
    if {"seed", "size"} & set(config):
        raise DatasetError("give the seed and size as --seed and --size, not in --config")
    config.update(seed=seed, size=size)
    if system_prompt is not None and system_prompt not in SYSTEM_PROMPTS:
        raise DatasetError(
            f"unknown system prompt {system_prompt!r}; reasoning-gym has {sorted(SYSTEM_PROMPTS)}"
        )
    try:
        dataset = reasoning_gym.create_dataset(name, **config)
    except (TypeError, ValueError, AssertionError) as exc:  # the config dataclass or its validate()
        raise DatasetError(f"reasoning-gym refuses the config of {name}: {exc}") from exc
    system = [] if system_prompt is None else [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]}]
    rows = []
    for index in range(size):
        entry = dataset[index]
        spec = {"dataset": name, "config": config, "index": index, "entry_sha256": entry_digest(entry)}
        if boxed_fallback:
            spec["boxed_fallback"] = True
        try:
            validate_spec(ReasoningGymSpec, spec)
        except SpecError as exc:
            raise DatasetError(f"{name}[{index}]: {exc}") from exc
        rows.append(
            {
                "messages": [*system, {"role": "user", "content": entry["question"]}],
                "reward_spec": {"verifier": "reasoning_gym", **spec},
                "prompt_id": f"rg-{name}-{seed}-{index}",
            }
        )
    return rows


def _batches(rows: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl submit", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path, nargs="?", help="JSONL (or parquet with pyarrow) of prompts")
    parser.add_argument("--reasoning-gym", metavar="NAME", help="generate the prompts from this dataset")
    parser.add_argument("--size", type=int, help="--reasoning-gym: entries to generate")
    parser.add_argument("--seed", type=int, default=0, help="--reasoning-gym: the dataset's seed")
    parser.add_argument(
        "--config", type=json.loads, default=None, help="--reasoning-gym: config fields, JSON"
    )
    parser.add_argument(
        "--system-prompt",
        default="default",
        help="--reasoning-gym: one of reasoning-gym's SYSTEM_PROMPTS, or none",
    )
    parser.add_argument(
        "--boxed-fallback",
        action="store_true",
        help="--reasoning-gym: score a \\boxed{} answer without <answer> tags",
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("ASYNCRL_ROLLOUT_URL", "http://127.0.0.1:8001"),
        help="rollout service base URL",
    )
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument(
        "--sampling-params", type=json.loads, default=None, help="JSON object (SGLang's names)"
    )
    parser.add_argument(
        "--reward-spec", type=json.loads, default=None, help='JSON, e.g. {"verifier": "math"}'
    )
    parser.add_argument("--idempotency-key", default=None)
    parser.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="prompts per job")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    if (args.file is None) == (args.reasoning_gym is None):
        parser.error("give FILE or --reasoning-gym NAME (one of them)")
    if args.reasoning_gym is not None:
        if args.size is None or args.size < 1:
            parser.error("--reasoning-gym needs --size N (N >= 1)")
        if args.reward_spec is not None:
            parser.error("--reasoning-gym prompts carry their own reward spec; drop --reward-spec")
        if args.config is not None and not isinstance(args.config, dict):
            parser.error("--config must be a JSON object")
    source = args.file if args.file is not None else f"reasoning-gym {args.reasoning_gym}"

    import httpx

    headers = (
        {"Authorization": f"Bearer {os.environ['ASYNCRL_API_TOKEN']}"}
        if os.environ.get("ASYNCRL_API_TOKEN")
        else {}
    )
    sent = 0
    try:
        with httpx.Client(base_url=args.url, timeout=args.timeout, headers=headers) as client:
            if args.file is not None:
                rows = read_rows(args.file)
            else:
                rows = iter(
                    reasoning_gym_rows(
                        args.reasoning_gym,
                        args.size,
                        args.seed,
                        args.config,
                        None if args.system_prompt == "none" else args.system_prompt,
                        args.boxed_fallback,
                    )
                )
            for n, prompts in enumerate(_batches(rows, args.batch)):
                body: dict[str, Any] = {"prompts": prompts}
                for key in ("group_size", "sampling_params", "reward_spec"):
                    if getattr(args, key) is not None:
                        body[key] = getattr(args, key)
                if args.idempotency_key:
                    body["idempotency_key"] = f"{args.idempotency_key}-{n}"
                resp = client.post("/v1/rollouts", json=body)
                if resp.status_code != 202:
                    print(
                        f"asyncrl submit: batch {n} refused (HTTP {resp.status_code}): {resp.text[:2000]}",
                        file=sys.stderr,
                    )
                    return 1
                print(json.dumps(resp.json()), flush=True)
                sent += len(prompts)
    except (OSError, DatasetError) as exc:
        print(f"asyncrl submit: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"asyncrl submit: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if sent == 0:
        print(f"asyncrl submit: {source} has no prompts", file=sys.stderr)
        return 1
    return 0
