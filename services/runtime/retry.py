"""Retries with exponential backoff, for the places that own a retry policy: the rollout's
engine and reward clients and its requeue of a group whose engine failed, the judge verifier.

An attempt raises `Retryable` when another attempt may succeed (a transport error, an HTTP
status `may_retry` accepts, a garbage answer), anything else (a refused request, a timeout not
worth repeating) to end the retries at once; it counts its own failures, where it tells them
apart. No deadline is kept here: each attempt is bounded by its client's timeout, a budget for
the whole by the caller.

Which HTTP statuses are worth a retry is decided here, for every client: `RETRY_STATUSES`, and
any 5xx of asyncrl's own services. The one variant, `JUDGE_RETRY_STATUSES`, is for a third-party
OpenAI-compatible endpoint (the judge verifier), whose retry advice is the OpenAI API's.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# Answers after which the same request may succeed later: rate limited or busy (429), failed
# or unavailable (500, 502, 503, 504). Any other 4xx means the request itself is wrong.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# A third-party OpenAI-compatible server also asks for a retry with 408 (it gave up waiting for
# the request), 409 (a conflicting request in flight) and 425 (too early), as the OpenAI clients
# retry them; its other 5xx (501 not implemented, 505 …) stay what they say, so only these count.
JUDGE_RETRY_STATUSES = RETRY_STATUSES | {408, 409, 425}


def may_retry(status: int, statuses: frozenset[int] = RETRY_STATUSES, *, any_5xx: bool = True) -> bool:
    """Whether resending a request answered with HTTP `status` (not a success) may succeed: one of
    `statuses`, or, with `any_5xx` (asyncrl's own services, whose every 5xx is a failure of the
    moment), any 5xx."""
    return status in statuses or (any_5xx and status >= 500)


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
