"""Which GPUs each process `asyncrl up` starts may use: engines first, the trainer after them.

`place` assigns GPU *indices* into the launcher's visible GPUs (`visible_gpus`: what
`CUDA_VISIBLE_DEVICES` lists when the launcher was given one, else `nvidia-smi -L`'s GPUs, or
`[launch] gpus`). Engine i takes indices [i·tp, (i+1)·tp), the trainer the next
`trainer_nproc` ones, one per rank; `engine_gpus` / `trainer_gpus` replace either split. Each
process then gets `CUDA_VISIBLE_DEVICES` naming exactly its GPUs, so SGLang's `--tp-size` ranks
and torchrun's `cuda:LOCAL_RANK` count from 0 inside it.

Refused with `PlacementError`, before anything starts: a GPU given to two processes (an
engine and the trainer, or two engines) unless `allow_shared` says so; an index past the
visible GPUs; a process given the same GPU twice or more GPUs than exist (never allowed, shared
or not: a tp-2 engine on one GPU is not a smaller engine); an explicit list whose length is not
what the engines' tp or the trainer's ranks need. With no GPU visible, placement is a no-op:
every process sees what the launcher sees and nothing is refused.

`check_nccl_weight_group` refuses, even with `allow_shared`, a `distributed` weight publish over
NCCL whose group would hold two ranks on one GPU (trainer rank 0 and an engine, or two engines)
or an engine on the CPU: NCCL cannot run either.

Guarantees only what CUDA_VISIBLE_DEVICES guarantees: a process that resets it, or reads GPUs
through NVML, can still see the others. Torch-free: the launcher imports it.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# `nvidia-smi -L` answers in well under a second; a hung driver must not hang `asyncrl up`
NVIDIA_SMI_TIMEOUT_S = 20.0
TRAINER = "trainer"


class PlacementError(RuntimeError):
    """A GPU placement that would not run, or that shares a GPU nobody asked to share.

    A RuntimeError like the launcher's other refusals at start (a port in use, a weak token),
    so `asyncrl up` and `asyncrl demo` report it as one line and stop."""


@dataclass(frozen=True)
class Placement:
    """GPU indices per process. `devices[i]` is how CUDA_VISIBLE_DEVICES names index i (the
    launcher's own CUDA_VISIBLE_DEVICES entry, or `str(i)`); empty on a machine without GPUs."""

    devices: tuple[str, ...]
    engines: tuple[tuple[int, ...], ...]
    trainer: tuple[int, ...]

    def env(self, gpus: Sequence[int]) -> dict[str, str]:
        """The environment that confines a process to `gpus`: CUDA_VISIBLE_DEVICES naming them
        (empty hides every GPU from a process that uses none). Nothing without GPUs."""
        if not self.devices:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices[g] for g in gpus)}

    def describe(self) -> str:
        """One line for the launcher's log, e.g. `engine-0: GPU 0; trainer: GPUs 1,2`."""
        if not self.devices:
            return "no GPU visible: every process runs with the launcher's environment"
        groups = [(f"engine-{i}", g) for i, g in enumerate(self.engines)] + [(TRAINER, self.trainer)]
        parts = [f"{name}: {_gpus(self.devices, g)}" for name, g in groups if g]
        shared = _shared(groups)
        note = "; shared: " + ", ".join(_gpus(self.devices, [g]) for g in shared) if shared else ""
        return (
            f"GPU placement ({len(self.devices)} visible): " + "; ".join(parts or ["no GPU process"]) + note
        )


