"""Versatile-workload policy: roles, quotas, G and boundary steps (plain Python, no MPI, no torch).

The invariant this module keeps (checked at run time by every `plan`/`replan`, see `_check`):

    sum over alive replicas r of len(committed_ids(r))  ==  B  ==  W_init * G_init
    and no microbatch is committed twice (exact mode: committed ids == {t*B, ..., t*B+B-1}).

Roles, for W alive replicas (sorted ids) and G = G(W) microbatches per replica:
  MAJOR  the first B // G replicas: compute and commit G microbatches.
  MINOR  the next one when B % G > 0: computes and commits the remainder q, 0 < q < G.
  SPARE  the rest (keep_spares=True): compute like a major, commit nothing unless promoted.
  IDLE   the rest (keep_spares=False): compute nothing; still join the collectives (zero gradient).
G(W) = ceil(B / W) under g_raise="ceil" (so ceil(B/G) <= W always fits); g_raise="reserve" keeps
one replica spare after the first loss: G(W) = ceil(B / (W - 1)) for 2 <= W < W_init, B for W = 1.
The alive count only shrinks during a run, so G only rises; W = W_init gives G_init (stock layout).

A failure inside an iteration is seen at gradient sync, after every replica computed its work.
`replan(plan, dead)` rebuilds the same step: the dead replicas' committed work (compute + extras)
is lost; an unpromoted spare whose whole computation fits inside the loss is promoted (it already
holds the gradient, so promotion is free: the trainer must snapshot a spare's bucket before zeroing
it); what is still missing becomes extra microbatches ("policy boundary step"), dealt one at a time
to the survivor with the fewest extras (ties: lowest id). Bound: after a replan every survivor's
extras <= max(previous max, ceil(E / W_s)), E the survivors' extras, W_s the survivors; hence
<= ceil(B / W_s) in any iteration. One lost major (G) in a clean step costs each survivor at most
ceil(G / (W - 1)) extras: a single microbatch time when W - 1 >= G, more rounds below that.

Data assignment (`DataAssignment`):
  stream  (the paper) ids are positions in the replica's own endless stream, its *slot* (see
          [Note: stream slots]); the slot's cursor advances by what the replica committed, so
          the positions a replica commits are contiguous from its cursor and a spare draws 0:
          it computes the next G positions without consuming them (they are drawn again next
          step), and an unpromoted spare's extras are those same first positions.
  exact   ids are global: step t commits exactly t*B .. t*B+B-1. Contributing replicas (majors,
          then the minor, in id order) take contiguous blocks, so with W_init replicas, G_init each
          and no spares, replica r's g-th microbatch is t*B + r*G_init + g: stock HSDP's layout.
          A spare *shadows* a contributor (spare j takes the block of contributor j mod
          #contributors): it computes the same ids, so when that contributor dies the spare is
          promoted and covers its ids exactly with no extra compute. A spare holding other ids
          cannot be promoted (it would commit ids outside the failure-free set), so unshadowed
          losses become extras. Shadowing costs nothing over the paper's spare (which computes G
          microbatches anyway) and keeps the committed id set equal to the failure-free one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Iterable, Mapping, NamedTuple


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


class GRaise(str, Enum):
    """Rule that sets G from the alive count (see the module docstring)."""

    CEIL = "ceil"
    RESERVE = "reserve"


def validate_workload_fields(*, microbatches_per_replica, keep_spares, data_assignment,
                             g_raise) -> None:
    """Check the `[recover]` fields this layer owns; ValueError names the field and the fix."""
    g = microbatches_per_replica
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"recover.microbatches_per_replica must be an integer >= 1 (got {g!r}): "
                         "set it in the [recover] section")
    if not isinstance(keep_spares, bool):
        raise ValueError(f"recover.keep_spares must be true or false (got {keep_spares!r}): "
                         "set it in the [recover] section")
    for name, value, enum in (("data_assignment", data_assignment, DataAssignment),
                              ("g_raise", g_raise, GRaise)):
        if value not in {e.value for e in enum}:
            choices = " or ".join(repr(e.value) for e in enum)
            raise ValueError(f"recover.{name} must be {choices} (got {value!r}): "
                             "set it in the [recover] section")


@dataclass(frozen=True)
class ReplicaAssignment:
    """One replica's work in one iteration.

    compute_ids: microbatches computed before the gradient sync (global ids in exact mode, positions
    in the replica's own shard in stream mode); extra_ids: microbatches added by replans (boundary
    step); promoted: a spare whose compute is committed; shadow_of: the contributor whose ids an
    exact-mode spare holds; stream_start: the cursor of the replica's stream slot at the start of
    the step; slot: that stream slot (stream mode).
    """

    replica: int
    role: Role
    compute_ids: tuple[int, ...]
    extra_ids: tuple[int, ...] = ()
    promoted: bool = False
    shadow_of: int | None = None
    stream_start: int | None = None
    slot: int | None = None

    @property
    def commits_compute(self) -> bool:
        """Whether the pre-sync gradient is committed (majors, the minor, promoted spares)."""
        return self.role in (Role.MAJOR, Role.MINOR) or self.promoted

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
    all discarded. Plans are immutable values: equal events give equal plans on every rank.
    """

    step: int
    global_microbatches: int
    g: int
    data_assignment: DataAssignment
    assignments: tuple[ReplicaAssignment, ...]
    dead: tuple[int, ...] = ()
    lost_work: tuple[tuple[int, tuple[int, ...]], ...] = ()
    round: int = 0
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


