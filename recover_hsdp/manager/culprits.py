"""Bad replicas: a replica alive but computing garbage is absorbed like a failure of one step.

[Note: bad replicas] A replica whose contribution is non-finite (a NaN/Inf gradient from silent
data corruption or a bad HBM page, an Inf loss) would poison every replica's sum: the cross-
replica reduce adds it into every bucket. Detection costs nothing on the good path: the step's
loss is already in the totals all-reduce, and the gradient norm is already computed by the
update (``StepWork.apply_update`` returns it without updating anything when it is not finite);
both are the same on every rank (the reduced sums are identical everywhere), so every rank
takes the bad path together. Only then does each rank look at its own contribution (a pass over
its snapshots and extras, ``BucketSync.nonfinite_buckets``, and its microbatches' losses) and
the world agrees on the culprits in one more small all-reduce (per initial replica: its ranks'
non-finite buckets, by index, and losses; a row is ``BUCKET_SLOTS`` + 1 wide on every rank, as
ranks of different pipeline stages have different FSDP units: [Note: pipeline stages in a
replica] in titan/pipeline.py). Then, like a dead replica's, the culprits' committed ids become
extras of the others (``WorkloadPolicy.exclude``: promotion, water-filling), the culprits
contribute zero, every bucket is restored from its snapshot and reduced again (they all hold the
poisoned sum), and the step commits exactly B; exact mode commits the failure-free ids, so the
loss is the failure-free run's. A culprit is excluded from that step only: it stays in the
membership and is planned as usual next step. After ``[recover.bad_replicas] max_offences``
offences within ``offence_window_steps`` steps it retires as a unit instead: its ranks leave (the
reason goes to ``errors/``, the others' next consensus sees a death), and it may come back fresh
through the rejoin path. A replica's ranks count its own offences (they are born together and see the
same agreed culprits), so that decision needs no state a newcomer lacks; the others exclude it
either way and then repair the death. No culprit found (a finite contribution that overflowed in
the sum) refuses the step in one line. Every finding is one ``events.jsonl`` line (``phase``
``nonfinite``: step, culprits, their buckets, loss, offences, what was done).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from recover_hsdp.config import BadReplicas
from recover_hsdp.outputs import RunMetrics
from recover_hsdp.phases import Phase
from recover_hsdp.workload import StepPlan

BUCKET_SLOTS = 64
"""Columns of a replica's row in the culprits' agreement: bucket index b counts in column
min(b, BUCKET_SLOTS - 1) (a rank's own index: each pipeline stage numbers its own units)."""


class Offences:
    """Per replica the steps at which its contribution was non-finite, inside a window."""

    def __init__(self, max_offences: int, window_steps: int) -> None:
        self.max_offences, self.window_steps = max_offences, window_steps
        self.steps: dict[int, list[int]] = {}

    def add(self, step: int, replica: int) -> int:
        """One more offence of ``replica`` at ``step``; returns its offences in the window."""
        kept = [s for s in self.steps.get(replica, []) if s > step - self.window_steps]
        self.steps[replica] = kept + [step]
        return len(self.steps[replica])

    def retires(self, count: int) -> bool:
        return count >= self.max_offences

    def forget(self, replica: int) -> None:
        self.steps.pop(replica, None)


class Culprits:
    """Finds and agrees on the culprits of a non-finite step; see [Note: bad replicas].

    Args:
        world: the ``World`` (collectives/interface.py).
        bucket_sync: this rank's ``BucketSync``.
        outputs: this rank's ``RunMetrics`` (events, written by the writer).
        initial_replicas: W_init (one row of the agreement per initial replica).
        limits: the ``[recover.bad_replicas]`` section (config.BadReplicas): ``max_offences``
            within ``offence_window_steps`` retire a replica (default: the section's defaults).
    """

    def __init__(self, *, world, bucket_sync, outputs: RunMetrics, initial_replicas: int,
                 limits: BadReplicas | None = None) -> None:
        limits = limits or BadReplicas()
        self.world, self.bucket_sync, self.outputs = world, bucket_sync, outputs
        self.initial_replicas = initial_replicas
        self.offences = Offences(limits.max_offences, limits.offence_window_steps)

    def absorb(self, step: int, state, policy, span, leave: Callable[[int, str], None],
               compute_new_extras: Callable[[], None], rereduce: Callable[[], int],
               found: tuple[int, ...] = (),
               log_found: Callable[[dict, list], None] | None = None) -> None:
        """The bad path of ``step`` (its ``StepState``): agree on the culprits, exclude them
        from the plan (``policy.exclude``), compute the new extras, then rebuild and reduce
        every bucket. If the agreement's reduce failed (a death meanwhile) nothing changes:
        the consensus repairs first and the step is checked again. ``found``: culprits
        already agreed elsewhere (an audit's, [Note: gradient audits] in audits.py): no
        agreement, their offences counted here and ``log_found(counts, retiring)`` records
        them."""
        with span(step, Phase.REPAIR):
            if found:
                culprits = found
                self.sentence(step, culprits, leave, "audited gradients that differ",
                              log_found or (lambda counts, retiring: None))
            else:
                culprits = self.agree(step, state.plan, state.stats, leave)
            if culprits is None:
                return
            state.plan = policy.exclude(state.plan, culprits)
            compute_new_extras()
        with span(step, Phase.REREDUCE):
            self.bucket_sync.invalidate()  # every bucket holds the poisoned sum
            rereduce()

    def agree(self, step: int, plan: StepPlan, stats: Mapping[int, tuple],
              leave: Callable[[int, str], None]) -> tuple[int, ...] | None:
        """The culprits of ``step`` (sorted), agreed by every rank; None if the agreement's
        reduce failed (the consensus repairs first, then the step is checked again). A rank of
        a culprit that reached its offence limit calls ``leave(step, reason)`` (never returns);
        a culprit's extras are dropped from its buckets."""
        width = BUCKET_SLOTS + 1  # the buckets, then the loss: the same width on every rank
        mine = plan.assignment(self.world.replica)
        flags = np.zeros((self.initial_replicas, width), np.float64)
        for index in self.bucket_sync.nonfinite_buckets():
            flags[self.world.replica, min(index, BUCKET_SLOTS - 1)] += 1
        losses = [stats[i][0] for i in mine.committed_ids if i in stats]
        flags[self.world.replica, -1] = float(not all(math.isfinite(x) for x in losses))
        values = flags.reshape(-1)
        if not self.world.allreduce_global(values):
            return None
        rows = values.reshape(self.initial_replicas, width)
        culprits = tuple(r for r in range(self.initial_replicas) if rows[r].any())
        if not culprits:
            raise RuntimeError(f"step {step}: refusing to commit: the reduced gradient or loss is "
                               "not finite but no replica's own contribution is (an overflow in "
                               "the sum, not a bad replica): [Note: bad replicas]")
        self.sentence(step, culprits, leave, "non-finite contributions",
                      lambda counts, retiring: self._log(step, rows, counts, retiring))
        return culprits

    def sentence(self, step: int, culprits: tuple[int, ...], leave: Callable[[int, str], None],
                 what: str, log: Callable[[dict, list], None]) -> None:
        """One more offence for each of ``culprits`` (``log(counts, retiring)`` records it);
        a rank of a culprit at its limit calls ``leave`` (never returns); a culprit's extras
        are dropped from its buckets."""
        counts = {r: self.offences.add(step, r) for r in culprits}
        retiring = [r for r in culprits if self.offences.retires(counts[r])]
        log(counts, retiring)
        for r in retiring:
            self.offences.forget(r)
        if self.world.replica in retiring:
            leave(step, f"retired: {counts[self.world.replica]} {what} within "
                        f"{self.offences.window_steps} steps ([Note: bad replicas])")
        if self.world.replica in culprits:
            self.bucket_sync.drop_extras()

    def _log(self, step: int, rows: np.ndarray, counts: dict[int, int], retiring) -> None:
        self.outputs.log_event({
            "step": step, "phase": "nonfinite", "epoch": self.world.epoch,
            "culprits": {str(r): {
                "buckets": [int(b) for b in np.nonzero(rows[r, :-1])[0]],
                "loss": bool(rows[r, -1]), "offences": counts[r],
                "action": "retired" if r in retiring else "excluded"} for r in sorted(counts)},
            "action": "culprits contribute zero, their microbatches computed as extras by the "
                      "others, every bucket restored and reduced again"})
