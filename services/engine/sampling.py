"""Batched next-token sampling with per-request parameters and seeds.

Which log-probability is returned (the behaviour policy μ the trainer corrects against):

* `temperature > 0`: the log-probability of the sampled token under the distribution it was
  actually drawn from: logits / temperature, then top-k / top-p / min-p filtering exactly as
  SGLang's `top_k_top_p_min_p_sampling_from_probs_torch` does it (top-p on the cumulative
  temperature-scaled probabilities sorted descending, keeping the first token; top-k on the
  rank; min-p against the top probability), renormalised over the kept tokens.
  With `top_p = 1`, `top_k = -1`, `min_p = 0` this is `log_softmax(logits / T)`, which is
  what SGLang's sampler returns by default as we read it at the commit pinned in
  `proto/sglang.py` (`SGLANG_RETURN_ORIGINAL_LOGPROB` unset: log of the temperature-scaled
  probabilities, before top-p/top-k; set: raw logits, before temperature). With filters on, SGLang still returns the unfiltered
  temperature-scaled value; we return the renormalised one because it is the true μ of the
  sample, which is what the importance-sampling correction needs. At temperature 1 and no
  filters both are `log_softmax(logits)`, the raw model distribution.
* `temperature = 0` (greedy): the raw model log-probability `log_softmax(logits)` of the argmax
  token, as SGLang does; the greedy "distribution" is a point mass and its log-probability 0
  would carry no information.

Randomness: each request has a seed (`sampling_seed`, else one from the engine's seeded RNG);
its t-th token is the inverse CDF of the t-th output of SplitMix64 from that seed. SplitMix64
is a counter-based generator (output t mixes seed + (t + 1)·γ), so each decode step draws the
uniforms of all its rows at once in numpy (`uniforms_at`), nothing is drawn ahead: a request
of 8k tokens costs no more at submission than one of 3 (drawing them all there cost ~1 µs a
token of Python, 8 ms per such request). A seeded request's tokens therefore
depend only on its seed and its logits, never on which requests share the batch (up to float
rounding of the batched matmuls), and the whole batch samples with one vectorised
`searchsorted`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowSampling:
    temperature: float
    top_p: float
    top_k: int  # -1 or 0: no top-k
    min_p: float


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / the golden ratio)


def draw_uniforms(count: int, seed: int) -> list[float]:
    """The first `count` uniforms in [0, 1) a request samples its tokens with (one per token):
    SplitMix64 (Steele, Lea and Flood, 2014) from `seed`, each output's top 53 bits as a double.
    The reference for `uniforms_at`, one output after the other."""
    out, state = [], seed & _MASK64
    for _ in range(count):
        state = (state + _GAMMA) & _MASK64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(((z ^ (z >> 31)) >> 11) * 2.0**-53)
    return out


def uniforms_at(seeds: list[int], steps: list[int]) -> np.ndarray:
    """Row i's uniform for its token `steps[i]` (0-based) from `seeds[i]`: `draw_uniforms(steps[i]
    + 1, seeds[i])[-1]`, for a whole batch in a few numpy operations (uint64 arithmetic wraps
    modulo 2^64, as SplitMix64's does)."""
    u64 = np.uint64
    seed = np.array([x & _MASK64 for x in seeds], dtype=u64)
    z = seed + (np.array(steps, dtype=u64) + u64(1)) * u64(_GAMMA)
    z = (z ^ (z >> u64(30))) * u64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> u64(27))) * u64(0x94D049BB133111EB)
    return ((z ^ (z >> u64(31))) >> u64(11)).astype(np.float64) * 2.0**-53


def sample_next(
    logits: torch.Tensor, rows: list[RowSampling], uniforms: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V], one uniform per row → (token ids [n] int64, logprobs [n] float32)."""
    logits, uniforms = logits.float(), np.asarray(uniforms, dtype=np.float64)
    greedy_rows = [r.temperature == 0.0 for r in rows]
    if all(greedy_rows):
        return _greedy(logits)
    if not any(greedy_rows):
        return _sample(logits, rows, uniforms)
    greedy = torch.tensor(greedy_rows, device=logits.device)
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    logprobs = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
    tokens[greedy], logprobs[greedy] = _greedy(logits[greedy])
    keep = [i for i, g in enumerate(greedy_rows) if not g]
    tokens[~greedy], logprobs[~greedy] = _sample(logits[~greedy], [rows[i] for i in keep], uniforms[keep])
    return tokens, logprobs


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raw = torch.log_softmax(logits, dim=-1)
    top = raw.argmax(dim=-1)
    return top, raw.gather(1, top[:, None]).squeeze(1)


def _sample(
    logits: torch.Tensor, rows: list[RowSampling], uniforms: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    temps = torch.tensor([r.temperature for r in rows], device=logits.device)
    logp = torch.log_softmax(_filter(logits / temps[:, None], rows, logits.shape[1]), dim=-1)
    u = torch.from_numpy(np.ascontiguousarray(uniforms, dtype=np.float64)).to(logits.device)
    picks = _inverse_cdf(logp.exp().double(), u)
    return picks, logp.gather(1, picks[:, None]).squeeze(1)


def _filter(scaled: torch.Tensor, rows: list[RowSampling], vocab: int) -> torch.Tensor:
    """Set filtered-out logits to -inf (top-p, then top-k, then min-p; SGLang's order)."""
    if all(r.top_p >= 1.0 and not 0 < r.top_k < vocab and r.min_p <= 0.0 for r in rows):
        return scaled
    top_p = torch.tensor([r.top_p for r in rows], device=scaled.device)
    top_k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=scaled.device)
    min_p = torch.tensor([r.min_p for r in rows], device=scaled.device)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    remove = (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    remove |= torch.arange(vocab, device=scaled.device)[None, :] >= top_k[:, None]
    remove |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds u · total, for each row; never a zero-probability token."""
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    # u · total can round up to the total itself: fall back to the last token with mass.
    vocab = probs.shape[1]
    last_with_mass = vocab - 1 - (probs > 0).flip(dims=[1]).int().argmax(dim=1)
    return torch.minimum(picks, last_with_mass)
