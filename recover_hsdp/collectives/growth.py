"""Growth of the world at a rejoin: stage 4 of [Note: rejoin] (``join.py``), on every member.

``FaultTolerantWorld.grow`` calls :func:`grow` on survivors and newcomers alike, once the join's
agreement in stage 3 said yes. Invariant: the world changes only after one more uniform agreement
on the merged communicator; on failure it is left as it was (the survivors' old communicators are
intact) and the merged one is revoked. Like ``repair.py`` this module sits below ``world.py``.
"""

from __future__ import annotations

from recover_hsdp.collectives.guard import log_line
from recover_hsdp.collectives.membership import ReplicaLayout
from recover_hsdp.collectives.mpi import MPI, errname

__all__ = ["grow"]


def grow(world, merged: MPI.Comm, ranks: list[int], alive_replicas: tuple[int, ...],
         num_replicas: int, epoch: int) -> bool:
    """Make ``merged`` (rank i is original world rank ``ranks[i]``) the global communicator of
    ``world`` (a ``FaultTolerantWorld``) with shard communicators built on it, epoch ``epoch`` + 1
    and alive replicas ``alive_replicas``. False: nothing changed."""
    world._check_usable()
    shard = None
    built = True
    try:
        shard = world._split(merged, world.shard, world.replica)
    except MPI.Exception as e:
        log_line(f"rank {world.world_rank}: join: shard split failed with {errname(e)}")
        built = False
    if not world._agree(merged, built):
        world._revoke(merged, shard)
        world._graveyard += [c for c in (merged, shard) if c is not None]
        return False
    world._graveyard += [c for c in (world._global, world._shard) if c is not None]
    world._global, world._shard = merged, shard
    world._base_group, world._logical = merged.Get_group(), list(ranks)
    world.layout = ReplicaLayout(world.layout.ranks_per_replica, num_replicas,
                                 tuple(sorted(alive_replicas)))
    world.epoch, world._failed_at = epoch + 1, None
    log_line(f"rank {world.world_rank}: epoch {world.epoch}: joined, alive "
             f"{list(world.layout.alive_replicas)}")
    return True
