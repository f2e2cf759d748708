"""Prometheus metrics of the rollout service (process-wide, default registry, `/metrics`).

`asyncrl_rollout_` prefix, base units, `_total` counters; labels are bounded (results,
reasons, statuses, the engine's index in the configured list — never ids or URLs).
Evaluations use the `asyncrl_eval_` prefix; their gauges are labelled by evaluation name and
version, and only the newest `EVAL_SERIES_KEPT` (name, version) series are kept.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

JOBS_SUBMITTED = Counter("asyncrl_rollout_jobs_submitted_total", "Jobs accepted by POST /v1/rollouts")
GROUPS_SUBMITTED = Counter("asyncrl_rollout_groups_submitted_total", "Groups enqueued by POST /v1/rollouts")
REQUESTS_REJECTED = Counter(
    "asyncrl_rollout_requests_rejected_total", "Rollout API requests refused with a 4xx/5xx", ["reason"]
)
JOBS_CANCELLED = Counter("asyncrl_rollout_jobs_cancelled_total", "DELETE /v1/rollouts/{id} calls")

GROUPS_CLAIMED = Counter(
    "asyncrl_rollout_groups_claimed_total", "Group jobs taken from the jobs stream", ["source"]
)
GROUPS_ADMITTED = Counter(
    "asyncrl_rollout_groups_admitted_total", "Groups that got (or resumed) an admission slot"
)
GROUPS_FINISHED = Counter(
    "asyncrl_rollout_groups_finished_total",
    "Groups leaving the rollout service (buffered, duplicate, failed, cancelled)",
    ["result"],
)
GROUPS_UNSCORED = Counter(
    "asyncrl_rollout_groups_unscored_total",
    "Groups written with no scored sample (every reward timeout, error or invalid_input)",
)
GROUPS_REQUEUED = Counter(
    "asyncrl_rollout_groups_requeued_total",
    "Groups restarted after an engine failure or an internal error",
    ["reason"],
)
ACTIVE_GROUPS = Gauge("asyncrl_rollout_active_groups", "Groups claimed by this replica and not finished")
ADMISSION_WAITS = Counter("asyncrl_rollout_admission_waits_total", "Admission attempts answered `full`")
ADMISSION_WAIT_SECONDS = Histogram(
    "asyncrl_rollout_admission_wait_seconds",
    "Claim to admission of a group",
    buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800),
)

GENERATION_SECONDS = Histogram(
    "asyncrl_rollout_generation_seconds",
    "Admission to the last sample of a group generated",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
GENERATED_TOKENS = Counter(
    "asyncrl_rollout_generated_tokens_total", "Completion tokens received from engines"
)
TOKENS_PER_SECOND = Gauge(
    "asyncrl_rollout_tokens_per_second", "Completion tokens per second of the last group"
)
ABORTS = Counter("asyncrl_rollout_aborts_total", "Generate calls that came back with finish_reason abort")
RESUBMITS = Counter("asyncrl_rollout_resubmits_total", "Partial samples resubmitted (prompt + tokens so far)")
ENGINE_REQUESTS = Counter(
    "asyncrl_rollout_engine_requests_total", "Engine HTTP calls by outcome", ["engine", "op", "result"]
)
ENGINE_ROUTE_FALLBACKS = Counter(
    "asyncrl_rollout_engine_route_fallbacks_total",
    "Engines that answered 404 on an SGLang 0.5.23 route, so its deprecated name is used",
    ["route"],
)
ENGINE_HEALTHY = Gauge(
    "asyncrl_rollout_engine_healthy", "1 when the engine is used, 0 when marked unhealthy", ["engine"]
)
FAILOVER_RESUMES = Counter(
    "asyncrl_rollout_failover_resumes_total",
    "Unfinished samples of a group whose engine failed, continued on another engine from their last "
    "received segment (the tokens and versions received so far kept)",
)
FLEET_CHANGES = Counter(
    "asyncrl_rollout_fleet_changes_total",
    "Engine fleet changes (services/rollout/fleet.py): joined (brought to the current weights, then "
    "added to the router), rejoined (a down engine answered again), left (removed through the API), "
    "down (unreachable: out of the router and of weight updates), join_failed",
    ["change"],
)
FLEET_ENGINES = Gauge("asyncrl_rollout_fleet_engines", "Engine fleet members by state", ["state"])
FLEET_SYNC_ERRORS = Counter(
    "asyncrl_rollout_fleet_sync_errors_total",
    "Fleet syncs that could not read the roster (source=redis) or the router's workers (source=router)",
    ["source"],
)
ROUTER_CALLS = Counter(
    "asyncrl_rollout_router_calls_total",
    "Changes and reads of sglang-router's workers by op (list, add, remove) and result",
    ["op", "result"],
)
COALESCED_CALLS = Histogram(
    "asyncrl_rollout_coalesced_calls",
    "Generate calls (groups or resubmission rounds) sharing one flush",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
COALESCED_SPLITS = Counter(
    "asyncrl_rollout_coalesced_splits_total", "Coalesced requests refused (4xx) and retried per caller"
)
BUFFER_WRITE_GROUPS = Histogram(
    "asyncrl_rollout_buffer_write_groups",
    "Scored groups put (and their jobs ended) by one buffer write",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
ENGINE_IN_FLIGHT = Gauge("asyncrl_rollout_engine_in_flight", "Generate calls in flight", ["engine"])

REWARD_SECONDS = Histogram(
    "asyncrl_rollout_reward_seconds",
    "Latency of one reward batch (a group)",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120),
)
REWARD_RESULTS = Counter(
    "asyncrl_rollout_reward_results_total", "Scored samples by reward status", ["status"]
)
REWARD_CALLS = Counter("asyncrl_rollout_reward_calls_total", "Reward HTTP calls by outcome", ["result"])

STALENESS_AT_WRITE = Histogram(
    "asyncrl_rollout_staleness_at_write",
    "Trainer version minus the group's oldest token version when the group is written",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
)
WEIGHT_UPDATES = Counter(
    "asyncrl_rollout_weight_updates_total", "Weight events handled by method and result", ["method", "result"]
)
WEIGHT_UPDATE_SECONDS = Histogram(
    "asyncrl_rollout_weight_update_seconds",
    "Pause → update → continue on all engines",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
)
ADAPTER_LOADS = Counter(
    "asyncrl_rollout_adapter_loads_total", "LoRA adapters loaded on an engine (one per engine and version)"
)
ADAPTER_LOAD_FAILURES = Counter(
    "asyncrl_rollout_adapter_load_failures_total",
    "LoRA adapter loads an engine refused or failed: that version is not sampled on it until a retry loads it",
    ["engine"],
)
ADAPTER_UNLOADS = Counter(
    "asyncrl_rollout_adapter_unloads_total", "LoRA adapters unloaded by this replica", ["result"]
)
ADAPTER_LOST = Counter(
    "asyncrl_rollout_adapter_lost_total",
    "Requests an engine refused because it no longer held the adapter they named (restarted, evicted): "
    "reloaded and sent again",
)
POLICY_VERSION = Gauge(
    "asyncrl_rollout_engine_weight_version", "Weight version the engines were last updated to"
)

GATEWAY_REQUESTS = Counter(
    "asyncrl_rollout_gateway_requests_total",
    "Gateway requests answered, by route and HTTP status",
    ["route", "code"],
)
GATEWAY_ERRORS = Counter(
    "asyncrl_rollout_gateway_errors_total",
    "Gateway requests refused or failed (and reaper passes that failed), by route and reason",
    ["route", "reason"],
)
GATEWAY_COMPLETIONS = Counter(
    "asyncrl_rollout_gateway_completions_total",
    "Chat completions generated: in a session, or proxied",
    ["mode"],
)
GATEWAY_SESSIONS = Counter(
    "asyncrl_rollout_gateway_sessions_total",
    "Gateway sessions opened, closed, split (into several samples), expired and abandoned (never closed)",
    ["event"],
)
GATEWAY_GROUPS = Counter(
    "asyncrl_rollout_gateway_groups_total",
    "Gateway groups put in the buffer, put before (duplicate), expired, abandoned (a session deleted), "
    "or failed to build",
    ["result"],
)

EVAL_SERIES_KEPT = 256  # (name, version) series of the eval gauges; older ones are removed
EVAL_ACCURACY = Gauge(
    "asyncrl_eval_accuracy",
    "Fraction of items scored with reward >= 1 (unscored items are wrong)",
    ["name", "version"],
)
EVAL_FORMAT_RATE = Gauge(
    "asyncrl_eval_format_rate",
    "Fraction of items whose answer had the final-answer format its verifier requires (unset: no format verdict)",
    ["name", "version"],
)
EVAL_FORMATTED_ACCURACY = Gauge(
    "asyncrl_eval_formatted_accuracy",
    "Fraction of the formatted items that are correct (unset: none formatted)",
    ["name", "version"],
)
EVAL_MEAN_REWARD = Gauge("asyncrl_eval_mean_reward", "Mean reward of the scored items", ["name", "version"])
EVAL_MEAN_LENGTH = Gauge(
    "asyncrl_eval_mean_length", "Mean completion length in tokens of all items", ["name", "version"]
)
EVAL_GAUGES = (EVAL_ACCURACY, EVAL_FORMAT_RATE, EVAL_FORMATTED_ACCURACY, EVAL_MEAN_REWARD, EVAL_MEAN_LENGTH)
EVALS_SUBMITTED = Counter("asyncrl_eval_submitted_total", "Evaluations created", ["source"])
EVALS_FINISHED = Counter(
    "asyncrl_eval_evaluations_total",
    "Evaluations this replica ran to an end: done, failed, or lost (its lease went to another replica)",
    ["result"],
)
EVAL_ITEMS = Counter("asyncrl_eval_items_total", "Evaluated items by reward status", ["status"])
EVAL_REDIS_ERRORS = Counter(
    "asyncrl_eval_redis_errors_total",
    "Evaluation queue or store calls that failed (retried, or left to the lease)",
)
EVALS_RUNNING = Gauge("asyncrl_eval_running", "Evaluations this replica is running")
EVAL_SECONDS = Histogram(
    "asyncrl_eval_seconds",
    "Claim to stored result of one evaluation",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
AUTO_EVALS = Counter(
    "asyncrl_eval_auto_total",
    "Automatic evaluations due at a version: created, exists (another replica's), error (not created)",
    ["result"],
)

# Episodes: multi-turn rollouts with an environment.
EPISODES = Counter(
    "asyncrl_rollout_episodes_total",
    "Episodes finished, by how (answered, turns, length, failed)",
    ["result"],
)
EPISODE_RETRIES = Counter(
    "asyncrl_rollout_episode_retries_total",
    "Episodes started again after their environment failed, by kind",
    ["kind"],
)
ENV_STEPS = Counter(
    "asyncrl_rollout_env_steps_total",
    "Environment steps, by environment and the tool's status",
    ["environment", "status"],
)
OPENENV_ERRORS = Counter(
    "asyncrl_rollout_openenv_errors_total",
    "Failures of OpenEnv servers' sessions, by server and kind (dropped, server_error, garbage, "
    "refused_action, unavailable)",
    ["server", "kind"],
)
TOOL_CALLS = Counter(
    "asyncrl_rollout_tool_calls_total",
    "Tool calls the policy made, by outcome (called, unparsable)",
    ["result"],
)

VF_GROUPS = Counter(
    "asyncrl_rollout_vf_groups_total",
    "Groups of verifiers runs (`vf-eval` through the gateway): buffered, put before, or failed whole",
    ["result"],
)
VF_ROLLOUTS_FAILED = Counter(
    "asyncrl_rollout_vf_rollouts_failed_total",
    "Rollouts of verifiers runs not trained on: failed in verifiers, no session here, or a "
    "rollout that was fine in a group that failed",
    ["reason"],
)

GATEWAY_RESPONSES = Counter(
    "asyncrl_rollout_gateway_responses_total",
    "Responses API answers and their stored conversations, by event (answered, continued, "
    "stored, not_stored: too large or Redis failed)",
    ["event"],
)
