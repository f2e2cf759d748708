"""Settings of the reference engine (`asyncrl engine`): defaults → TOML `[engine]` → env
`ASYNCRL_ENGINE_…` → CLI flags."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


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
    device: str = Field(default="auto", description="'cpu', 'cuda', 'cuda:N' or 'auto'")
    dtype: str = Field(default="auto", description="'float32', 'bfloat16', 'float16' or 'auto' (fp32 on CPU)")
    num_threads: int = Field(default=1, gt=0, le=256, description="torch intra-op threads on CPU")
    served_model_name: str | None = Field(default=None, description="model name reported to OpenAI clients")
    weight_version: str = Field(default="0", description="initial weight_version reported in meta_info")
    log_level: str = Field(default="info", description="debug, info, warning, error")

    @model_validator(mode="after")
    def _check(self) -> EngineSettings:
        if self.max_batch_size > self.max_queued_requests:
            raise ValueError("max_batch_size exceeds max_queued_requests: such a batch could never be queued")
        return self
