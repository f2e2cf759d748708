"""Durable, sharded trainer checkpoints: model + optimizer + LR schedule + version + RNG + the
groups they cover.

Layout of `<root>/step_<version:08d>/`:
* `__<rank>_0.distcp`, `.metadata`: torch.distributed.checkpoint (DCP). Every rank writes its own
  FSDP shards of the parameters that train and of their optimizer state (`exp_avg`,
  `exp_avg_sq`, `step`); no rank gathers the full state. A full fine-tune saves the whole model;
  with LoRA only the adapters and their state (the frozen base is the model directory's).
* `extra.pt` (rank 0): every rank's torch RNG state (and CUDA's), rank 0's Python RNG, the
  optimizer's param groups (lr, betas, …) and the LR scheduler's state; tensors and plain
  containers only, so `torch.load(weights_only=True)` reads it.
* `meta.json` (rank 0): version, `consumed_ids`, the world size that wrote it, `saved_at`.

All ranks write into `<root>/.tmp-step_<version:08d>`; once `dcp.save` has returned (its
coordinator writes `.metadata` only after every rank reported its files written), rank 0 writes
`extra.pt` and `meta.json`, fsyncs every file and the directory, renames it into place and
fsyncs `<root>`: a checkpoint directory that exists is complete. `meta.json` lists the ids of
the groups trained since the previous checkpoint; the caller acks them in the buffer only after
`save` returns (exactly-once, docs/architecture.md §4).

Loading: every rank reads the latest checkpoint into a state dict sharded for the current
world (DCP reshards), so a run resumes on a different number of ranks; rank r then takes the
RNG state the saved rank r mod (saved world) had.

Nothing in a checkpoint can run code when it is loaded: the shards are read by DCP with
`torch.load(weights_only=True)`, `extra.pt` likewise, and DCP's own `.metadata` index (a pickle
of DCP's types) by an unpickler that builds only those types and the torch sizes, dtypes,
layouts and paths they hold (`CheckedReader`); anything else in it is refused with
`UnsafeCheckpoint` before any object is built from it.

Limits: `<root>` must be one directory every rank sees (a shared filesystem across nodes; any
directory on one node). DCP does not promise to read checkpoints across torch versions. Weights
published to engines are separate (trainer/publish.py: an HF safetensors directory, or the
broadcast).
"""

from __future__ import annotations

import enum
import io
import json
import os
import pickle
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.optim.lr_scheduler import LRScheduler

from asyncrl.trainer.model import Dist, broadcast_from_main

PREFIX = "step_"

# What DCP's `.metadata` pickle may build (torch 2.13's FileSystemWriter): its own records, and
# the torch sizes, dtypes and layouts and the paths they hold. Names, not modules: a module-wide
# allowance would admit whatever else the module imports.
_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint's `.metadata` asks to build something that is not checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str):
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _METADATA_TYPES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):  # how some Pythons pickle an enum member: by name
            return self._enum_member
        raise UnsafeCheckpoint(
            f"{self.path} refers to {module}.{name}, which is not checkpoint metadata: "
            "refusing to load it (a checkpoint directory written by this trainer never does)"
        )

    def _enum_member(self, cls, name):
        """`getattr` as an enum member's pickle uses it, `getattr(EnumClass, member_name)`, and
        nothing else: a general getattr would reach the methods of the objects built here."""
        if (
            isinstance(cls, type)
            and issubclass(cls, enum.Enum)
            and isinstance(name, str)
            and name in cls.__members__
        ):
            return cls[name]
        raise UnsafeCheckpoint(
            f"{self.path} asks for getattr({type(cls).__name__} object, {name!r}): only an enum "
            "member's lookup is checkpoint metadata"
        )


