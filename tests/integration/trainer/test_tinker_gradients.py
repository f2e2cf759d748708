"""The Tinker backend's gradients (trainer/tinker) against the async trainer's step and against
a hand-written torch reference of Tinker's cross-entropy, on a tiny Qwen2 in a gloo world of
one.

RL: the same rows (prompt, completion, sampler log-probs μ, one advantage per row) go through
`forward_backward` as Tinker data (tokens = prompt + completion minus its last token, targets
shifted by one, advantages 0 on the prompt) and through the trainer's own `policy_step`
(trainer/step.py) with SGD at lr 1 and no clipping, so its update is −gradient. PPO with
thresholds 1 ∓ ε is the trainer's `ppo` with clip ε, π_old = μ (no behaviour correction); Tinker
sums over tokens where the trainer's token mean divides by their count, so the trainer's
gradient is Tinker's over the number of completion tokens. importance_sampling is the same PPO
with clips no ratio reaches; cispo is the trainer's cispo (its weight clipped above only). The sampler's log-probs are the model's own moved by up to ±0.15,
so ratios lie in [0.86, 1.16]: PPO and CISPO at 0.05 clip some tokens (counted below), IS none.

Cross-entropy: Tinker's definition, Σ −log p(target)·weight, written with the model's full
logits (plain HF forward, log_softmax, gather) against the backend's chunked head in small
micro-batches, weights of both signs and a top-K datum ([N, K] targets).

Before comparing, one cross-entropy step moves the adapters' B off 0, so A has a gradient too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.trainer.tinker import Datum, TinkerSettings, TinkerTrainer

torch.set_num_threads(1)
CE_DATA_SEED, RL_SEED = 3, 4


@pytest.fixture(scope="module")
def trainer(one_rank, tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker")
    settings = TinkerSettings(
        base_models={"tiny": str(tiny)},
        weights_root=str(root / "weights"),
        checkpoints_root=str(root / "checkpoints"),
        chunk_tokens=5,  # the chunked head, several chunks per micro-batch
        micro_batch_tokens=24,  # several micro-batches per call: their gradients add up
    )
    t = TinkerTrainer(settings)
    t.create_model("m", "tiny", {"rank": 4, "seed": 7, "train_unembed": False})
    warm = sft_data(np.random.default_rng(CE_DATA_SEED), 3)
    t.forward_backward("m", warm, "cross_entropy", None)
    t.optim_step("m", {"learning_rate": 0.05})
    return t


def sft_data(rng, n: int) -> list[Datum]:
    out = []
    for _ in range(n):
        seq = rng.integers(3, 40, int(rng.integers(6, 11)))
        weights = rng.uniform(-0.5, 1.0, len(seq) - 1).astype(np.float32)
        out.append(Datum(seq[:-1].tolist(), {"target_tokens": seq[1:].astype(np.int64), "weights": weights}))
    return out


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def rl_rows(trainer, rng, n: int):
    """(prompt, completion, μ, advantage) rows; μ = the model's own log-probs ± up to 0.15."""
    rows = []
    for _ in range(n):
        prompt = rng.integers(3, 40, int(rng.integers(3, 6)))
        completion = rng.integers(3, 40, int(rng.integers(3, 7)))
        rows.append([prompt, completion, None, float(rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 2.0))])
    probe = [as_datum(p, c, np.zeros(len(c), np.float32), 0.0) for p, c, _, _ in rows]
    for d in probe:  # cross_entropy with zero weights: the log-probs only
        d.inputs = {
            "target_tokens": d.inputs["target_tokens"],
            "weights": np.zeros(len(d.tokens), np.float32),
        }
    lp = trainer.forward("m", probe, "cross_entropy", None).outputs
    for row, out in zip(rows, lp):
        mine = out["logprobs"][len(row[0]) - 1 :]
        row[2] = (mine + rng.uniform(-0.15, 0.15, len(mine))).astype(np.float32)
    return rows


def as_datum(prompt, completion, mu, advantage) -> Datum:
    seq = np.concatenate([prompt, completion]).astype(np.int64)
    pad = np.zeros(len(prompt) - 1, np.float32)
    return Datum(
        seq[:-1].tolist(),
        {
            "target_tokens": seq[1:],
            "logprobs": np.concatenate([pad, mu]).astype(np.float32),
            "advantages": np.concatenate([pad, np.full(len(completion), advantage, np.float32)]),
        },
    )


