"""Settings of `asyncrl rollout` (defaults → TOML `[rollout]` → env `ASYNCRL_ROLLOUT_…` → CLI)."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from asyncrl.proto.limits import MAX_GROUP_SIZE
from asyncrl.services.runtime.config import ServiceSettings


def _name_list(value: Any) -> list[str]:
    """Accept a list, a JSON list or a comma-separated string (the CLI and env give strings)."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            value = json.loads(text)
        else:
            value = [part for part in (p.strip() for p in text.split(",")) if part]
    return [str(v).strip() for v in value]


def _url_list(value: Any) -> list[str]:
    urls = [u.rstrip("/") for u in _name_list(value)]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL must be http(s)://…, got {url!r}")
    return urls


class OpenEnvServer(BaseModel):
    """An OpenEnv env server episodes may name (`episode.kind = "openenv"`); only these are ever
    connected to, never an address from a job."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        description="the server's root: ws(s)://host:port drives each episode over one WebSocket session "
        "(the environment's state lives in the server); http(s)://host:port over POST /reset and /step, "
        "for stateless environments only (each call builds a fresh one)"
    )
    max_sessions: int = Field(
        1, ge=1, le=4096, description="episodes in flight at once (the server's max_concurrent_envs)"
    )
    timeout_s: float = Field(60.0, gt=0, le=3600, description="timeout of one reset or step")
    description: str = Field("", max_length=1024, description="the tool's description for the policy")
    judges: bool = Field(
        True,
        description="the episode's reward is the sum of the env's step rewards (0 for an episode that never "
        "steps); false: the job's reward_spec verifier scores the final answer",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("ws://", "wss://", "http://", "https://")):
            raise ValueError(f"an OpenEnv server URL is ws(s):// or http(s)://, got {value!r}")
        return value.rstrip("/")

    @property
    def websocket(self) -> bool:
        return self.url.startswith(("ws://", "wss://"))

    @property
    def http_url(self) -> str:
        """Where `/schema` (and the HTTP routes) are."""
        return "http" + self.url[2:] if self.websocket else self.url


class RolloutSettings(ServiceSettings):
    """Rollout service: takes jobs over HTTP, generates groups on SGLang-compatible engines with
    partial rollouts across weight updates, scores them and writes them to the replay buffer."""

    model_config = SettingsConfigDict(env_prefix="ASYNCRL_ROLLOUT_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8001, ge=1, le=65535, description="port to bind")
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$", description="log level")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="largest accepted request body (413 above)")
    max_inflight_submissions: int = Field(
        32, ge=1, description="POSTs in progress at once; one more answers 503 + Retry-After (load shedding)"
    )
    redis_url: str | None = Field(None, description="Redis URL; unset starts an embedded Redis in run_dir")
    run_dir: str = Field("runs/default", description="where an embedded Redis keeps its files")
    run: str = Field("default", min_length=1, max_length=64, description="run id (buffer key namespace)")
    replica: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=128,
        description="replica id; must be stable across restarts of the same replica",
    )

    engine_urls: str = Field(
        "http://127.0.0.1:30000",
        description="generation endpoints, comma-separated: engines or one sglang-router",
    )
    engine_admin_urls: str = Field(
        "",
        description="engines to update weights on (default: engine_urls, or none with router_url); the "
        "workers behind a router",
    )
    router_url: str = Field(
        "",
        description="an sglang-router (>= 0.3, its /workers API) whose workers this service manages "
        "(docs/architecture.md §7): engine_admin_urls and the engines joined through POST /v1/engines "
        "are added to it once they serve the current weights, and taken out when removed or unreachable; "
        "generation goes to engine_urls (default: this router). Unset: the engines are a static list",
    )
    fleet_join_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="how long a joining engine may take to be listed healthy by the router",
    )
    reward_url: str = Field("http://127.0.0.1:8002", description="reward service base URL")
    tokenizer: str = Field(description="local tokenizer directory (the policy model's)")

    context_length: int | None = Field(
        None, gt=1, description="prompt + completion limit (default: model config)"
    )
    max_new_tokens_cap: int = Field(4096, gt=0, description="largest max_new_tokens a job may ask")
    default_max_new_tokens: int = Field(256, gt=0, description="max_new_tokens when a job sets none")
    default_group_size: int = Field(8, ge=1, le=MAX_GROUP_SIZE, description="group size when a job sets none")
    initial_weight_version: int = Field(
        0, ge=0, description="version of tokens from an engine whose weight_version is not an integer"
    )

    max_active_groups: int = Field(32, gt=0, le=100_000, description="groups claimed and in progress at once")
    admission_poll_s: float = Field(0.2, gt=0, le=60, description="wait between admission attempts when full")
    claim_poll_s: float = Field(0.1, gt=0, le=10, description="wait between job-stream polls when idle")
    heartbeat_s: float = Field(2.0, gt=0, le=600, description="interval of job heartbeats and cancel checks")
    recover_idle_s: float = Field(30.0, gt=0, description="a job idle this long belongs to a dead replica")
    recover_interval_s: float = Field(5.0, gt=0, description="how often dead replicas' jobs are looked for")

    engine_timeout_s: float = Field(600.0, gt=0, description="timeout of one /generate call")
    engine_retries: int = Field(3, ge=0, le=100, description="retries of a failed engine call")
    engine_backoff_s: float = Field(0.2, ge=0, le=60, description="first retry delay; doubles each retry")
    engine_unhealthy_after: int = Field(
        3, ge=1, description="consecutive failures that mark an engine unhealthy"
    )
    engine_probe_s: float = Field(1.0, gt=0, le=600, description="health probe interval of unhealthy engines")
    requeue_backoff_max_s: float = Field(
        30.0, gt=0, description="cap of the delay before a requeued group retries"
    )
    max_resubmits: int = Field(
        64, ge=1, description="aborts one sample may survive before its group is requeued"
    )

    reward_timeout_s: float = Field(120.0, gt=0, description="timeout of one reward batch")
    reward_concurrency: int = Field(8, gt=0, le=1024, description="reward batches in flight")
    reward_retries: int = Field(2, ge=0, le=20, description="retries of a reward batch on transport errors")
    verifiers_ttl_s: float = Field(
        60.0, gt=0, description="how long the reward service's verifier list is cached"
    )
    local_verifiers: str = Field(
        "",
        description="inline verifiers (pure functions: reverse, arith) scored in this process instead of over "
        "HTTP, comma-separated or a list: no reward-service round trip per batch; the spec checks, cache and "
        "verdicts are the reward service's own code (services/reward/local.py), and the verdicts are counted "
        "in this process's asyncrl_reward_items_total",
    )

    environments_url: str = Field(
        "", description="environment server (proto/environments.py); default: reward_url"
    )
    env_timeout_s: float = Field(120.0, gt=0, description="timeout of one environment reset or step")
    env_retries: int = Field(
        2, ge=0, le=20, description="retries of an environment call on transport errors and 5xx"
    )

    openenv: dict[str, OpenEnvServer] = Field(
        default_factory=dict,
        description="OpenEnv env servers by the name episodes give (TOML [rollout.openenv.NAME]; env: JSON)",
    )

    weight_update_timeout_s: float = Field(600.0, gt=0, description="timeout of one engine weight update")
    weight_update_abort: bool = Field(
        True,
        description="a disk weight update aborts the requests in flight, whose samples go on under the new "
        "weights (partial rollouts, docs/architecture.md §5); false: the engine finishes them under the old "
        "weights first (SGLang's default), cheaper than a resubmission when completions are a few tokens",
    )
    weight_update_in_flight: bool = Field(
        False,
        description="a disk weight update pauses the engines (mode retract), loads and continues them without "
        "aborting anything: requests in flight go on under the new weights and each token carries the version "
        "that sampled it (SGLang >= 0.5.23's meta_info.weight_versions; PipelineRL's in-flight updates). "
        "Overrides weight_update_abort",
    )
    max_loaded_adapters: int = Field(
        4,
        ge=1,
        le=1024,
        description="LoRA runs ([trainer.lora]): adapters kept loaded per engine; past it the oldest that no "
        "request of this replica and no evaluation uses is unloaded (the newest never). At most the engine's "
        "max_loaded_loras, so the engine never evicts one itself",
    )
    weights_poll_s: float = Field(
        5.0, gt=0, description="fallback poll of the latest weights (pub/sub may drop)"
    )

    eval_file: str | None = Field(
        None,
        description="JSONL of held-out prompts (RolloutPrompt shape, each with a reward_spec) "
        "evaluated automatically; unset: no automatic evaluations",
    )
    eval_every: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="evaluate eval_file and eval_sets at every version divisible by this (version 0 "
        "included); 0: off",
    )
    eval_name: str = Field(
        "heldout", min_length=1, max_length=64, description="name of the automatic evaluations of eval_file"
    )
    eval_sets: dict[str, str] = Field(
        default_factory=dict,
        description="more automatic evaluations beside eval_file: name → JSONL of held-out prompts (as "
        "eval_file), each evaluated at the same versions and reported under its own name "
        "(TOML [rollout.eval_sets]; env: JSON)",
    )
    eval_max_new_tokens: int | None = Field(
        None,
        gt=0,
        description="max_new_tokens of evaluations that set none (default: default_max_new_tokens)",
    )
    eval_sampling_params: dict[str, Any] | None = Field(
        None,
        description="SGLang sampling params of automatic evaluations, JSON (default: greedy, "
        "temperature 0, eval_max_new_tokens)",
    )
    eval_concurrency: int = Field(
        1, ge=1, le=64, description="queued evaluations this replica runs at once (each pins one engine)"
    )

    gateway_session_ttl_s: float = Field(
        3600.0,
        gt=0,
        le=7 * 86400,
        description="a gateway group with no call, session or close for this long expires: its admission slot "
        "is given back and its calls dropped",
    )
    gateway_admission_wait_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="how long POST /v1/sessions waits for an admission slot for a new group before answering "
        "429 (0: answer at once; the client retries after Retry-After)",
    )
    gateway_engine_wait_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="how long a chat completion waits for a healthy engine before answering 503",
    )
    gateway_max_inflight: int = Field(
        1024, ge=1, description="gateway requests in progress at once; one more answers 503 + Retry-After"
    )
    gateway_put_lease_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="a replica that closed a gateway group's last session has this long to put the group before "
        "another replica's reaper puts it (a replica that dies between close and put loses nothing)",
    )
    gateway_reap_interval_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="how often expired gateway groups, and complete groups a failed replica did not put, are "
        "looked for",
    )

    @field_validator("eval_sampling_params", mode="before")
    @classmethod
    def _sampling_params(cls, value: Any) -> Any:
        from asyncrl.proto.sglang import SamplingParams  # here, not at the top: `--help` stays fast

        value = json.loads(value) if isinstance(value, str) else value
        if value is not None:
            try:
                params = SamplingParams.model_validate(value)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"not SGLang sampling params: {where}: {first['msg']}") from None
            if params.n != 1:
                raise ValueError("n must be 1: an evaluation takes one completion per prompt")
        return value

    @field_validator("openenv")
    @classmethod
    def _openenv_names(cls, value: dict[str, OpenEnvServer]) -> dict[str, OpenEnvServer]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise ValueError(f"OpenEnv server name {name!r}: 1-64 of A-Z a-z 0-9 _ . - (a tool name)")
        return value

    @field_validator("eval_name")
    @classmethod
    def _eval_name(cls, value: str) -> str:
        from asyncrl.proto.evals import EVAL_NAME_PATTERN

        if not re.fullmatch(EVAL_NAME_PATTERN, value):
            raise ValueError(f"must match {EVAL_NAME_PATTERN} (it is a Prometheus label value)")
        return value

    @field_validator("eval_sets")
    @classmethod
    def _eval_set_names(cls, value: dict[str, str]) -> dict[str, str]:
        from asyncrl.proto.evals import EVAL_NAME_PATTERN

        for name in value:
            if not re.fullmatch(EVAL_NAME_PATTERN, name):
                raise ValueError(
                    f"evaluation name {name!r} must match {EVAL_NAME_PATTERN} (a Prometheus label value)"
                )
        return value

    @field_validator("engine_urls", "engine_admin_urls", mode="before")
    @classmethod
    def _normalise_urls(cls, value: Any) -> str:
        return ",".join(_url_list(value))

    @field_validator("router_url", mode="before")
    @classmethod
    def _router_url(cls, value: Any) -> str:
        urls = _url_list(value)
        if len(urls) > 1:
            raise ValueError("router_url is one URL")
        return urls[0] if urls else ""

    @field_validator("local_verifiers", mode="before")
    @classmethod
    def _local_verifiers(cls, value: Any) -> str:
        from asyncrl.proto.verifiers import INLINE

        names = _name_list(value)
        for name in names:
            if name not in INLINE:
                inline = ", ".join(sorted(INLINE))
                raise ValueError(f"{name!r} cannot be scored locally: only inline verifiers can ({inline})")
        return ",".join(dict.fromkeys(names))

    @model_validator(mode="after")
    def _check(self) -> RolloutSettings:
        if self.router_url and "engine_urls" not in self.model_fields_set:
            self.engine_urls = self.router_url  # generation goes through the router it manages
        if not self.engine_url_list:
            raise ValueError("engine_urls needs at least one URL")
        if self.router_url and self.router_url in _url_list(self.engine_admin_urls):
            raise ValueError("engine_admin_urls lists router_url: the router is not one of its own workers")
        if self.default_max_new_tokens > self.max_new_tokens_cap:
            raise ValueError("default_max_new_tokens exceeds max_new_tokens_cap")
        if self.heartbeat_s * 3 > self.recover_idle_s:
            raise ValueError("heartbeat_s must be at most recover_idle_s / 3, or live jobs get stolen")
        if (not self.auto_eval_files) != (self.eval_every == 0):
            raise ValueError("automatic evaluations need both eval_file (or eval_sets) and eval_every > 0")
        if self.eval_file is not None and self.eval_name in self.eval_sets:
            raise ValueError(f"eval_sets names {self.eval_name!r}, the name of eval_file's evaluations")
        if (self.eval_max_new_tokens or 0) > self.max_new_tokens_cap:
            raise ValueError("eval_max_new_tokens exceeds max_new_tokens_cap")
        if self.gateway_reap_interval_s > self.gateway_session_ttl_s:
            raise ValueError("gateway_reap_interval_s must be at most gateway_session_ttl_s")
        if (self.eval_sampling_params or {}).get("max_new_tokens", 0) > self.max_new_tokens_cap:
            raise ValueError("eval_sampling_params.max_new_tokens exceeds max_new_tokens_cap")
        return self

    @property
    def auto_eval_files(self) -> dict[str, str]:
        """Every automatic evaluation: name → its JSONL (eval_file under eval_name, then eval_sets)."""
        first = {self.eval_name: self.eval_file} if self.eval_file is not None else {}
        return first | self.eval_sets

    @property
    def engine_url_list(self) -> list[str]:
        return _url_list(self.engine_urls)

    @property
    def local_verifier_list(self) -> list[str]:
        return _name_list(self.local_verifiers)

    @property
    def admin_url_list(self) -> list[str]:
        """The engines weight updates go to at start. With a router_url the generation URL is
        the router, which takes no weight update: only the listed workers (maybe none yet)."""
        if self.router_url:
            return _url_list(self.engine_admin_urls)
        return _url_list(self.engine_admin_urls) or self.engine_url_list
