"""What the trainer does for the manager in one step (``StepWork``) and for a rejoin
(``JoinWork``), and what one step accumulates on a rank while [Note: the step protocol]
(manager.py) runs (``StepState``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from recover_hsdp.manager.totals import StepTotals
from recover_hsdp.workload import DataRef, StepPlan


class StepWork(Protocol):
    """What the trainer does for the manager inside one step (one replica, this rank)."""

    def set_gradient_sync(self, enabled: bool) -> None:
        """FSDP gradient sync on (last microbatch) or off (accumulate locally)."""

    def forward_backward(self, data: DataRef, nominal_tokens: int,
                         before_backward: Callable[[], None],
                         grad_factor: float = 1.0) -> tuple[float, int, int]:
        """Forward + backward of the microbatch at ``data`` (a global id, or a position in a
        stream slot), loss divided by ``nominal_tokens``; ``before_backward()`` between the two
        (a phase point); ``grad_factor`` != 1: the backward runs on the loss times it (a
        ``mode=corrupt`` fault: a wrong but finite gradient, the loss returned unchanged).
        Returns (that loss, valid label tokens, label positions: tokens of the microbatch on
        this rank, valid or not), each maybe still on the device: the manager reads a step's
        worth at once with :meth:`measures`."""

    def measures(self, measured: list[tuple]) -> list[tuple[float, int, int]]:
        """What :meth:`forward_backward` returned for this step's microbatches, as host
        values (float loss, int, int), read at once: one device-to-host copy per step instead
        of a host sync per microbatch."""

    def apply_update(self, grad_scale: float) -> float:
        """Scale the reduced gradient by ``grad_scale`` (1.0: no-op), clip, optimizer and LR
        scheduler step. Returns the gradient norm before clipping. A norm that is not finite
        updates nothing (no optimizer or scheduler step): the manager finds the culprits,
        rebuilds the gradient and calls it again ([Note: bad replicas] in manager/culprits.py)."""

    def parameter_shards(self) -> list[Any]:
        """This rank's parameters (torch tensors; DTensors allowed): what the divergence vote
        fingerprints and a ``mode=bitflip`` fault flips ([Note: divergence votes] in
        manager/divergence.py)."""


class JoinWork(Protocol):
    """What the trainer provides for a join ([Note: rejoin at a boundary] in rejoin.py; one
    rank)."""

    def join_meta(self) -> dict[str, Any]:
        """Picklable replica state besides tensors (step, schedulers, tokens seen, ...)."""

    def load_join_meta(self, meta: dict[str, Any]) -> None: ...

    def join_tensors(self) -> list[np.ndarray]:
        """This rank's state tensors (parameters, then optimizer state) as writable numpy
        views, in an order that is the same on every replica (on a GPU: staged to host memory;
        called by the donor and the newcomers only)."""

    def join_nbytes(self) -> int:
        """The bytes of :meth:`join_tensors`, from the tensors' sizes: nothing staged (every
        survivor records it)."""

    def spawn_command(self, replicas: list[int]) -> tuple[str, list[str]]:
        """The program and arguments that start one replacement rank of ``replicas``."""


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
    fingerprint: int | None = None  # this rank's, before the update ([Note: divergence votes])
    diverged: tuple[int, ...] = ()  # replicas the vote sent away in this epoch
    audit_pairs: list = field(default_factory=list)  # [Note: gradient audits] (audits.py)
    signatures: np.ndarray | None = None  # this rank's share of StepTotals.signatures
    audit: dict | None = None  # the audit's summary once its verdict is in
    audit_culprits: tuple[int, ...] = ()  # to be excluded from the step
    audit_failed: bool = False  # the third computations' reduce failed (a death)
