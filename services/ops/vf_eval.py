"""`asyncrl verifiers --gateway URL [--run ID] [--output-dir DIR] -- vf-eval ENV [vf-eval options]`:
run a verifiers environment, unmodified, through the rollout gateway, and buffer its groups
with verifiers' rewards (services/rollout/gateway/vf_runs.py, docs/architecture.md §12).

The command after `--` is the user's own `vf-eval` (verifiers 0.4.0, in whatever environment
has it); this adds only `--client.base-url URL/v1/runs/ID/v1`, `--output-dir DIR`, `--run.dir ID`
(and `--client.api-key-var ASYNCRL_API_TOKEN` when that token is set), so the gateway records
every model call of a rollout as one session. While it runs, `traces.jsonl` is read as it
grows: a task's group is named to the gateway (`POST /v1/runs/ID/groups`) as soon as its
`num_rollouts` traces are written, with each trace's reward (verifiers' `Trace.reward`) or the
error it ended with, and `num_rollouts`: a group still short of it when `vf-eval` exits fails
(counted by the gateway, listed in the summary, as are lines that cannot be read).

Prints one JSON summary line; exits with `vf-eval`'s status when it failed, 1 when a group
could not be named to the gateway, else 0. A full buffer (429) is waited out, up to
`--admission-wait-s` per group.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

OWNED_FLAGS = ("--client.base-url", "--client.base_url", "--output-dir", "--output_dir", "-o", "--run.dir")
TOKEN_ENV = "ASYNCRL_API_TOKEN"
TRACES_FILE = "traces.jsonl"  # verifiers.v1.utils.trace_store.TRACES_FILE
SAVED_CONFIG = Path("configs") / "resolved" / "eval.json"  # where vf-eval saves its resolved config
GROUP_KEY = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # proto/vf_runs.py's group key
TRACE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass
class Pending:
    """One task's rollouts read so far: (trace id, reward or None, error or None)."""

    rollouts: list[tuple[str, float | None, str | None]] = field(default_factory=list)
    sent: bool = False


class GatewayRefused(RuntimeError):
    pass


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: asyncrl verifiers --gateway URL [options] -- vf-eval ENV [vf-eval options]")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="asyncrl verifiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", required=True, help="the rollout service's URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--run", default=None, help="this run's id in the gateway (default: a new one)")
    p.add_argument("--output-dir", default="outputs", help="vf-eval's output dir; the run writes to DIR/ID")
    p.add_argument("--poll-s", type=float, default=0.5, help="how often traces.jsonl is read")
    p.add_argument(
        "--admission-wait-s", type=float, default=600.0, help="longest wait on a full buffer, per group"
    )
    args = p.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        raise SystemExit("asyncrl verifiers: give the vf-eval command after `--`")
    owned = [a for a in command if a.split("=", 1)[0] in OWNED_FLAGS]
    if owned:
        raise SystemExit(
            f"asyncrl verifiers sets {owned[0].split('=', 1)[0]} itself; leave it out of the command"
        )
    return args, command


def vf_command(command: list[str], base_url: str, output_dir: Path, run: str) -> list[str]:
    extra = ["--client.base-url", base_url, "--output-dir", str(output_dir), "--run.dir", run]
    if os.environ.get(TOKEN_ENV):
        extra += ["--client.api-key-var", TOKEN_ENV]
    return [*command, *extra]


def group_key(key: str) -> str:
    return key if GROUP_KEY.match(key) else hashlib.sha256(key.encode()).hexdigest()[:32]


def trace_key(trace_id: str) -> str:
    return (
        trace_id
        if TRACE_ID.match(trace_id)
        else "unreadable-" + hashlib.sha256(trace_id.encode()).hexdigest()[:16]
    )


class TraceTail:
    """The complete lines appended to `traces.jsonl` since the last read."""

    def __init__(self, path: Path):
        self.path, self.offset, self.lines = path, 0, 0  # bytes and lines read so far

    def new_lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        lines = data[:end].decode("utf-8", "replace").splitlines()
        self.lines += len(lines)
        return lines


