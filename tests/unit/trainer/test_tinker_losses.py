"""trainer/tinker/losses.py and data.py against examples computed by hand.

Shared example, one datum of 3 tokens in a row of 4 (the last position is padding):
  sampler log q = −1 everywhere; r = p_θ/q = [1.5, 0.5, 1.1], so log p_θ = −1 + ln r =
  [−0.594535, −1.693147, −0.904690]; advantages A = [1, −1, 2].
  importance_sampling: −r·A = [−1.5, 0.5, −2.2] → sum −3.2; ∂/∂log p = −r·A (∂r/∂log p = r).
  ppo (0.8, 1.2): clip(r) = [1.2, 0.8, 1.1]; −min(rA, clip(r)A) = [−1.2, +0.8, −2.2] → −2.6;
     tokens 0 and 1 take the clipped branch (no gradient): ∂ = [0, 0, −2.2].
  cispo (0, 4): sg(r)·log p·A negated = [0.891802, −0.846574, 1.990318] → 2.035546; ∂ = −r·A.
  dro (β = 0.5): −(log p·A − ¼ (ln r)²) = [0.635635, −1.573034, 1.811651] → 0.874252;
     ∂ = −A + β ln r = [−0.797267, 0.653426, −1.952345].
  cross_entropy (weights [1, 0, −0.5]): −log p·w = [0.594535, 0, −0.452345] → 0.142190; ∂ = −w.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.trainer.tinker.data import Datum, check, loss_config, micro_batches
from asyncrl.trainer.tinker.errors import CapacityError, InvalidInputError, UnsupportedError
from asyncrl.trainer.tinker.losses import LOSSES, MAX_LOG_RATIO, elementwise_loss

torch.set_num_threads(1)
R = [1.5, 0.5, 1.1]
PRESENT = torch.tensor([[True, True, True, False]])


def example():
    lp = torch.tensor([[-1 + math.log(r) for r in R] + [0.0]], dtype=torch.float64, requires_grad=True)
    inputs = {
        "logprobs": torch.tensor([[-1.0, -1.0, -1.0, 0.0]], dtype=torch.float64),
        "advantages": torch.tensor([[1.0, -1.0, 2.0, 0.0]], dtype=torch.float64),
        "weights": torch.tensor([[1.0, 0.0, -0.5, 0.0]], dtype=torch.float64),
    }
    return lp, inputs


CASES = {
    # name: (config, per-token loss, gradient per token)
    "importance_sampling": ({}, [-1.5, 0.5, -2.2], [-1.5, 0.5, -2.2]),
    "ppo": (loss_config("ppo", None)[1], [-1.2, 0.8, -2.2], [0.0, 0.0, -2.2]),
    "cispo": (loss_config("cispo", None)[1], [0.891802, -0.846574, 1.990318], [-1.5, 0.5, -2.2]),
    "dro": ({"beta": 0.5}, [0.635635, -1.573034, 1.811651], [-0.797267, 0.653426, -1.952345]),
    "cross_entropy": ({}, [0.594535, 0.0, -0.452345], [-1.0, 0.0, 0.5]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_loss_is_the_docs_sum_over_tokens(name):
    config, tokens, grads = CASES[name]
    lp, inputs = example()
    per_token = elementwise_loss(name, lp, inputs, config, PRESENT)
    per_token.sum().backward()
    assert per_token.detach()[0].tolist() == pytest.approx([*tokens, 0.0], abs=1e-6)
    assert lp.grad[0].tolist() == pytest.approx([*grads, 0.0], abs=1e-6)  # padding: no gradient


def test_defaults_are_the_docs_thresholds():
    assert loss_config("ppo", None)[1] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_config("cispo", {})[1] == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert loss_config("ppo", {"clip_high_threshold": 1.5})[1]["clip_high_threshold"] == 1.5


def test_cispo_thresholds_bound_its_weight_on_both_sides():
    lp, inputs = example()
    config = {"clip_low_threshold": 0.6, "clip_high_threshold": 1.2}  # w = [1.2, 0.6, 1.1]
    elementwise_loss("cispo", lp, inputs, config, PRESENT).sum().backward()
    assert lp.grad[0, :3].tolist() == pytest.approx([-1.2, 0.6, -2.2])  # −w·A


def test_a_wild_log_ratio_is_clamped_not_infinite():
    lp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    inputs = {"logprobs": torch.tensor([[-1000.0]], dtype=torch.float64), "advantages": torch.ones(1, 1)}
    loss = elementwise_loss("importance_sampling", lp, inputs, {}, torch.tensor([[True]])).sum()
    assert float(loss.detach()) == pytest.approx(-math.exp(MAX_LOG_RATIO))
    loss.backward()
    assert float(lp.grad) == 0.0  # beyond the clamp: no gradient


def datum(n=4, k=None, **inputs):
    targets = np.arange(3, 3 + n * (k or 1), dtype=np.int64).reshape((n, k) if k else (n,))
    base = {"target_tokens": targets, "weights": np.ones(targets.shape, np.float32)}
    return Datum(list(range(5, 5 + n)), {**base, **inputs})


def rl_datum(n=4):
    return Datum(
        list(range(5, 5 + n)),
        {
            "target_tokens": np.arange(3, 3 + n),
            "logprobs": np.zeros(n, np.float32),
            "advantages": np.zeros(n, np.float32),
        },
    )


def refusal(loss, data, vocab=50, max_tokens=100, config=None):
    spec, _ = loss_config(loss, config)
    with pytest.raises((InvalidInputError, CapacityError)) as err:
        check(data, loss, spec, vocab, max_tokens)
    return err


def test_unknown_and_unsupported_losses_are_refused_by_name():
    for name, words in (("gspo", "is a Tinker loss this backend does not compute"), ("nope", "is unknown")):
        with pytest.raises(UnsupportedError, match=f"loss_fn '{name}' {words}.*cross_entropy"):
            loss_config(name, None)


def test_loss_config_keys_and_values_are_checked():
    with pytest.raises(InvalidInputError, match=r"\['clip_ratio'\] are not read by ppo"):
        loss_config("ppo", {"clip_ratio": 0.2})
    with pytest.raises(InvalidInputError, match="dro needs loss_fn_config\\['beta'\\]"):
        loss_config("dro", None)
    with pytest.raises(InvalidInputError, match="finite number"):
        loss_config("dro", {"beta": "high"})
    with pytest.raises(InvalidInputError, match="clip_low_threshold <= clip_high_threshold"):
        loss_config("ppo", {"clip_low_threshold": 1.3})


def test_bad_data_is_refused_naming_the_datum_and_input():
    good = datum()
    short = datum()
    short.inputs["weights"] = np.ones(3, np.float32)
    assert "datum 1: loss_fn_inputs['weights'] has shape [3]" in str(
        refusal("cross_entropy", [good, short]).value
    )
    extra = datum(mask=np.ones(4, np.float32))
    assert "unknown: ['mask']" in str(refusal("cross_entropy", [extra]).value)
    assert "missing: ['advantages', 'logprobs']" in str(refusal("ppo", [datum()]).value)
    out_of_vocab = datum()
    out_of_vocab.inputs["target_tokens"][2] = 50
    assert "token id 50 is outside the model's vocabulary [0, 50)" in str(
        refusal("cross_entropy", [out_of_vocab]).value
    )
    bad_input = Datum([5, -1], {"target_tokens": np.array([1, 2]), "weights": np.ones(2, np.float32)})
    assert "model_input: token id -1" in str(refusal("cross_entropy", [bad_input]).value)
    nan = rl_datum()
    nan.inputs["advantages"][1] = np.nan
    assert "'advantages'] must be finite" in str(refusal("ppo", [nan]).value)
    top_k_rl = rl_datum()
    top_k_rl.inputs["target_tokens"] = np.zeros((4, 2), np.int64)  # top-K is cross_entropy's only
    assert "ppo needs [4]" in str(refusal("ppo", [top_k_rl]).value)
    assert "no data" in str(refusal("cross_entropy", []).value)
    assert refusal("cross_entropy", [datum(n=60), datum(n=60)]).type is CapacityError


def test_micro_batches_cover_every_datum_once_with_top_k_positions_repeated():
    data = [datum(n=2, k=3), datum(n=5), datum(n=3)]
    spec, _ = loss_config("cross_entropy", None)
    chunks = micro_batches(data, spec, max_tokens=10, pad_id=0)
    assert [c.index for c in chunks] == [
        [1, 2],
        [0],
    ]  # longest first; 2 rows × 5 fit in 10, a third would not
    top_k = chunks[1]
    assert top_k.shapes == [(2, 3)]
    # position i predicts targets [i, 0..K): each position's flat index K times, row-major
    assert top_k.batch.token_index[0].tolist() == [0, 0, 0, 1, 1, 1]
    assert top_k.batch.targets[0].tolist() == list(range(3, 9))
    padded = chunks[0]
    assert padded.batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]
    assert padded.batch.present.sum(1).tolist() == [5, 3]
    assert padded.batch.token_index[1, :3].tolist() == [5, 6, 7]  # row 1 starts at 1 × 5


def test_every_loss_names_its_inputs():
    assert {name: spec.inputs for name, (spec, _) in LOSSES.items()} == {
        "cross_entropy": ("target_tokens", "weights"),
        "importance_sampling": ("target_tokens", "logprobs", "advantages"),
        "ppo": ("target_tokens", "logprobs", "advantages"),
        "cispo": ("target_tokens", "logprobs", "advantages"),
        "dro": ("target_tokens", "logprobs", "advantages"),
    }