def place(
    devices: Sequence[str],
    *,
    engines: int,
    engine_tp: int = 1,
    trainer_nproc: int = 0,
    engine_gpus: Sequence[int] | None = None,
    trainer_gpus: Sequence[int] | None = None,
    allow_shared: bool = False,
) -> Placement:
    """GPU indices for `engines` engines of `engine_tp` GPUs each and a trainer of `trainer_nproc`
    ranks (0: no trainer on a GPU) on the GPUs `devices` names.

    Automatic split: the GPUs no explicit list claims, in order, engines first. With
    `allow_shared` and too few GPUs, what is left over is taken from GPU 0 up again (each
    process still gets distinct GPUs). Raises PlacementError (see the module docstring)."""
    n = len(devices)
    if n == 0:
        return Placement((), tuple(() for _ in range(engines)), ())
    need_engines = engines * engine_tp
    for what, size in (("engine_tp", engine_tp if engines else 0), ("trainer_nproc_per_node", trainer_nproc)):
        if size > n:
            raise PlacementError(
                f"{what} = {size} needs {size} distinct GPUs in one process; {_visible(devices)}"
            )
    _check_list(
        "engine_gpus", engine_gpus, need_engines, f"{engines} GPU engine(s) × engine_tp {engine_tp}", devices
    )
    _check_list(
        "trainer_gpus", trainer_gpus, trainer_nproc, "the trainer's ranks (trainer_nproc_per_node)", devices
    )

    claimed = set(engine_gpus or ()) | set(trainer_gpus or ())
    free = [g for g in range(n) if g not in claimed]
    auto_need = (need_engines if engine_gpus is None else 0) + (trainer_nproc if trainer_gpus is None else 0)
    if auto_need > len(free) and not allow_shared:
        raise PlacementError(
            f"engines ({engines} × engine_tp {engine_tp} = {_count(need_engines)}) and the trainer "
            f"({_count(trainer_nproc)}) need {_count(need_engines + trainer_nproc)}; {_visible(devices)}"
            + (f", {len(claimed)} of them named in engine_gpus/trainer_gpus" if claimed else "")
            + ". Start fewer engines or ranks, or set [launch] allow_shared_gpus = true to share GPUs"
        )

    def take(size: int) -> tuple[int, ...]:
        group = [free.pop(0) for _ in range(min(size, len(free)))]
        group += [g for g in range(n) if g not in group][: size - len(group)]  # sharing (allowed, see above)
        return tuple(sorted(group))

    if engine_gpus is None:
        engine_groups = tuple(take(engine_tp) for _ in range(engines))
    else:
        engine_groups = tuple(tuple(engine_gpus[i * engine_tp : (i + 1) * engine_tp]) for i in range(engines))
    trainer = take(trainer_nproc) if trainer_gpus is None else tuple(trainer_gpus)

    groups = [(f"engine-{i}", g) for i, g in enumerate(engine_groups)] + [(TRAINER, trainer)]
    for name, group in groups:
        if len(set(group)) != len(group):
            raise PlacementError(
                f"{name} is given the same GPU twice ({_gpus(devices, group)}); each of its "
                "ranks needs its own"
            )
    shared = _shared(groups)
    if shared and not allow_shared:
        (gpu, users), *_ = shared.items()
        raise PlacementError(
            f"{_gpus(devices, [gpu])} is given to {' and '.join(users)}"
            + (f" (and {len(shared) - 1} more shared GPU(s))" if len(shared) > 1 else "")
            + ": choose disjoint [launch] engine_gpus and trainer_gpus, or set allow_shared_gpus = true "
            "if they fit in one GPU's memory together"
        )
    return Placement(tuple(devices), engine_groups, trainer)


