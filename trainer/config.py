"""Trainer settings: the `[trainer]` table of a run's TOML, `ASYNCRL_TRAINER_…` env, CLI flags.

The loss has its own table, `[trainer.loss]` (trainer/losses.py `LossConfig`); env
`ASYNCRL_TRAINER_LOSS__KIND=gspo` sets one of its fields. Weights & Biases tracking likewise:
`[trainer.wandb]` (`WandbSettings` below, used by trainer/tracking.py), env
`ASYNCRL_TRAINER_WANDB__ENABLED=true`. LoRA too: `[trainer.lora]` (`LoraSettings`, used by
trainer/lora.py), env `ASYNCRL_TRAINER_LORA__RANK=16`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic_settings import SettingsConfigDict

from asyncrl.services.runtime.config import ServiceSettings
from asyncrl.trainer.loss_config import LossConfig

WandbTag = Annotated[str, StringConstraints(min_length=1, max_length=64)]  # W&B refuses longer tags


class WandbSettings(BaseModel):
    """Weights & Biases tracking of rank 0's step metrics, run config and evaluations (optional:
    `pip install 'asyncrl[tracking]'`; wandb is imported only when enabled)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="log to W&B (needs the asyncrl[tracking] extra)")
    project: str = Field("asyncrl", min_length=1, max_length=128, description="W&B project")
    entity: str | None = Field(None, min_length=1, description="W&B entity (user or team; default: yours)")
    name: str | None = Field(
        None, min_length=1, max_length=128, description="W&B run name (default: the run id)"
    )
    group: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="W&B group (default: the run id: a restarted trainer's runs sit together)",
    )
    tags: list[WandbTag] = Field(default_factory=list, max_length=32, description="W&B run tags")
    mode: Literal["online", "offline", "disabled"] = Field(
        "offline", description="offline: write <dir>/wandb/offline-run-* for `wandb sync`, no network needed"
    )
    dir: str | None = Field(
        None, min_length=1, description="W&B writes under <dir>/wandb (default: output_dir)"
    )


LORA_ALL_LINEAR = "all-linear"  # peft's shorthand: every Linear layer but the LM head
# Modules outside the decoder layers that a target list may not name: the LM head's log-probs are
# computed from its weight (trainer/logprobs.py), and an embedding adapter is not a Linear one
# (SGLang loads those only with an added-tokens file).
LORA_REFUSED_TARGETS = ("lm_head", "embed_tokens")
LoraTarget = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.]+$")]


