"""Settings of `asyncrl tinker` (defaults → TOML `[tinker]` → env `ASYNCRL_TINKER_…` → CLI)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from asyncrl.services.runtime.config import ServiceSettings


class TinkerServiceSettings(ServiceSettings):
    """Tinker-compatible training API: the `tinker` SDK's calls on this stack's LoRA trainer and engines."""

    model_config = SettingsConfigDict(env_prefix="ASYNCRL_TINKER_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8004, ge=1, le=65535, description="port to bind")
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$", description="log level")
    redis_url: str = Field(description="Redis holding the command log, futures and checkpoints' index")
    namespace: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="key prefix in Redis (one service per namespace)",
    )
    base_models: dict[str, str] = Field(
        description="model name a client sends -> local HF directory, e.g. "
        '{"HuggingFaceTB/SmolLM2-135M-Instruct" = "runs/models/smollm2"}',
    )
    engine_urls: list[str] = Field(
        default_factory=list,
        description="engines serving the base models with LoRA (SGLang or `asyncrl engine --enable-lora`); "
        "empty: sampling is refused",
    )
    weights_root: str = Field(
        "runs/tinker/weights", description="sampler adapters (the engines read them here)"
    )
    checkpoints_root: str = Field("runs/tinker/checkpoints", description="save_weights checkpoints")
    max_models: int = Field(4, ge=1, le=1024, description="models held at once (429 past it)")
    max_lora_rank: int = Field(64, ge=1, le=4096, description="largest LoRA rank a model may ask")
    max_tokens_per_call: int = Field(
        32768,
        ge=16,
        description="tokens of one forward/forward_backward call, and of one sample's prompt, at most (400 above)",
    )
    max_samples_per_call: int = Field(
        256, ge=1, le=100_000, description="num_samples of one sample call at most (400 above)"
    )
    max_queued_commands: int = Field(
        64, ge=1, le=100_000, description="commands of one model waiting to run (429 past it)"
    )
    max_inflight_samples: int = Field(
        256, ge=1, le=100_000, description="sample calls running at once (429 past it)"
    )
    max_body_bytes: int = Field(64 << 20, ge=1024, description="largest accepted request body (413 above)")
    session_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7 * 86400,
        description="a session without a heartbeat this long is over (the SDK beats every 10 s): its models are "
        "released, as when the client closes it",
    )
    gap_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="how long a command waits for a missing earlier seq id before it fails",
    )
    result_ttl_s: int = Field(
        7 * 86400, ge=60, description="how long a finished call's result (and its seq id) is kept in Redis"
    )
    poll_hold_s: float = Field(
        10.0, gt=0, le=40, description="how long retrieve_future holds a poll open before answering try-again"
    )
    engine_timeout_s: float = Field(600.0, gt=0, description="limit of one engine call (load or generate)")
    max_loaded_adapters: int = Field(
        4, ge=1, le=1024, description="sampler adapters this service keeps loaded per engine (LRU unloads)"
    )
    max_sample_tokens: int = Field(4096, ge=1, description="largest max_tokens a sample may ask")
    unembed_without_adapter: bool = Field(
        True,
        description="accept the SDK's default train_unembed=True and train no lm_head adapter (engines serve "
        "adapters on the decoder's linear layers only; get_info and the README say so)",
    )
    mixed_precision: str = Field(
        "float32", pattern="^(float32|bfloat16)$", description="trainer compute dtype"
    )
    threads: int = Field(1, ge=1, le=256, description="torch threads of the training worker")
    api_token: str | None = Field(
        None,
        description="key clients send (X-API-Key, as the SDK does, or Authorization: Bearer); default "
        "ASYNCRL_API_TOKEN; the SDK wants it to start with `tml-`",
    )

    @model_validator(mode="after")
    def _checked(self) -> TinkerServiceSettings:
        if not self.base_models:
            raise ValueError("base_models is empty: name at least one model the service trains")
        for url in self.engine_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine_urls: {url!r} is not an http(s) URL")
        if self.engine_urls and len(self.base_models) > 1:
            # Nothing says which engine serves which base: a sample of one base (or of an adapter
            # trained on it) would go to an engine serving another and answer for it.
            raise ValueError(
                f"engine_urls serve one base model, and base_models names {len(self.base_models)}: "
                "run one service per base model to sample (or no engine_urls to train only)"
            )
        return self
