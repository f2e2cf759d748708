"""`asyncrl submit FILE --url URL [--group-size N] [--sampling-params JSON] [--reward-spec JSON]
[--idempotency-key KEY] [--batch N]`: post a dataset as rollout jobs.

FILE is JSONL (one prompt object per line: `text` | `messages` | `input_ids`, optional
`reward_spec`, `prompt_id`; other columns are refused) or, when `pyarrow` is installed,
parquet with the same columns. Rows are sent in batches of `--batch` prompts; with an
idempotency key each batch gets `KEY-<n>`, so re-running the same command submits nothing twice.
Prints one JSON line per job (`job_id`, `groups`, `duplicate`).
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
    parser.add_argument("file", type=Path, help="JSONL (or parquet with pyarrow) of prompts")
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

    import httpx

    headers = (
        {"Authorization": f"Bearer {os.environ['ASYNCRL_API_TOKEN']}"}
        if os.environ.get("ASYNCRL_API_TOKEN")
        else {}
    )
    sent = 0
    try:
        with httpx.Client(base_url=args.url, timeout=args.timeout, headers=headers) as client:
            for n, prompts in enumerate(_batches(read_rows(args.file), args.batch)):
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
        print(f"asyncrl submit: {args.file} has no prompts", file=sys.stderr)
        return 1
    return 0
