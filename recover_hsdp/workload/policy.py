"""Versatile-workload policy: roles, quotas, G and boundary steps (plain Python, no MPI, no torch).

The invariant this module keeps (checked at run time by every `plan`/`replan`, see `_checked`):

    sum over alive replicas r of len(committed_ids(r))  ==  B  ==  W_init * G_init
    and no microbatch is committed twice (exact mode: committed ids == {t*B, ..., t*B+B-1}).

Roles, for W alive replicas (sorted ids) and G = G(W) microbatches per replica:
  MAJOR  the first B // G replicas: compute and commit G microbatches.
  MINOR  the next one when B % G > 0: computes and commits the remainder q, 0 < q < G.
  SPARE  the rest (keep_spares=True): compute like a major, commit nothing unless promoted.
  IDLE   the rest (keep_spares=False): compute nothing; still join the collectives (zero gradient).
G(W) = ceil(B / W) under g_raise="ceil" (so ceil(B/G) <= W always fits); g_raise="reserve" keeps
one replica spare after the first loss: G(W) = ceil(B / (W - 1)) for 2 <= W < W_init, B for W = 1.
G follows the alive count both ways, B unchanged: a failure (`commit` of a replanned step) shrinks
W and raises G; replacements taken in by `admit` grow W back and bring G back toward G_init.
W = W_init gives G_init (stock layout).

A failure inside an iteration is seen at gradient sync, after every replica computed its work.
`replan(plan, dead)` rebuilds the same step: the dead replicas' committed work (compute + extras)
is lost; an unpromoted spare whose whole computation fits inside the loss is promoted (it already
holds the gradient, so promotion is free: the trainer must snapshot a spare's bucket before zeroing
it); what is still missing becomes extra microbatches ("policy boundary step"), dealt one at a time
to the survivor with the fewest extras (ties: lowest id). Bound: after a replan every survivor's
extras <= max(previous max, ceil(E / W_s)), E the survivors' extras, W_s the survivors; hence
<= ceil(B / W_s) in any iteration. One lost major (G) in a clean step costs each survivor at most
ceil(G / (W - 1)) extras: a single microbatch time when W - 1 >= G, more rounds below that.

A culprit (a replica alive but with a non-finite contribution) is excluded from one step by
`exclude(plan, culprits)`: its committed ids are dealt to the others exactly as a dead replica's
(promotion first, then water-filling), but it stays in the plan (it still joins the collectives,
contributing zero) and in the next step's membership. Stragglers: contributors' quotas follow
their measured speed (`observe_speeds`, [Note: straggler quotas] in rebalance.py); blocks stay
contiguous, so the sum is B and exact mode's id set is unchanged.

Data assignment (`DataAssignment`): the rules above are written once here; what the ids name is
left to one `Assigner` per mode, built with the policy (assignment.py): the ids of a role, when a
spare's work "fits inside the loss", the id of an extra, and the mode's half of the invariant.
  stream  `StreamSlots` (the paper): ids are positions in the replica's own stream slot
          ([Note: stream slots]); a spare computes its next G positions without consuming them.
  exact   `ExactIds`: ids are global, step t commits exactly t*B .. t*B+B-1 (stock HSDP's layout
          with W_init replicas); spare j shadows contributor j mod #contributors (same ids).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from enum import Enum
from typing import Iterable, Mapping

from recover_hsdp.workload.assignment import Assigner, make_assigner
from recover_hsdp.workload.plan import (DataAssignment, DataRef, Layout, ReplicaAssignment, Role,
                                        StepPlan)
from recover_hsdp.workload.rebalance import Rebalancer, StragglerRule

__all__ = ["DataAssignment", "DataRef", "GRaise", "ReplicaAssignment", "Role", "StepPlan",
           "StragglerRule", "WorkloadPolicy", "validate_workload_fields"]


class GRaise(str, Enum):
    """Rule that sets G from the alive count (see the module docstring)."""

    CEIL = "ceil"
    RESERVE = "reserve"


def validate_workload_fields(*, microbatches_per_replica, keep_spares, data_assignment,
                             g_raise) -> None:
    """Check the `[recover.workload]` fields this layer owns; ValueError names the field and the
    fix."""
    g = microbatches_per_replica
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"recover.microbatches_per_replica must be an integer >= 1 (got {g!r}): "
                         "set it in the [recover] section")
    if not isinstance(keep_spares, bool):
        raise ValueError(f"recover.workload.keep_spares must be true or false (got "
                         f"{keep_spares!r}): set it in the [recover.workload] section")
    for name, value, enum in (("data_assignment", data_assignment, DataAssignment),
                              ("g_raise", g_raise, GRaise)):
        if value not in {e.value for e in enum}:
            choices = " or ".join(repr(e.value) for e in enum)
            raise ValueError(f"recover.workload.{name} must be {choices} (got {value!r}): "
                             "set it in the [recover.workload] section")


class WorkloadPolicy:
    """Deterministic workload policy; every rank holds one and feeds it the agreed membership.

    Args:
        initial_replicas: W_init, the replica count the run was launched with.
        microbatches_per_replica: G_init; B = W_init * G_init stays fixed for the whole run.
        global_microbatches: B, optional consistency check.
        keep_spares: surplus replicas are SPARE (compute, promotable) instead of IDLE.
        data_assignment: "stream" or "exact" (see the module docstring); picks `assigner`.
        g_raise: "ceil" or "reserve".
        alive_replicas: current membership when restarting with fewer replicas (default: all).
        straggler: the straggler thresholds ([Note: straggler quotas]); None or slow_ratio 0: off.
    """

    def __init__(self, *, initial_replicas: int, microbatches_per_replica: int,
                 global_microbatches: int | None = None, keep_spares: bool = True,
                 data_assignment: DataAssignment | str = DataAssignment.STREAM,
                 g_raise: GRaise | str = GRaise.CEIL,
                 alive_replicas: Iterable[int] | None = None,
                 straggler: StragglerRule | None = None) -> None:
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
        self.assigner: Assigner = make_assigner(
            DataAssignment(getattr(data_assignment, "value", data_assignment)), initial_replicas)
        self.g_raise = GRaise(getattr(g_raise, "value", g_raise))
        self.rebalancer = Rebalancer(straggler or StragglerRule())
        self.step = 0
        self.alive = _sorted_ids(range(initial_replicas) if alive_replicas is None
                                 else alive_replicas)
        self._layout: Layout | None = None  # the last plan's ([Note: a plan in O(1) per step])
        self._layout_weights: tuple = ()
        self._layout_source: object = None  # the membership object it was built from

    @property
    def data_assignment(self) -> DataAssignment:
        """The data assignment this policy was built for (its `assigner`'s mode)."""
        return self.assigner.mode

    @property
    def cursors(self) -> dict[int, int]:
        """Stream slot -> positions committed (empty under exact ids)."""
        return self.assigner.cursors

    @property
    def slots(self) -> dict[int, int]:
        """Replica -> stream slot, where it is not the replica's own id (empty under exact ids)."""
        return self.assigner.slots

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
        """Failure-free plan of `step` for the agreed membership (default: the policy's own).
        Contributor k owns block k of the step's B ids; spare j stands for contributor j mod
        #contributors; the assigner turns role and block into ids, for one replica when it is
        asked for: O(1) per step while the membership and the quota weights stay ([Note: a plan
        in O(1) per step] in plan.py)."""
        layout = self._layout_of(self.alive if alive_replicas is None else alive_replicas)
        return self._checked(StepPlan(step, self.global_microbatches, layout.g,
                                      self.data_assignment, self.assigner.placer(layout, step)))

    def _layout_of(self, alive: Iterable[int]) -> Layout:
        """The roles and blocks for ``alive`` under the current quota weights: the last one
        when neither changed (an identity test, else one tuple comparison), else built and
        checked (O(W))."""
        weights = tuple(sorted(self.rebalancer.weights.items()))
        last = self._layout
        if last is not None and self._layout_weights == weights and (
                alive is last.alive or alive is self._layout_source
                or (isinstance(alive, tuple) and alive == last.alive)):
            return last
        source, alive = alive, _sorted_ids(alive)
        if last is not None and self._layout_weights == weights and alive == last.alive:
            return last
        b, g = self.global_microbatches, self.g_for(len(alive))
        n_major, q = divmod(b, g)
        offsets = [0]
        for size in self.rebalancer.quotas(alive[:n_major + (q > 0)], b, g):  # G each, q last,
            offsets.append(offsets[-1] + size)                               # unless a
        self._layout = Layout(alive, g, tuple(offsets), n_major,              # straggler is
                              self.keep_spares)                               # slower
        self._layout_weights = weights
        self._layout_source = source if isinstance(source, tuple) else None  # immutable only
        return self._layout

    def replan(self, plan: StepPlan, dead_replicas: Iterable[int]) -> StepPlan:
        """Same step after `dead_replicas` died: promote spares, then deal extras (boundary)."""
        dead = set(dead_replicas)
        if not dead or not dead <= set(plan.alive):
            raise ValueError(f"dead replicas {sorted(dead)} must be a non-empty subset of the "
                             f"alive replicas {list(plan.alive)}")
        survivors = {a.replica: a for a in plan.assignments if a.replica not in dead}
        if not survivors:
            raise RuntimeError(f"step {plan.step}: every replica died, nothing can keep the step")
        missing = sorted(i for r in sorted(dead) for i in plan.assignment(r).committed_ids)
        self._deal(survivors, missing)
        new = tuple(survivors[r] for r in sorted(survivors))
        lost_work = plan.lost_work + tuple(
            (r, plan.assignment(r).compute_ids + plan.assignment(r).extra_ids)
            for r in sorted(dead))
        return self._checked(replace(plan, assignments=new, dead=plan.dead + tuple(sorted(dead)),
                                     lost_work=lost_work, round=plan.round + 1))

    def exclude(self, plan: StepPlan, culprits: Iterable[int]) -> StepPlan:
        """Same step without the contributions of `culprits` (alive replicas whose contribution
        was non-finite): their committed ids are dealt to the others as a dead replica's would
        be, and they stay in the plan, excluded (they commit nothing, keep their role, and are
        back in the next step's plan)."""
        bad = set(culprits)
        if not bad or not bad <= set(plan.alive):
            raise ValueError(f"culprits {sorted(bad)} must be a non-empty subset of the alive "
                             f"replicas {list(plan.alive)}")
        others = {a.replica: a for a in plan.assignments
                  if a.replica not in bad and not a.excluded}
        if not others:
            raise RuntimeError(f"step {plan.step}: every replica's contribution is non-finite "
                               "(or excluded): nothing can keep the step")
        missing = sorted(i for r in sorted(bad) for i in plan.assignment(r).committed_ids)
        self._deal(others, missing)
        new = tuple(others.get(a.replica) or replace(a, excluded=True, extra_ids=())
                    for a in plan.assignments)
        culprits = plan.culprits + tuple(sorted(bad - set(plan.culprits)))
        return self._checked(replace(plan, assignments=new, round=plan.round + 1,
                                     culprits=culprits))

    def _deal(self, survivors: dict[int, ReplicaAssignment], missing: list[int]) -> None:
        """Cover the lost ids `missing` with `survivors` (updated in place): promote spares
        whose whole computation fits inside the loss, then water-fill extras one at a time to
        the survivor with the fewest (ties: lowest id). Excluded culprits take nothing."""
        for r, a in sorted(survivors.items()):   # promotion: the spare's whole work fits the loss
            if a.role is Role.SPARE and not a.promoted and not a.excluded and a.compute_ids \
                    and self.assigner.promotable(a, missing):
                survivors[r] = replace(a, promoted=True)
                missing = self.assigner.cover(a, missing)
        heap = [(len(a.extra_ids), r) for r, a in survivors.items() if not a.excluded]
        if missing and not heap:
            raise RuntimeError("every surviving replica is an excluded culprit: nothing can "
                               "keep the step")
        heapq.heapify(heap)
        for i in missing:               # water-filling: one extra to the least loaded survivor
            n, r = heapq.heappop(heap)
            a = survivors[r]
            survivors[r] = replace(a, extra_ids=a.extra_ids + (self.assigner.extra_id(i, a),))
            heapq.heappush(heap, (n + 1, r))

    def observe_speeds(self, seconds: Mapping[int, float]) -> bool:
        """A committed step's measured compute seconds per microbatch of every alive replica
        (the same figures on every rank): the next plans' quotas follow ([Note: straggler
        quotas] in rebalance.py). Returns whether a quota weight changed."""
        return self.rebalancer.observe(seconds)

    def _checked(self, plan: StepPlan) -> StepPlan:
        """Assert the invariant (always on; O(B), O(1) for a fresh plan whose layout was
        checked when built): B committed here, the mode's half (no id twice, exact ids as
        planned) by the assigner."""
        b = plan.global_microbatches
        if plan.committed_total() != b:
            raise AssertionError(f"step {plan.step}: {plan.committed_total()} microbatches "
                                 f"committed, expected B={b}")
        self.assigner.check(plan)
        return plan

    def commit(self, plan: StepPlan) -> None:
        """The step committed: adopt its survivors (G follows the new count, roles reassigned),
        and the assigner advances what each consumed (stream cursors; [Note: stream slots])."""
        self.step = plan.step + 1
        self.alive = plan.alive
        self.assigner.commit(plan)

    def admit(self, replicas: Iterable[int]) -> None:
        """Replacement replicas joined between two steps ([Note: rejoin at a boundary] in
        recover_hsdp/manager/rejoin.py): they are alive from the next plan on, so G goes back
        toward G_init with B unchanged. In stream mode each takes a slot no alive replica reads
        (its own first), resumed at that slot's cursor."""
        new = _sorted_ids(replicas)
        if set(new) & set(self.alive) or any(r < 0 or r >= self.initial_replicas for r in new):
            raise ValueError(f"replicas {list(new)} cannot join: alive {list(self.alive)}, "
                             f"W_init {self.initial_replicas}")
        self.assigner.admit(self.alive, new)
        self.alive = _sorted_ids((*self.alive, *new))

    def slot_of(self, replica: int) -> int:
        """The stream slot ``replica`` reads ([Note: stream slots]); exact mode: its own id."""
        return self.assigner.slot_of(replica)

    def orphaned_slots(self, dead: Iterable[int] = ()) -> dict[int, int]:
        """Stream slots no alive replica reads (those of ``dead`` too): slot -> its cursor,
        where its unread remainder starts. Exact mode: none."""
        return self.assigner.orphaned(self.alive, dead)

    # ---- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serializable state (config included) for checkpoints."""
        return {"version": 2, "global_microbatches": self.global_microbatches,
                "initial_replicas": self.initial_replicas,
                "microbatches_per_replica": self.initial_g,
                "keep_spares": self.keep_spares, "data_assignment": self.data_assignment.value,
                "g_raise": self.g_raise.value, "step": self.step, "alive": list(self.alive),
                "g": self.g, **self.assigner.state_dict(self.alive),
                **({"straggler": self.rebalancer.state_dict()} if self.rebalancer.enabled else {})}

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
        ``orphaned_slots()``. (Kept by `StreamSlots` in assignment.py.)"""
        if state.get("version") not in (1, 2):
            raise ValueError(f"unknown workload state version {state.get('version')!r}")
        p = cls(initial_replicas=state["initial_replicas"],
                microbatches_per_replica=state["microbatches_per_replica"],
                global_microbatches=state["global_microbatches"], keep_spares=state["keep_spares"],
                data_assignment=state["data_assignment"], g_raise=state["g_raise"],
                alive_replicas=state["alive"] if alive_replicas is None else alive_replicas)
        p.step = int(state["step"])
        p.assigner.load_state_dict(state, p.alive)
        if "straggler" in state:
            p.rebalancer = Rebalancer.from_state_dict(state["straggler"])
        return p


def _sorted_ids(replicas: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated replica ids; at least one."""
    ids = tuple(sorted(set(int(r) for r in replicas)))
    if not ids or ids[0] < 0:
        raise ValueError(f"alive replicas must be non-empty non-negative ids (got {list(ids)})")
    return ids
