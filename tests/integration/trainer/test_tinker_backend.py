"""`TinkerTrainer` (trainer/tinker) as the Tinker service drives it, on a tiny Qwen2 in a gloo
world of one: supervised steps lower the loss; two models on one base are isolated; a
checkpoint restores adapters and AdamW state exactly; sampler weights are a PEFT directory that
reproduces the backend's log-probs; bad requests are refused with typed errors and change
nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.trainer.tinker import (
    CapacityError,
    Datum,
    InvalidInputError,
    TinkerSettings,
    TinkerTrainer,
    UnknownModelError,
    UnsupportedError,
)

torch.set_num_threads(1)
LORA = {"rank": 4, "seed": 7, "train_unembed": False}
ADAM = {"learning_rate": 0.02, "weight_decay": 0.01, "grad_clip_norm": 5.0}
# The tiny Qwen2's adapters on every Linear at r = 4: 4 · 2048 per layer × 2 layers (test_lora.py).
ADAPTER_PARAMS = 4 * 2048 * 2
VOCAB = 54  # the tiny tokenizer: 3 special tokens, 26 letters, 10 digits, 15 symbols and the newline


@pytest.fixture
def trainer(one_rank, tiny, tmp_path):
    return TinkerTrainer(
        TinkerSettings(
            base_models={"tiny": str(tiny)},
            weights_root=str(tmp_path / "weights"),
            checkpoints_root=str(tmp_path / "checkpoints"),
            max_models=3,
            max_lora_rank=8,
            max_tokens_per_call=200,
        )
    )


def sft_set(seed: int = 0) -> list[Datum]:
    """Four fixed sentences of the tiny character vocabulary, all positions weighted."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(4):
        seq = rng.integers(3, 40, 12)
        out.append(
            Datum(
                seq[:-1].tolist(),
                {"target_tokens": seq[1:].astype(np.int64), "weights": np.ones(11, np.float32)},
            )
        )
    return out


def step(t: TinkerTrainer, model_id: str, data, adam=ADAM) -> float:
    loss = t.forward_backward(model_id, data, "cross_entropy", None).metrics["loss:sum"]
    t.optim_step(model_id, adam)
    return loss


def adapter_values(t, model_id) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model(model_id).module.named_parameters() if p.requires_grad}


def adam_state(t, model_id) -> list[dict[str, torch.Tensor]]:
    opt = t.model(model_id).optimizer
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def assert_same(a: dict | list, b: dict | list) -> None:
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    assert len(a) == len(b)
    for x, y in pairs:
        if isinstance(x, dict):
            assert_same(x, y)
        else:
            assert torch.equal(x, y)


def patterns() -> list[Datum]:
    """Four sequences that repeat a 3-token cycle: learnable in a few steps."""
    out = []
    for start in (3, 10, 20, 30):
        seq = np.array([start + i % 3 for i in range(12)])
        out.append(
            Datum(
                seq[:-1].tolist(),
                {"target_tokens": seq[1:].astype(np.int64), "weights": np.ones(11, np.float32)},
            )
        )
    return out


def test_cross_entropy_steps_lower_the_loss(trainer):
    info = trainer.create_model("a", "tiny", LORA)
    assert info["lora_rank"] == 4 and info["is_lora"] and info["model_name"] == "tiny"
    data = patterns()
    losses = [step(trainer, "a", data, {"learning_rate": 0.003}) for _ in range(6)]
    final = trainer.forward("a", data, "cross_entropy", None).metrics["loss:sum"]
    assert losses[0] == pytest.approx(44 * np.log(VOCAB), rel=0.02)  # ~uniform over the vocabulary at first
    assert all(b < a for a, b in zip(losses, losses[1:])) and final < 0.75 * losses[0], (losses, final)
    assert trainer.metrics()["a"]["step"] == 6 and trainer.metrics()["a"]["forward_backward_tokens"] == 6 * 44


