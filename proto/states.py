"""One vocabulary of states for the buffer, the rollout service and the HTTP API.

Each is a `StrEnum`, so a member is its own wire value (`str()` and f-strings give the value):
in Redis hashes and counters, metric labels and JSON alike. A group's whole life uses `GroupState` (docs/architecture.md §4):

    queued → generating → scoring → buffered → trained | dropped | withheld | lost | zero_spread
                      ↘ failed | cancelled          (and dead_lettered where a record does not decode)

`JobState` is what `GET /v1/rollouts/{id}` says of a whole job; `Admission` answers a
request to start generating a group; `EngineState` is an engine of the rollout's fleet.
"""

from __future__ import annotations

from enum import StrEnum


class GroupState(StrEnum):
    queued = "queued"  # its job waits in the jobs stream (or is claimed, not yet generating)
    generating = "generating"
    scoring = "scoring"
    buffered = "buffered"  # in the groups stream, waiting for or held by the trainer
    failed = "failed"  # refused by the engine, an invalid result, or an internal error
    cancelled = "cancelled"  # its job was cancelled before the group was buffered
    trained = "trained"  # the checkpoint covering its update is durable (keeps its admission count)
    dropped = "dropped"  # too stale, policy `drop`
    withheld = "withheld"  # too stale, policy `withhold`: rewards counted, no gradient
    lost = "lost"  # a token sampled by weights of an abandoned history (proto/lineage.py)
    zero_spread = "zero_spread"  # discarded by dynamic sampling: no reward spread
    dead_lettered = "dead_lettered"  # its record did not decode: see the dead-letter stream


# How a queued group job ends: its group was buffered (now or before), or it never will be.
JOB_ENDS = (GroupState.buffered, GroupState.failed, GroupState.cancelled)


class JobState(StrEnum):
    """A rollout job: `queued` → `running` → `done` | `failed` (no group gave a scored sample),
    or `cancelling` → `cancelled`."""

    queued = "queued"
    running = "running"
    done = "done"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"


class EngineState(StrEnum):
    """An engine of the rollout's fleet (services/rollout/fleet.py)."""

    joining = "joining"  # being brought to the current weights, then added to the router
    serving = "serving"  # in the router and in every weight update
    down = "down"  # unreachable or refused: out of the router and of weight updates, probed to rejoin


class Admission(StrEnum):
    """The answer to `try_admit(group_id)` (the rule is in buffer/admission.py)."""

    admitted = "admitted"  # a new slot taken: generate
    resumed = "resumed"  # the group already holds a slot (e.g. a reclaimed job): generate
    duplicate = "duplicate"  # the group was put already: nothing to generate
    full = "full"  # capacity reached: wait for the trainer

    @property
    def go(self) -> bool:
        return self in (Admission.admitted, Admission.resumed)
