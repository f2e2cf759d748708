"""Run the README's HTTP examples as written against a live topology.

Every `curl …` and `asyncrl submit …` command in the README's ```bash blocks is run with bash,
with only two substitutions: the documented ports (`localhost:8001` rollout, `:8002` reward,
`:30000` engine, `:8003` trainer) become the topology's, and the placeholders `j…` / `e…`
become the job / evaluation id an earlier command of the same block printed. Each curl gets
`-w` appended to report its status code; anything ≥ 400 is a failure. `make …` lines and
comments are not run (the Makefile targets have tests of their own).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
DOC_PORTS = {"rollout": 8001, "reward": 8002, "engine": 30000, "trainer": 8003}
STATUS_MARK = "\n@@status="


@dataclass
class Ran:
    command: str
    status: int | None  # HTTP status (curl), None for other commands
    returncode: int
    output: str


def commands(readme: Path = README) -> list[list[str]]:
    """The runnable commands of each bash block (multi-line commands joined), block by block."""
    blocks = re.findall(r"^```bash\n(.*?)^```", readme.read_text(), flags=re.DOTALL | re.MULTILINE)
    out = []
    for block in blocks:
        cmds, current = [], ""
        for line in block.splitlines():
            current = f"{current}\n{line}" if current else line
            if not _complete(current):
                continue
            stripped = current.strip()
            if stripped.startswith(("curl ", "asyncrl submit ")):
                cmds.append(stripped)
            current = ""
        if cmds:
            out.append(cmds)
    return out


def _complete(text: str) -> bool:
    """True when `text` is a whole shell command (no open quote)."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def run_all(urls: dict[str, str], cwd: Path, env: dict[str, str] | None = None) -> list[Ran]:
    """Run every command against `urls` (service name -> base URL like http://127.0.0.1:PORT)."""
    ran = []
    for block in commands():
        ids: dict[str, str] = {}
        for cmd in block:
            ran.append(_run(_substitute(cmd, urls, ids), cwd, env))
            for key, mark in (("job_id", "j…"), ("eval_id", "e…")):
                match = re.search(rf'"{key}":\s*"([^"]+)"', ran[-1].output)
                if match:
                    ids[mark] = match.group(1)
    return ran


def _substitute(cmd: str, urls: dict[str, str], ids: dict[str, str]) -> str:
    for name, port in DOC_PORTS.items():
        hostport = urls[name].split("://", 1)[1]
        cmd = re.sub(rf"(https?://)?localhost:{port}\b", lambda m, hp=hostport: (m.group(1) or "") + hp, cmd)
    for mark, value in ids.items():
        cmd = cmd.replace(mark, value)
    return cmd


def _run(cmd: str, cwd: Path, env: dict[str, str] | None) -> Ran:
    is_curl = cmd.startswith("curl ")
    if is_curl:  # the status code after the body (before any trailing comment)
        cmd = "curl -w '" + STATUS_MARK + "%{http_code}'" + cmd[len("curl") :]
    res = subprocess.run(["bash", "-c", cmd], check=False, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    out, status = res.stdout, None
    if is_curl and STATUS_MARK in out:
        out, code = out.rsplit(STATUS_MARK, 1)
        status = int(code.strip() or 0)
    return Ran(cmd, status, res.returncode, out + res.stderr)


def failures(ran: list[Ran]) -> list[str]:
    bad = []
    for r in ran:
        if r.returncode != 0 or (r.status is not None and not 200 <= r.status < 400):
            bad.append(f"{r.command}\n  → rc={r.returncode} status={r.status}: {r.output[:500]}")
    return bad


def sample_dataset(path: Path) -> None:
    """The `data.jsonl` the README's `asyncrl submit` line reads."""
    rows = [{"text": "What is 2+3?", "reward_spec": {"verifier": "math", "answer": "5"}},
            {"text": "What is 4*4?", "reward_spec": {"verifier": "math", "answer": "16"}}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
