"""A step's plan as values: roles, data references, one replica's work, every replica's work.

Plain Python (no MPI, no torch). `WorkloadPolicy` (policy.py) builds these; an `Assigner`
(assignment.py) fills in the ids. Plans are immutable: equal events give equal plans on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


class Role(str, Enum):
    """What a replica does this iteration."""

    MAJOR = "major"
    MINOR = "minor"
    SPARE = "spare"
    IDLE = "idle"


class DataAssignment(str, Enum):
    """How microbatch ids map to data: own endless shard per replica, or global exact ids."""

    STREAM = "stream"
    EXACT = "exact"


class DataRef(NamedTuple):
    """Where a microbatch's data is: ``stream`` None and ``index`` a global microbatch id
    (exact), or ``stream`` a slot and ``index`` a position in that slot's stream (stream)."""

    stream: int | None
    index: int


@dataclass(frozen=True)
class ReplicaAssignment:
    """One replica's work in one iteration.

    compute_ids: microbatches computed before the gradient sync (global ids in exact mode, positions
    in the replica's own shard in stream mode); extra_ids: microbatches added by replans (boundary
    step); promoted: a spare whose compute is committed; shadow_of: the contributor whose ids an
    exact-mode spare holds; stream_start: the cursor of the replica's stream slot at the start of
    the step; slot: that stream slot (stream mode); excluded: a culprit of this step (a
    non-finite contribution, [Note: bad replicas] in manager/culprits.py): alive, it takes part
    in the collectives, but commits nothing (its ids became the others' extras).
    """

    replica: int
    role: Role
    compute_ids: tuple[int, ...]
    extra_ids: tuple[int, ...] = ()
    promoted: bool = False
    shadow_of: int | None = None
    stream_start: int | None = None
    slot: int | None = None
    excluded: bool = False

    @property
    def commits_compute(self) -> bool:
        """Whether the pre-sync gradient is committed (majors, the minor, promoted spares; never
        an excluded culprit)."""
        return (self.role in (Role.MAJOR, Role.MINOR) or self.promoted) and not self.excluded

    @property
    def committed_ids(self) -> tuple[int, ...]:
        """Microbatches this replica contributes to the committed step (compute if kept, extras)."""
        return (self.compute_ids if self.commits_compute else ()) + self.extra_ids

    @property
    def discarded_ids(self) -> tuple[int, ...]:
        """Computed microbatches whose gradient is zeroed (an unpromoted spare's compute)."""
        return () if self.commits_compute else self.compute_ids

    @property
    def quota(self) -> int:
        """Number of microbatches committed by this replica."""
        return len(self.committed_ids)

    @property
    def computed_count(self) -> int:
        """Number of microbatches this replica computes this iteration, extras included."""
        return len(self.compute_ids) + len(self.extra_ids)

    def data_ref(self, microbatch: int) -> DataRef:
        """The data of one of this replica's microbatch ids."""
        return DataRef(self.slot, microbatch)

    def next_extra_position(self) -> int:
        """Stream mode: the position of this replica's next extra microbatch. Committed
        positions stay contiguous from the cursor: after a committed compute, else (an
        unpromoted spare or idle replica) from the cursor itself."""
        kept = len(self.compute_ids) if self.commits_compute else 0
        return self.stream_start + kept + len(self.extra_ids)


@dataclass(frozen=True)
class StepPlan:
    """The work of every alive replica for one step; `round` counts the replans (0: failure-free).

    dead: replicas lost during this step, in order; lost_work: (dead replica, ids it had computed),
    all discarded; culprits: replicas excluded from this step only (``WorkloadPolicy.exclude``).
    Plans are immutable values: equal events give equal plans on every rank.
    """

    step: int
    global_microbatches: int
    g: int
    data_assignment: DataAssignment
    assignments: tuple[ReplicaAssignment, ...]
    dead: tuple[int, ...] = ()
    lost_work: tuple[tuple[int, tuple[int, ...]], ...] = ()
    round: int = 0
    culprits: tuple[int, ...] = ()
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update({a.replica: a for a in self.assignments})

    @property
    def alive(self) -> tuple[int, ...]:
        """Sorted ids of the replicas alive in this plan."""
        return tuple(a.replica for a in self.assignments)

    def assignment(self, replica: int) -> ReplicaAssignment:
        """The work of `replica`; KeyError if it is not alive in this plan."""
        return self._index[replica]

    def committed_total(self) -> int:
        """Sum of committed microbatches over the alive replicas (== B, the invariant)."""
        return sum(a.quota for a in self.assignments)

    def committed_ids(self) -> dict[int, tuple[int, ...]]:
        """Committed microbatch ids per alive replica."""
        return {a.replica: a.committed_ids for a in self.assignments}

    def count(self, role: Role) -> int:
        """Number of alive replicas holding `role`."""
        return sum(a.role is role for a in self.assignments)

    def promoted(self) -> tuple[int, ...]:
        """Spares promoted in this step."""
        return tuple(a.replica for a in self.assignments if a.promoted)

    def extras_total(self) -> int:
        """Extra microbatches assigned to the alive replicas (the boundary step's extra work)."""
        return sum(len(a.extra_ids) for a in self.assignments)

    def max_extras(self) -> int:
        """Most extras one alive replica runs: the boundary step's cost in microbatch times."""
        return max((len(a.extra_ids) for a in self.assignments), default=0)