def test_gradients_accumulate_across_calls_until_optim_step(trainer):
    trainer.create_model("a", "tiny", LORA)
    step(trainer, "a", sft_set(seed=4))  # B off 0: every adapter has a gradient
    first, second = sft_set(seed=5), sft_set(seed=6)
    trainer.forward_backward("a", first + second, "cross_entropy", None)
    together = {n: p.grad.clone() for n, p in trainer.model("a").module.named_parameters() if p.requires_grad}
    trainer.model("a").optimizer.zero_grad(set_to_none=True)
    trainer.forward_backward("a", first, "cross_entropy", None)
    trainer.forward_backward("a", second, "cross_entropy", None)
    for name, p in trainer.model("a").module.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(
                p.grad, together[name], rtol=1e-5, atol=1e-6 * float(together[name].abs().max())
            )
    trainer.optim_step("a", ADAM)
    assert all(p.grad is None for p in trainer.model("a").module.parameters())  # the step clears them


def test_two_models_on_one_base_are_isolated(trainer):
    trainer.create_model("a", "tiny", LORA)
    trainer.create_model("b", "tiny", {**LORA, "seed": 8})
    a, b = trainer.model("a").module, trainer.model("b").module
    # one base in memory: b's frozen weights are a's tensors
    shared = [
        (pa, pb)
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters())
        if not pa.requires_grad
    ]
    assert shared and all(pa.data_ptr() == pb.data_ptr() for pa, pb in shared)
    probe = sft_set(seed=1)
    step(trainer, "b", sft_set(seed=2))  # b has optimizer state of its own
    b_adapters, b_state = adapter_values(trainer, "b"), adam_state(trainer, "b")
    b_out = trainer.forward("b", probe, "cross_entropy", None)
    a_before = adapter_values(trainer, "a")

    for _ in range(2):
        trainer.forward_backward("a", sft_set(), "cross_entropy", None)
        assert all(p.grad is None for p in b.parameters())  # a's backward leaves b without gradients
        trainer.optim_step("a", ADAM)

    assert not all(
        torch.equal(x, y) for x, y in zip(a_before.values(), adapter_values(trainer, "a").values())
    )
    assert_same(adapter_values(trainer, "b"), b_adapters)
    assert_same(adam_state(trainer, "b"), b_state)
    again = trainer.forward("b", probe, "cross_entropy", None)
    assert again.metrics == b_out.metrics
    assert all(np.array_equal(x["logprobs"], y["logprobs"]) for x, y in zip(again.outputs, b_out.outputs))
    assert trainer.metrics()["b"]["step"] == 1 and trainer.metrics()["a"]["step"] == 2


def test_save_and_load_state_restore_adapters_and_optimizer_exactly(trainer):
    trainer.create_model("a", "tiny", LORA)
    data, later = sft_set(), sft_set(seed=3)
    step(trainer, "a", data)
    step(trainer, "a", data)
    path = trainer.save_state("a", "after-2", optimizer=True, extra={"seq_id": 7, "note": "x"})
    assert path == "a/after-2"
    saved = adapter_values(trainer, "a")
    step(trainer, "a", later)
    uninterrupted, uninterrupted_state = adapter_values(trainer, "a"), adam_state(trainer, "a")
    trainer.forward_backward("a", data, "cross_entropy", None)  # pending gradients: a load drops them

    assert trainer.load_state("a", path, optimizer=True) == {"seq_id": 7, "note": "x"}
    assert all(p.grad is None for p in trainer.model("a").module.parameters())
    assert_same(adapter_values(trainer, "a"), saved)
    step(trainer, "a", later)
    assert_same(adapter_values(trainer, "a"), uninterrupted)
    assert_same(adam_state(trainer, "a"), uninterrupted_state)
    assert trainer.info("a")["step"] == 3

    # into another model (a fresh start from the checkpoint): the same next step
    trainer.create_model("c", "tiny", {**LORA, "seed": 99})
    assert trainer.checkpoint_info(path)["lora"]["rank"] == 4
    trainer.load_state("c", path, optimizer=True)
    step(trainer, "c", later)
    assert_same(adapter_values(trainer, "c"), uninterrupted)

    # weights only: the optimizer starts fresh, so the next step differs
    trainer.load_state("c", path, optimizer=False)
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in adam_state(trainer, "c"))
    step(trainer, "c", later)
    assert not all(
        torch.equal(x, y) for x, y in zip(adapter_values(trainer, "c").values(), uninterrupted.values())
    )


