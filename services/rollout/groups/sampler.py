"""A group's generation on the engine the scheduler picked for it, the one generate path of its
samples: a one-turn group's batch and each turn of an episode go through `GroupSampler.generate`.
It adds to `segments.generate_resuming` only what belongs to a group: its request ids (aborted
when its job is cancelled), a job's `sampling_seed` moved per sample and segment, and too many
weight-update aborts turned into an `EngineFailure` (the scheduler requeues the group)."""

from __future__ import annotations

from asyncrl.services.rollout.clients.engine import EngineClient, EngineEndpoint, EngineFailure
from asyncrl.services.rollout.engine_updates import WeightSync
from asyncrl.services.rollout.segments import Draft, TooManyAborts, generate_resuming, moved_seed


class GroupSampler:
    """Generation for one group on the engine it was given: `segments.generate_resuming` with the
    group's request ids (cancelled with the group) and a job's `sampling_seed` moved per sample
    and segment. What the scheduler hands to whoever makes the group's samples (its own one-turn
    batch, `EpisodeRunner`'s turns)."""

    def __init__(
        self,
        engines: EngineClient,
        engine: EngineEndpoint,
        weights: WeightSync,
        *,
        group_id: str,
        rids: set[str],
        max_resubmits: int,
        context_length: int,
        initial_version: int,
    ):
        self.engines, self.engine, self.weights = engines, engine, weights
        self.group_id, self.rids = group_id, rids
        self.max_resubmits, self.context_length, self.initial_version = (
            max_resubmits,
            context_length,
            initial_version,
        )

    async def generate(
        self,
        prompts: list[list[int]],
        drafts: list[Draft],
        budgets: list[int],
        params: dict,
        first_segment: int = 0,
    ) -> None:
        """Extend `drafts[i]` from `prompts[i]` up to `budgets[i]` tokens (see `generate_resuming`);
        segment numbers count from `first_segment` (an episode's turns apart). Too many
        weight-update aborts are an `EngineFailure` of the group (it is requeued)."""

        def params_for(d: Draft, segment: int) -> dict:
            if "sampling_seed" not in params:
                return params
            return {
                **params,
                "sampling_seed": moved_seed(params["sampling_seed"] + first_segment + segment, d.index + 1),
            }

        try:
            await generate_resuming(
                self.engines,
                self.engine,
                self.weights,
                prompts,
                drafts,
                budgets,
                params_for,
                rids=self.rids,
                max_resubmits=self.max_resubmits,
                context_length=self.context_length,
                initial_version=self.initial_version,
            )
        except TooManyAborts as exc:
            raise EngineFailure(f"samples of {self.group_id} were {exc}") from None
