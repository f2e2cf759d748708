"""The trainer's parts, built once per worker: model, optimizer, buffer, publishers, checkpoints.

Rank 0 alone talks to Redis, writes weights and checkpoints and serves /metrics; every rank
holds its FSDP shard and takes part in the collectives (state-dict gathers, broadcasts).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from asyncrl.proto import WeightsInfo
from asyncrl.services.runtime.auth import engine_token
from asyncrl.services.runtime.cores import CoreShare, cpu_count
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.runtime.metrics import serve_metrics
from asyncrl.services.transport.weights import adapter_name
from asyncrl.trainer import metrics as tm
from asyncrl.trainer.batch import Shaping
from asyncrl.trainer.checkpoint import Checkpointer
from asyncrl.trainer.config import TrainerSettings
from asyncrl.trainer.data import GroupSource
from asyncrl.trainer.lora import adapter_config, adapter_state_dict
from asyncrl.trainer.model import (
    DTYPES,
    Dist,
    build_model,
    full_state_dict,
    resolve_mixed_precision,
    share_cores,
)
from asyncrl.trainer.publish import BroadcastPublisher, DiskPublisher, cast_state, detach_from
from asyncrl.trainer.schedule import build_scheduler
from asyncrl.trainer.step import StepConfig
from asyncrl.trainer.tracking import Tracker, build_tracker

if TYPE_CHECKING:
    from asyncrl.buffer import AdmissionControl, Groups, PolicyVersions

log = logging.getLogger("asyncrl.trainer")


@dataclass
class Parts:
    cfg: TrainerSettings
    ranks: Dist  # this process: rank, world size, device, backend
    model: nn.Module
    ref_model: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler  # steps once per version (trainer/schedule.py)
    step_cfg: StepConfig
    source: GroupSource
    ckpt: Checkpointer
    groups: Groups | None  # rank 0: the trainer's consumer of the buffer
    versions: PolicyVersions | None  # rank 0: versions, weight locations and lineage in the buffer
    admission: AdmissionControl | None  # rank 0
    disk: DiskPublisher | None
    broadcast: BroadcastPublisher | None
    status: tm.TrainerStatus  # what /healthz reports
    pad_id: int
    audit_path: Path | None
    tracker: Tracker | None = None  # rank 0's W&B run when [trainer.wandb] is enabled
    fetch_evaluations: Callable[[], list[dict]] | None = None  # evaluation summaries for the tracker
    epoch: int = 0  # the run's history this trainer writes (proto/lineage.py); set by `resume`
    cores: CoreShare | None = None  # [trainer] core_share: the engine's core while it idles

    # rank 0, `publish_background`: the disk write of the newest version, running while the next step trains
    _shipping: Future | None = field(default=None, init=False, repr=False)
    _shipper: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    def publish(self, version: int, rollback: bool = False) -> None:
        """Collective: gather the full weights (with LoRA, the adapter alone: the frozen base is
        never gathered), then rank 0 ships them and announces `version`.

        With `publish_background` (disk only), rank 0 hands a snapshot of the weights to one
        writer thread and returns: the directory is written, fsynced and announced while the
        next step trains, so `version` moves a write's time (~ms) after the step, not before the
        next one starts. One write at a time, in version order: a publish first waits for the
        previous one and raises its error (so does `finish_publishing`). A rollback (resume)
        publishes in the foreground."""
        if self.cfg.publish == "none":
            if self.versions is not None:
                self.versions.set_version(version)
            return
        t0 = time.perf_counter()
        state = adapter_state_dict(self.model) if self.cfg.lora.enabled else full_state_dict(self.model)
        if not self.ranks.is_main:
            return
        state = cast_state(state, DTYPES[self.cfg.publish_dtype])
        self.finish_publishing()
        background = self.disk is not None and self.cfg.publish_background and not rollback
        if background or (self.disk or self.broadcast).delta:
            # the next step updates the live tensors in place (a delta publisher also keeps them)
            state = detach_from(state, self.model)
        if background:
            if self._shipper is None:
                self._shipper = ThreadPoolExecutor(1, thread_name_prefix="weights-publish")
            self._shipping = self._shipper.submit(self._ship, version, state, rollback, t0)
            self._shipping.add_done_callback(
                partial(_log_failed_publish, version)
            )  # seen even if never awaited
        else:
            self._ship(version, state, rollback, t0)

    def finish_publishing(self) -> None:
        """Rank 0: wait for a background publish; raises what it raised."""
        shipping, self._shipping = self._shipping, None
        if shipping is not None:
            shipping.result()

    def _ship(self, version: int, state: dict[str, torch.Tensor], rollback: bool, t0: float) -> None:
        if self.disk is not None:
            out = self.disk.write(version, state, self.epoch)
            lora = self.cfg.lora.enabled
            info = WeightsInfo(
                version=version,
                epoch=self.epoch,
                method="disk",
                path=out.path,
                published_at=time.time(),
                kind="lora" if lora else "full",
                adapter_name=adapter_name(self.cfg.run, version, self.epoch) if lora else None,
            )
        else:
            out = self.broadcast.publish(version, state, self.epoch)
            info = WeightsInfo(
                version=version,
                epoch=self.epoch,
                method="distributed",
                published_at=time.time(),
                extra={"group_name": self.broadcast.group_name},
            )
        self.versions.publish(info, rollback=rollback, set_version=True)  # announced, then `version` set
        seconds = time.perf_counter() - t0
        tm.PUBLISH_SECONDS.labels(info.method).observe(seconds)
        tm.PUBLISH_BYTES.labels(info.method).inc(out.nbytes)
        log_event(
            log,
            "weights published",
            version=version,
            epoch=self.epoch,
            method=info.method,
            bytes=out.nbytes,
            seconds=round(seconds, 4),
            path=info.path,
        )

    def audit(self, event: str, version: int, **fields) -> None:
        """Rank 0: append one JSON line (one write: a killed process leaves whole lines)."""
        if self.audit_path is None or not self.ranks.is_main:
            return
        line = json.dumps({"event": event, "version": version, "t": time.time(), **fields}) + "\n"
        fd = os.open(self.audit_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _log_failed_publish(version: int, shipping: Future) -> None:
    if not shipping.cancelled() and shipping.exception() is not None:
        tm.PUBLISH_FAILURES.inc()
        log_event(
            log, "weights publish failed", logging.ERROR, version=version, error=repr(shipping.exception())
        )


def step_config(cfg: TrainerSettings) -> StepConfig:
    """What one policy step needs of the trainer's settings."""
    return StepConfig(
        loss=cfg.loss,
        temperature=cfg.temperature,
        grad_clip=cfg.grad_clip,
        minibatches=cfg.minibatches,
        kl_coef=cfg.kl_coef,
        kl_kind=cfg.kl_kind,
        entropy_coef=cfg.entropy_coef,
        chunk_tokens=cfg.logprob_chunk_tokens,
    )


