"""``StepTotals``: the step's sums across every rank, reduced in one small all-reduce.

[Note: measured microbatches] (recovery/buckets.py) says why the microbatch gradients and token
positions are counted, not read from the plan; [Note: rejoin at a boundary]
(manager/rejoin.py) why the join counts ride along; [Note: straggler quotas]
(workload/rebalance.py) why each replica's compute seconds per microbatch do; [Note: divergence
votes] (manager/divergence.py) why each replica's parameter fingerprint does; [Note: gradient
audits] (manager/audits.py) why the audit's signatures do. The fields travel as one float64
array in a fixed order (``to_array`` / ``from_array``): the only place that order is written
(the scalar fields, then ``compute_s``, one slot per initial replica, then ``fingerprints``,
two per initial replica, then ``signatures``, ``audits.SLOTS`` per initial replica in a run
with audits, none without).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from recover_hsdp.manager.audits import SLOTS
from recover_hsdp.outputs import RunMetrics
from recover_hsdp.workload import StepPlan, WorkloadPolicy


@dataclasses.dataclass
class StepTotals:
    """One rank's share of the step's totals, or (after the reduce) their sums.

    Attributes:
        loss: summed loss of the committed microbatches (each divided by the step's nominal
            tokens), one rank per FSDP rank adds its part.
        tokens: valid label tokens of the committed microbatches (ditto).
        positions: label positions computed (valid or not): must come to B x tokens per
            microbatch.
        reduced: microbatch gradients the buckets really summed (every rank adds its buckets'
            count): must come to S x B.
        disagree: ranks whose buckets disagree on that count (must be 0).
        join_requests: operator join requests the writer sees.
        join_ready: survivors that see the starting newcomers ready.
        join_failed: survivors that see the starting newcomers failed.
        compute_s: per initial replica, its compute seconds per microbatch in this step (each
            of its ranks adds its own divided by S: the replica's mean); 0: not measured.
        fingerprints: per initial replica, the high and low 32 bits of its ranks' parameter
            fingerprints ([Note: exact fingerprints] in recovery/fingerprint.py), each rank
            adding its own halves (exact in float64); all 0 in a step without a vote.
        signatures: per initial replica, the signatures of its audited microbatch and of the
            one it audits (``audits.SLOTS`` values; empty in a run without audits, all 0 in a
            step without one).
    """

    loss: float = 0.0
    tokens: float = 0.0
    positions: float = 0.0
    reduced: float = 0.0
    disagree: float = 0.0
    join_requests: float = 0.0
    join_ready: float = 0.0
    join_failed: float = 0.0
    # per replica: numpy arrays (views of the reduced array after ``from_array``), never
    # Python lists: W values per step ([Note: a plan in O(1) per step] in workload/plan.py)
    compute_s: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    fingerprints: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    signatures: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    def add_microbatch(self, loss: float, tokens: int, positions: int) -> None:
        self.loss += loss
        self.tokens += tokens
        self.positions += positions

    def to_array(self) -> np.ndarray:
        return np.concatenate([np.array([getattr(self, name) for name in _SCALARS], np.float64),
                               np.asarray(self.compute_s, np.float64),
                               np.asarray(self.fingerprints, np.float64),
                               np.asarray(self.signatures, np.float64)])

    @classmethod
    def from_array(cls, values: np.ndarray, replicas: int = 0) -> StepTotals:
        """``replicas``: W_init (``compute_s`` has one slot per replica, ``fingerprints``
        two, ``signatures`` ``audits.SLOTS`` or none)."""
        first = len(_SCALARS)
        if len(values) not in (first + 3 * replicas, first + (3 + SLOTS) * replicas):
            raise ValueError(f"StepTotals: {len(values)} values for {first} fields and "
                             f"{replicas} replicas")
        prints = first + replicas
        values = np.asarray(values, np.float64)
        return cls(**{name: float(value) for name, value in zip(_SCALARS, values)},
                   compute_s=values[first:prints],
                   fingerprints=values[prints:prints + 2 * replicas],
                   signatures=values[prints + 2 * replicas:])

    def replica_fingerprint(self, replica: int) -> tuple[float, float]:
        """``replica``'s summed fingerprint halves (high, low)."""
        return float(self.fingerprints[2 * replica]), float(self.fingerprints[2 * replica + 1])

    def fingerprints_agree(self, alive: Sequence[int]) -> bool:
        """Every replica of ``alive`` (sorted) summed the same fingerprint halves: O(W) in
        numpy, no Python object per replica (the vote's common case)."""
        pairs = self.fingerprints.reshape(-1, 2)
        if len(alive) == len(pairs) and alive[-1] == len(pairs) - 1:  # every slot alive
            return bool((pairs == pairs[0]).all())
        chosen = pairs[np.fromiter(alive, np.int64, len(alive))]
        return bool((chosen == chosen[0]).all())

    def slowest(self, count: int) -> dict[str, float]:
        """The ``count`` replicas with the most compute seconds per microbatch this step
        (measured ones only), for the step's record: O(W) in numpy, a bounded record."""
        measured = np.flatnonzero(self.compute_s > 0)
        if len(measured) > count:
            measured = measured[np.argpartition(self.compute_s[measured], -count)[-count:]]
        return {str(int(r)): float(self.compute_s[r]) for r in sorted(measured)}

    def check_measured(self, step: int, committed: int, ranks_per_replica: int,
                       nominal_tokens: int) -> int:
        """[Note: measured microbatches]: raise unless the buckets summed ``committed`` (B)
        microbatch gradients over ``nominal_tokens`` token positions. Returns the
        microbatches summed."""
        reduced = self.reduced / ranks_per_replica
        if reduced != committed or int(self.positions) != nominal_tokens or self.disagree:
            raise RuntimeError(
                f"step {step}: refusing to commit: the buckets summed {reduced:g} microbatch "
                f"gradients over {int(self.positions)} token positions (buckets disagree on "
                f"{int(self.disagree)} ranks), the plan commits B = {committed} "
                f"over {nominal_tokens} ([Note: measured microbatches])")
        return int(reduced)


_SCALARS = tuple(f.name for f in dataclasses.fields(StepTotals)
                 if f.name not in ("compute_s", "fingerprints", "signatures"))


def observe_speeds(policy: WorkloadPolicy, outputs: RunMetrics, step: int, plan: StepPlan,
                   compute_s: Sequence[float]) -> None:
    """[Note: straggler quotas]: feed the committed ``plan``'s replicas' seconds per microbatch
    (``StepTotals.compute_s``, the same sums on every rank, so every rank keeps the same plan)
    to ``policy``; a change of the quota weights is one ``events.jsonl`` line (``phase``
    ``rebalance``)."""
    if not policy.rebalancer.enabled:
        return
    seconds = {r: float(compute_s[r]) for r in plan.alive}  # O(W): stragglers on only
    if policy.observe_speeds(seconds):
        outputs.log_event({"step": step, "phase": "rebalance",
                           "seconds_per_microbatch": {str(r): s for r, s in seconds.items()},
                           "weights": {str(r): w for r, w in policy.rebalancer.weights.items()}})
