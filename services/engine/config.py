"""Settings of the reference engine (`asyncrl engine`): defaults → TOML `[engine]` → env
`ASYNCRL_ENGINE_…` → CLI flags. Refused at start: a weak API token, and a non-loopback host
without one (anyone reaching it could load weights or stall generation)."""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from asyncrl.services.runtime.auth import API_TOKEN_ENV, ENGINE_TOKEN_ENV, TOKEN_HINT, check_token
from asyncrl.services.runtime.config import ServiceSettings

# The modules an adapter may target here: the linear layers of a Llama/Qwen2-style decoder layer
# (SGLang 0.5.23 `utils/common.py` SUPPORTED_LORA_TARGET_MODULES, less the MLA, indexer, MoE,
# embedding and lm_head names this engine's models do not have or it does not adapt).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGET_ALL = "all"
# SGLang stacks q/k/v and gate/up into one weight each and checks targets by the stacked name
# (`lora/utils.py` get_normalized_target_modules): allowing q_proj allows k_proj and v_proj.
LORA_STACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip
LORA_TARGET_NAMES = (*LORA_TARGET_MODULES, "qkv_proj", "gate_up_proj")  # what lora_target_modules takes


class EngineSettings(ServiceSettings):
    """Reference inference engine speaking SGLang's native HTTP API (CPU or one GPU)."""

    model_config = SettingsConfigDict(env_prefix="ASYNCRL_ENGINE_", extra="forbid")

    model: str = Field(description="HF model directory (config.json, *.safetensors, tokenizer)")
    host: str = Field(default="127.0.0.1", description="bind address")
    port: int = Field(default=30000, gt=0, lt=65536, description="bind port (SGLang's default)")
    max_running_requests: int = Field(default=64, gt=0, le=4096, description="requests decoded together")
    max_prefill_tokens: int = Field(default=4096, gt=0, description="prompt tokens admitted per prefill step")
    num_continuous_decode_steps: int = Field(
        default=1,
        gt=0,
        le=64,
        description="decode steps between two admissions while requests run (SGLang's name)",
    )
    max_new_tokens_cap: int = Field(
        default=4096, gt=0, description="largest max_new_tokens a request may ask"
    )
    context_length: int | None = Field(
        default=None,
        gt=1,
        description="prompt + completion limit (default: the model's max_position_embeddings)",
    )
    max_queued_requests: int = Field(default=4096, gt=0, description="waiting requests beyond this get 503")
    max_batch_size: int = Field(
        default=4096, gt=0, description="prompts in one /generate body at most (400 above)"
    )
    max_body_bytes: int = Field(
        default=64 << 20, ge=1024, description="largest accepted request body (413 above)"
    )
    seed: int = Field(default=0, ge=0, description="seeds requests that bring no sampling_seed")
    logit_noise_std: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,
        description="FOR STUDIES ONLY (benchmarks/mismatch_study.py): Gaussian noise of this std added "
        "to every sampling logit, a controlled engine/trainer mismatch (the reported logprobs are the "
        "perturbed distribution's, as with real numeric mismatch); 0: off",
    )
    device: str = Field(default="auto", description="'cpu', 'cuda', 'cuda:N' or 'auto'")
    dtype: str = Field(default="auto", description="'float32', 'bfloat16', 'float16' or 'auto' (fp32 on CPU)")
    num_threads: int = Field(default=1, gt=0, le=256, description="torch intra-op threads on CPU")
    core_share: str | None = Field(
        default=None,
        description="CPU: a file shared with the trainer on this machine (services/runtime/cores.py); the "
        "engine uses core_share_threads while the trainer waits for rollouts, num_threads while it trains",
    )
    core_share_threads: int = Field(
        default=0,
        ge=0,
        le=256,
        description="core_share: threads while the trainer waits (0: every core of the affinity mask)",
    )
    served_model_name: str | None = Field(default=None, description="model name reported to OpenAI clients")
    weight_version: str = Field(default="0", description="initial weight_version reported in meta_info")
    log_level: str = Field(default="info", description="debug, info, warning, error")
    api_token: SecretStr | None = Field(
        default=None,
        description=f"bearer token of the control endpoints, and of generation beyond loopback (env "
        f"{ENGINE_TOKEN_ENV}, else {API_TOKEN_ENV}); unset: control endpoints refused, loopback only",
    )
    weights_root: str | None = Field(
        default=None,
        description="update_weights_from_disk loads only directories inside this one (absolute "
        "model_path, symlinks and '..' resolved); unset: disk updates refused",
    )
    weight_update_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="bound on one update_weights_from_disk / _from_distributed call, its wait for "
        "its turn included (updates run one at a time)",
    )
    weight_group_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="bound on init_weights_update_group (its turn + the rendezvous) and on each "
        "broadcast of the group",
    )
    shutdown_timeout_s: float = Field(
        default=5.0, ge=0, le=600, description="on SIGTERM, how long requests in flight may still finish"
    )
    # LoRA, with SGLang 0.5.23's flags (`sglang/srt/arg_groups/fields/lora.py`): names and defaults
    # as there, and as there an engine that starts with no adapters must be told their bounds.
    enable_lora: bool = Field(
        default=False,
        description="serve LoRA adapters: /load_lora_adapter, /unload_lora_adapter, /generate's lora_path",
    )
    max_loras_per_batch: int = Field(
        default=8,
        gt=0,
        le=1024,
        description="distinct adapters in one running batch, the base model counted as one (SGLang's)",
    )
    max_lora_rank: int | None = Field(
        default=None, gt=0, le=4096, description="largest adapter rank loaded (required with enable_lora)"
    )
    lora_target_modules: str | None = Field(
        default=None,
        description="the modules adapters may target (required with enable_lora), comma-separated: of "
        f"{', '.join(LORA_TARGET_NAMES)}, or 'all'; q/k/v_proj count as one (qkv_proj) and gate/up_proj "
        "as one (gate_up_proj), as in SGLang",
    )
    max_loaded_loras: int | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="adapters held at once (at least max_loras_per_batch); a load past it unloads the "
        "least recently used one that no request uses and is not pinned. Unset: no bound (SGLang's default)",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineSettings:
        if self.enable_lora:
            self._check_lora()
        if self.max_batch_size > self.max_queued_requests:
            raise ValueError("max_batch_size exceeds max_queued_requests: such a batch could never be queued")
        if self.api_token is None and os.environ.get(API_TOKEN_ENV):
            self.api_token = SecretStr(os.environ[API_TOKEN_ENV])
        if self.api_token is not None:
            check_token(self.api_token.get_secret_value(), f"the engine's API token ({ENGINE_TOKEN_ENV})")
        elif not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without an API token: anyone reaching it could "
                f"load weights or stall generation. Set {ENGINE_TOKEN_ENV} (or {API_TOKEN_ENV}) to a "
                f"random token ({TOKEN_HINT}), or listen on 127.0.0.1"
            )
        return self

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _target_list(cls, value: Any) -> str | None:
        """A list (TOML), or names separated by commas or spaces (env, CLI) → "a,b"."""
        if value is None:
            return None
        names = value.replace(",", " ").split() if isinstance(value, str) else [str(v) for v in value]
        return ",".join(dict.fromkeys(names)) or None

    def _check_lora(self) -> None:
        """SGLang's start-up checks of its LoRA flags (`arg_groups/lora_hook.py`)."""
        if self.max_lora_rank is None or not self.lora_target_modules:
            raise ValueError(
                "enable_lora needs max_lora_rank and lora_target_modules: the engine starts with no "
                "adapter to infer them from (SGLang's rule without --lora-paths)"
            )
        names = self.lora_target_modules.split(",")
        unknown = sorted(set(names) - {*LORA_TARGET_NAMES, LORA_TARGET_ALL})
        if unknown:
            raise ValueError(f"lora_target_modules {unknown}: not one of {LORA_TARGET_NAMES} or 'all'")
        if LORA_TARGET_ALL in names and len(names) > 1:
            raise ValueError("'all' in lora_target_modules must be the only module given")
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be at least max_loras_per_batch "
                f"({self.max_loras_per_batch})"
            )

    @property
    def lora_targets(self) -> frozenset[str]:
        """The stacked names (qkv_proj, gate_up_proj, o_proj, down_proj) adapters may target."""
        names = (self.lora_target_modules or "").split(",")
        if LORA_TARGET_ALL in names:
            names = list(LORA_TARGET_MODULES)
        return frozenset(LORA_STACKED.get(n, n) for n in names if n)

    @property
    def token(self) -> str | None:
        return self.api_token.get_secret_value() if self.api_token is not None else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: may resolve to anything
        return False
