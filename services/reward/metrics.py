"""Prometheus metrics of the reward service (docs/architecture.md §9: `asyncrl_` prefix, base units,
`_total` counters, bounded labels: verifier names, statuses and reasons, never item ids)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "asyncrl_reward_requests_total",
    "POST /v1/rewards requests by outcome (accepted, rejected = 4xx before scoring)",
    ["outcome"],
)
ITEMS = Counter(
    "asyncrl_reward_items_total", "Scored items by verifier and result status", ["verifier", "status"]
)
LATENCY = Histogram(
    "asyncrl_reward_verify_seconds",
    "Time to verify one item (cache misses only, queueing included)",
    ["verifier"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
CACHE_HITS = Counter("asyncrl_reward_cache_hits_total", "Items answered from the result cache", ["verifier"])
CACHE_MISSES = Counter("asyncrl_reward_cache_misses_total", "Items verified (not in the cache)", ["verifier"])
VERIFIER_FAILURES = Counter(
    "asyncrl_reward_verifier_failures_total",
    "Items that ended in `timeout` or `error`, by verifier and reason",
    ["verifier", "reason"],
)
SANDBOX_FAILURES = Counter(
    "asyncrl_reward_sandbox_failures_total",
    "Sandbox runs that failed for infrastructure reasons (the program never ran or ran unjudged)",
    ["reason"],
)
CODE_TESTS = Counter("asyncrl_reward_code_tests_total", "Code test executions by per-test status", ["status"])
CODE_ASSERT_ITEMS = Counter(
    "asyncrl_reward_code_assert_items_total",
    "assert_code items by how their asserts ran: split (calls in the sandbox, comparisons in the "
    "service: hack-resistant) or in_sandbox (unsplittable, run as written next to the program)",
    ["mode"],
)
MATH_WORKER_RESTARTS = Counter(
    "asyncrl_reward_math_worker_restarts_total", "math-verify workers killed and replaced", ["reason"]
)
RGYM_WORKER_RESTARTS = Counter(
    "asyncrl_reward_reasoning_gym_worker_restarts_total",
    "reasoning-gym scorer workers killed and replaced",
    ["reason"],
)
JUDGE_CALLS = Counter(
    "asyncrl_reward_judge_calls_total",
    "Judge HTTP attempts by outcome (ok, retried, http_error, transport_error, bad_response)",
    ["outcome"],
)
ENV_RESETS = Counter(
    "asyncrl_reward_env_resets_total", "Episodes started (reset answered) by environment", ["environment"]
)
ENV_STEPS = Counter(
    "asyncrl_reward_env_steps_total",
    "Environment steps answered, by environment and step status",
    ["environment", "status"],
)
ENV_FAILURES = Counter(
    "asyncrl_reward_env_failures_total",
    "Environment infrastructure failures by environment and kind: a masked episode's failure_kind "
    "(sandbox, queue_timeout), or crash (a 500)",
    ["environment", "kind"],
)
ENV_REJECTED = Counter(
    "asyncrl_reward_env_requests_rejected_total",
    "Environment requests refused with a 4xx, by reason (unknown_environment, invalid_body: "
    "a body or task arguments that do not validate)",
    ["reason"],
)
ENV_STEP_LATENCY = Histogram(
    "asyncrl_reward_env_step_seconds",
    "Time to answer one environment step (tool runs and sandbox queueing included)",
    ["environment"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
NEMO_GYM_CALLS = Counter(
    "asyncrl_reward_nemo_gym_calls_total",
    "NeMo Gym resources-server HTTP calls by server, route (seed_session, verify, close) and outcome "
    "(ok, retried, http_error, transport_error, bad_response)",
    ["server", "route", "outcome"],
)
NEMO_GYM_VERDICTS = Counter(
    "asyncrl_reward_nemo_gym_verdicts_total",
    "NeMo Gym samples by server and outcome: scored, masked (mask_sample), failed (judge failure, "
    "server unavailable, refused, bad answer); masked and failed samples carry no reward",
    ["server", "outcome"],
)
NEMO_GYM_FAILURES = Counter(
    "asyncrl_reward_nemo_gym_failures_total",
    "NeMo Gym samples masked or failed, by server and failure kind (the server's failure_kind or "
    "_ng_failure_class if known, `other` if not, `unspecified` if absent; ours: unavailable, "
    "http_error, bad_response)",
    ["server", "kind"],
)
