"""The engine's sampler on hand-computed distributions: which tokens survive top-p / top-k /
min-p, which token each uniform picks (inverse CDF), and the logprob returned for it (the
renormalised filtered distribution)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.services.engine.sampling import RowSampling, draw_uniforms, sample_next

torch.set_num_threads(1)

# probabilities 0.5, 0.3, 0.2 (temperature 1): CDF 0.5, 0.8, 1.0
LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))


def pick(u, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0):
    tok, lp = sample_next(LOGITS, [RowSampling(temperature, top_p, top_k, min_p)], [u])
    return int(tok), float(lp)


@pytest.mark.parametrize(
    "u,token,p",
    [(0.0, 0, 0.5), (0.49, 0, 0.5), (0.51, 1, 0.3), (0.79, 1, 0.3), (0.81, 2, 0.2), (0.999999, 2, 0.2)],
)
def test_unfiltered_inverse_cdf_and_model_logprobs(u, token, p):
    assert pick(u) == (token, pytest.approx(math.log(p), abs=1e-6))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # mass before each token: 0, 0.5, 0.8 → with top_p 0.6 token 2 (0.8 > 0.6) goes; kept 0.5/0.8, 0.3/0.8
    assert pick(0.5, top_p=0.6) == (0, pytest.approx(math.log(0.5 / 0.8), abs=1e-6))  # 0.5 < 0.625
    assert pick(0.7, top_p=0.6) == (1, pytest.approx(math.log(0.3 / 0.8), abs=1e-6))
    assert pick(0.999999, top_p=0.6)[0] == 1  # the filtered token is never drawn


def test_top_k_one_is_a_point_mass():
    assert pick(0.99, top_k=1) == (0, pytest.approx(0.0, abs=1e-7))


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # threshold 0.5 * 0.5 = 0.25: token 2 (0.2) goes
    assert pick(0.99, min_p=0.5) == (1, pytest.approx(math.log(0.3 / 0.8), abs=1e-6))


def test_temperature_scales_before_filtering():
    # T = 0.5 squares the probabilities: 0.25, 0.09, 0.04 over 0.38
    assert pick(0.99, temperature=0.5) == (2, pytest.approx(math.log(0.04 / 0.38), abs=1e-5))


def test_greedy_returns_raw_logprob_of_argmax():
    assert pick(0.99, temperature=0.0) == (0, pytest.approx(math.log(0.5), abs=1e-6))


def test_mixed_batch_rows_use_their_own_parameters():
    rows = [
        RowSampling(0.0, 1.0, -1, 0.0),
        RowSampling(1.0, 1.0, 1, 0.0),
        RowSampling(1.0, 0.4, -1, 0.0),
        RowSampling(1.0, 1.0, -1, 0.0),
    ]
    tokens, logprobs = sample_next(LOGITS.repeat(4, 1), rows, [0.9, 0.9, 0.9, 0.9])
    assert tokens.tolist() == [0, 0, 0, 2]
    assert logprobs.tolist() == pytest.approx([math.log(0.5), 0.0, 0.0, math.log(0.2)], abs=1e-6)


def test_uniforms_are_a_function_of_the_seed():
    assert draw_uniforms(5, 3) == draw_uniforms(5, 3)
    assert draw_uniforms(5, 3) != draw_uniforms(5, 4)
    assert all(0.0 <= u < 1.0 for u in draw_uniforms(1000, 0))


def test_uniforms_are_splitmix64_outputs():
    # SplitMix64's first outputs from state 0 (the reference C implementation), top 53 bits.
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert draw_uniforms(3, 0) == [(x >> 11) * 2.0**-53 for x in expected]
    u = draw_uniforms(200_000, 12345)
    assert abs(sum(u) / len(u) - 0.5) < 0.003
    counts = [0] * 10
    for x in u:
        counts[int(x * 10)] += 1
    assert max(abs(c - 20_000) for c in counts) < 600  # ~4.5 sigma for a uniform decile


def test_uniforms_at_is_the_reference_stream_at_each_step():
    """The per-step batch draw equals the reference, seed by seed, including seeds past 2^63
    (wrapped modulo 2^64) and far steps."""
    from asyncrl.services.engine.sampling import uniforms_at

    seeds = [0, 3, 12345, 2**63 + 7, 2**64 - 1, -5]
    reference = {s: draw_uniforms(300, s) for s in seeds}
    for step in (0, 1, 17, 299):
        got = uniforms_at(seeds, [step] * len(seeds))
        assert got.tolist() == [reference[s][step] for s in seeds], step
    mixed = uniforms_at(seeds, [0, 299, 5, 1, 250, 42])
    assert mixed.tolist() == [reference[s][t] for s, t in zip(seeds, [0, 299, 5, 1, 250, 42])]
