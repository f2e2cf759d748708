"""Retries with backoff (`services/runtime/retry.py`): doubling, capped, jittered; stopped by the
first error that is not retryable."""

from __future__ import annotations

import asyncio

import pytest


class Refused(Exception):
    pass


def test_retries_back_off_and_stop_at_the_first_error_that_is_not_retryable(monkeypatch):
    import types

    from asyncrl.services.runtime import retry
    from asyncrl.services.runtime.retry import Retryable, with_retries

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    # Only the retry module's sleep: servers other tests left running in this process (session
    # fixtures) sleep through the same asyncio module, and a global patch turned their 0.1 s ticks
    # into a busy loop appending to `slept`.
    monkeypatch.setattr(retry, "asyncio", types.SimpleNamespace(sleep=sleep))

    def run(outcomes: list, retries: int, **backoff):
        tried = []

        async def attempt(n: int) -> str:
            tried.append(n)
            if isinstance(outcomes[n], Exception):
                raise outcomes[n]
            return outcomes[n]

        slept.clear()
        return asyncio.run(with_retries(attempt, retries, **backoff)), tried

    fails = [Retryable(str(n)) for n in range(4)]
    assert run([*fails, "ok"], retries=5, first_s=0.5, max_s=1.5) == ("ok", [0, 1, 2, 3, 4])
    assert slept == [0.5, 1.0, 1.5, 1.5]  # doubling, capped
    run([*fails, "ok"], retries=5, first_s=1.0, jitter=0.25)
    assert all(1.0 <= d / b <= 1.25 for d, b in zip(slept, [1, 2, 4, 8]))
    with pytest.raises(Retryable, match="1"):  # out of retries: the last problem
        run([*fails, "ok"], retries=1, first_s=0.5)
    with pytest.raises(Refused):  # not retryable: ends at once
        run([Refused(), "ok"], retries=5, first_s=0.5)