def visible_gpus(count: int | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs the launcher may hand out, as CUDA_VISIBLE_DEVICES entries: the launcher's own
    CUDA_VISIBLE_DEVICES when set (ids or UUIDs; the first `count` of them when `count` is
    given), else `count` GPUs 0..count-1, else the GPUs `nvidia-smi -L` lists (none without
    nvidia-smi)."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = parse_visible_devices(listed)
        if count is not None and count > len(entries):
            raise PlacementError(
                f"[launch] gpus = {count}, but CUDA_VISIBLE_DEVICES={listed!r} makes {len(entries)} visible"
            )
        return entries if count is None else entries[:count]
    return tuple(str(i) for i in range(detect_gpus() if count is None else count))


def parse_visible_devices(value: str) -> tuple[str, ...]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated ids or UUIDs, up to the first
    invalid entry (an empty or negative one; `-1` is the usual way to hide every GPU)."""
    entries = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return tuple(entries)


def detect_gpus() -> int:
    """GPUs `nvidia-smi -L` lists (MIG instances are not counted: name them in
    CUDA_VISIBLE_DEVICES instead); 0 without nvidia-smi. A failing nvidia-smi is an error, not
    a CPU machine: set `[launch] gpus` to say how many GPUs there are."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run(
            [exe, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise PlacementError(
            f"`nvidia-smi -L` did not answer in {NVIDIA_SMI_TIMEOUT_S:.0f} s; set [launch] gpus (0: CPU)"
        ) from None
    if out.returncode != 0:
        raise PlacementError(
            f"`nvidia-smi -L` failed ({out.returncode}): {out.stderr.strip()[:200]}; "
            "set [launch] gpus (0: CPU)"
        )
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _check_list(name: str, gpus: Sequence[int] | None, need: int, who: str, devices: Sequence[str]) -> None:
    if gpus is None:
        return
    if len(gpus) != need:
        raise PlacementError(f"[launch] {name} lists {len(gpus)} GPU(s); {who} need {need}")
    for g in gpus:
        if not 0 <= g < len(devices):
            raise PlacementError(f"[launch] {name} names GPU {g}; {_visible(devices)}")


def check_nccl_weight_group(p: Placement, *, engines_on_gpu: bool) -> None:
    """A `distributed` publish over NCCL joins trainer rank 0 and every engine rank in one
    group, and NCCL runs one rank per GPU (two on one GPU fail at the first broadcast with
    "Duplicate GPU detected"); an engine on the CPU cannot join NCCL at all. Refuse either
    before anything starts. Nothing to check without GPUs or without the trainer on them."""
    if not p.devices or not p.trainer:
        return
    fix = 'set [trainer] broadcast_backend = "gloo" (through host memory, slower) or publish = "disk"'
    if not engines_on_gpu:
        raise PlacementError(
            f'[trainer] publish = "distributed" over NCCL needs the engines on GPUs, but they run '
            f"on the CPU: {fix}"
        )
    groups = [(f"{TRAINER} rank 0", p.trainer[:1])] + [(f"engine-{i}", g) for i, g in enumerate(p.engines)]
    for g, names in _shared(groups).items():
        raise PlacementError(
            f"{_gpus(p.devices, [g])} holds {' and '.join(names)}, but [trainer] publish = "
            f'"distributed" over NCCL needs every rank of the weight group on its own GPU '
            f"(NCCL refuses two ranks on one GPU): give them distinct GPUs, or {fix}"
        )


def _shared(groups: list[tuple[str, tuple[int, ...]]]) -> dict[int, list[str]]:
    users: dict[int, list[str]] = {}
    for name, group in groups:
        for g in group:
            users.setdefault(g, []).append(name)
    return {g: names for g, names in sorted(users.items()) if len(names) > 1}


def _count(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"


def _visible(devices: Sequence[str]) -> str:
    return f"{len(devices)} visible ({_gpus(devices, range(len(devices)))})"


def _gpus(devices: Sequence[str], gpus: Sequence[int]) -> str:
    """`GPU 1`, `GPUs 0,1`, or with the launcher's CUDA_VISIBLE_DEVICES entries when they differ
    from the indices: `GPUs 0,1 (CUDA_VISIBLE_DEVICES 4,5)`."""
    ids = ",".join(str(g) for g in gpus)
    names = ",".join(devices[g] for g in gpus)
    label = f"GPU{'s' if len(gpus) != 1 else ''} {ids}"
    return label if names == ids else f"{label} (CUDA_VISIBLE_DEVICES {names})"