class LoraSettings(BaseModel):
    """LoRA adapters on the policy (`[trainer.lora]`, trainer/lora.py): with `rank` > 0 only the
    adapters train, the base model stays frozen, and each version publishes only the adapter."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(0, ge=0, le=1024, description="r of every adapter (0: no LoRA, the whole model trains)")
    alpha: float = Field(
        16.0, gt=0.0, description="LoRA α: the adapter's output is scaled by α/r (α/√r with rslora)"
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the adapters' input in every trainer forward (the π_old recompute too): "
        "keep 0 for RL, where π_old must be the policy's deterministic log-probs",
    )
    target_modules: Literal["all-linear"] | list[LoraTarget] = Field(
        LORA_ALL_LINEAR,
        description="Linear layers of the decoder layers to adapt: names or name suffixes "
        "(q_proj, v_proj, ...), or all-linear (every Linear but the LM head)",
    )
    rslora: bool = Field(False, description="rank-stabilised scaling α/√r instead of α/r")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _check(self) -> LoraSettings:
        if isinstance(self.target_modules, list):
            if not self.target_modules:
                raise ValueError("lora target_modules is empty: name modules, or use all-linear")
            refused = [t for t in self.target_modules if t.split(".")[-1] in LORA_REFUSED_TARGETS]
            if refused:
                raise ValueError(
                    f"lora target_modules {refused}: adapters go on the Linear layers inside the decoder "
                    "layers only; the LM head's log-probs come from its weight directly (trainer/logprobs.py) "
                    "and an embedding adapter needs added-token files SGLang reads apart"
                )
        return self


class TrainerSettings(ServiceSettings):
    """FSDP2 trainer: takes scored groups from the Redis buffer, trains, publishes weights."""

    model_config = SettingsConfigDict(
        env_prefix="ASYNCRL_TRAINER_", extra="forbid", env_nested_delimiter="__"
    )

    # where things are
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="replay buffer Redis URL")
    run: str = Field("default", min_length=1, description="run id (buffer namespace)")
    consumer: str = Field("trainer-0", min_length=1, description="stable consumer name across restarts")
    model_path: str = Field(
        ..., min_length=1, description="local HF model directory (config.json [+ safetensors])"
    )
    random_init: bool = Field(
        False, description="initialise from config.json with `seed` instead of loading weights"
    )
    output_dir: str = Field("runs/trainer", description="checkpoints/, weights/ and the audit log go here")

    # the RL step
    batch_groups: int = Field(8, ge=1, description="B: groups per optimizer step")
    max_staleness: int = Field(1, ge=0, description="η: train on a group only if v − min_version ≤ η")
    staleness_policy: Literal["drop", "withhold"] = Field(
        "drop", description="what happens to too-stale groups"
    )
    prefill_groups: int = Field(
        0,
        ge=0,
        description=(
            "a fresh run's first step waits until the buffer holds this many groups: with η·B, every "
            "batch is ~η versions old from the start, as when generation outruns the trainer "
            "(benchmarks/mismatch_study.py); at most (η + 1)·B, what admission lets wait"
        ),
    )
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = Field(
        "grpo", description="advantage estimator"
    )
    bypass: bool = Field(False, description="skip the old-logprob recompute: π_old := μ (engine logprobs)")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature the engine used")
    loss: LossConfig = Field(default_factory=LossConfig, description="policy loss ([trainer.loss])")
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the KL penalty to the frozen initial model")
    kl_kind: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus weight")
    dynamic_sampling: bool = Field(
        False, description="DAPO: skip (discard, counted) zero-reward-spread groups"
    )
    overlong_max_len: int | None = Field(None, gt=0, description="DAPO overlong shaping: hard length limit")
    overlong_cache_len: int = Field(0, ge=0, description="DAPO overlong shaping: soft punishment window")
    overlong_factor: float = Field(1.0, ge=0.0, description="DAPO overlong shaping: maximum penalty")

    # optimisation
    lr: float = Field(1e-6, ge=0.0, description="AdamW peak learning rate (trainer/schedule.py shapes it)")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="after warmup: constant or cosine"
    )
    lr_warmup_steps: int = Field(0, ge=0, description="versions of linear warmup: update n ≤ W gets lr·n/W")
    lr_decay_steps: int | None = Field(
        None, gt=0, description="cosine: update reaching lr·lr_min_ratio (max_steps)"
    )
    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine: final lr as a fraction of lr")
    weight_decay: float = Field(
        0.0, ge=0.0, description="AdamW decoupled weight decay, biases and norms included"
    )
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW β1")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW β2")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW ε")
    grad_clip: float = Field(1.0, gt=0.0, description="max global gradient norm")
    minibatches: int = Field(1, ge=1, description="optimizer steps per batch (PPO minibatches)")
    micro_batch_size: int = Field(8, ge=1, description="sequences per forward on each rank")
    max_tokens_per_micro_batch: int = Field(
        0,
        ge=0,
        description="pack samples into micro-batches of at most this many tokens, no padding (0: padded "
        "micro-batches of micro_batch_size); attention never crosses samples",
    )
    share_prompts: bool = Field(
        False,
        description="one row per prompt in each micro-batch: the prompt once, each completion after it under a "
        "tree-shaped attention mask (trainer/batch.py collate_shared); same logprobs and gradients as padded rows, the "
        "prompt's forward and backward done once per group. Padded micro-batches only (not with packing)",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="tokens per chunk of LM-head logits for log-probs and entropy, recomputed in backward "
        "(0: all logits at once)",
    )
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer in backward")
    max_steps: int = Field(0, ge=0, description="stop after this version (0: run until stopped)")
    seed: int = Field(0, description="seed for random_init and the RNG state")

    # parallelism
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cuda+nccl when available, else cpu+gloo"
    )
    mixed_precision: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        description="FSDP2 param dtype; auto: bfloat16 on CUDA or a CPU with native bf16 (AMX, AVX512-BF16). "
        "float16 runs without loss scaling: gradients under fp16's range (~6e-8) are lost, so prefer bfloat16",
    )
    core_share: str | None = Field(
        None,
        description="CPU, one rank: a file shared with the engine on this machine (services/runtime/cores.py); "
        "the trainer computes on core_share_threads while the engine has nothing to generate, on OMP_NUM_THREADS "
        "while it generates",
    )
    core_share_threads: int = Field(
        0,
        ge=0,
        le=256,
        description="core_share: threads while the engine idles (0: every core of the affinity mask)",
    )
    dist_timeout_s: float = Field(
        1800.0, gt=0, description="collective timeout (ranks wait while rank 0 waits for data)"
    )

    # data
    block_ms: int = Field(1000, ge=1, description="how long one buffer read blocks")
    heartbeat_s: float = Field(
        30.0, gt=0, description="ranks exchange a heartbeat this often while waiting for data"
    )

    # weights
    publish: Literal["disk", "distributed", "none"] = Field(
        "disk", description="how new weights reach engines"
    )
    publish_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="dtype of published weights"
    )
    publish_background: bool = Field(
        True,
        description="disk: write and announce each version in a background thread while the next step trains",
    )
    keep_weights: int = Field(3, ge=1, description="weight directories kept on disk")
    publish_delta: bool = Field(
        False,
        description="disk or distributed: publish only what changed since the previous version, with "
        "a full anchor every delta_anchor_every versions (disk: reference engines only; distributed: "
        "tensor granularity only)",
    )
    delta_anchor_every: int = Field(10, ge=1, description="publish_delta: a full version every N versions")
    delta_granularity: Literal["tensor", "block"] = Field(
        "tensor", description="publish_delta: ship changed whole tensors, or changed blocks of them"
    )
    delta_block_elems: int = Field(
        65536, ge=1, description="publish_delta with blocks: elements per block of a flattened tensor"
    )
    engine_urls: list[str] = Field(default_factory=list, description="engines joining the broadcast group")
    broadcast_master_addr: str = Field(
        "127.0.0.1", description="address engines reach the trainer's rank 0 on"
    )
    broadcast_port: int = Field(
        0, ge=0, le=65535, description="TCPStore port of the broadcast group (0: pick one)"
    )
    broadcast_backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="broadcast group backend")
    bucket_mb: int = Field(512, ge=1, description="broadcast bucket size cap in MiB")

    # checkpoints
    checkpoint_every: int = Field(
        10, ge=1, description="checkpoint (and ack the groups it covers) every k steps"
    )
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    audit_log: bool = Field(
        True, description="append the group ids of every step to output_dir/trained.jsonl"
    )

    # serving
    metrics_host: str = Field("127.0.0.1", description="address of the /metrics and /healthz server")
    metrics_port: int = Field(0, ge=0, le=65535, description="port of /metrics and /healthz (0: disabled)")
    log_level: str = Field("info", description="log level")
    wandb: WandbSettings = Field(default_factory=WandbSettings, description="W&B tracking ([trainer.wandb])")
    lora: LoraSettings = Field(
        default_factory=LoraSettings, description="LoRA adapters instead of a full fine-tune ([trainer.lora])"
    )

    @model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        if self.publish == "distributed" and not self.engine_urls:
            raise ValueError("publish=distributed needs engine_urls")
        if self.publish_delta and self.publish == "none":
            raise ValueError("publish_delta needs publish=disk or publish=distributed")
        if self.publish_delta and self.publish == "distributed" and self.delta_granularity != "tensor":
            raise ValueError(
                "publish_delta over publish=distributed needs delta_granularity=tensor: SGLang's "
                "/update_weights_from_distributed loads whole named tensors, a changed block has no name there"
            )
        if self.lora.enabled and self.publish == "distributed":
            raise ValueError(
                "[trainer.lora] with publish=distributed: SGLang takes an adapter by path "
                "(/load_lora_adapter) or as tensors serialized in its own process "
                "(/load_lora_adapter_from_tensors, one host); its broadcast, /update_weights_from_distributed, "
                "updates base weights only. Publish adapters with publish=disk (one adapter is a few MB)"
            )
        if self.lora.enabled and self.publish_delta:
            raise ValueError(
                "[trainer.lora] with publish_delta: every element of every adapter changes each step, so a "
                "delta would be the whole adapter, and /load_lora_adapter has no delta form: unset publish_delta"
            )
        if self.share_prompts and self.max_tokens_per_micro_batch > 0:
            raise ValueError(
                "share_prompts lays a prompt's samples out as one row with a tree mask, packing lays "
                "samples back to back: set one of share_prompts, max_tokens_per_micro_batch"
            )
        if self.prefill_groups > (self.max_staleness + 1) * self.batch_groups:
            raise ValueError(
                f"prefill_groups {self.prefill_groups} > (max_staleness + 1)·batch_groups = "
                f"{(self.max_staleness + 1) * self.batch_groups}: admission never lets that many wait"
            )
        if self.heartbeat_s * 2 > self.dist_timeout_s:
            raise ValueError("heartbeat_s must be well under dist_timeout_s")
        if self.overlong_max_len is not None and not 0 < self.overlong_cache_len <= self.overlong_max_len:
            raise ValueError("overlong shaping needs 0 < overlong_cache_len <= overlong_max_len")
        if self.lr_schedule == "cosine" and (self.lr_decay_steps or self.max_steps) <= self.lr_warmup_steps:
            raise ValueError("lr_schedule=cosine needs lr_decay_steps (or max_steps) > lr_warmup_steps")
        if self.lr_schedule == "constant" and (self.lr_decay_steps is not None or self.lr_min_ratio != 0.0):
            raise ValueError("lr_decay_steps and lr_min_ratio apply to lr_schedule=cosine only")
        return self
