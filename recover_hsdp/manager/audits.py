"""Gradient audits: one microbatch computed again by another replica, compared, a culprit settled.

[Note: gradient audits] A replica whose backward is wrong but finite (an ALU that is slightly
off, a flipped bit in an activation) contributes to every sum and no other check sees it: the
loss stays finite ([Note: bad replicas] in culprits.py) and the parameters stay equal on every
replica, since they are all updated with the same wrong sum ([Note: divergence votes] in
divergence.py). Only computing the same work twice can. Every ``[recover.bad_replicas]
audit_interval`` steps (0: off, the default):

1. **Pairs** (:func:`audit_pairs`, from the plan: the same on every rank, no message). Every
   replica that commits work (an *owner*) has one of its committed microbatches audited (a
   different one each audit, in turn). Its *auditor* is a spare if one is free (a spare's step
   is otherwise one zeroed microbatch: it waits for the others anyway), else the previous owner
   in a ring: every replica audits at most one other and every owner is audited at every audit,
   so a wrong replica is looked at within 1 x ``audit_interval`` steps (R = 1).
2. **Signatures** after the step's own buckets are summed (``Phase.AUDIT``): the owner and the
   auditor each compute the audited microbatch once more with gradient sync on and the bucket
   hook in audit mode (``BucketSync.begin_audit``: each bucket's statistics are taken and the
   bucket zeroed, so FSDP's accumulation into ``.grad`` adds nothing and nothing is reduced
   across replicas). A signature is (loss, sum, sum of |g|, sum of g^2) of that microbatch's
   gradient alone, each rank's summed over the replica's ranks; both ride in the step's totals
   all-reduce (``StepTotals.signatures``). Before the update, not after it: the update of the
   audited step is the one kept clean.
3. **Verdict** (:func:`compare`): a pair agrees when every statistic is within
   ``audit_tolerance`` of the other (relative to the pair's larger |loss|, sum of |g|, sum of
   |g|, sum of g^2). A pair that differs is **settled by a third computation**: a replica
   outside the pair (a spare first) computes the same microbatch and its signature is summed in
   one more small all-reduce; the side it agrees with is right, the other side is the culprit.
   No third replica (2 alive) or a third that agrees with neither: nothing says which side is
   right, and the step is refused in one line (``NoMajority``, as a vote without a majority:
   the relaunch tier goes back to the newest certified checkpoint).
4. **Culprits** are absorbed like non-finite ones ([Note: bad replicas]): excluded from the
   step (their committed ids dealt to the others as extras, every bucket restored and reduced
   again, B held, exact mode commits the failure-free ids) and after ``max_offences`` offences
   within ``offence_window_steps`` they retire as a unit (and may rejoin fresh).

Cost: every audited replica computes 2 more microbatches (its own again, the one it audits) in
an audit step, an auditing spare 1; no message of its own on the good path (the signatures ride
in the totals: 8 floats per initial replica). With ``audit_interval = 1`` and G microbatches a
step that is about (G + 2) / G of the step's compute (benchmarks/fingerprint_bench.py measures
it). On CPU the two computations are bitwise equal (measured: 0 difference), so any tolerance
finds a factor of 1.001; on a GPU with non-deterministic kernels the tolerance must sit above
their noise (each step's record carries ``audit.max_rel_diff`` to measure it).

What it does not find: corruption smaller than the tolerance; a wrong computation that does
not touch the audited microbatch (the audit samples one microbatch of each replica per audit:
a fault in every backward is found at once, a rare transient one only when it hits the
sample); corruption after the bucket hook (in the cross-replica sum itself: every replica
receives the same sum, nothing differs); wrong data. Exact data assignment only: in stream mode
an auditor cannot read another replica's stream position (refused in one line by the config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from recover_hsdp.manager.divergence import NoMajority
from recover_hsdp.workload import DataRef, StepPlan

#: A signature's statistics: loss, sum, sum of |g|, sum of g^2 (the microbatch's gradient).
SIGNATURE = 4
#: Per initial replica in ``StepTotals.signatures``: its own audited microbatch, then the one it
#: audits.
SLOTS = 2 * SIGNATURE


@dataclass(frozen=True)
class AuditPair:
    """``auditor`` computes ``owner``'s committed microbatch ``microbatch`` (at ``data``)."""

    owner: int
    auditor: int
    microbatch: int
    data: DataRef