class CheckedReader(FileSystemReader):
    """DCP's file reader, with its `.metadata` index read by `_MetadataUnpickler` instead of
    `pickle.load`: a tampered checkpoint directory cannot run code in the trainer."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f.read(), str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@dataclass
class CheckpointMeta:
    version: int
    consumed_ids: list[str]
    path: Path | None
    # hyperparameters the configuration changed since the checkpoint: name -> (saved, now)
    changed: dict[str, tuple] = field(default_factory=dict)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_publish_dir(tmp: Path, final: Path, written: list[Path] | None = None) -> None:
    """fsync every file in `tmp` (or only those `written`: a hard link to a file fsynced before
    needs none, the fsync of `tmp` makes its entry durable) and `tmp` itself, rename it to
    `final`, fsync the parent."""
    for f in written if written is not None else (f for f in tmp.rglob("*") if f.is_file()):
        fsync_file(f)
    fsync_dir(tmp)
    if final.exists():  # a re-run of the same version after a crash: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def trained_state(model: nn.Module, state: dict) -> dict:
    """`state` (a model state dict) without the frozen parameters, under every name they have: a
    checkpoint holds what trains (with LoRA, the adapters: the frozen base is the model
    directory's, loaded again at every start). torch's `ignore_frozen_params` would keep a tied
    alias of a frozen weight (the LM head of tied embeddings: the whole embedding matrix)."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


class Checkpointer:
    def __init__(self, root: str | Path, ranks: Dist, keep: int = 2):
        self.root = Path(root)
        self.ranks = ranks
        self.keep = keep
        if ranks.is_main:
            self.root.mkdir(parents=True, exist_ok=True)

    def _complete(self) -> list[Path]:
        dirs = [p for p in self.root.glob(PREFIX + "*") if (p / "meta.json").exists()]
        return sorted(dirs, key=lambda p: int(p.name[len(PREFIX) :]))

    def latest(self) -> Path | None:
        done = self._complete()
        return done[-1] if done else None

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        """[world, n]: every rank's `mine` (the same shape on every rank). Collective."""
        dev = self.ranks.device if self.ranks.backend == "nccl" else torch.device("cpu")
        out = [torch.empty_like(mine, device=dev) for _ in range(self.ranks.world)]
        dist.all_gather(out, mine.to(dev))
        return torch.stack([t.cpu() for t in out])

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler,
        version: int,
        consumed_ids: list[str],
    ) -> Path | None:
        """Collective. Returns the durable directory on rank 0 (None elsewhere)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's shards (DTensors), no gather
        model_sd = trained_state(model, model_sd)
        cuda = self.ranks.device.type == "cuda"
        python_rng = random.getstate()
        extra = {
            "rng": self._gather(torch.get_rng_state()),
            "cuda_rng": self._gather(torch.cuda.get_rng_state(self.ranks.device)) if cuda else None,
            "python_rng": list(python_rng[1]),
            "python_rng_gauss": python_rng[2],
            "param_groups": optim_sd["param_groups"],
            "scheduler": scheduler.state_dict(),
        }
        final = self.root / f"{PREFIX}{version:08d}"
        tmp = self.root / f".tmp-{final.name}"  # one name on every rank: they all write into it
        if self.ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash while saving this version
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save({"model": model_sd, "optim": optim_sd["state"]}, checkpoint_id=tmp)
        path = None
        if self.ranks.is_main:
            torch.save(extra, tmp / "extra.pt")
            meta = {
                "version": version,
                "consumed_ids": list(consumed_ids),
                "world": self.ranks.world,
                "saved_at": time.time(),
            }
            (tmp / "meta.json").write_text(json.dumps(meta))
            atomic_publish_dir(tmp, final)
            self._prune()
            path = final
        dist.barrier()
        return path

    def _prune(self) -> None:
        for old in self._complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale_tmp in self.root.glob(".tmp-*"):
            shutil.rmtree(stale_tmp, ignore_errors=True)

    def load(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler
    ) -> CheckpointMeta | None:
        """Collective: restore the latest durable checkpoint into model, optimizer and scheduler
        (and the RNG), resharded for this world; None when there is none."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        latest = self.latest() if self.ranks.is_main else None  # rank 0 decides: all ranks load the same one
        version = torch.tensor([-1 if latest is None else int(latest.name[len(PREFIX) :])], dtype=torch.long)
        broadcast_from_main(self.ranks, version)
        if int(version) < 0:
            return None
        path = self.root / f"{PREFIX}{int(version):08d}"
        seen = self._gather(torch.tensor([(path / ".metadata").is_file()], dtype=torch.uint8))[:, 0]
        if not bool(seen.all()):  # every rank raises, rather than the others waiting in dcp.load
            blind = [r for r, ok in enumerate(seen.tolist()) if not ok]
            raise RuntimeError(
                f"ranks {blind} find no {path / '.metadata'}: checkpoints need a directory every "
                "rank sees, written in this (sharded) format"
            )
        # Freshly made state dicts of this world's shards (the optimizer's state is initialised by
        # a zero-lr step if empty); dcp.load fills them in place from whatever world saved them.
        model_sd, optim_sd = get_state_dict(model, optimizer)
        trained = trained_state(model, model_sd).keys()
        configured = _hyperparameters(optimizer, scheduler)  # what this start's config asks for
        reader = CheckedReader(path)
        # a tampered index raises UnsafeCheckpoint here (dcp.load would wrap it)
        saved = {
            k.removeprefix("model."): tuple(getattr(m, "size", ()))
            for k, m in reader.read_metadata().state_dict_metadata.items()
            if k.startswith("model.")
        }
        wanted = {k: tuple(model_sd[k].shape) for k in trained}
        if saved != wanted:
            differ = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
            raise ValueError(
                f"{path} holds {len(saved)} model tensors, this trainer trains {len(trained)}, "
                f"{len(differ)} of them differing in name or shape (e.g. {differ[:3]}): it was written "
                "with another [trainer.lora] (or without one); restore that setting or start from a "
                "fresh output_dir"
            )
        # the saved parameters are those that train (`save`): they are read in place into model_sd,
        # whose frozen entries load back the values the model has
        dcp.load(
            {"model": {k: model_sd[k] for k in trained}, "optim": optim_sd["state"]},
            checkpoint_id=path,
            storage_reader=reader,
        )
        extra = torch.load(path / "extra.pt", map_location="cpu", weights_only=True)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_sd,
            optim_state_dict={"state": optim_sd["state"], "param_groups": extra["param_groups"]},
        )
        scheduler.load_state_dict(extra["scheduler"])
        changed = _apply_hyperparameters(optimizer, scheduler, configured)
        rng = extra["rng"]
        torch.set_rng_state(rng[self.ranks.rank % rng.shape[0]].clone())
        if extra["cuda_rng"] is not None and self.ranks.device.type == "cuda":
            torch.cuda.set_rng_state(
                extra["cuda_rng"][self.ranks.rank % rng.shape[0]].clone(), self.ranks.device
            )
        if self.ranks.is_main:
            random.setstate((3, tuple(extra["python_rng"]), extra["python_rng_gauss"]))
        meta = json.loads((path / "meta.json").read_text())
        return CheckpointMeta(int(version), list(meta["consumed_ids"]), path, changed)


