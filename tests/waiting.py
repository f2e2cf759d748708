"""Waiting on a condition instead of sleeping a fixed time.

A fixed sleep that orders two events ("the consumer is now reading") holds on an idle machine
and fails on a loaded one; a wait on the condition itself holds on both and costs only as long
as the event takes. Tests import it by plain name (`from waiting import wait_until`):
tests/ is on sys.path through tests/conftest.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT_S = 60.0  # generous: a 2-core machine running other suites must not fail a healthy test
INTERVAL_S = 0.02


def wait_until(predicate: Callable[[], T], *, message: str, timeout: float = TIMEOUT_S,
               interval: float = INTERVAL_S) -> T:  # fmt: skip
    """Call `predicate` every `interval` seconds until it returns something truthy, and return
    that; raise AssertionError naming `message` once `timeout` seconds have passed. The
    predicate is always called once more after the deadline, so a slow poll never loses."""
    deadline = time.monotonic() + timeout
    while True:
        late = time.monotonic() >= deadline
        value = predicate()
        if value:
            return value
        if late:
            raise AssertionError(f"timed out after {timeout:g} s waiting until {message}")
        time.sleep(interval)