def _free_spares(plan: StepPlan) -> list[int]:
    """Alive replicas that commit nothing and are not an excluded culprit, sorted: the
    auditors and third computers asked first."""
    return sorted(a.replica for a in plan.assignments if not a.committed_ids and not a.excluded)


def audit_pairs(plan: StepPlan, step: int, interval: int) -> list[AuditPair]:
    """The pairs of an audit step ([Note: gradient audits] 1): every replica that commits work
    is audited, by a free spare first, else by the previous such replica in a ring; none when
    fewer than 2 replicas are alive."""
    owners = sorted((a for a in plan.assignments if a.committed_ids), key=lambda a: a.replica)
    spares = _free_spares(plan)
    turn = step // max(interval, 1)
    pairs = []
    for index, owner in enumerate(owners):
        if index < len(spares):
            auditor = spares[index]
        elif len(owners) > 1:
            auditor = owners[index - 1].replica
        else:
            continue
        ids = owner.committed_ids
        microbatch = ids[turn % len(ids)]
        pairs.append(AuditPair(owner.replica, auditor, microbatch, owner.data_ref(microbatch)))
    return pairs


def relative_difference(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest difference of two signatures' statistics, each relative to its scale: the
    larger |loss|; the larger sum of |g| (for the sum and for the sum of |g|); the larger sum of
    g^2. inf when either is not finite; 0 when both are all zero."""
    if not all(math.isfinite(x) for x in (*a, *b)):
        return math.inf
    scales = (max(abs(a[0]), abs(b[0])), max(a[2], b[2]), max(a[2], b[2]), max(a[3], b[3]))
    worst = 0.0
    for x, y, scale in zip(a, b, scales):
        if x != y:
            worst = max(worst, abs(x - y) / scale if scale > 0 else math.inf)
    return worst


def compare(a: Sequence[float], b: Sequence[float], tolerance: float) -> bool:
    """Whether two signatures of the same microbatch agree within ``tolerance``."""
    return relative_difference(a, b) <= tolerance


def settle(pair: AuditPair, owner: Sequence[float], auditor: Sequence[float],
           third: Sequence[float] | None, tolerance: float) -> int | None:
    """The culprit of a pair that differs, by the third signature: the side it disagrees with
    (None: it agrees with neither, or there is no third)."""
    if third is None:
        return None
    with_owner, with_auditor = compare(third, owner, tolerance), compare(third, auditor, tolerance)
    if with_owner and not with_auditor:
        return pair.auditor
    if with_auditor and not with_owner:
        return pair.owner
    return None


def third_for(pair: AuditPair, plan: StepPlan, alive: Sequence[int], step: int) -> int | None:
    """Who computes a differing pair's microbatch a third time: an alive replica outside the
    pair, a free spare first, in turn by step; None when there is none."""
    others = sorted(r for r in alive if r not in (pair.owner, pair.auditor))
    pool = [r for r in _free_spares(plan) if r in others] or others
    return pool[step % len(pool)] if pool else None


class Audits:
    """[Note: gradient audits] on one rank.

    Args:
        world: the ``World`` (its replica, ``allreduce_global`` for the third computations).
        outputs: ``RunMetrics`` (an ``audit`` event when a pair differs).
        initial_replicas: W_init (the totals' slots).
        interval: ``audit_interval`` (0: off).
        tolerance: ``audit_tolerance``.
    """

    def __init__(self, *, world, outputs, initial_replicas: int, interval: int,
                 tolerance: float) -> None:
        self.world, self.outputs = world, outputs
        self.initial_replicas, self.interval, self.tolerance = initial_replicas, interval, tolerance

    def due(self, step: int, plan: StepPlan) -> list[AuditPair]:
        """The pairs of ``step`` ([] when no audit is due)."""
        if self.interval <= 0 or step % self.interval:
            return []
        return audit_pairs(plan, step, self.interval)

    def signatures(self, pairs: Sequence[AuditPair],
                   signature: Callable[[DataRef], Sequence[float]]) -> np.ndarray:
        """This rank's share of the step's ``StepTotals.signatures``: the signature of this
        replica's audited microbatch and of the one it audits (``signature(data)`` computes one
        on this rank)."""
        values = np.zeros(SLOTS * self.initial_replicas, np.float64)
        me = self.world.replica
        for pair in pairs:
            if pair.owner == me:
                values[SLOTS * me:SLOTS * me + SIGNATURE] = signature(pair.data)
            if pair.auditor == me:
                values[SLOTS * me + SIGNATURE:SLOTS * (me + 1)] = signature(pair.data)
        return values

    def verdict(self, step: int, plan: StepPlan, pairs: Sequence[AuditPair],
                summed: Sequence[float], signature: Callable[[DataRef], Sequence[float]]) \
            -> tuple[tuple[int, ...], dict] | None:
        """The culprits of ``step`` (sorted; () when every pair agrees) and a summary for the
        step's record; None when the third computations' reduce failed (a death: the
        consensus repairs first, then the step is checked again). Raises ``NoMajority`` when a
        pair differs and nothing settles it. Pairs with a member no longer alive are skipped."""
        alive = self.world.alive_replicas
        checked = [p for p in pairs if p.owner in alive and p.auditor in alive]
        differ, worst = [], 0.0
        for pair in checked:
            own, audit = self._own(summed, pair.owner), self._audit(summed, pair.auditor)
            difference = relative_difference(own, audit)
            worst = max(worst, difference)
            if difference > self.tolerance:
                differ.append((pair, own, audit))
        summary = {"pairs": len(checked), "max_rel_diff": worst, "culprits": []}
        if not differ:
            return (), summary
        thirds = [third_for(pair, plan, alive, step) for pair, _, _ in differ]
        settled = self._third_signatures(differ, thirds, signature)
        if settled is None:
            return None
        culprits = set()
        summary["differ"] = _differ(differ, thirds, settled)
        for (pair, own, audit), third, value in zip(differ, thirds, settled):
            culprit = settle(pair, own, audit, value if third is not None else None,
                             self.tolerance)
            if culprit is None:
                self.log(step, summary, {}, [])
                raise NoMajority(
                    f"step {step}: refusing to commit: replicas {pair.owner} and {pair.auditor} "
                    f"computed microbatch {pair.microbatch} differently (relative difference "
                    f"{relative_difference(own, audit):.3g} > audit_tolerance={self.tolerance:g})"
                    + (f" and replica {third} agrees with neither" if third is not None else
                       " and no third replica is alive to settle it")
                    + ": restart from the newest certified checkpoint ([Note: gradient audits])")
            culprits.add(culprit)
        summary["culprits"] = sorted(culprits)
        return tuple(sorted(culprits)), summary

    def _own(self, summed: Sequence[float], replica: int) -> Sequence[float]:
        return summed[SLOTS * replica:SLOTS * replica + SIGNATURE]

    def _audit(self, summed: Sequence[float], replica: int) -> Sequence[float]:
        return summed[SLOTS * replica + SIGNATURE:SLOTS * (replica + 1)]

    def _third_signatures(self, differ, thirds, signature) -> list[np.ndarray] | None:
        """One more small all-reduce: each differing pair's third signature."""
        values = np.zeros(SIGNATURE * len(differ), np.float64)
        for index, ((pair, _, _), third) in enumerate(zip(differ, thirds)):
            if third == self.world.replica:
                values[SIGNATURE * index:SIGNATURE * (index + 1)] = signature(pair.data)
        if not self.world.allreduce_global(values):
            return None
        return [values[SIGNATURE * i:SIGNATURE * (i + 1)] for i in range(len(differ))]

    def log(self, step: int, summary: dict, counts: dict, retiring: list) -> None:
        """One ``events.jsonl`` line (``phase`` ``audit``) for pairs that differ: their
        signatures, the third's, the culprits, their offences and what was done."""
        culprits = summary["culprits"]
        self.outputs.log_event({
            "step": step, "phase": "audit", "epoch": self.world.epoch,
            "differ": summary["differ"],
            "culprits": {str(r): {"offences": counts.get(r, 0),
                                  "action": "retired" if r in retiring else "excluded"}
                         for r in culprits},
            "action": "culprits contribute zero, their microbatches computed as extras by the "
                      "others, every bucket restored and reduced again" if culprits else
                      "refused: nothing settles which side is right"})


def _differ(differ, thirds, settled) -> list[dict]:
    return [{"owner": pair.owner, "auditor": pair.auditor, "microbatch": pair.microbatch,
             "third": third, "owner_signature": [float(x) for x in own],
             "auditor_signature": [float(x) for x in audit],
             "third_signature": [float(x) for x in value] if third is not None else None}
            for (pair, own, audit), third, value in zip(differ, thirds, settled)]
