"""Generation that survives weight updates, for every caller of the engines (the scheduler's
groups, an episode's turns, the gateway's calls).

A weight update may abort the requests in flight (`weight_update_abort`). An aborted sample with
budget left goes again as prompt + its tokens so far, with the budget that is left: a new
**segment**. Every token keeps the `weight_version` of the segment that sampled it (or, when
the engine reports per-token `weight_versions` spans, its own: with in-flight updates one
answer spans several versions), and the sample's lineage the newest version per epoch
(proto/lineage.py). `generate_resuming` runs the
segments of any number of samples on one engine, the aborted ones of each round together as one
batch; the callers differ only in each segment's sampling parameters (`params_for`).

With LoRA versions (`WeightSync.lease`, services/rollout/adapter_versions.py) each segment names
the newest adapter its engine holds, and its tokens carry that adapter's version: the engine's
`weight_version` is the base model's then, never the policy's. A segment refused because the
engine no longer holds the adapter (it restarted) is sent again once the adapter is reloaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.proto.lineage import merge
from asyncrl.proto.openai import SEED_MOD
from asyncrl.proto.sglang import lora_not_loaded
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import EngineFailure, EngineRejected, Generation
from asyncrl.services.transport.weights import parse_weight_version, weight_version_name

SEED_STRIDE = 1_000_003  # spreads a sampling_seed over samples and segments (a prime)
# A segment refused for an adapter its engine lost goes again after a reload at most this many
# times: an engine that loses it again each time is failing, and the group moves on.
ADAPTER_RELOADS = 2


class TooManyAborts(EngineFailure):
    """A sample was aborted by weight updates more times than `max_resubmits` allows."""


@dataclass
class Draft:
    """A generated sample before scoring."""

    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    lineage: dict[int, int] = field(default_factory=dict)  # epoch -> newest version (proto/lineage.py)
    finish_reason: str = "length"
    engine_text: str = ""  # the engine's text of the tokens when one answer made them all, else ""
    text: str = ""  # the sample's text: `sample_text` (an episode's: its final answer)
    segments: int = 0  # engine answers the tokens came in (more than one after a weight-update abort)
    # Episodes (services/rollout/groups/episodes.py): which tokens the policy sampled, turns, rewards.
    loss_mask: list[int] | None = None
    turn_starts: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    env_reward: float | None = None  # the environment judged the episode (no verifier)
    details: dict = field(default_factory=dict)
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None


def moved_seed(seed: int, offset: int) -> int:
    """A sampling seed moved by `offset` strides: distinct, reproducible streams per sample and segment."""
    return (seed + SEED_STRIDE * offset) % SEED_MOD


async def generate_resuming(
    engines,
    engine,
    weights,
    prompts: list[list[int]],
    drafts: list[Draft],
    budgets: list[int],
    params_for: Callable[[Draft, int], dict],
    *,
    rids: set[str],
    max_resubmits: int,
    context_length: int,
    initial_version: int,
) -> None:
    """Generate `drafts[i]` from `prompts[i] + drafts[i].tokens` on `engine` until each stops or
    holds `budgets[i]` tokens (counted from the draft's start, so an episode's turn passes the
    tokens before it plus its own budget). `params_for(draft, segment)` gives a segment's
    sampling parameters; `max_new_tokens` is set here. Raises `TooManyAborts` after
    `max_resubmits` resubmissions of the same samples; engine errors pass through.
    `weights` (a `WeightSync`, or None) holds every segment while the weights change."""
    pending = list(range(len(drafts)))
    for segment in range(max_resubmits + 1):
        bodies = [prompts[i] + drafts[i].tokens for i in pending]
        params = [
            {**params_for(drafts[i], segment), "max_new_tokens": budgets[i] - len(drafts[i].tokens)}
            for i in pending
        ]
        if weights is not None:
            await weights.ready.wait()  # never start a segment while the weights change
        gens, label = await _segment(engines, engine, weights, bodies, params, rids)
        pending = [
            i
            for i, gen in zip(pending, gens)
            if _extend(drafts[i], gen, budgets[i], len(prompts[i]), context_length, initial_version, label)
        ]
        if not pending:
            return
        m.RESUBMITS.inc(len(pending))
    raise TooManyAborts(f"aborted by weight updates {max_resubmits + 1} times")


async def _segment(
    engines, engine, weights, bodies: list[list[int]], params: list[dict], rids: set[str]
) -> tuple[list[Generation], str | None]:
    """One segment's request, and the version name its tokens carry (None: the engine's own
    `weight_version`s). With LoRA it names the newest adapter the engine holds; refused because
    the engine lost it, the adapter is reloaded and the request sent again."""
    for attempt in range(ADAPTER_RELOADS + 1):
        lease = weights.lease(engine, rids) if weights is not None else None
        if lease is None:
            return await engines.generate(engine, bodies, params, rids), None
        try:
            gens = await engines.generate(engine, bodies, params, lease.rids, lora=lease.name)
            return gens, weight_version_name(lease.version, lease.epoch)
        except EngineRejected as exc:
            if lease.name not in lora_not_loaded(str(exc)):
                raise
            if attempt == ADAPTER_RELOADS:  # the engine's fault, not the request's: the group moves on
                raise EngineFailure(
                    f"{engine.url} lost adapter {lease.name} again after {ADAPTER_RELOADS} reloads"
                ) from exc
        finally:
            weights.release(lease)
        await weights.recover(engine, lease.name)
    raise AssertionError("unreachable: the last attempt returns or raises")


def sample_text(tokenizer, d: Draft, params: dict) -> str:
    """The text of all of `d`'s tokens, as SGLang gives it: the engine's own when one answer made
    them (its rules: a matched stop token trimmed, special tokens skipped); else the tokens
    decoded by the same rules (`no_stop_trim`, `skip_special_tokens` from `params`)."""
    if d.segments == 1:
        return d.engine_text
    skip = params.get("skip_special_tokens", True)
    if d.finish_reason != "stop" or params.get("no_stop_trim"):
        return tokenizer.decode(d.tokens, skip_special_tokens=skip)
    stops = params.get("stop") or []
    text = tokenizer.decode(d.tokens, skip_special_tokens=skip)
    cuts = [text.find(s) for s in ([stops] if isinstance(stops, str) else stops) if s and s in text]
    if cuts:  # it ended at a stop string: the text before it (the tokens stay)
        return text[: min(cuts)]
    return tokenizer.decode(d.tokens[:-1], skip_special_tokens=skip)  # at a stop token


def _version(name: str | None, initial_version: int) -> tuple[int, int]:
    """`(version, epoch)` of an engine's weight version name (SGLang starts at "default")."""
    return parse_weight_version(name) or (initial_version, 0)


