"""`LossConfig`: how trainer/losses.py forms the policy loss. Torch-free, so the trainer's
settings (and `asyncrl train --help`) load without importing torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LossKind = Literal["ppo", "gspo", "cispo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
ISCorrection = Literal["none", "tis", "icepop", "token_mask", "seq_tis", "seq_mask", "geo_mask"]


class LossConfig(BaseModel):
    """How the policy loss is formed. Defaults: PPO with clip-higher (DAPO), token mean, TIS."""

    model_config = ConfigDict(extra="forbid")

    kind: LossKind = Field("ppo", description="ppo (token ratio), gspo (sequence ratio) or cispo")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(0.28, ge=0.0, description="ratio clipped above at 1 + clip_high")
    agg: Aggregation = Field("token_mean", description="how token losses are reduced to a scalar")
    max_tokens: int | None = Field(None, gt=0, description="constant length for seq_mean_token_sum_norm")
    is_correction: ISCorrection = Field("tis", description="behaviour-policy correction of π_old / μ")
    is_low: float = Field(0.5, ge=0.0, description="lower bound for icepop and the mask corrections")
    is_high: float = Field(2.0, gt=0.0, description="upper bound (truncation or mask) for the correction")

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.agg == "seq_mean_token_sum_norm" and self.max_tokens is None:
            raise ValueError("agg=seq_mean_token_sum_norm needs max_tokens")
        if self.is_low > self.is_high:
            raise ValueError(f"is_low {self.is_low} > is_high {self.is_high}")
        return self
