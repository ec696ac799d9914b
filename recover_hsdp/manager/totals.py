"""``StepTotals``: the step's sums across every rank, reduced in one small all-reduce.

[Note: measured microbatches] (recovery/buckets.py) says why the microbatch gradients and token
positions are counted, not read from the plan; [Note: rejoin at a boundary]
(manager/rejoin.py) why the join counts ride along. The fields travel as one float64 array in a
fixed order (``to_array`` / ``from_array``): the only place that order is written.
"""

from __future__ import annotations

import dataclasses

import numpy as np


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
    """

    loss: float = 0.0
    tokens: float = 0.0
    positions: float = 0.0
    reduced: float = 0.0
    disagree: float = 0.0
    join_requests: float = 0.0
    join_ready: float = 0.0
    join_failed: float = 0.0

    def add_microbatch(self, loss: float, tokens: int, positions: int) -> None:
        self.loss += loss
        self.tokens += tokens
        self.positions += positions

    def to_array(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in dataclasses.fields(self)], np.float64)

    @classmethod
    def from_array(cls, values: np.ndarray) -> StepTotals:
        names = [f.name for f in dataclasses.fields(cls)]
        if len(values) != len(names):
            raise ValueError(f"StepTotals: {len(values)} values for {len(names)} fields")
        return cls(**{name: float(value) for name, value in zip(names, values)})
