"""``World``: the contract the layers above hold a fault-tolerant world to.

``FaultTolerantWorld`` (world.py) is the implementation; the in-process tests' ``FakeWorld``
(tests/fakes.py) is the other, and tests/package/test_interfaces.py fails when either differs from
this Protocol in a member or a method's signature. The step protocol (manager/), in-step
recovery (recovery/) and the ``torch`` data plane (groups/data_plane.py) name this type
rather than a list of the methods they call. Standard library only (plus numpy types).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, NoReturn, Protocol

import numpy as np

from recover_hsdp.collectives.guard import Deadlines
from recover_hsdp.collectives.membership import ConsensusResult, ReplicaLayout


class World(Protocol):
    """One rank's view of the job: who it is, who is alive, the epoch, and the guarded
    collectives whose failure fails the epoch (never raises, never hangs: [Note: guarded
    calls] in guarded.py). Callbacks: ``on_phase(name)`` before each step of the consensus,
    ``on_failed(ranks)`` when a call names failed ranks, ``on_leave()`` when this rank leaves
    normally, ``on_hung(reason)`` (watchdog thread) just before the hang watchdog kills it,
    ``on_blocked(now)`` (watchdog thread) while a guarded call waits ([Note: stopped peers
    outside the detector] in processes.py)."""

    world_rank: int
    replica: int
    shard: int
    layout: ReplicaLayout
    deadlines: Deadlines
    retired: bool
    on_phase: Callable[[str], None] | None
    on_failed: Callable[[list[int]], None] | None
    on_leave: Callable[[], None] | None
    on_hung: Callable[[str], None] | None
    on_blocked: Callable[[float], None] | None

    epoch: int

    # -- state
    @property
    def epoch_failed(self) -> bool: ...
    @property
    def alive_replicas(self) -> tuple[int, ...]: ...
    def shard_members(self) -> tuple[int, ...]: ...

    # -- the hang watchdog
    def heartbeat(self) -> None: ...
    def step_done(self, longest_unit_s: float = 0.0) -> None: ...
    def watchdog_paused(self) -> ContextManager[None]: ...

    # -- guarded collectives (shard communicator; ``_global``: every alive rank; ``*_bytes``:
    #    point to point between the ranks of one shard position)
    def allreduce(self, buf: np.ndarray) -> bool: ...
    def allreduce_global(self, buf: np.ndarray) -> bool: ...
    def allgather(self, obj: Any) -> list[Any] | None: ...
    def allgather_global(self, obj: Any) -> list[Any] | None: ...
    def send_bytes(self, data: np.ndarray, to_replicas: list[int]) -> bool: ...
    def recv_bytes(self, from_replica: int) -> np.ndarray | None: ...
    def barrier(self) -> bool: ...
    def fail_epoch(self, reason: str) -> None: ...
    def peers_failed(self) -> bool: ...

    # -- consensus, repair, leaving
    def consensus(self, ok: bool) -> ConsensusResult: ...
    def retire(self, message: str = "") -> NoReturn: ...
    def finish(self) -> bool: ...
    def close(self) -> None: ...

    # -- rejoin ([Note: rejoin] in join.py)
    def adopt(self, offer) -> None: ...
    def grow(self, merged, ranks: list[int], alive_replicas: tuple[int, ...],
             num_replicas: int, epoch: int) -> bool: ...
