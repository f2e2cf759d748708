"""Which HTTP statuses are worth a retry, decided once (services/runtime/retry.py `may_retry`)
for the rollout's engine, reward and environment clients and the judge verifier."""

from __future__ import annotations

from asyncrl.services.runtime.retry import JUDGE_RETRY_STATUSES, RETRY_STATUSES, may_retry


def test_asyncrl_services_busy_or_failing_are_retried_and_a_wrong_request_is_not():
    assert sorted(RETRY_STATUSES) == [429, 500, 502, 503, 504]
    for status in (429, 500, 501, 502, 503, 504, 505, 599):  # rate limited; every 5xx of our own
        assert may_retry(status), status
    for status in (400, 401, 403, 404, 408, 409, 413, 422, 425):  # the request itself is wrong
        assert not may_retry(status), status


def test_a_third_party_judge_retries_its_list_only():
    """The OpenAI API's retry advice: 408, 409, 425 as well, but not a 501 or a 505, which say
    what they mean."""
    assert sorted(JUDGE_RETRY_STATUSES - RETRY_STATUSES) == [408, 409, 425]
    retried = [s for s in range(400, 600) if may_retry(s, JUDGE_RETRY_STATUSES, any_5xx=False)]
    assert retried == [408, 409, 425, 429, 500, 502, 503, 504]
