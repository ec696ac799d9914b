"""Stragglers: the committed step's measured speed of every replica goes to the policy.

[Note: straggler quotas] (workload/rebalance.py) says what the policy does with it. The figures
are each replica's compute seconds per microbatch, summed across ranks in the step's totals
(``StepTotals.compute_s``), so every rank feeds the same numbers and keeps the same plan.
"""

from __future__ import annotations

from typing import Sequence

from recover_hsdp.outputs import RunMetrics
from recover_hsdp.workload import StepPlan, WorkloadPolicy


def observe_speeds(policy: WorkloadPolicy, outputs: RunMetrics, step: int, plan: StepPlan,
                   compute_s: Sequence[float]) -> None:
    """Feed the committed ``plan``'s replicas' seconds per microbatch to ``policy``; a change
    of the quota weights is one ``events.jsonl`` line (``phase`` ``rebalance``)."""
    if not policy.rebalancer.enabled:
        return
    seconds = {r: compute_s[r] for r in plan.alive}
    if policy.observe_speeds(seconds):
        outputs.log_event({"step": step, "phase": "rebalance",
                           "seconds_per_microbatch": {str(r): s for r, s in seconds.items()},
                           "weights": {str(r): w for r, w in policy.rebalancer.weights.items()}})