HYPERPARAMETERS = ("betas", "eps", "weight_decay")  # of an AdamW param group, besides its lr and state


def _hyperparameters(optimizer: torch.optim.Optimizer, scheduler: LRScheduler) -> list[dict]:
    """Per param group: the configured peak lr (the scheduler's base lr) and the other
    hyperparameters, as built from this start's config."""
    return [
        {**{k: g[k] for k in HYPERPARAMETERS if k in g}, "lr": base}
        for g, base in zip(optimizer.param_groups, scheduler.base_lrs)
    ]


def _apply_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: LRScheduler, configured: list[dict]
) -> dict[str, tuple]:
    """After a load: the configured hyperparameters replace the saved ones (the checkpoint holds
    the state: moments, step counts, the schedule's position), and the lr of the next update is
    the configured peak times the schedule's factor there. Unchanged, this is the saved lr
    exactly (an exact continuation). Returns what changed: name -> (saved, configured)."""
    changed: dict[str, tuple] = {}
    for i, (group, want) in enumerate(zip(optimizer.param_groups, configured)):
        suffix = f"[{i}]" if len(configured) > 1 else ""
        if scheduler.base_lrs[i] != want["lr"]:
            changed["lr" + suffix] = (scheduler.base_lrs[i], want["lr"])
            scheduler.base_lrs[i] = group["initial_lr"] = want["lr"]
            group["lr"] = want["lr"] * scheduler.lr_lambdas[i](scheduler.last_epoch)
        for k in HYPERPARAMETERS:
            if k in want and _plain(group.get(k)) != _plain(want[k]):
                changed[k + suffix] = (group.get(k), want[k])
                group[k] = want[k]
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # what get_last_lr() reports
    return changed


def _plain(value):
    """betas compare as a tuple whether a load gave a list or a tuple."""
    return tuple(value) if isinstance(value, (list, tuple)) else value
