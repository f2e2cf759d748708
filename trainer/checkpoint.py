"""Durable trainer checkpoints: model + optimizer + version + RNG + the groups they cover.

Layout: `<root>/step_<version:08d>/{state.pt, meta.json}`. Rank 0 writes full (unsharded)
state dicts with `torch.save` (tensors and plain containers only: `torch.load(weights_only=True)`
reads them back) into `<root>/.tmp-…`, fsyncs every file and the directory, then renames it
into place and fsyncs `<root>`: a checkpoint directory that exists is complete. `meta.json`
lists the ids of the groups trained since the previous checkpoint; the caller acks them in the
buffer only after `save` returns (exactly-once, docs/architecture.md §4).

Limits: full state dicts pass through rank 0's CPU memory (fine to a few billion parameters;
use DCP sharded checkpoints beyond). Only rank 0 touches `<root>`: loading reads there and
broadcasts, so the directory need not be on a shared filesystem.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer.model import Dist, broadcast_from_main

PREFIX = "step_"


@dataclass
class CheckpointMeta:
    version: int
    consumed_ids: list[str]
    path: Path | None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_publish_dir(tmp: Path, final: Path) -> None:
    """fsync every file in `tmp` and `tmp` itself, rename it to `final`, fsync the parent."""
    for f in tmp.rglob("*"):
        if f.is_file():
            fsync_file(f)
    fsync_dir(tmp)
    if final.exists():  # a re-run of the same version after a crash: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


class Checkpointer:
    def __init__(self, root: str | Path, d: Dist, keep: int = 2):
        self.root = Path(root)
        self.d = d
        self.keep = keep
        if d.is_main:
            self.root.mkdir(parents=True, exist_ok=True)

    def _complete(self) -> list[Path]:
        dirs = [p for p in self.root.glob(PREFIX + "*") if (p / "meta.json").exists() and (p / "state.pt").exists()]
        return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]))

    def latest(self) -> Path | None:
        done = self._complete()
        return done[-1] if done else None

    def _rng_states(self) -> torch.Tensor:
        """[world, n] uint8: every rank's torch CPU RNG state, gathered (collective)."""
        mine = torch.get_rng_state()
        dev = self.d.device if self.d.backend == "nccl" else torch.device("cpu")
        out = [torch.empty_like(mine, device=dev) for _ in range(self.d.world)]
        dist.all_gather(out, mine.to(dev))
        return torch.stack([t.cpu() for t in out])

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, version: int, consumed_ids: list[str],
             extra: dict | None = None) -> Path | None:  # fmt: skip
        """Collective. Returns the durable directory on rank 0 (None elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        rng = self._rng_states()
        path = None
        if self.d.is_main:
            final = self.root / f"{PREFIX}{version:08d}"
            tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            state = {"model": model_sd, "optim": optim_sd, "rng": rng, "python_rng": list(random.getstate()[1]),
                     "python_rng_pos": random.getstate()[2], "cuda_rng": self._cuda_rng()}  # fmt: skip
            torch.save(state, tmp / "state.pt")
            meta = {"version": version, "consumed_ids": list(consumed_ids), "saved_at": time.time(),
                    "world": self.d.world, **(extra or {})}  # fmt: skip
            (tmp / "meta.json").write_text(json.dumps(meta))
            atomic_publish_dir(tmp, final)
            self._prune()
            path = final
        dist.barrier()
        return path

    def _cuda_rng(self) -> torch.Tensor | None:
        return torch.cuda.get_rng_state(self.d.device) if self.d.device.type == "cuda" else None

    def _prune(self) -> None:
        for old in self._complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale_tmp in self.root.glob(".tmp-*"):
            shutil.rmtree(stale_tmp, ignore_errors=True)

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> CheckpointMeta | None:
        """Collective: restore the latest durable checkpoint into model and optimizer, or None."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = self.latest() if self.d.is_main else None
        version = torch.tensor([-1 if path is None else int(path.name[len(PREFIX):])], dtype=torch.long)
        broadcast_from_main(self.d, version)
        if int(version) < 0:
            return None
        state, meta = {}, {}
        if self.d.is_main:
            state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
            meta = json.loads((path / "meta.json").read_text())
        # Model and optimizer separately: `set_state_dict` with the empty dicts of ranks ≠ 0
        # takes an optimizer-only path there and the ranks' collectives no longer match.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state.get("model", {}), options=options)
        set_optimizer_state_dict(model, optimizer, state.get("optim", {}), options=options)
        rng = state["rng"] if self.d.is_main else torch.empty(0, dtype=torch.uint8)
        shape = torch.tensor(list(rng.shape) if self.d.is_main else [0, 0], dtype=torch.long)
        broadcast_from_main(self.d, shape)
        if not self.d.is_main:
            rng = torch.empty(tuple(shape.tolist()), dtype=torch.uint8)
        broadcast_from_main(self.d, rng)
        torch.set_rng_state(rng[self.d.rank % rng.shape[0]].clone())
        if self.d.is_main:
            random.setstate((3, tuple(state["python_rng"]), state["python_rng_pos"]))
            if state.get("cuda_rng") is not None and self.d.device.type == "cuda":
                torch.cuda.set_rng_state(state["cuda_rng"], self.d.device)
        return CheckpointMeta(int(version), list(meta.get("consumed_ids", [])), path)
