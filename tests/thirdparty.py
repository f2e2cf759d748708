"""Third-party packages in venvs of their own.

A client the suite drives as its users run it (an agent framework, `vf-eval`, an OpenEnv env
server) often pins libraries differently from asyncrl (openai, pydantic, fastapi), so it gets a
venv of its own beside the project's, built on first use from the same package index and kept
under `.venv-thirdparty/` keyed by its requirement list. A test talks to it only over HTTP or a
subprocess, the way a user's process would.

    python = thirdparty_venv("verifiers", ["verifiers==0.4.0"])
    subprocess.run([python, "-m", "...", ...])
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = Path(os.environ.get("ASYNCRL_THIRDPARTY_VENVS", ROOT / ".venv-thirdparty"))


class ThirdPartyUnavailable(RuntimeError):
    """The package cannot be installed here; the message says exactly why (pip's own words)."""


def thirdparty_venv(name: str, requirements: list[str]) -> Path:
    """The python of a venv holding exactly `requirements`; built once, reused after.

    Concurrent callers (two pytest processes) wait on a lock rather than build it twice. A
    failed install leaves no venv behind and raises `ThirdPartyUnavailable` with pip's output,
    so a test fails saying what could not be installed.
    """
    key = hashlib.sha256("\n".join([sys.version, *requirements]).encode()).hexdigest()[:12]
    venv = VENVS / f"{name}-{key}"
    python = venv / "bin" / "python"
    done = venv / ".complete"
    VENVS.mkdir(parents=True, exist_ok=True)
    with open(VENVS / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return python
        subprocess.run(["rm", "-rf", str(venv)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # torch, when a requirement pulls it in, must be the pinned CPU build (the pip
        # constraints of this machine and the project's pin agree on it).
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *requirements],
            capture_output=True,
            text=True,
        )
        if install.returncode != 0:
            subprocess.run(["rm", "-rf", str(venv)], check=True)
            raise ThirdPartyUnavailable(
                f"pip install {' '.join(requirements)} failed:\n{install.stdout}\n{install.stderr}"
            )
        done.touch()
    return python