def _extend(
    d: Draft,
    gen,
    budget: int,
    prompt_len: int,
    context_length: int,
    initial_version: int,
    label: str | None = None,
) -> bool:
    """Append one segment's tokens (each with the version that sampled it: `label`, the
    adapter's, when the request named one); True when the sample was aborted with budget left
    and must be resubmitted."""
    n = len(gen.output_ids)
    names = [label] * n if label is not None else gen.token_versions or [gen.weight_version] * n
    parsed = {name: _version(name, initial_version) for name in set(names)}
    d.segments += 1
    d.engine_text = gen.text if d.segments == 1 else ""
    d.tokens += gen.output_ids
    d.logprobs += gen.logprobs
    d.versions += [parsed[name][0] for name in names]
    if d.loss_mask is not None:  # an episode's turn: the policy sampled these
        d.loss_mask += [1] * n
    for version, epoch in parsed.values():
        merge(d.lineage, {epoch: version})
    if n and d.first_token is None:
        d.first_token = time.time()
    if gen.finish_reason != "abort":
        d.finish_reason, d.finished = gen.finish_reason, time.time()
        return False
    m.ABORTS.inc()
    if len(d.tokens) >= budget or prompt_len + len(d.tokens) >= context_length:
        d.finish_reason, d.finished = "length", time.time()
        return False
    return True
