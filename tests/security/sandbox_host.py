"""What the security tests know of the sandbox on the host: its uids and the secret a probe
looks for (shared by conftest.py's reward service and the attack tests)."""

from __future__ import annotations

from pathlib import Path

SECRET_ENV = "ASYNCRL_SECURITY_PROBE_SECRET"
UID_BASE = 2_100_000  # sandbox host uids of these tests (slot i = UID_BASE + i)
SLOTS = 2


def sandbox_pids() -> list[int]:
    """Host processes running as one of this service's sandbox uids."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if UID_BASE <= int(uid_line.split()[1]) < UID_BASE + SLOTS:
            pids.append(int(status.parent.name))
    return pids