def merge(
    pending: dict[str, Pending], unattributed: list[tuple[str, str]], lines: list[str], first_line: int = 1
) -> None:
    """Add newly written episodes (from line `first_line` on) to their tasks' groups
    (services/rollout/gateway/verifiers.py)."""
    from asyncrl.services.rollout.gateway.verifiers import read_traces

    traces = read_traces(lines, first_line)
    attributed = set()
    for group in traces.groups:
        entry = pending.setdefault(group.key, Pending())
        entry.rollouts += [(r.trace_id, r.reward, None) for r in group.rollouts]
        entry.rollouts += [(t, None, why) for t, why in group.failed]
        attributed |= {t for t, _ in group.failed}
    unattributed += [(where, why) for where, why in traces.failed if where not in attributed]


def post_group(client, url: str, body: dict, wait_s: float) -> dict:
    """Name one group to the gateway; a full buffer (429) or a gateway without Redis (503) is
    retried after its Retry-After, until `wait_s` has passed."""
    import httpx

    deadline = time.monotonic() + wait_s
    while True:
        try:
            resp = client.post(url, json=body)
        except httpx.TransportError as exc:
            if time.monotonic() >= deadline:
                raise GatewayRefused(f"{url}: {exc}") from exc
            time.sleep(1.0)
            continue
        if resp.status_code == 200:
            return resp.json()
        if resp.status_code in (429, 503) and time.monotonic() < deadline:
            time.sleep(float(resp.headers.get("retry-after", "1")))
            continue
        raise GatewayRefused(f"{url}: {resp.status_code} {resp.text[:500]}")


def main(argv: list[str]) -> int:
    args, command = parse_args(argv)
    import httpx

    run = args.run or f"vf-{uuid.uuid4().hex[:12]}"
    gateway = args.gateway.rstrip("/")
    run_dir = Path(args.output_dir) / run
    proc = subprocess.Popen(vf_command(command, f"{gateway}/v1/runs/{run}/v1", Path(args.output_dir), run))
    tail = TraceTail(run_dir / TRACES_FILE)
    pending: dict[str, Pending] = {}
    unattributed: list[tuple[str, str]] = []
    results: dict[str, list[str]] = {"buffered": [], "duplicate": [], "failed": []}
    refused: list[str] = []
    size: int | None = None
    headers = {"Authorization": f"Bearer {os.environ[TOKEN_ENV]}"} if os.environ.get(TOKEN_ENV) else {}

    def send(key: str, entry: Pending) -> None:
        rollouts = [
            {"trace_id": trace_key(t), **({"error": e[:500]} if e is not None else {"reward": r})}
            for t, r, e in entry.rollouts
        ]
        body = {"group_id": group_key(key), "prompt_id": group_key(key), "rollouts": rollouts}
        if size is not None:  # (a group short of it when vf-eval exits fails whole)
            body["num_rollouts"] = size
        entry.sent = True
        try:
            answer = post_group(client, f"{gateway}/v1/runs/{run}/groups", body, args.admission_wait_s)
        except GatewayRefused as exc:
            refused.append(str(exc))
            print(f"asyncrl verifiers: group {key} not named: {exc}", file=sys.stderr)
            return
        results[answer["group"]].append(key)

    with httpx.Client(timeout=60, headers=headers) as client:
        while True:
            done = proc.poll() is not None
            if size is None and (run_dir / SAVED_CONFIG).exists():
                size = int(json.loads((run_dir / SAVED_CONFIG).read_text())["num_rollouts"])
            first = tail.lines + 1
            merge(pending, unattributed, tail.new_lines(), first)
            for key, entry in pending.items():
                if size is not None and not entry.sent and len(entry.rollouts) >= size:
                    send(key, entry)
            if done:
                break
            time.sleep(args.poll_s)
        for key, entry in pending.items():
            if not entry.sent:
                send(key, entry)
    summary = {
        "run": run,
        "traces": str(tail.path),
        "vf_eval_exit": proc.returncode,
        "groups": {k: len(v) for k, v in results.items()},
        "failed_groups": results["failed"],
        "unreadable": [f"{where}: {why}" for where, why in unattributed],
        "not_named": refused,
    }
    print(json.dumps(summary))
    if proc.returncode:
        return proc.returncode
    return 1 if refused else 0
