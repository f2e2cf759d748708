"""Settings of `asyncrl reward` (defaults → TOML `[reward]` → env `ASYNCRL_REWARD_…` → CLI)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from asyncrl.proto.verifiers import NEMO_GYM_SERVER_NAME
from asyncrl.services.runtime.config import ServiceSettings, refuse_placeholder_secret


class NemoGymServer(BaseModel):
    """One NeMo Gym resources server the `nemo_gym` verifier may call (`[reward.nemo_gym.<name>]`).
    Specs name it; its address is the operator's alone, so a job cannot aim the service at a URL."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="base URL of the resources server (http(s)://host:port)")
    close_path: str | None = Field(
        None,
        pattern=r"^/[A-Za-z0-9_/-]{1,128}$",
        description="POSTed (with the session cookie) after verify, e.g. /end_session; unset: none",
    )

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, got {url!r}")
        return url.rstrip("/")


class RewardSettings(ServiceSettings):
    """Reward service: scores completions with math, code (sandboxed), judge, reasoning-gym and toy verifiers."""

    model_config = SettingsConfigDict(env_prefix="ASYNCRL_REWARD_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8002, ge=1, le=65535, description="port to bind")
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$", description="log level")
    development: bool = Field(False, description="development mode: placeholder secrets allowed")
    max_body_bytes: int = Field(64 << 20, ge=1024, description="largest accepted request body (413 above)")
    cache_entries: int = Field(100_000, ge=0, description="result cache size (LRU entries; 0 disables)")
    queue_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="longest an item may wait for a verifier slot before `timeout`"
    )
    toy_timeout_s: float = Field(2.0, gt=0, le=60, description="item timeout of the reverse/arith verifiers")

    math_workers: int = Field(2, ge=1, le=256, description="math-verify worker processes")
    math_timeout_s: float = Field(
        5.0, gt=0, le=300, description="per-item math timeout; the worker is killed past it"
    )
    math_max_chars: int = Field(8192, ge=64, le=1_000_000, description="completion/gold chars parsed at most")
    math_memory_mb: int = Field(2048, ge=256, le=1 << 20, description="address-space limit of a math worker")
    math_strict: bool = Field(
        False,
        description="math specs that leave `strict` unset pay only a marked answer (\\boxed{}, <answer>, ####, Answer:)",
    )

    reasoning_gym_enabled: bool = Field(
        False, description="serve the `reasoning_gym` verifier (needs reasoning-gym)"
    )
    reasoning_gym_workers: int = Field(2, ge=1, le=256, description="reasoning-gym scorer worker processes")
    reasoning_gym_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="per-item limit (entry regenerated and scored); the worker is killed past it",
    )
    reasoning_gym_max_chars: int = Field(
        32_768, ge=64, le=1_000_000, description="completion tail searched for the <answer> tag"
    )
    reasoning_gym_memory_mb: int = Field(
        4096, ge=512, le=1 << 20, description="address-space limit of a reasoning-gym worker"
    )

    code_enabled: bool = Field(True, description="serve the `code` verifier (needs bubblewrap)")
    code_concurrency: int = Field(2, ge=1, le=1024, description="sandboxes running at once")
    code_max_test_timeout_s: float = Field(
        20.0, gt=0, le=600, description="largest per-test timeout_s a spec may ask"
    )
    code_max_memory_mb: int = Field(4096, ge=64, le=1 << 20, description="largest memory_mb a spec may ask")
    code_item_timeout_s: float = Field(120.0, gt=0, le=3600, description="budget for all tests of one item")
    code_max_tests: int = Field(256, ge=1, le=10_000, description="most tests in one spec")
    code_output_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="stdout/stderr cap per run")
    code_tmpfs_mb: int = Field(64, ge=1, le=1 << 16, description="size of the sandbox's tmpfs work dir")
    code_max_procs: int = Field(32, ge=4, le=4096, description="RLIMIT_NPROC inside the sandbox")
    code_max_files: int = Field(64, ge=16, le=65536, description="RLIMIT_NOFILE inside the sandbox")
    code_uid_base: int = Field(
        2_000_000, ge=1000, le=4_000_000_000, description="host uid of sandbox slot 0 (slot i runs as base+i)"
    )
    code_python: str = Field("/usr/bin/python3", description="interpreter run inside the sandbox")
    bwrap: str = Field("bwrap", description="bubblewrap executable")
    allow_unsandboxed: bool = Field(
        False, description="DEVELOPMENT ONLY: run code without bubblewrap if missing"
    )

    env_python_concurrency: int = Field(
        2,
        ge=1,
        le=1024,
        description="`python` environment sandboxes at once (host uids after the code verifier's)",
    )
    env_python_timeout_s: float = Field(
        5.0, gt=0, le=600, description="wall-clock limit of one `python` tool call (CPU limit: ceil of it)"
    )
    env_python_memory_mb: int = Field(
        512, ge=64, le=1 << 20, description="address-space limit of a `python` tool call"
    )
    env_python_output_chars: int = Field(
        4096, ge=64, le=32_768, description="stdout and stderr characters (each) shown to the policy"
    )

    judge_base_url: str | None = Field(
        None, description="OpenAI-compatible base URL (…/v1); unset disables judge"
    )
    judge_model: str = Field("default", min_length=1, description="model name sent to the judge")
    judge_api_key: str | None = Field(None, description="bearer key for the judge endpoint")
    judge_concurrency: int = Field(8, ge=1, le=1024, description="judge calls in flight")
    judge_request_timeout_s: float = Field(30.0, gt=0, le=600, description="timeout of one judge HTTP call")
    judge_item_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="budget for one item, retries included"
    )
    judge_max_retries: int = Field(3, ge=0, le=20, description="retries on 429/5xx/transport errors")
    judge_backoff_s: float = Field(0.5, ge=0, le=60, description="first retry delay; doubles each retry")
    judge_max_tokens: int = Field(512, ge=1, le=65536, description="max_tokens of a judgment")
    judge_temperature: float = Field(0.0, ge=0, le=2, description="sampling temperature of the judge")
    judge_max_chars: int = Field(
        32_000, ge=256, le=1_000_000, description="completion chars shown to the judge"
    )

    nemo_gym: dict[str, NemoGymServer] = Field(
        default_factory=dict, description="NeMo Gym resources servers by name; none: `nemo_gym` disabled"
    )
    nemo_gym_concurrency: int = Field(16, ge=1, le=1024, description="NeMo Gym samples in flight")
    nemo_gym_request_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="timeout of one seed_session/verify/close call"
    )
    nemo_gym_item_timeout_s: float = Field(
        300.0, gt=0, le=7200, description="budget for one sample's calls, retries included"
    )
    nemo_gym_max_retries: int = Field(
        2, ge=0, le=20, description="retries of a sample on 5xx/transport errors"
    )
    nemo_gym_backoff_s: float = Field(0.5, ge=0, le=60, description="first retry delay; doubles each retry")

    @field_validator("nemo_gym")
    @classmethod
    def _server_names(cls, servers: dict[str, NemoGymServer]) -> dict[str, NemoGymServer]:
        bad = [name for name in servers if not re.fullmatch(NEMO_GYM_SERVER_NAME, name)]
        if bad:
            raise ValueError(f"NeMo Gym server names must match {NEMO_GYM_SERVER_NAME}, got {bad}")
        return servers

    @model_validator(mode="after")
    def _check(self) -> RewardSettings:
        refuse_placeholder_secret(self.judge_api_key, "judge_api_key", self.development)
        if self.judge_base_url is not None and not self.judge_base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge_base_url must be an http(s) URL, got {self.judge_base_url!r}")
        return self
