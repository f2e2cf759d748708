"""Weight-version lineage: which trainer history a policy version belongs to (docs/architecture.md §5).

A version number alone cannot tell two histories apart. A trainer killed at v466 after its
checkpoint at v460 resumes at v460 and publishes its own v461…v466: the engines, the weight
directories and the samples must never mix those with the lost ones. So every trainer start
that resumes a run (a checkpoint exists, or something was published) opens a new **epoch**
(`buffer.PolicyVersions.begin_epoch`), which records its **fork point**: the version it resumed from.
The first start of a run is epoch 0.

* A version is named `(version, epoch)`; publication order is the lexicographic order of
  `(epoch, version)`. Engines carry it in SGLang's free-form `weight_version` string
  (`weight_version_name` in services/transport/weights).
* A token sampled by `(v, e)` belongs to the surviving history iff `v ≤ fork(e')` for every
  later epoch `e'`: the versions at or below a fork are shared by both sides of it.
* A group records, per epoch, the newest version that sampled any of its tokens
  (`Group.lineage`); the buffer drops a group with any token from a lost history.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def merge(into: dict[int, int], sampled: dict[int, int]) -> dict[int, int]:
    """Fold `sampled` (epoch -> newest version) into `into`, each epoch keeping its newest
    version: a group's lineage from its samples', a sample's from its segments'. Returns `into`."""
    for epoch, version in sampled.items():
        into[epoch] = max(version, into.get(epoch, version))
    return into


@dataclass
class Lineage:
    """The run's epochs: `forks[e]` is the version epoch `e` resumed from (epoch 0 has none)."""

    epoch: int = 0
    forks: dict[int, int] = field(default_factory=dict)

    def cutoff(self, epoch: int) -> float:
        """The newest version of `epoch` that is still in the surviving history."""
        later = [v for e, v in self.forks.items() if e > epoch]
        return min(later) if later else float("inf")

    def lost(self, sampled: dict[int, int]) -> bool:
        """True when any token of a group (`Group.lineage`: epoch -> newest version) was
        sampled by weights of a history a later epoch abandoned."""
        return any(version > self.cutoff(epoch) for epoch, version in sampled.items())
