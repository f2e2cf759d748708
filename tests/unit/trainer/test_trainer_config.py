"""`asyncrl train` settings: TOML [trainer] + [trainer.loss], env, flags, and clear refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.services.runtime.config import load_settings
from asyncrl.trainer.config import TrainerSettings


def test_toml_env_and_flags_layer(tmp_path, monkeypatch):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[trainer]\nmodel_path = "/m"\nbatch_groups = 4\nlr = 0.5\n[trainer.loss]\nkind = "gspo"\nclip_high = 0.4\n'
    )
    monkeypatch.setenv("ASYNCRL_TRAINER_LR", "0.25")
    s = load_settings(
        TrainerSettings, ["--config", str(cfg), "--batch-groups", "6"], prog="t", section="trainer"
    )
    assert (s.model_path, s.batch_groups, s.lr) == ("/m", 6, 0.25)  # flag > env > file
    assert (s.loss.kind, s.loss.clip_high, s.loss.clip_low, s.loss.is_correction) == ("gspo", 0.4, 0.2, "tis")


@pytest.mark.parametrize("bad,match", [
    ({"publish": "distributed"}, "engine_urls"),
    ({"publish": "none", "publish_delta": True}, "publish_delta needs publish=disk or publish=distributed"),
    (
        {"publish": "distributed", "engine_urls": ["http://e"], "publish_delta": True, "delta_granularity": "block"},
        "needs delta_granularity=tensor: SGLang's /update_weights_from_distributed loads whole named tensors",
    ),
    ({"delta_granularity": "row"}, "delta_granularity"),
    ({"batch_groups": 0}, "greater than or equal to 1"),
    ({"overlong_max_len": 100, "overlong_cache_len": 200}, "overlong"),
    ({"loss": {"agg": "seq_mean_token_sum_norm"}}, "max_tokens"),
    ({"loss": {"kind": "dpo"}}, "kind"),
    ({"unknown_field": 1}, "unknown_field"),
    (
        {"lora": {"rank": 8}, "publish": "distributed", "engine_urls": ["http://e"]},
        r"\[trainer.lora\] with publish=distributed: SGLang takes an adapter by path",
    ),
    ({"lora": {"rank": 8}, "publish_delta": True}, r"\[trainer.lora\] with publish_delta"),
    ({"lora": {"rank": 8, "target_modules": ["q_proj", "lm_head"]}}, r"\['lm_head'\]: adapters go on the Linear layers inside"),
    ({"lora": {"rank": 8, "target_modules": ["model.embed_tokens"]}}, "embed_tokens"),
    ({"lora": {"rank": 8, "target_modules": []}}, "target_modules is empty"),
    ({"lora": {"rank": 8, "target_modules": "all"}}, "target_modules"),
    ({"lora": {"rank": -1}}, "rank"),
    ({"lora": {"rank": 8, "dropout": 1.0}}, "dropout"),
    ({"lora": {"rank": 8, "bias": "all"}}, "bias"),
])  # fmt: skip
def test_bad_settings_are_refused(bad, match):
    with pytest.raises(ValidationError, match=match):
        TrainerSettings(model_path="/m", **bad)


def test_auto_mixed_precision_picks_bf16_only_where_it_is_native():
    import torch

    from asyncrl.trainer.model import resolve_mixed_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mixed_precision("auto", cuda) == "bfloat16"
    assert resolve_mixed_precision("auto", cpu, {"avx2", "fma", "amx_bf16", "amx_tile"}) == "bfloat16"
    assert resolve_mixed_precision("auto", cpu, {"avx2", "avx512f", "avx512_bf16"}) == "bfloat16"
    # AVX512 without bf16 instructions, and AVX2 only: oneDNN would emulate bf16, so fp32
    assert resolve_mixed_precision("auto", cpu, {"avx2", "avx512f", "avx512bw"}) == "float32"
    assert resolve_mixed_precision("auto", cpu, {"avx2", "fma"}) == "float32"
    for explicit in ("float32", "bfloat16", "float16"):  # an explicit choice is never second-guessed
        assert resolve_mixed_precision(explicit, cpu, {"avx2"}) == explicit
    assert TrainerSettings(model_path="/m", mixed_precision="auto").mixed_precision == "auto"
    with pytest.raises(ValidationError, match="mixed_precision"):
        TrainerSettings(model_path="/m", mixed_precision="bf16")


def test_lora_table_and_env(tmp_path, monkeypatch):
    """`[trainer.lora]` with a rank turns LoRA on (rank 0, the default, is a full fine-tune); env
    sets one of its fields like any nested table's. Its defaults: α 16, no dropout, every Linear."""
    assert not TrainerSettings(model_path="/m").lora.enabled
    cfg = tmp_path / "run.toml"
    cfg.write_text('[trainer]\nmodel_path = "/m"\nkl_coef = 0.1\n[trainer.lora]\nrank = 16\nrslora = true\n')
    monkeypatch.setenv("ASYNCRL_TRAINER_LORA__ALPHA", "32")
    s = load_settings(TrainerSettings, ["--config", str(cfg)], prog="t", section="trainer")
    assert s.lora.enabled and (s.lora.rank, s.lora.alpha, s.lora.rslora) == (16, 32.0, True)
    assert (s.lora.dropout, s.lora.target_modules) == (0.0, "all-linear")
    narrow = TrainerSettings(
        model_path="/m", lora={"rank": 4, "target_modules": ["q_proj", "layers.3.mlp.down_proj"]}
    )
    assert narrow.lora.target_modules == ["q_proj", "layers.3.mlp.down_proj"]