def trainer_step_gradient(model, rows, kind: str, clip_low: float, clip_high: float) -> tuple[dict, dict]:
    """The trainer's policy_step on `rows` (SGD lr 1, no clipping): −(its update), its metrics.
    The adapters are put back afterwards."""
    from asyncrl.trainer.batch import Row, micro_batches
    from asyncrl.trainer.losses import LossConfig
    from asyncrl.trainer.step import StepConfig, policy_step

    rows = [Row(p, c, mu, a, True) for p, c, mu, a in rows]
    micro = micro_batches(rows, 0, 1, 1, 2, 0, torch.device("cpu"))
    before = adapters(model)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    cfg = StepConfig(
        loss=LossConfig(kind=kind, clip_low=clip_low, clip_high=clip_high, is_correction="none"),
        grad_clip=1e9,
    )
    old = [mb.behavior_logprobs for mb in micro]  # π_old = μ: the ratio Tinker's losses take
    stats = policy_step(model, sgd, micro, old, [None] * len(micro), cfg, torch.device("cpu"))
    after = adapters(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in before:
                p.copy_(before[n])
    return {n: before[n] - after[n] for n in before}, stats


@pytest.mark.parametrize(
    "loss_fn, config, trainer_loss, clipped",
    [
        ("importance_sampling", None, ("ppo", 0.99, 100.0), False),
        ("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}, ("ppo", 0.05, 0.05), True),
        # the trainer's CISPO clips above only: Tinker's with its lower threshold at 0
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.05}, ("cispo", 0.2, 0.05), True),
    ],
)
def test_rl_gradients_equal_the_trainers_step(trainer, loss_fn, config, trainer_loss, clipped):
    m = trainer.model("m")
    rows = rl_rows(trainer, np.random.default_rng(RL_SEED), 5)
    tokens = sum(len(c) for _, c, _, _ in rows)
    data = [as_datum(*row) for row in rows]
    trainer.forward_backward("m", data, loss_fn, config)
    tinker = grads(m.module)
    m.optimizer.zero_grad(set_to_none=True)
    step, stats = trainer_step_gradient(m.module, rows, *trainer_loss)
    assert stats["tokens"] == tokens
    assert (stats["clip_frac"] > 0.1) is clipped  # the clipping is exercised; IS never clips
    assert set(tinker) == set(step) and len(tinker) == 2 * 7 * 2  # A and B of 7 Linear × 2 layers
    for name in tinker:
        assert tinker[name].abs().max() > 0, name  # B moved off 0 in the warm-up: A has a gradient
        # fp32 sums in another order: equal to 1e-4 of the tensor's largest entry
        scale = float(step[name].abs().max())
        torch.testing.assert_close(tinker[name] / tokens, step[name], rtol=1e-4, atol=1e-4 * scale)


def test_cross_entropy_gradient_equals_a_hand_written_reference(trainer):
    m = trainer.model("m")
    rng = np.random.default_rng(CE_DATA_SEED + 1)
    data = sft_data(rng, 4)
    top_k = np.stack([rng.integers(3, 40, 6) for _ in range(3)], axis=1)  # [6, 3]: position i, 3 targets
    data.append(
        Datum(
            rng.integers(3, 40, 6).tolist(),
            {"target_tokens": top_k, "weights": rng.uniform(0, 1, (6, 3)).astype(np.float32)},
        )
    )
    out = trainer.forward_backward("m", data, "cross_entropy", None)
    mine = grads(m.module)
    m.optimizer.zero_grad(set_to_none=True)

    total = torch.zeros((), dtype=torch.float64)
    for d, o in zip(data, out.outputs):
        logits = m.module(input_ids=torch.tensor([d.tokens])).logits[0]  # [N, V], the full vocabulary
        logp = torch.log_softmax(logits.double(), dim=-1)
        targets = torch.from_numpy(d.inputs["target_tokens"])
        picked = logp.gather(-1, targets.reshape(len(d.tokens), -1)).reshape(targets.shape)
        loss = -(picked * torch.from_numpy(d.inputs["weights"]).double()).sum()
        loss.backward()
        total += loss.detach()
        np.testing.assert_allclose(o["logprobs"], picked.detach().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            o["elementwise_loss"], (-picked * torch.from_numpy(d.inputs["weights"])).detach(), atol=1e-5
        )
    reference = grads(m.module)
    m.optimizer.zero_grad(set_to_none=True)
    assert out.metrics["loss:sum"] == pytest.approx(float(total), rel=1e-5)
    assert out.outputs[-1]["logprobs"].shape == (6, 3)
    for name in mine:
        scale = float(reference[name].abs().max())
        torch.testing.assert_close(mine[name], reference[name], rtol=1e-4, atol=1e-4 * scale)
