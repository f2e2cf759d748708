"""Retries with exponential backoff, for the places that own a retry policy: the rollout's
engine and reward clients and its requeue of a group whose engine failed, the judge verifier.

An attempt raises `Retryable` when another attempt may succeed (a transport error, a 5xx or 429,
a garbage answer), anything else (a refused request, a timeout not worth repeating) to end the
retries at once; it counts its own failures, where it tells them apart. No deadline is kept
here: each attempt is bounded by its client's timeout, a budget for the whole by the caller.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Retryable(Exception):
    """An attempt failed in a way another attempt may fix; the message says how."""


async def with_retries(
    attempt: Callable[[int], Awaitable[T]],
    retries: float,
    *,
    first_s: float,
    max_s: float = math.inf,
    jitter: float = 0.0,
) -> T:
    """`attempt(0)`, and while it raises `Retryable`, `attempt(1)`, … at most `retries` times
    more (`math.inf`: until one succeeds), raising the last `Retryable` when none succeeded.
    Retry n waits `first_s · 2^(n-1)`, at most `max_s`, lengthened by up to `jitter` of itself
    at random (so that clients failing together do not retry in step)."""
    n = 0
    while True:
        try:
            return await attempt(n)
        except Retryable:
            if n >= retries:
                raise
        n += 1
        await asyncio.sleep(
            min(first_s * 2.0 ** min(n - 1, 60), max_s) * (1 + jitter * random.random())
        )  # (2^60: no overflow)
