"""Data assignment: what a replica's microbatch ids name (plain Python, no MPI, no torch).

One `Assigner` per `DataAssignment`, built once with the policy (`make_assigner`). The policy's
rules (roles, quotas, G, promotion order, water-filling, the B count) are written once in
policy.py; an assigner answers only what depends on the ids:

  place, placer                a replica's ids in a failure-free plan, given its role and block;
                               placer: the same for position k of a `Layout`, built when asked
                               ([Note: a plan in O(1) per step] in plan.py)
  promotable, cover, extra_id  in a replan: which spare may be promoted, what it covers, the id
                               of one extra microbatch
  check                        this mode's half of the invariant (the B count is the policy's)
  commit, admit, orphaned,     the stream slots' bookkeeping: cursors, replica -> slot, and its
  slot_of, state_dict,         part of the checkpoint (exact ids keep none)
  load_state_dict

  ExactIds     (`exact`)  ids are global: step t commits exactly t*B .. t*B+B-1.
  StreamSlots  (`stream`, the paper) ids are positions in the replica's own stream slot.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol, Sequence

from recover_hsdp.workload.plan import (DataAssignment, FreshAssignments, Layout,
                                        ReplicaAssignment, Role, StepPlan)


class Assigner(Protocol):
    """What the policy asks of a data assignment; `cursors` and `slots` are its stream state."""

    mode: DataAssignment
    cursors: dict[int, int]   # stream slot -> positions committed (exact: empty)
    slots: dict[int, int]     # replica -> stream slot, where not its own id (exact: empty)

    def place(self, replica: int, role: Role, block: range, shadow: int | None,
              g: int) -> ReplicaAssignment:
        """The failure-free work of `replica`: `block` holds the global ids it stands for (its
        own block as a contributor, the block of contributor `shadow` as a spare, none if idle)."""

    def placer(self, layout: Layout, step: int) -> FreshAssignments:
        """The failure-free work of every position of `layout` at `step`, each built when first
        asked for, from this assigner's state now (later commits do not change it)."""

    def promotable(self, spare: ReplicaAssignment, missing: Sequence[int]) -> bool:
        """Whether committing `spare`'s computed gradient covers part of `missing`, the lost
        ids not yet covered, without committing anything twice."""

    def cover(self, spare: ReplicaAssignment, missing: Sequence[int]) -> list[int]:
        """`missing` less what the promoted `spare` covers."""

    def extra_id(self, lost: int, receiver: ReplicaAssignment) -> int:
        """The id `receiver` computes as an extra to stand for the lost id `lost`."""

    def check(self, plan: StepPlan) -> None:
        """Raise AssertionError if `plan` breaks this mode's half of the invariant."""

    def commit(self, plan: StepPlan) -> None:
        """`plan` committed: advance what each survivor consumed."""

    def admit(self, alive: Sequence[int], new: Sequence[int]) -> None:
        """`new` replicas join the `alive` ones between two steps."""

    def slot_of(self, replica: int) -> int:
        """The stream slot `replica` reads (exact: its own id)."""

    def orphaned(self, alive: Sequence[int], dead: Iterable[int]) -> dict[int, int]:
        """Stream slots no replica of `alive` less `dead` reads: slot -> its cursor."""

    def state_dict(self, alive: Sequence[int]) -> dict:
        """This mode's part of the policy checkpoint: ``cursors`` and ``slots`` (JSON keys)."""

    def load_state_dict(self, state: Mapping, alive: Sequence[int]) -> None:
        """Restore from a policy checkpoint `state` for the (possibly new) `alive` replicas."""