def build(cfg: TrainerSettings, ranks: Dist) -> Parts:
    from transformers import AutoConfig

    if cfg.core_share is not None and (ranks.world > 1 or ranks.device.type != "cpu"):
        # refused before anything loads, starts a W&B run or writes the output directory
        raise ValueError(
            f"core_share is for one CPU rank beside a CPU engine (this trainer: {ranks.world} ranks on "
            f"{ranks.device.type}); unset it"
        )
    out = Path(cfg.output_dir)
    if ranks.is_main:
        out.mkdir(parents=True, exist_ok=True)
    tracker = build_tracker(
        cfg, ranks.rank, ranks.world, ranks.backend
    )  # enabled without wandb: stop before the model loads
    compute_dtype = resolve_mixed_precision(cfg.mixed_precision, ranks.device)
    if ranks.is_main:
        log_event(
            log, "compute dtype", setting=cfg.mixed_precision, dtype=compute_dtype, device=ranks.device.type
        )
    model = build_model(
        cfg.model_path,
        ranks,
        random_init=cfg.random_init,
        seed=cfg.seed,
        mixed_precision=compute_dtype,
        activation_checkpointing=cfg.activation_checkpointing,
        packing=cfg.max_tokens_per_micro_batch > 0,
        lora=cfg.lora,
    )
    ref_model = None
    if cfg.kl_coef > 0 and not cfg.lora.enabled:  # with LoRA the reference is the base: adapters off
        ref_model = build_model(
            cfg.model_path,
            ranks,
            random_init=cfg.random_init,
            seed=cfg.seed,
            mixed_precision=compute_dtype,
            trainable=False,
            packing=cfg.max_tokens_per_micro_batch > 0,
        )
    cores = None
    if cfg.core_share is not None:
        home = torch.get_num_threads()
        cores = CoreShare(
            cfg.core_share, "trainer", home=home, total=max(cfg.core_share_threads or cpu_count(), home)
        )
        for m in (model, ref_model):
            if m is not None:
                share_cores(m, cores)
        log_event(log, "core sharing", file=cfg.core_share, home=home, total=cores.total)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # with LoRA: the adapters alone
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    scheduler = build_scheduler(
        optimizer, cfg.lr_schedule, cfg.lr_warmup_steps, cfg.lr_decay_steps or cfg.max_steps, cfg.lr_min_ratio
    )
    step_cfg = step_config(cfg)
    shaping = Shaping(cfg.overlong_max_len, cfg.overlong_cache_len, cfg.overlong_factor)
    groups = versions = admission = disk = broadcast = None
    status = tm.TrainerStatus()
    if ranks.is_main:
        from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions

        buf = Buffer(cfg.redis_url, run=cfg.run)
        groups, versions = Groups(buf, consumer=cfg.consumer), PolicyVersions(buf)
        admission = AdmissionControl(buf, cfg.batch_groups, cfg.max_staleness)
        admission.configure(batch_groups=cfg.batch_groups, max_staleness=cfg.max_staleness)
        if cfg.publish == "disk":
            disk = DiskPublisher(
                out / "weights",
                cfg.model_path,
                keep=cfg.keep_weights,
                delta=cfg.publish_delta,
                anchor_every=cfg.delta_anchor_every,
                granularity=cfg.delta_granularity,
                block_elems=cfg.delta_block_elems,
                adapter_config=adapter_config(model, cfg.model_path) if cfg.lora.enabled else None,
            )
        elif cfg.publish == "distributed":
            from asyncrl.buffer.server import free_port

            backend = cfg.broadcast_backend if cfg.broadcast_backend != "auto" else ranks.backend
            broadcast = BroadcastPublisher(
                cfg.engine_urls,
                cfg.broadcast_master_addr,
                cfg.broadcast_port or free_port(),
                backend,
                cfg.bucket_mb << 20,
                group_name=f"asyncrl-{cfg.run}-{time.time_ns()}",
                api_token=engine_token(),
                delta=cfg.publish_delta,
                anchor_every=cfg.delta_anchor_every,
            )
            # a fresh group name per trainer start: engines still hold the dead group of a crashed one
        if cfg.metrics_port:
            serve_metrics(
                cfg.metrics_host,
                cfg.metrics_port,
                json_routes={"/healthz": status.as_dict},
                thread_name="trainer-metrics",
            )
    source = GroupSource(
        ranks,
        groups,
        cfg.batch_groups,
        cfg.max_staleness,
        cfg.staleness_policy,
        cfg.block_ms,
        cfg.dynamic_sampling,
        shaping if cfg.overlong_max_len else None,
        cfg.heartbeat_s,
        prefill=cfg.prefill_groups,
    )
    pad_id = AutoConfig.from_pretrained(cfg.model_path).pad_token_id or 0
    fetch = None
    if tracker is not None and ranks.is_main:
        from asyncrl.buffer import EvalStore

        evals = EvalStore(cfg.redis_url, run=cfg.run)  # the rollout service's evaluations of this run

        def fetch() -> list[dict]:
            return [e.model_dump() for e in evals.list()]

    return Parts(
        cfg,
        ranks,
        model,
        ref_model,
        optimizer,
        scheduler,
        step_cfg,
        source,
        Checkpointer(out / "checkpoints", ranks, cfg.keep_checkpoints),
        groups,
        versions,
        admission,
        disk,
        broadcast,
        status,
        int(pad_id),
        out / "trained.jsonl" if cfg.audit_log else None,
        tracker,
        fetch,
        cores=cores,
    )