def test_save_for_sampler_writes_an_immutable_peft_directory_per_version(trainer, tiny):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    trainer.create_model("a", "tiny", LORA)
    step(trainer, "a", sft_set())
    first = trainer.save_for_sampler("a", "s1")
    assert (first["version"], first["adapter_name"], first["lora_rank"]) == (1, "a-1", 4)
    files = sorted(p.name for p in Path(first["adapter_path"]).iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    with safe_open(f"{first['adapter_path']}/adapter_model.safetensors", "pt") as f:
        names = list(f.keys())
        assert all(".lora_A." in n or ".lora_B." in n for n in names)
        assert sum(f.get_tensor(n).numel() for n in names) == ADAPTER_PARAMS  # the adapter's bytes only
    assert first["bytes"] == ADAPTER_PARAMS * 4
    config = json.loads((Path(first["adapter_path"]) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 32.0)

    probe = sft_set(seed=5)
    mine = trainer.forward("a", probe, "cross_entropy", None).outputs
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), first["adapter_path"]).eval()
    with torch.no_grad():
        for d, out in zip(probe, mine):
            logp = torch.log_softmax(peft(input_ids=torch.tensor([d.tokens])).logits[0], -1)
            theirs = logp.gather(-1, torch.from_numpy(d.inputs["target_tokens"])[:, None])[:, 0]
            np.testing.assert_allclose(out["logprobs"], theirs.numpy(), atol=1e-5)

    weights = Path(first["adapter_path"]) / "adapter_model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    step(trainer, "a", sft_set())
    second = trainer.save_for_sampler("a", "s2")
    assert second["version"] == 2 and second["adapter_path"] != first["adapter_path"]
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest  # version 1 is never rewritten
    trainer.unload("a")
    trainer.create_model("a", "tiny", LORA)  # the same id again: its versions continue, never overwrite
    assert trainer.save_for_sampler("a", "s3")["version"] == 3


def test_bad_requests_are_refused_with_typed_errors_and_change_nothing(trainer):
    with pytest.raises(UnsupportedError, match="rank 9 is above this service's max_lora_rank 8"):
        trainer.create_model("a", "tiny", {**LORA, "rank": 9})
    with pytest.raises(UnsupportedError, match="full fine-tuning"):
        trainer.create_model("a", "tiny", None)
    with pytest.raises(UnsupportedError, match="train_unembed=True"):
        trainer.create_model("a", "tiny", {"rank": 4})  # the SDK's default asks for an lm_head adapter
    with pytest.raises(UnsupportedError, match="base model 'other' is not served here"):
        trainer.create_model("a", "other", LORA)
    with pytest.raises(InvalidInputError, match=r"lora_config keys \['alpha'\] are unknown"):
        trainer.create_model("a", "tiny", {**LORA, "alpha": 3})
    with pytest.raises(InvalidInputError, match="model_id '../x'"):
        trainer.create_model("../x", "tiny", LORA)
    for i in range(3):
        trainer.create_model(f"m{i}", "tiny", LORA)
    with pytest.raises(CapacityError, match="3 models are loaded"):
        trainer.create_model("m3", "tiny", LORA)
    with pytest.raises(InvalidInputError, match="exists already"):
        trainer.create_model("m0", "tiny", LORA)
    with pytest.raises(UnknownModelError, match="no model 'zz'"):
        trainer.forward_backward("zz", sft_set(), "cross_entropy", None)

    good = sft_set()
    bad_length = Datum(
        good[0].tokens,
        {"target_tokens": good[0].inputs["target_tokens"][:5], "weights": np.ones(5, np.float32)},
    )
    out_of_vocab = Datum(
        [3, 4, VOCAB], {"target_tokens": np.array([4, 5, 6]), "weights": np.ones(3, np.float32)}
    )
    cases = [
        (
            [*good, bad_length],
            "cross_entropy",
            None,
            InvalidInputError,
            "datum 4: loss_fn_inputs\\['target_tokens'\\] has shape \\[5\\]",
        ),
        (
            [*good, out_of_vocab],
            "cross_entropy",
            None,
            InvalidInputError,
            f"token id {VOCAB} is outside the model's vocabulary \\[0, {VOCAB}\\)",
        ),
        (good, "gspo", None, UnsupportedError, "'gspo' is a Tinker loss this backend does not compute"),
        (good, "ppo", None, InvalidInputError, "ppo takes loss_fn_inputs .*unknown: \\['weights'\\]"),
        (good, "cross_entropy", {"beta": 1.0}, InvalidInputError, "are not read by cross_entropy"),
        (
            good * 5,
            "cross_entropy",
            None,
            CapacityError,
            "220 tokens in one call; this service takes at most 200",
        ),
    ]
    for data, loss_fn, config, error, message in cases:
        with pytest.raises(error, match=message):
            trainer.forward_backward("m0", data, loss_fn, config)
    assert all(p.grad is None for p in trainer.model("m0").module.parameters())  # nothing ran
    with pytest.raises(InvalidInputError, match="adam_params beta1 must be below 1"):
        trainer.optim_step("m0", {"beta1": 1.0})
    with pytest.raises(InvalidInputError, match=r"adam_params \['momentum'\] are unknown"):
        trainer.optim_step("m0", {"momentum": 0.9})
    with pytest.raises(UnsupportedError, match="optimizer 'dimuon'"):
        trainer.optim_step("m0", {"type": "dimuon", "learning_rate": 0.1})
    with pytest.raises(UnknownModelError, match="no checkpoint 'm0/none'"):
        trainer.load_state("m0", "m0/none", optimizer=True)
    with pytest.raises(InvalidInputError, match="expected '<model_id>/<name>'"):
        trainer.load_state("m0", "../../etc", optimizer=True)
    assert trainer.info("m0")["step"] == 0


