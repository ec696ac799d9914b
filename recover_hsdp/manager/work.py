"""What the trainer does for the manager in one step (``StepWork``), and what one step
accumulates on a rank while [Note: the step protocol] (manager.py) runs (``StepState``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from recover_hsdp.manager.totals import StepTotals
from recover_hsdp.workload import DataRef, StepPlan


class StepWork(Protocol):
    """What the trainer does for the manager inside one step (one replica, this rank)."""

    def set_gradient_sync(self, enabled: bool) -> None:
        """FSDP gradient sync on (last microbatch) or off (accumulate locally)."""

    def forward_backward(self, data: DataRef, nominal_tokens: int,
                         before_backward: Callable[[], None]) -> tuple[float, int, int]:
        """Forward + backward of the microbatch at ``data`` (a global id, or a position in a
        stream slot), loss divided by ``nominal_tokens``; ``before_backward()`` between the two
        (a phase point). Returns (that loss as a float, valid label tokens, label positions:
        tokens of the microbatch on this rank, valid or not)."""

    def apply_update(self, grad_scale: float) -> float:
        """Scale the reduced gradient by ``grad_scale`` (1.0: no-op), clip, optimizer and LR
        scheduler step. Returns the gradient norm before clipping. A norm that is not finite
        updates nothing (no optimizer or scheduler step): the manager finds the culprits,
        rebuilds the gradient and calls it again ([Note: bad replicas] in manager/culprits.py)."""


@dataclass
class StepState:
    """What one step accumulates on this rank while the protocol runs."""

    plan: StepPlan
    nominal_tokens: int
    stats: dict[int, tuple[float, int, int]] = field(default_factory=dict)  # id -> (loss,
    # valid tokens, token positions) of this rank's part
    extras_done: tuple[int, ...] = ()
    sync_time_s: float = 0.0
    compute_s: float = 0.0  # seconds per microbatch of this rank's compute phase
    longest_microbatch_s: float = 0.0  # for the hang bound (collectives/guard.py)
    totals: StepTotals = field(default_factory=StepTotals)
