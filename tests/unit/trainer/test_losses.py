"""trainer/losses.py against tiny examples computed by hand (the arithmetic is in the comments).

Shared example, two rows, T = 3 (row 1 has one padded position holding NaN):
  row 0: r = π_θ/π_old = [1.5, 0.5, 1.1], A = [1, -1, 2],   ρ = π_old/μ = [3, 1, 0.5]
  row 1: r = [1.0, 0.9, pad],             A = [-0.5, -0.5], ρ = [2, 2]
  old_logprobs = -1 everywhere, so logprobs = -1 + log r and behaviour = -1 - log ρ.
PPO (clip 0.2 / 0.28, bounds [0.8, 1.28]), token losses ℓ = −min(rA, clip(r)A):
  row 0: min(1.5, 1.28) = 1.28 → −1.28 (clipped) · min(−0.5, −0.8) = −0.8 → +0.8 (clipped)
         · min(2.2, 2.2) → −2.2      sum row 0 = −2.68
  row 1: min(−0.5, −0.5) → +0.5 · min(−0.45, −0.45) → +0.45      sum row 1 = 0.95
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.trainer.losses import (
    MAX_LOG_RATIO,
    LossConfig,
    aggregate,
    entropy_bonus,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
)

torch.set_num_threads(1)
LN = math.log


def example(requires_grad: bool = True):
    r = torch.tensor([[1.5, 0.5, 1.1], [1.0, 0.9, 1.0]], dtype=torch.float64)
    rho = torch.tensor([[3.0, 1.0, 0.5], [2.0, 2.0, 1.0]], dtype=torch.float64)
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logprobs = (old + r.log()).clone()
    logprobs[1, 2] = float("nan")  # padding may hold garbage
    logprobs.requires_grad_(requires_grad)
    behavior = old - rho.log()
    adv = torch.tensor([[1.0, -1.0, 2.0], [-0.5, -0.5, 123.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    return logprobs, old, behavior, adv, mask


def cfg(**kw) -> LossConfig:
    return LossConfig(**{"is_correction": "none", **kw})


def test_defaults_match_design():
    c = LossConfig()
    assert (c.kind, c.clip_low, c.clip_high, c.agg, c.is_correction, c.is_high) == (
        "ppo",
        0.2,
        0.28,
        "token_mean",
        "tis",
        2.0,
    )
    assert MAX_LOG_RATIO == 20.0
    with pytest.raises(ValueError, match="max_tokens"):
        LossConfig(agg="seq_mean_token_sum_norm")


def test_ppo_token_mean_and_clip_gradients():
    lp, old, beh, adv, mask = example()
    loss, m = policy_loss(lp, old, beh, adv, mask, cfg())
    # (−2.68 + 0.95) / 5 = −0.346
    assert loss.item() == pytest.approx(-0.346, abs=1e-9)
    # clipped: row 0 tokens 0 and 1 → 2 of 5
    assert m["clip_frac"] == pytest.approx(0.4)
    assert m["is_weight_mean"] == pytest.approx(1.0)
    loss.backward()
    g = lp.grad
    # d(−rA/5)/d logprob = −rA/5: clipped tokens 0; row0 tok2 −2.2/5; row1 tok0 0.5/5, tok1 0.45/5; pad 0
    expected = torch.tensor([[0.0, 0.0, -0.44], [0.1, 0.09, 0.0]], dtype=torch.float64)
    assert torch.allclose(g, expected, atol=1e-12)


@pytest.mark.parametrize(
    "agg,max_tokens,expected",
    [
        ("token_mean", None, -1.73 / 5),
        # row means: −2.68/3 = −0.893333…, 0.95/2 = 0.475 → mean −0.2091666…
        ("seq_mean_token_mean", None, (-2.68 / 3 + 0.475) / 2),
        # Σℓ / (B · max_tokens) = −1.73 / (2 · 4) = −0.21625
        ("seq_mean_token_sum_norm", 4, -0.21625),
    ],
)
def test_aggregations(agg, max_tokens, expected):
    lp, old, beh, adv, mask = example()
    loss, _ = policy_loss(lp, old, beh, adv, mask, cfg(agg=agg, max_tokens=max_tokens))
    assert loss.item() == pytest.approx(expected, abs=1e-9)


def test_denominator_override_splits_a_batch_exactly():
    # Two halves with the global token count (5) as denominator add up to the whole-batch loss.
    lp, old, beh, adv, mask = example()
    whole, _ = policy_loss(lp, old, beh, adv, mask, cfg())
    parts = [
        policy_loss(
            lp[i : i + 1],
            old[i : i + 1],
            beh[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            cfg(),
            denominator=5.0,
        )[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-12)
    # row 0 alone: −2.68 / 5
    assert parts[0].item() == pytest.approx(-0.536, abs=1e-12)


@pytest.mark.parametrize(
    "correction,low,high,expected_loss,masked_frac",
    [
        # w = min(ρ, 2) = [2, 1, 0.5 | 2, 2]: (−1.28·2 + 0.8·1 − 2.2·0.5 + 0.5·2 + 0.45·2)/5 = −0.96/5
        ("tis", 0.5, 2.0, -0.96 / 5, 0.0),
        # w = ρ·1[0.5 ≤ ρ ≤ 2] = [0, 1, 0.5 | 2, 2]: (0 + 0.8 − 1.1 + 1.0 + 0.9)/5 = 1.6/5
        ("icepop", 0.5, 2.0, 1.6 / 5, 0.2),
        # w = 1[0.5 ≤ ρ ≤ 2] = [0, 1, 1 | 1, 1]: (0.8 − 2.2 + 0.5 + 0.45)/5 = −0.45/5
        ("token_mask", 0.5, 2.0, -0.45 / 5, 0.2),
        # sequence ρ: row 0 = 3·1·0.5 = 1.5, row 1 = 2·2 = 4. seq_tis high 2 → w = [1.5 | 2]:
        # (1.5·−2.68 + 2·0.95)/5 = (−4.02 + 1.9)/5 = −2.12/5
        ("seq_tis", 0.5, 2.0, -2.12 / 5, 0.0),
        # seq_mask [1.2, 2.5]: row 0 (1.5) kept, row 1 (4) masked: −2.68/5; 2 of 5 tokens masked
        ("seq_mask", 1.2, 2.5, -2.68 / 5, 0.4),
        # geo_mask [1.2, 2.5]: row 0 exp(ln1.5/3) = 1.1447 masked, row 1 exp(ln4/2) = 2 kept: 0.95/5
        ("geo_mask", 1.2, 2.5, 0.95 / 5, 0.6),
        ("none", 0.5, 2.0, -1.73 / 5, 0.0),
    ],
)
def test_is_corrections(correction, low, high, expected_loss, masked_frac):
    lp, old, beh, adv, mask = example()
    loss, m = policy_loss(lp, old, beh, adv, mask, cfg(is_correction=correction, is_low=low, is_high=high))
    assert loss.item() == pytest.approx(expected_loss, abs=1e-9)
    assert m["is_masked_frac"] == pytest.approx(masked_frac, abs=1e-12)


def test_is_weight_metrics_and_mismatch_kl():
    lp, old, beh, adv, mask = example()
    _, m = policy_loss(lp, old, beh, adv, mask, cfg(is_correction="tis"))
    # w = [2, 1, 0.5, 2, 2] → mean 7.5/5 = 1.5, max 2
    assert m["is_weight_mean"] == pytest.approx(1.5)
    assert m["is_weight_max"] == pytest.approx(2.0)
    # k3 = ρ − 1 − ln ρ: 3 → 2 − 1.0986123 = 0.9013877; 1 → 0; 0.5 → 0.1931472; 2 → 0.3068528 (×2)
    k3 = [3 - 1 - LN(3), 0.0, 0.5 - 1 - LN(0.5), 2 - 1 - LN(2), 2 - 1 - LN(2)]
    assert m["mismatch_kl"] == pytest.approx(sum(k3) / 5, abs=1e-9)
    assert m["mismatch_kl"] == pytest.approx((0.9013877 + 0.1931472 + 2 * 0.3068528) / 5, abs=1e-6)
    # approx KL (k3 of r): 1.5 → 0.0945349, 0.5 → 0.1931472, 1.1 → 0.0046898, 1 → 0, 0.9 → 0.0053605
    assert m["approx_kl"] == pytest.approx((0.0945349 + 0.1931472 + 0.0046898 + 0.0053605) / 5, abs=1e-6)


def test_gspo_value_and_gradient_match_sequence_ratio():
    lp, old, beh, adv, mask = example()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]], dtype=torch.float64)
    loss, m = policy_loss(lp, old, beh, adv, mask, cfg(kind="gspo"))
    # s0 = (1.5·0.5·1.1)^(1/3) = 0.825^(1/3) = 0.9378887; inside [0.8, 1.28] → ℓ0 = −0.9378887
    # s1 = (1·0.9)^(1/2) = 0.9486833, A = −0.5 → ℓ1 = +0.4743416
    # token_mean: (3·ℓ0 + 2·ℓ1)/5 = (−2.8136662 + 0.9486833)/5 = −0.3729966
    s0, s1 = 0.825 ** (1 / 3), 0.9**0.5
    assert s0 == pytest.approx(0.9378887, abs=1e-7)
    assert loss.item() == pytest.approx(-0.3729966, abs=1e-7)
    assert loss.item() == pytest.approx((3 * -s0 + 2 * 0.5 * s1) / 5, abs=1e-9)
    assert m["clip_frac"] == 0.0
    loss.backward()
    # d s_i / d logprob_t = s_i / L_i. Row 0: −(3/5)·s0/3 = −s0/5 per token. Row 1: (2/5)·0.5·s1/2 = 0.1·s1.
    expected = torch.tensor([[-s0 / 5] * 3, [0.1 * s1, 0.1 * s1, 0.0]], dtype=torch.float64)
    assert torch.allclose(lp.grad, expected, atol=1e-12)


def test_gspo_clipped_sequence_has_zero_gradient():
    # r = [2, 2] → s = 2 > 1.28 with A = 1 → ℓ = −1.28, no gradient
    old = torch.zeros(1, 2, dtype=torch.float64)
    lp = torch.full((1, 2), LN(2), dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(
        lp, old, old, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2), cfg(kind="gspo")
    )
    assert loss.item() == pytest.approx(-1.28)
    assert m["clip_frac"] == 1.0
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(1, 2, dtype=torch.float64))


def test_cispo_value_and_stop_gradient_weight():
    lp, old, beh, adv, mask = example()
    loss, m = policy_loss(lp[:1], old[:1], beh[:1], adv[:1], mask[:1], cfg(kind="cispo"))
    # weight = sg[min(r, 1.28)] = [1.28, 0.5, 1.1]; logprobs = −1 + ln r = [−0.5945349, −1.6931472, −0.9046898]
    # ℓ = −w·A·lp = [0.7610047, −0.8465736, 1.9903176] → mean 1.9047487/3 = 0.6349162
    assert loss.item() == pytest.approx(0.6349162, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # weight has no gradient: d/d lp = −w·A/3 = [−1.28/3, 0.5/3, −2.2/3]. Had the weight carried
    # gradient, token 2 would get −2·1.1·(1 + lp)/3 ≠ −2.2/3.
    expected = torch.tensor([[-1.28 / 3, 0.5 / 3, -2.2 / 3], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(lp.grad, expected, atol=1e-12)


def test_log_ratio_clamp_keeps_values_finite():
    old = torch.zeros(1, 2)
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    behavior = torch.tensor([[-1000.0, 0.0]])  # engine wildly disagrees: log ρ = 1000 → clamped to 20
    loss, m = policy_loss(lp, old, behavior, torch.ones(1, 2), torch.ones(1, 2), cfg(is_correction="icepop"))
    assert math.isfinite(loss.item()) and math.isfinite(m["mismatch_kl"])
    # k3 at the clamp: e^20 − 1 − 20 over 2 tokens
    assert m["mismatch_kl"] == pytest.approx((math.exp(20) - 21) / 2, rel=1e-5)
    # icepop drops the token with ρ = e^20; the other has r = 1, A = 1: loss = −1/2
    assert loss.item() == pytest.approx(-0.5)


def test_kl_estimators():
    # x = logprobs − ref = [ln 2, 0, −ln 2]
    lp = torch.tensor([[LN(2), 0.0, -LN(2)]], dtype=torch.float64)
    ref = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    # k1 = x = [0.6931472, 0, −0.6931472]
    assert torch.allclose(
        kl_penalty(lp, ref, mask, "k1"),
        torch.tensor([[0.6931472, 0.0, -0.6931472]], dtype=torch.float64),
        atol=1e-7,
    )
    # k2 = x²/2 = [0.2402265, 0, 0.2402265]
    assert torch.allclose(
        kl_penalty(lp, ref, mask, "k2"),
        torch.tensor([[0.2402265, 0.0, 0.2402265]], dtype=torch.float64),
        atol=1e-7,
    )
    # k3 = e^{−x} − 1 + x = [0.5 − 1 + 0.6931472, 0, 2 − 1 − 0.6931472] = [0.1931472, 0, 0.3068528]
    assert torch.allclose(
        kl_penalty(lp, ref, mask, "k3"),
        torch.tensor([[0.1931472, 0.0, 0.3068528]], dtype=torch.float64),
        atol=1e-7,
    )
    masked = kl_penalty(lp, ref, torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64), "k3")
    assert masked[0, 2].item() == 0.0


def test_entropy_and_bonus():
    # logits [0, 0] → ln 2 = 0.6931472; [0, ln 3] → p = [0.25, 0.75]:
    # −(0.25·ln 0.25 + 0.75·ln 0.75) = 0.3465736 + 0.2157616 = 0.5623351
    logits = torch.tensor([[[0.0, 0.0], [0.0, LN(3)]]])
    ent = entropy_from_logits(logits)
    assert torch.allclose(ent, torch.tensor([[0.6931472, 0.5623351]]), atol=1e-6)
    # bonus −0.1 · token mean = −0.1 · (0.6931472 + 0.5623351)/2 = −0.0627741
    assert entropy_bonus(ent, torch.ones(1, 2), 0.1).item() == pytest.approx(-0.0627741, abs=1e-6)


def test_aggregate_rows_without_tokens():
    values = torch.tensor([[2.0, 4.0], [7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    # the empty row neither contributes nor counts: token mean 6/2 = 3, seq mean (3)/1 = 3
    assert aggregate(values, mask, "token_mean").item() == 3.0
    assert aggregate(values, mask, "seq_mean_token_mean").item() == 3.0
    # sum norm counts B: 6 / (2·3) = 1
    assert aggregate(values, mask, "seq_mean_token_sum_norm", max_tokens=3).item() == 1.0
