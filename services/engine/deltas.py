"""The engine's side of delta versions (services/transport/weights/delta.py holds the format
on disk, services/transport/weights/broadcast.py the broadcast).

Disk. A delta applies only on top of exactly its base version, which the engine knows from the last
version directory it loaded (`Loaded`). Otherwise, or when a hash after applying differs, or
when the delta cannot be read, the engine resyncs: it reads the chain's full anchor and applies
every delta from there to the target, each checked by hash, and loads the result whole. Each
resync is counted by reason (`asyncrl_engine_weight_resyncs_total`). A rebuild that fails as
well (a corrupt delta in the chain, a pruned anchor) raises `DeltaError`, and the caller leaves
the weights as they were.

Broadcast (`BroadcastChain`). A bucket announced with a `delta` is taken only on top of exactly
its base version, as whole versions broadcast in the same group made it; otherwise, or when a
received tensor's sha256 differs from the announced one, the engine refuses it with a 409 that
names what it holds, counted by reason, and the sender follows with a full version (the engine
does not rebuild anything itself: the sender has the full weights at hand).

Limit (disk): the base tensors are the engine's parameters read in the delta's dtype. An engine whose
dtype holds the publish dtype exactly (fp32 engine, bf16 or fp32 deltas; same dtype) applies
deltas; one that does not (a bf16 engine given fp32 deltas) fails the hash check every version
and resyncs every time (counted): publish full versions to it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.services.engine import metrics
from asyncrl.services.engine.model_runner import read_checkpoint
from asyncrl.services.transport.weights.delta import (
    DeltaError,
    DeltaManifest,
    apply_delta,
    read_delta,
)
from asyncrl.services.transport.weights.filesystem import MODEL_FILE, VERSION_DIR, version_dir_name


@dataclass(frozen=True)
class Loaded:
    """The published version directory whose weights the engine holds: its publish root (real
    path: two runs' `v00000005` are different versions), epoch and version."""

    root: str
    epoch: int
    version: int


def loaded_of(path: str) -> Loaded | None:
    """The version a full published directory holds (from its name), None for any other directory."""
    real = os.path.realpath(path)
    named = VERSION_DIR.fullmatch(os.path.basename(real))
    return None if named is None else Loaded(os.path.dirname(real), int(named[2] or 0), int(named[1]))


def rebuild(
    path: str,
    loaded: Loaded | None,
    params: Callable[[], Mapping[str, torch.Tensor]],
    inside_root: Callable[[str], str | None],
) -> tuple[dict[str, torch.Tensor], bool, Loaded]:
    """(tensors to load, whether they are the whole model, the version they make) for delta
    directory `path`. `params()` gives the engine's current parameters; `inside_root(p)` is the
    real path of directory `p` when the engine may read it, else None."""
    try:
        manifest, tensors = read_delta(path)
    except DeltaError as exc:
        return _resync(path, None, exc.reason, inside_root)
    except OSError:
        return _resync(path, None, "malformed", inside_root)
    root = os.path.dirname(os.path.realpath(path))
    target = Loaded(root, manifest.epoch, manifest.version)
    if loaded != Loaded(root, manifest.epoch, manifest.base):
        return _resync(path, manifest, "base", inside_root)
    try:
        touched = apply_delta(params(), tensors, manifest)
    except DeltaError as exc:
        return _resync(path, manifest, exc.reason, inside_root)
    metrics.WEIGHT_DELTAS.labels(result="applied").inc()
    return touched, False, target


def _resync(
    path: str, manifest: DeltaManifest | None, reason: str, inside_root: Callable[[str], str | None]
) -> tuple[dict[str, torch.Tensor], bool, Loaded]:
    metrics.WEIGHT_RESYNCS.labels(reason=reason).inc()
    try:
        if manifest is None:
            raise DeltaError(reason, f"cannot read the delta at {path}, so not its chain either")
        state = _replay(Path(path).parent, manifest, inside_root)
    except (DeltaError, OSError, ValueError) as exc:
        metrics.WEIGHT_DELTAS.labels(result="failed").inc()
        if isinstance(exc, DeltaError):
            raise
        raise DeltaError("malformed", f"resync from the anchor failed: {exc}") from exc
    metrics.WEIGHT_DELTAS.labels(result="resynced").inc()
    return state, True, Loaded(os.path.dirname(os.path.realpath(path)), manifest.epoch, manifest.version)


def _replay(
    root: Path, target: DeltaManifest, inside_root: Callable[[str], str | None]
) -> dict[str, torch.Tensor]:
    """The full weights of `target`: its anchor, then every delta after it in order."""

    def directory(version: int) -> str:
        real = inside_root(str(root / version_dir_name(version, target.epoch)))
        if real is None:
            raise DeltaError("malformed", f"version {version} of the chain is not on disk")
        return real

    anchor = directory(target.anchor)
    if not os.path.isfile(os.path.join(anchor, MODEL_FILE)):
        raise DeltaError("malformed", f"anchor {target.anchor} is not a full version")
    state = read_checkpoint(anchor)
    for version in range(target.anchor + 1, target.version + 1):
        manifest, tensors = read_delta(directory(version))
        if (manifest.version, manifest.base, manifest.anchor) != (version, version - 1, target.anchor):
            raise DeltaError("malformed", f"version {version} is not a delta of this chain")
        state.update(apply_delta(state, tensors, manifest))
    return state


class BroadcastChain:
    """Which whole version the engine's weights are, as broadcasts in a group made them.

    `held` is `(group, weight_version)` once the last bucket of a whole version is applied: a
    full version whose buckets covered every parameter, or a delta taken on top of a held base.
    Applying any bucket clears it until its version's last bucket (the one that names the
    version); `clear()` is for every other change of the weights (a disk load, a failed or
    late copy, a dropped group). Not thread-safe: the engine's updates run one at a time."""

    def __init__(self, missing: Callable[[set[str]], list[str]]):
        self._missing = missing  # parameters the given names do not cover
        self.held: tuple[str, str] | None = None
        # the version whose buckets are being applied: (group, its delta base or None, names so far)
        self._arriving: tuple[str, str | None, set[str]] | None = None
        self._resync_due = False  # a delta was refused: the next whole full version is its resync

    def clear(self) -> None:
        self.held = self._arriving = None

    def refusal(
        self, group: str, base: str, announced: Mapping[str, str], received: Mapping[str, str]
    ) -> tuple[str, str] | None:
        """`(reason, message)` when a delta bucket on `base` whose tensors hash to `received`
        (name → sha256) must not be applied, else None:
        `base`, the engine holds another version and is not half-way through this delta;
        `hash`, a received tensor's sha256 is not the announced one (the weights may now be
        half-way through the delta: only a full version is taken after that)."""
        arriving = self._arriving
        on_base = (arriving is None and self.held == (group, base)) or (
            arriving is not None and arriving[:2] == (group, base)
        )
        if not on_base:
            held = (
                "no whole version broadcast in this group"
                if self.held is None or self.held[0] != group
                else f"version {self.held[1]!r}"
            )
            if arriving is not None:
                held += " (a version half-applied)"
            return self._refuse(
                "base", f"delta on base {base!r} refused: this engine holds {held}; send a full version"
            )
        for name, digest in received.items():
            if digest != announced.get(name):
                return self._refuse(
                    "hash",
                    f"delta on base {base!r} refused: {name}: sha256 of the received bytes differs "
                    "from the announced; send a full version",
                )
        return None

    def _refuse(self, reason: str, message: str) -> tuple[str, str]:
        self._resync_due = True
        if self._arriving is not None:  # earlier buckets of this version were applied
            self.clear()
        return reason, message

    def applying(self, group: str, base: str | None, names: list[str]) -> None:
        """Before a bucket's weights are copied in (`base`: the delta's, None for a full version)."""
        arriving = self._arriving
        if arriving is None or arriving[:2] != (group, base):
            arriving = (group, base, set())
        arriving[2].update(names)
        self.held, self._arriving = None, arriving

    def applied(self, group: str, weight_version: str | None) -> str | None:
        """After a bucket's weights are in: at the last bucket (`weight_version` set) the
        version is held if it is whole; returns `applied` for a delta version taken, `resynced`
        for a whole full version after a refused delta (the metric's label), else None."""
        arriving = self._arriving
        if weight_version is None or arriving is None:
            return None
        self._arriving = None
        _, base, names = arriving
        if base is None and self._missing(names):
            return None  # a subset, not a version: nothing is held
        self.held = (group, weight_version)
        if base is not None:
            return "applied"
        resynced, self._resync_due = self._resync_due, False
        return "resynced" if resynced else None