class ExactIds:
    """`exact`: ids are global, step t commits exactly t*B .. t*B+B-1 (the failure-free set).

    Contributing replicas (majors, then the minor, in id order) take contiguous blocks, so with
    W_init replicas, G_init each and no spares, replica r's g-th microbatch is t*B + r*G_init + g:
    stock HSDP's layout. A spare *shadows* a contributor (the policy gives spare j the block of
    contributor j mod #contributors): it computes the same ids, so when that contributor dies the
    spare is promoted and covers its ids exactly with no extra compute. A spare holding other ids
    cannot be promoted (it would commit ids outside the failure-free set), so unshadowed losses
    become extras, each the lost id itself. Shadowing costs nothing over the paper's spare (which
    computes G microbatches anyway) and keeps the committed id set equal to the failure-free one.
    No state: no cursors, every replica is its own slot.
    """

    mode = DataAssignment.EXACT

    def __init__(self) -> None:
        self.cursors: dict[int, int] = {}
        self.slots: dict[int, int] = {}

    def place(self, replica, role, block, shadow, g):
        return ReplicaAssignment(replica, role, tuple(block), shadow_of=shadow)

    def placer(self, layout, step):
        first = step * layout.offsets[-1]

        def place(k: int) -> ReplicaAssignment:
            role, block, shadow = layout.role_at(k)
            return ReplicaAssignment(layout.alive[k], role,
                                     tuple(range(first + block.start, first + block.stop)),
                                     shadow_of=shadow)
        return FreshAssignments(layout, place)

    def promotable(self, spare, missing):
        return set(missing).issuperset(spare.compute_ids)

    def cover(self, spare, missing):
        held = set(spare.compute_ids)
        return [i for i in missing if i not in held]

    def extra_id(self, lost, receiver):
        return lost

    def check(self, plan):
        if plan.is_fresh:  # the layout's blocks cover 0 .. B: ids t*B .. t*B+B-1
            return
        b, t = plan.global_microbatches, plan.step
        ids = {i for a in plan.assignments for i in a.committed_ids}
        if ids != set(range(t * b, t * b + b)):
            raise AssertionError(f"step {t}: committed ids differ from the failure-free set")

    def commit(self, plan):
        pass

    def admit(self, alive, new):
        pass

    def slot_of(self, replica):
        return replica

    def orphaned(self, alive, dead):
        return {}

    def state_dict(self, alive):
        return {"cursors": {}, "slots": {str(r): r for r in alive}}

    def load_state_dict(self, state, alive):
        pass


