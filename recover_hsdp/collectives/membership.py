"""Replica membership as the fault-tolerant collectives see it: the layout, a consensus outcome and
the join offer that brings replicas back.

Plain dataclasses with no MPI import, so the layers above (workload policy, trainer, metrics)
can use them without MPI; ``recover_hsdp.collectives`` produces them.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """Which original world ranks form which replica, and which replicas are still alive.

    Invariant: original world rank w belongs to replica ``w // ranks_per_replica`` and holds shard index
    ``w % ranks_per_replica``; ``alive_replicas`` is sorted; it shrinks at a repair and grows only
    when replacement ranks join ([Note: rejoin] in join.py).
    """

    ranks_per_replica: int
    num_replicas: int
    alive_replicas: tuple[int, ...]

    def replica_of(self, rank: int) -> int:
        return rank // self.ranks_per_replica

    def shard_of(self, rank: int) -> int:
        return rank % self.ranks_per_replica

    def ranks_of(self, replica: int) -> tuple[int, ...]:
        s = self.ranks_per_replica
        return tuple(range(replica * s, (replica + 1) * s))

    def shard_ranks(self, shard: int) -> tuple[int, ...]:
        """Original ranks of the shard communicator of ``shard``, ordered by replica."""
        return tuple(r * self.ranks_per_replica + shard for r in self.alive_replicas)

    def alive_ranks(self) -> tuple[int, ...]:
        return tuple(w for r in self.alive_replicas for w in self.ranks_of(r))


@dataclasses.dataclass(frozen=True)
class ConsensusResult:
    """Outcome of ``FaultTolerantWorld.consensus``; identical on every rank that took part.

    Attributes:
        clean: Every rank reported a clean epoch and nobody saw a failure: commit the step.
        epoch: The world epoch after this call (unchanged when clean, +1 otherwise).
        dead_replicas: Replicas that died in this call (a replica is dead if ANY of its ranks is gone).
        alive_replicas: Replicas alive after this call, sorted.
        retire: This rank's replica is dead: the caller must call ``FaultTolerantWorld.retire()``.
        detect_s: Seconds from this rank's first failed MPI call (or the start of the consensus when it
            saw none) to the uniform "not clean" decision; 0 when clean.
        repair_s: Seconds from that decision to the rebuilt communicators; 0 when clean.
        rounds: Shrink/rebuild/agree rounds the repair took (0 when clean; > 1 means failures during it).
    """

    clean: bool
    epoch: int
    dead_replicas: frozenset[int]
    alive_replicas: tuple[int, ...]
    retire: bool
    detect_s: float = 0.0
    repair_s: float = 0.0
    rounds: int = 0


@dataclasses.dataclass
class JoinOffer:
    """What the survivors tell the newcomers (stage 2 of [Note: rejoin] in join.py); a newcomer's
    world takes its layout and arbiter folder from it (``FaultTolerantWorld.adopt``)."""

    epoch: int
    alive_replicas: tuple[int, ...]
    new_replicas: tuple[int, ...]
    ranks_per_replica: int
    num_replicas: int
    donor: int  # the replica whose ranks send the state
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)  # "arbiter": the folder