def _check(plan: StepPlan) -> StepPlan:
    """Assert the invariant (always on, O(B)): B committed, no id twice, exact ids as planned."""
    b, ids = plan.global_microbatches, []
    for a in plan.assignments:
        ids.extend(a.committed_ids)
        if plan.data_assignment is DataAssignment.STREAM and len(set(a.committed_ids)) != a.quota:
            raise AssertionError(f"step {plan.step}: replica {a.replica} commits a position twice")
    if len(ids) != b:
        raise AssertionError(f"step {plan.step}: {len(ids)} microbatches committed, expected B={b}")
    if plan.data_assignment is DataAssignment.EXACT and set(ids) != set(range(plan.step * b,
                                                                             plan.step * b + b)):
        raise AssertionError(f"step {plan.step}: committed ids differ from the failure-free set")
    return plan


class WorkloadPolicy:
    """Deterministic workload policy; every rank holds one and feeds it the agreed membership.

    Args:
        initial_replicas: W_init, the replica count the run was launched with.
        microbatches_per_replica: G_init; B = W_init * G_init stays fixed for the whole run.
        global_microbatches: B, optional consistency check.
        keep_spares: surplus replicas are SPARE (compute, promotable) instead of IDLE.
        data_assignment: "stream" or "exact" (see the module docstring).
        g_raise: "ceil" or "reserve".
        alive_replicas: current membership when restarting with fewer replicas (default: all).
    """

    def __init__(self, *, initial_replicas: int, microbatches_per_replica: int,
                 global_microbatches: int | None = None, keep_spares: bool = True,
                 data_assignment: DataAssignment | str = DataAssignment.STREAM,
                 g_raise: GRaise | str = GRaise.CEIL,
                 alive_replicas: Iterable[int] | None = None) -> None:
        validate_workload_fields(microbatches_per_replica=microbatches_per_replica,
                                 keep_spares=keep_spares, data_assignment=str(getattr(
                                     data_assignment, "value", data_assignment)),
                                 g_raise=str(getattr(g_raise, "value", g_raise)))
        if isinstance(initial_replicas, bool) or not isinstance(initial_replicas, int) \
                or initial_replicas < 1:
            raise ValueError(f"initial replica count must be >= 1 (got {initial_replicas!r}): "
                             "set parallelism.data_parallel_replicate_degree")
        b = initial_replicas * microbatches_per_replica
        if global_microbatches is not None and global_microbatches != b:
            raise ValueError(f"global_microbatches={global_microbatches} != initial_replicas * "
                             f"microbatches_per_replica = {b}: drop it or make them agree")
        self.global_microbatches, self.initial_replicas = b, initial_replicas
        self.initial_g, self.keep_spares = microbatches_per_replica, keep_spares
        self.data_assignment = DataAssignment(getattr(data_assignment, "value", data_assignment))
        self.g_raise = GRaise(getattr(g_raise, "value", g_raise))
        self.step = 0
        self.alive = _sorted_ids(range(initial_replicas) if alive_replicas is None
                                 else alive_replicas)
        self.cursors: dict[int, int] = {}   # stream slot -> positions committed
        self.slots: dict[int, int] = {}     # replica -> stream slot (default: its own id)

    # ---- policy rules -------------------------------------------------------------------------
    def g_for(self, alive_count: int) -> int:
        """G for `alive_count` replicas: ceil(B/W); ceil(B/(W-1)) below W_init under "reserve"."""
        b, w = self.global_microbatches, alive_count
        if self.g_raise is GRaise.RESERVE and w < self.initial_replicas:
            return b if w <= 1 else math.ceil(b / (w - 1))
        return math.ceil(b / w)

    @property
    def g(self) -> int:
        """Microbatches per replica for the current membership."""
        return self.g_for(len(self.alive))

    def plan(self, step: int, alive_replicas: Iterable[int] | None = None) -> StepPlan:
        """Failure-free plan of `step` for the agreed membership (default: the policy's own)."""
        alive = self.alive if alive_replicas is None else _sorted_ids(alive_replicas)
        b, g = self.global_microbatches, self.g_for(len(alive))
        n_major, q = divmod(b, g)
        n_contrib = n_major + (q > 0)
        exact = self.data_assignment is DataAssignment.EXACT
        blocks = [tuple(range(step * b + k * g, step * b + k * g + (g if k < n_major else q)))
                  for k in range(n_contrib)]
        out = []
        for k, r in enumerate(alive):
            shadow = None
            if k < n_contrib:
                role, n = (Role.MAJOR if k < n_major else Role.MINOR), len(blocks[k])
            elif self.keep_spares:
                role, shadow = Role.SPARE, (k - n_contrib) % n_contrib
                n = len(blocks[shadow]) if exact else g
            else:
                role, n = Role.IDLE, 0
            slot = None if exact else self.slot_of(r)
            start = None if exact else self.cursors.get(slot, 0)
            ids = (blocks[k] if k < n_contrib else blocks[shadow] if n else ()) if exact \
                else tuple(range(start, start + n))
            out.append(ReplicaAssignment(r, role, ids, stream_start=start, slot=slot,
                                         shadow_of=alive[shadow]
                                         if exact and shadow is not None else None))
        return _check(StepPlan(step, b, g, self.data_assignment, tuple(out)))

    def replan(self, plan: StepPlan, dead_replicas: Iterable[int]) -> StepPlan:
        """Same step after `dead_replicas` died: promote spares, then deal extras (boundary)."""
        dead = set(dead_replicas)
        if not dead or not dead <= set(plan.alive):
            raise ValueError(f"dead replicas {sorted(dead)} must be a non-empty subset of the "
                             f"alive replicas {list(plan.alive)}")
        survivors = {a.replica: a for a in plan.assignments if a.replica not in dead}
        if not survivors:
            raise RuntimeError(f"step {plan.step}: every replica died, nothing can keep the step")
        lost_ids = sorted(i for r in sorted(dead) for i in plan.assignment(r).committed_ids)
        exact = self.data_assignment is DataAssignment.EXACT
        lost = set(lost_ids)
        deficit = len(lost_ids)
        for r, a in sorted(survivors.items()):   # promotion: the spare's whole work fits the loss
            if a.role is Role.SPARE and not a.promoted and a.compute_ids and (
                    lost.issuperset(a.compute_ids) if exact
                    else len(a.compute_ids) <= deficit and not a.extra_ids):
                survivors[r] = replace(a, promoted=True)
                lost.difference_update(a.compute_ids)
                deficit -= len(a.compute_ids)
        todo = [i for i in lost_ids if i in lost] if exact else [None] * deficit
        heap = [(len(a.extra_ids), r) for r, a in survivors.items()]
        heapq.heapify(heap)
        extras: dict[int, list[int]] = {r: list(a.extra_ids) for r, a in survivors.items()}
        for i in todo:                  # water-filling: one extra to the least loaded survivor
            n, r = heapq.heappop(heap)
            a = survivors[r]
            extras[r].append(i if exact else replace(a, extra_ids=tuple(extras[r]))
                             .next_extra_position())
            heapq.heappush(heap, (n + 1, r))
        new = tuple(replace(survivors[r], extra_ids=tuple(extras[r])) for r in sorted(survivors))
        lost_work = plan.lost_work + tuple(
            (r, plan.assignment(r).compute_ids + plan.assignment(r).extra_ids)
            for r in sorted(dead))
        return _check(replace(plan, assignments=new, dead=plan.dead + tuple(sorted(dead)),
                              lost_work=lost_work, round=plan.round + 1))

    def commit(self, plan: StepPlan) -> None:
        """The step committed: adopt its survivors (G rises, roles reassigned), advance cursors
        by what each committed (a dead replica's slot keeps its cursor: [Note: stream slots])."""
        self.step = plan.step + 1
        self.alive = plan.alive
        if self.data_assignment is DataAssignment.STREAM:
            for a in plan.assignments:
                self.cursors[a.slot] = a.stream_start + a.quota
                self.slots[a.replica] = a.slot

    def admit(self, replicas: Iterable[int]) -> None:
        """Replacement replicas joined between two steps ([Note: rejoin at a boundary] in
        recover_hsdp/manager/rejoin.py): they are alive from the next plan on, so G goes back
        toward G_init with B unchanged. In stream mode each takes a slot no alive replica reads
        (its own first), resumed at that slot's cursor."""
        new = _sorted_ids(replicas)
        if set(new) & set(self.alive) or any(r < 0 or r >= self.initial_replicas for r in new):
            raise ValueError(f"replicas {list(new)} cannot join: alive {list(self.alive)}, "
                             f"W_init {self.initial_replicas}")
        read = self._slots_read()
        free = [slot for slot in range(self.initial_replicas) if slot not in read]
        self.alive = _sorted_ids((*self.alive, *new))
        if self.data_assignment is DataAssignment.STREAM:
            for r in new:
                slot = r if r in free else free[0]
                free.remove(slot)
                self.slots[r] = slot

    def slot_of(self, replica: int) -> int:
        """The stream slot ``replica`` reads ([Note: stream slots])."""
        return self.slots.get(replica, replica)

    def orphaned_slots(self, dead: Iterable[int] = ()) -> dict[int, int]:
        """Stream slots no alive replica reads (those of ``dead`` too): slot -> its cursor,
        where its unread remainder starts."""
        if self.data_assignment is not DataAssignment.STREAM:
            return {}
        known = set(self.cursors) | self._slots_read()
        return {s: self.cursors.get(s, 0) for s in sorted(known - self._slots_read(dead))}

    def _slots_read(self, dead: Iterable[int] = ()) -> set[int]:
        """The stream slots the alive replicas (less ``dead``) read."""
        dead = set(dead)
        return {self.slot_of(r) for r in self.alive if r not in dead}

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serializable state (config included) for checkpoints."""
        return {"version": 2, "global_microbatches": self.global_microbatches,
                "initial_replicas": self.initial_replicas,
                "microbatches_per_replica": self.initial_g,
                "keep_spares": self.keep_spares, "data_assignment": self.data_assignment.value,
                "g_raise": self.g_raise.value, "step": self.step, "alive": list(self.alive),
                "g": self.g, "cursors": {str(s): c for s, c in sorted(self.cursors.items())},
                "slots": {str(r): self.slot_of(r) for r in self.alive}}

    @classmethod
    def from_state_dict(cls, state: Mapping, alive_replicas: Iterable[int] | None = None
                        ) -> "WorkloadPolicy":
        """Rebuild from `state_dict()`; `alive_replicas` overrides the membership (restart).

        [Note: stream slots] In stream mode the data a replica reads is a *slot*: one of the
        W_init disjoint shards of the dataset (each split again over the replica's S ranks),
        with a cursor, the positions committed from it. A replica reads slot = its id until a
        restart changes the membership: then the i-th replica takes the i-th slot that was
        being read at the checkpoint (their loader state was saved at their cursor, so they
        continue where they were and nothing is read twice), then the slots of replicas that
        had died (resumed from their last saved loader state and fast-forwarded to their
        cursor). A slot whose replica died mid-run is not taken over by the survivors:
        resuming it needs the dead ranks' packing buffers and stream offsets, which died with
        them, so the survivors would have to replay it from the last checkpoint while the
        whole job waits; its unread remainder (from its cursor) is recorded in events.jsonl
        and it stays resumable by a restart. Slots no replica reads after a restart are
        ``orphaned_slots()``."""
        if state.get("version") not in (1, 2):
            raise ValueError(f"unknown workload state version {state.get('version')!r}")
        p = cls(initial_replicas=state["initial_replicas"],
                microbatches_per_replica=state["microbatches_per_replica"],
                global_microbatches=state["global_microbatches"], keep_spares=state["keep_spares"],
                data_assignment=state["data_assignment"], g_raise=state["g_raise"],
                alive_replicas=state["alive"] if alive_replicas is None else alive_replicas)
        p.step = int(state["step"])
        p.cursors = {int(s): int(c) for s, c in state["cursors"].items()}
        saved = {int(r): int(s) for r, s in state.get("slots", {}).items()}
        old_alive = [int(r) for r in state["alive"]]
        if p.data_assignment is DataAssignment.STREAM:
            was_read = [saved.get(r, r) for r in old_alive]
            orphans = sorted(set(p.cursors) - set(was_read))
            never = sorted(set(range(p.initial_replicas)) - set(was_read) - set(orphans))
            if tuple(p.alive) == tuple(old_alive):
                p.slots = {r: saved.get(r, r) for r in p.alive}
            else:
                p.slots = dict(zip(p.alive, was_read + orphans + never))
        return p


def _sorted_ids(replicas: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated replica ids; at least one."""
    ids = tuple(sorted(set(int(r) for r in replicas)))
    if not ids or ids[0] < 0:
        raise ValueError(f"alive replicas must be non-empty non-negative ids (got {list(ids)})")
    return ids