class StreamSlots:
    """`stream` (the paper): ids are positions in the replica's own endless stream, its *slot*
    ([Note: stream slots] in policy.py), one of `slot_count` (W_init) disjoint shards.

    The slot's cursor advances by what the replica committed, so the positions a replica commits
    are contiguous from its cursor and a spare draws 0: it computes the next G positions without
    consuming them (they are drawn again next step), and an unpromoted spare's extras are those
    same first positions. Hence any spare without extras can stand in for lost work (positions
    carry no identity across slots, the loss counts only by size), and a spare that already
    holds extras cannot (its compute and extras would commit the same positions twice).
    """

    mode = DataAssignment.STREAM

    def __init__(self, slot_count: int) -> None:
        self.slot_count = slot_count
        self.slots: dict[int, int] = {}     # replica -> stream slot (default: its own id)
        # [Note: stream cursors in O(1) per step] the cursors are _base advanced by _n
        # commits of fresh plans of _run (a Layout); _base is replaced, never changed in place
        self._base: dict[int, int] = {}
        self._run: Layout | None = None
        self._n = 0

    @property
    def cursors(self) -> dict[int, int]:
        """Stream slot -> positions committed.

        [Note: stream cursors in O(1) per step] A committed failure-free step advances the
        cursor of every slot by its replica's quota: O(W) per step if written out. While the
        steps are planned from one `Layout` the cursors are kept as the cursors at the start of
        that run plus ``n`` x each replica's quota under it (a replica reads the same slot while
        it is alive), written out (`_settle`, O(W)) only when asked for (a checkpoint, a join,
        a replan's commit, another layout). A fresh plan reads the cursor of a slot as it was
        when the plan was made (its own copy of base, run and n)."""
        self._settle()
        return self._base

    @cursors.setter
    def cursors(self, cursors: Mapping[int, int]) -> None:
        self._base, self._run, self._n = dict(cursors), None, 0

    def _advanced(self, base: Mapping[int, int], run: Layout | None, n: int, replica: int,
                  slot: int) -> int:
        """The cursor of ``slot`` (read by ``replica``) after ``n`` commits of ``run``."""
        start = base.get(slot, 0)
        k = run.index.get(replica) if run is not None and n else None
        if k is None or k >= run.n_contrib:
            return start
        return start + n * (run.offsets[k + 1] - run.offsets[k])

    def _settle(self) -> None:
        """Write the run's commits into ``_base`` (a new dict) and end the run: O(W)."""
        run, n = self._run, self._n
        if run is None or n == 0:
            self._run, self._n = None, 0
            return
        base = dict(self._base)
        for r in run.alive:  # every replica's slot gets a cursor, as a step's commit writes
            slot = self.slot_of(r)
            base[slot] = self._advanced(self._base, run, n, r, slot)
        self._base, self._run, self._n = base, None, 0

    def place(self, replica, role, block, shadow, g):
        slot = self.slot_of(replica)
        start = self._advanced(self._base, self._run, self._n, replica, slot)
        n = g if role is Role.SPARE else len(block)
        return ReplicaAssignment(replica, role, tuple(range(start, start + n)),
                                 stream_start=start, slot=slot)

    def placer(self, layout, step):
        base, run, n = self._base, self._run, self._n  # this plan's view of the cursors

        def place(k: int) -> ReplicaAssignment:
            r = layout.alive[k]
            role, block, _ = layout.role_at(k)
            slot = self.slot_of(r)  # an alive replica's slot does not change
            start = self._advanced(base, run, n, r, slot)
            count = layout.g if role is Role.SPARE else len(block)
            return ReplicaAssignment(r, role, tuple(range(start, start + count)),
                                     stream_start=start, slot=slot)
        fresh = FreshAssignments(layout, place)
        fresh.origin = (base, run, n)
        return fresh

    def promotable(self, spare, missing):
        return len(spare.compute_ids) <= len(missing) and not spare.extra_ids

    def cover(self, spare, missing):
        return list(missing[len(spare.compute_ids):])

    def extra_id(self, lost, receiver):
        return receiver.next_extra_position()

    def check(self, plan):
        if plan.is_fresh:  # a range of positions per replica
            return
        for a in plan.assignments:
            if len(set(a.committed_ids)) != a.quota:
                raise AssertionError(f"step {plan.step}: replica {a.replica} commits a position "
                                     "twice")

    def commit(self, plan):
        """A dead replica's slot keeps its cursor ([Note: stream slots]). A fresh plan made
        from the cursors as they are: O(1) ([Note: stream cursors in O(1) per step])."""
        origin = getattr(plan.assignments, "origin", None) if plan.is_fresh else None
        if origin is not None and origin[0] is self._base and origin[1] is self._run \
                and origin[2] == self._n:
            if self._run is not plan.layout:
                self._settle()
                self._run = plan.layout
            self._n += 1
            return
        self._settle()
        base = dict(self._base)
        for a in plan.assignments:
            base[a.slot] = a.stream_start + a.quota
            self.slots[a.replica] = a.slot
        self._base = base

    def admit(self, alive, new):
        """Each newcomer takes a slot no alive replica reads (its own first), resumed at that
        slot's cursor."""
        self._settle()
        read = self._read(alive)
        free = [slot for slot in range(self.slot_count) if slot not in read]
        for r in new:
            slot = r if r in free else free[0]
            free.remove(slot)
            self.slots[r] = slot

    def slot_of(self, replica):
        return self.slots.get(replica, replica)

    def orphaned(self, alive, dead):
        known = set(self.cursors) | self._read(alive)
        return {s: self.cursors.get(s, 0) for s in sorted(known - self._read(alive, dead))}

    def _read(self, alive: Sequence[int], dead: Iterable[int] = ()) -> set[int]:
        """The stream slots `alive` less `dead` read."""
        dead = set(dead)
        return {self.slot_of(r) for r in alive if r not in dead}

    def state_dict(self, alive):
        return {"cursors": {str(s): c for s, c in sorted(self.cursors.items())},
                "slots": {str(r): self.slot_of(r) for r in alive}}

    def load_state_dict(self, state, alive):
        """Same membership: each keeps its slot; else the i-th replica takes the i-th slot read
        at the checkpoint, then the orphaned ones, then those never read ([Note: stream slots])."""
        self._base = {int(s): int(c) for s, c in state["cursors"].items()}
        self._run, self._n = None, 0
        saved = {int(r): int(s) for r, s in state.get("slots", {}).items()}
        old_alive = [int(r) for r in state["alive"]]
        was_read = [saved.get(r, r) for r in old_alive]
        orphans = sorted(set(self._base) - set(was_read))
        never = sorted(set(range(self.slot_count)) - set(was_read) - set(orphans))
        if tuple(alive) == tuple(old_alive):
            self.slots = {r: saved.get(r, r) for r in alive}
        else:
            self.slots = dict(zip(alive, was_read + orphans + never))


def make_assigner(mode: DataAssignment, initial_replicas: int) -> Assigner:
    """The assigner of `mode` for a run launched with `initial_replicas` (W_init slots)."""
    return ExactIds() if mode is DataAssignment.EXACT else StreamSlots(initial_replicas)