def test_a_named_sampler_version_outlives_the_pruning_of_later_saves(one_rank, tiny, tmp_path):
    trainer = TinkerTrainer(
        TinkerSettings(
            base_models={"tiny": str(tiny)},
            weights_root=str(tmp_path / "weights"),
            checkpoints_root=str(tmp_path / "checkpoints"),
            keep_sampler_versions=2,
        )
    )
    trainer.create_model("a", "tiny", LORA)
    step(trainer, "a", sft_set())
    named = trainer.save_for_sampler("a", "final", keep=True)
    weights = Path(named["adapter_path"]) / "adapter_model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    unnamed = []
    for i in range(3):  # v2..v4: the publisher keeps the newest 2, so v1 and v2 go
        step(trainer, "a", sft_set(seed=i))
        unnamed.append(trainer.save_for_sampler("a", f"s{i}")["adapter_path"])
    versions = sorted(p.name for p in (tmp_path / "weights" / "a").iterdir() if p.name.startswith("v"))
    assert len(versions) == 2 and not Path(unnamed[0]).exists()  # pruned as before
    assert named["version"] == 1 and Path(named["adapter_path"]).parent.name == "kept"
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest  # still there, unchanged


def test_a_step_on_non_finite_gradients_is_refused_and_changes_nothing(trainer):
    """Weights are the client's numbers: finite each, they can still overflow the loss (here
    -log p · 1e38). AdamW on an inf/NaN gradient writes NaN into every adapter for good; the
    step is refused instead, the gradients dropped, the model as it was."""
    trainer.create_model("a", "tiny", LORA)
    step(trainer, "a", sft_set())
    before, state = adapter_values(trainer, "a"), adam_state(trainer, "a")
    huge = [Datum(d.tokens, {**d.inputs, "weights": np.full(11, 1e38, np.float32)}) for d in sft_set(seed=1)]
    out = trainer.forward_backward("a", huge, "cross_entropy", None)
    assert not np.isfinite(out.metrics["loss:sum"])
    with pytest.raises(InvalidInputError, match="gradients are not finite"):
        trainer.optim_step("a", ADAM)
    assert_same(adapter_values(trainer, "a"), before)
    assert_same(adam_state(trainer, "a"), state)
    assert all(p.grad is None for p in trainer.model("a").module.parameters())  # dropped
    assert trainer.info("a")["step"] == 1
    step(trainer, "a", sft_set())  # and the model trains on
    assert trainer.info("a")["step"] == 2
