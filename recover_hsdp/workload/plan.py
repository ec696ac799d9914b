"""A step's plan as values: roles, data references, one replica's work, every replica's work.

Plain Python (no MPI, no torch). `WorkloadPolicy` (policy.py) builds these; an `Assigner`
(assignment.py) fills in the ids. Plans are immutable: equal events give equal plans on every rank.

[Note: a plan in O(1) per step] A job of W replicas and G microbatches each plans every step on
every rank, so building every replica's ids (O(W x G): 120 ms at W = 12,500, G = 4) would sit on
the critical path of every step of a large job. A failure-free plan is instead a `Layout` (the
roles and blocks of one membership: who is major, minor, spare; contributor k's block is
``offsets[k] .. offsets[k+1]`` of the step's B), built and checked once per change of membership
or of the straggler weights, plus the step: `FreshAssignments` builds one replica's work when it
is first asked for (the manager asks for its own). The invariant holds by construction once the
layout is checked (blocks contiguous from 0 to B: exact ids are t*B .. t*B+B-1, stream positions
a range per replica), so checking such a plan is O(1). Everything that needs every replica
(a replan or an exclusion at a failure, the ledger's full line, ``committed_ids()``) iterates
`assignments` and pays O(W x G) then, where a failure already costs seconds; the ledger writes a
step planned from the same layout as the one before it as one short line
([Note: the compact ledger] in ledger.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, NamedTuple


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


@dataclass(frozen=True, eq=False)
class Layout:
    """The roles and blocks of one membership ([Note: a plan in O(1) per step]).

    alive: sorted replica ids; g: G for them; offsets: contributor k (alive[k], k < n_contrib)
    commits ids ``offsets[k] .. offsets[k+1]`` of the step's B (relative to step x B); a spare at
    position k shadows contributor (k - n_contrib) mod n_contrib; n_major: how many contributors
    are majors (the last one is the minor when n_contrib > n_major)."""

    alive: tuple[int, ...]
    g: int
    offsets: tuple[int, ...]
    n_major: int
    keep_spares: bool
    index: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.index.update({r: k for k, r in enumerate(self.alive)})
        b = self.offsets[-1] if self.offsets else 0
        if not self.offsets or self.offsets[0] != 0 or any(
                lo > hi for lo, hi in zip(self.offsets, self.offsets[1:])) or \
                len(self.offsets) - 1 > len(self.alive) or b <= 0:
            raise AssertionError(f"layout blocks {self.offsets} are not contiguous from 0 to B "
                                 f"over {len(self.alive)} replicas")

    @property
    def n_contrib(self) -> int:
        return len(self.offsets) - 1

    def role_at(self, k: int) -> tuple[Role, range, int | None]:
        """Position ``k``'s role, the block it stands for (relative ids) and whom it shadows."""
        n = self.n_contrib
        if k < n:
            return (Role.MAJOR if k < self.n_major else Role.MINOR,
                    range(self.offsets[k], self.offsets[k + 1]), None)
        if self.keep_spares:
            j = (k - n) % n
            return Role.SPARE, range(self.offsets[j], self.offsets[j + 1]), self.alive[j]
        return Role.IDLE, range(0), None

    def count(self, role: Role) -> int:
        n, spare = self.n_contrib, len(self.alive) - self.n_contrib
        return {Role.MAJOR: self.n_major, Role.MINOR: n - self.n_major,
                Role.SPARE: spare if self.keep_spares else 0,
                Role.IDLE: 0 if self.keep_spares else spare}[role]


class FreshAssignments(Sequence):
    """A failure-free plan's assignments: position k's is built by ``place(k)`` when first asked
    for ([Note: a plan in O(1) per step]); iterating builds them all (O(W x G))."""

    def __init__(self, layout: Layout, place: Callable[[int], ReplicaAssignment]) -> None:
        self.layout, self._place = layout, place
        self._built: dict[int, ReplicaAssignment] = {}

    def of(self, replica: int) -> ReplicaAssignment:
        """``replica``'s work; KeyError if it is not alive in this plan."""
        return self[self.layout.index[replica]]

    def __getitem__(self, k):
        if isinstance(k, slice):
            return tuple(self[i] for i in range(*k.indices(len(self))))
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        if k not in self._built:
            self._built[k] = self._place(k)
        return self._built[k]

    def __len__(self) -> int:
        return len(self.layout.alive)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"FreshAssignments({len(self)} replicas, G={self.layout.g})"


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
    assignments: Sequence[ReplicaAssignment]  # a tuple, or a failure-free plan's fresh ones
    dead: tuple[int, ...] = ()
    lost_work: tuple[tuple[int, tuple[int, ...]], ...] = ()
    round: int = 0
    culprits: tuple[int, ...] = ()
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.is_fresh:
            self._index.update({a.replica: a for a in self.assignments})

    @property
    def is_fresh(self) -> bool:
        """Planned from a layout, no replica's work changed since ([Note: a plan in O(1) per
        step]): O(1) to hold, to ask one replica's work of, to check and to count."""
        return isinstance(self.assignments, FreshAssignments)

    @property
    def layout(self) -> Layout | None:
        """The layout of a fresh plan, else None."""
        return self.assignments.layout if self.is_fresh else None

    @property
    def alive(self) -> tuple[int, ...]:
        """Sorted ids of the replicas alive in this plan."""
        if self.is_fresh:
            return self.assignments.layout.alive
        return tuple(a.replica for a in self.assignments)

    def assignment(self, replica: int) -> ReplicaAssignment:
        """The work of `replica`; KeyError if it is not alive in this plan."""
        if self.is_fresh:
            return self.assignments.of(replica)
        return self._index[replica]

    def committed_total(self) -> int:
        """Sum of committed microbatches over the alive replicas (== B, the invariant)."""
        if self.is_fresh:  # checked with the layout: its blocks cover 0 .. B
            return self.assignments.layout.offsets[-1]
        return sum(a.quota for a in self.assignments)

    def committed_ids(self) -> dict[int, tuple[int, ...]]:
        """Committed microbatch ids per alive replica."""
        return {a.replica: a.committed_ids for a in self.assignments}

    def count(self, role: Role) -> int:
        """Number of alive replicas holding `role`."""
        if self.is_fresh:
            return self.assignments.layout.count(role)
        return sum(a.role is role for a in self.assignments)

    def promoted(self) -> tuple[int, ...]:
        """Spares promoted in this step (none in a fresh plan)."""
        if self.is_fresh:
            return ()
        return tuple(a.replica for a in self.assignments if a.promoted)

    def extras_total(self) -> int:
        """Extra microbatches assigned to the alive replicas (the boundary step's extra work)."""
        if self.is_fresh:
            return 0
        return sum(len(a.extra_ids) for a in self.assignments)

    def max_extras(self) -> int:
        """Most extras one alive replica runs: the boundary step's cost in microbatch times."""
        if self.is_fresh:
            return 0
        return max((len(a.extra_ids) for a in self.assignments), default=0)
