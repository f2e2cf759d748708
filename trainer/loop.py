"""The trainer loop (docs/architecture.md §6), read top to bottom as the algorithm:

    resume from the last durable checkpoint (ack what it covers, reclaim what it does not)
    repeat:  take B groups (staleness rule) → log π_old (μ if bypass; the update's own
             forward if one minibatch; else a recompute)
             → advantages → minibatch steps → v += 1 → publish weights
             → every k steps: checkpoint, then XACK the groups it covers

Exactly-once: a group is acked only after the checkpoint holding its update is durable; after a
crash the groups consumed since that checkpoint are redelivered (`Groups.recover`) and trained
again from the same version, so each group is in the surviving lineage exactly once.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext

import torch

from asyncrl.buffer.groups import sampled_lineage
from asyncrl.proto.states import GroupState
from asyncrl.services.runtime.logging import log_event
from asyncrl.trainer import metrics as tm
from asyncrl.trainer.batch import build_rows, micro_batches, zero_spread_groups
from asyncrl.trainer.model import broadcast_from_main
from asyncrl.trainer.parts import Parts
from asyncrl.trainer.step import policy_step, recompute_logprobs, reference_logprobs

log = logging.getLogger("asyncrl.trainer")


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


def resume(parts: Parts) -> int:
    """Restore the last durable checkpoint, settle the buffer, return the version.

    Resuming a run opens a new epoch forked at the checkpoint's version (proto/lineage.py):
    what was published above it came from steps this start will redo differently, and the
    buffer drops every group sampled by those lost weights."""
    meta = parts.ckpt.load(parts.model, parts.optimizer, parts.scheduler)
    version = meta.version if meta else 0
    if parts.ranks.is_main and meta is not None and meta.changed:
        log_event(
            log,
            "hyperparameters changed since the checkpoint: the configured ones apply from this update on",
            logging.WARNING,
            version=version,
            changed={k: list(v) for k, v in meta.changed.items()},
        )
    if parts.ranks.is_main:
        if meta is not None or parts.versions.latest() is not None or parts.versions.version() > 0:
            parts.epoch = parts.versions.begin_epoch(version)
        if meta:
            parts.groups.ack(meta.consumed_ids)  # a crash between checkpoint and ack: finish the ack
        reclaimed = parts.groups.recover(0)  # consumed after the checkpoint: train them again
        parts.groups.sweep_payloads()  # cluster: payloads an exit cut off before its UNLINK left behind
        accepted = parts.admission.rebuild(version)
        log_event(
            log,
            "trainer resumed",
            version=version,
            epoch=parts.epoch,
            reclaimed=reclaimed,
            accepted=accepted,
            checkpoint=str(meta.path) if meta else None,
        )
        parts.audit("resume", version, epoch=parts.epoch, reclaimed=reclaimed)
    epoch = torch.tensor([parts.epoch], dtype=torch.long)
    broadcast_from_main(parts.ranks, epoch)  # rank 0 alone reads the buffer; publishing is collective
    parts.epoch = int(epoch)
    if parts.epoch > 0:
        parts.publish(version, rollback=True)  # engines may hold weights of a lost, uncheckpointed step
    return version


def train(parts: Parts) -> int:
    """The steps, inside rank 0's W&B run when tracking is on: the run is finished however the
    steps end (exit code 1 when an exception leaves them)."""
    with parts.tracker if parts.tracker is not None else nullcontext():
        return train_steps(parts)


def train_steps(parts: Parts) -> int:
    cfg, ranks = parts.cfg, parts.ranks
    version, consumed = resume(parts), []
    parts.status.state, parts.status.version = "training", version
    tm.VERSION.set(version)
    while cfg.max_steps == 0 or version < cfg.max_steps:
        timer, t_step = PhaseTimer(), time.perf_counter()
        with timer("wait"):
            if parts.cores is not None:
                parts.cores.rest()  # the engine may generate on every core meanwhile
            taken = parts.source.next(version)
            if parts.cores is not None:
                parts.cores.work()  # its borrowed core back before computing (waits at most a step of it)
        if taken.stop:
            break
        with timer("recompute"):
            rows = build_rows(taken.groups, cfg.advantage, parts.source.shaping)
            micro = micro_batches(
                rows.rows,
                ranks.rank,
                ranks.world,
                cfg.minibatches,
                cfg.micro_batch_size,
                parts.pad_id,
                ranks.device,
                cfg.max_tokens_per_micro_batch,
                cfg.share_prompts,
            )
            old = old_logprobs(parts, micro)
            ref = (
                reference_logprobs(
                    parts.model, parts.ref_model, micro, cfg.temperature, cfg.logprob_chunk_tokens
                )
                if cfg.kl_coef > 0
                else [None] * len(micro)
            )
        stats = policy_step(parts.model, parts.optimizer, micro, old, ref, parts.step_cfg, ranks.device)
        if parts.cores is not None:
            parts.cores.work()  # the layers' hooks check in; the LM head and AdamW since then do not
        stats["lr"] = parts.scheduler.get_last_lr()[0]  # the lr this version's update used
        parts.scheduler.step()  # once per version (trainer/schedule.py), before a checkpoint saves it
        timer.seconds["forward_backward"] = stats.pop("forward_backward_s")
        timer.seconds["optimizer"] = stats.pop("optimizer_s")
        version += 1
        with timer("publish"):
            parts.publish(version)
        ids = [g.group_id for g in taken.groups]
        consumed += ids
        if ranks.is_main:  # their jobs' progress shows them trained now, durable at the checkpoint
            parts.groups.stepped(ids, version)
        parts.audit(
            "step",
            version,
            groups=ids,
            sampled=[sampled_lineage(g) for g in taken.groups],
            dropped=taken.dropped,
            lost=taken.lost,
            discarded=taken.discarded,
            withheld=[g.group_id for g in taken.withheld],
            dead_lettered=taken.dead_lettered,
        )
        if version % cfg.checkpoint_every == 0 or version == cfg.max_steps:
            with timer("checkpoint"):
                checkpoint_and_ack(parts, version, consumed)
            consumed = []
        record(parts, version, taken, rows, stats, timer.seconds, time.perf_counter() - t_step)
    if consumed:  # stopped between checkpoints: make the last steps durable before leaving
        checkpoint_and_ack(parts, version, consumed)
    if ranks.is_main:
        parts.finish_publishing()  # the last version is announced before the trainer says it stopped
    parts.status.state = "stopped"
    return 0


def old_logprobs(parts: Parts, micro) -> list:
    """log π_old per micro-batch. Bypass: μ itself. One minibatch: π_old is π_θ before its only
    update, i.e. the training forward's own logprobs, detached; `policy_step` takes them from
    there (None here), which is the decoupled loss at no extra forward. Otherwise: recompute."""
    if parts.cfg.bypass:
        return [mb.behavior_logprobs for mb in micro]
    if parts.cfg.minibatches == 1:
        return [None] * len(micro)
    return recompute_logprobs(parts.model, micro, parts.cfg.temperature, parts.cfg.logprob_chunk_tokens)


def checkpoint_and_ack(parts: Parts, version: int, consumed: list[str]) -> None:
    parts.ckpt.save(parts.model, parts.optimizer, parts.scheduler, version, consumed)
    if parts.ranks.is_main:
        acked = parts.groups.ack(consumed)  # only now: the update of these groups is durable
        tm.CHECKPOINTS.inc()
        parts.audit("checkpoint", version, acked=len(consumed))
        log_event(log, "checkpoint", version=version, groups=len(consumed), acked=acked)


def record(parts: Parts, version: int, taken, rows, stats: dict, phases: dict, step_s: float) -> None:
    """Rank 0: step metrics to Prometheus, one log line and, when tracking is on, W&B (with the
    evaluations finished since the last step)."""
    if not parts.ranks.is_main:
        return
    busy = max(step_s - phases.get("wait", 0.0), 1e-9)
    for phase, s in phases.items():
        tm.PHASE_SECONDS.labels(phase).observe(s)
    tm.STEPS.inc()
    tm.STEP_SECONDS.set(step_s)
    tm.IDLE_RATIO.set(phases.get("wait", 0.0) / max(step_s, 1e-9))
    tm.IDLE_SECONDS.inc(phases.get("wait", 0.0))
    tm.BUSY_SECONDS.inc(busy)
    tm.TOKENS.inc(stats["tokens"])
    tm.TOKENS_PER_SECOND.set(stats["tokens"] / busy)
    tm.GROUPS.labels(GroupState.trained.value).inc(len(taken.groups))
    for reason, n in rows.masked.items():
        tm.SAMPLES_MASKED.labels(reason).inc(n)
    for s in taken.staleness:
        tm.STALENESS.observe(s)
    for n in rows.lengths:
        tm.RESPONSE_LENGTH.observe(n)
    truncation = rows.truncated / max(len(rows.rows), 1)
    zero_spread = sum(zero_spread_groups(taken.groups)) + len(taken.discarded)
    tm.TRUNCATION.set(truncation)
    tm.ZERO_SPREAD.set(zero_spread)
    withheld_rewards = [r for g in taken.withheld for r in g.rewards if r is not None]
    all_rewards = rows.rewards + withheld_rewards
    reward_mean = sum(all_rewards) / len(all_rewards) if all_rewards else 0.0
    gauges = {
        "loss": stats["loss"],
        "clip_fraction": stats["clip_frac"],
        "is_weight_mean": stats["is_weight_mean"],
        "is_weight_max": stats["is_weight_max"],
        "is_masked_fraction": stats["is_masked_frac"],
        "mismatch_kl": stats["mismatch_kl"],
        "approx_kl": stats["approx_kl"],
        "entropy": stats["entropy"],
        "ref_kl": stats["ref_kl"],
        "grad_norm": stats["grad_norm"],
        "reward_mean": reward_mean,
        "lr": stats["lr"],
    }
    tm.observe_step(gauges)
    tm.VERSION.set(version)  # last: a scrape that sees version v sees step v's figures
    parts.status.version, parts.status.last_step_at = version, time.time()
    log_event(
        log,
        "step",
        version=version,
        groups=len(taken.groups),
        tokens=int(stats["tokens"]),
        step_s=round(step_s, 4),
        **{k: round(v, 6) for k, v in gauges.items() if k != "lr"},
        lr=float(f"{stats['lr']:.6g}"),  # ~1e-6: six decimals would print 0
        **{f"{k}_s": round(v, 4) for k, v in phases.items()},
    )
    if parts.tracker is not None:
        parts.tracker.log_step(
            version,
            {
                **{f"train/{k}": v for k, v in gauges.items()},
                "perf/tokens": stats["tokens"],
                "perf/tokens_per_second": stats["tokens"] / busy,
                "perf/step_seconds": step_s,
                **{f"perf/{k}_seconds": v for k, v in phases.items()},
                "data/staleness_mean": sum(taken.staleness) / max(len(taken.staleness), 1),
                "data/staleness_max": max(taken.staleness, default=0),
                "data/response_length_mean": sum(rows.lengths) / max(len(rows.lengths), 1),
                "data/truncation_rate": truncation,
                "data/zero_spread_groups": zero_spread,
                "data/groups_trained": len(taken.groups),
                "data/groups_dropped": len(taken.dropped),
            },
        )
        if parts.fetch_evaluations is not None:
            parts.tracker.log_evaluations(parts.fetch_evaluations)
