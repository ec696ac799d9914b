"""Repair of a failed epoch: shrink, claim, rebuild, agree, then commit the new membership.

``FaultTolerantWorld.consensus`` calls :func:`repair` once every survivor agreed the epoch was not
clean. Invariant: every survivor commits the same membership. It is read from the shrunk
communicator (identical at every survivor; ``Get_failed`` is not); the arbiter's answer
([Note: split brain] in ``arbiter.py``) is the shrunk communicator's first rank's, spread by an
agreement (every other rank contributes "yes"; a bcast here crashed ranks when a falsely accused
rank was aborted mid-repair: [Note: detection margins by phase] in groups/heartbeat.py); and a
round commits only after a uniform agreement that every survivor built its communicators.
A failure inside a round starts another one on the last shrunk communicator, at most
``Deadlines.max_repair_rounds``; past the bound this rank dies, it never hangs.

The world is passed in and its communicators, layout and epoch are changed here (this module
sits below ``world.py`` and does not import it).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from recover_hsdp.collectives.arbiter import SplitBrainArbiter
from recover_hsdp.collectives.guard import die, log_line
from recover_hsdp.collectives.membership import ConsensusResult
from recover_hsdp.collectives.mpi import MPI, errname

__all__ = ["repair"]


def repair(world, decided: float, detect_s: float) -> ConsensusResult:
    """Repair ``world`` (a ``FaultTolerantWorld`` whose epoch failed) and return the uniform result.

    ``decided`` is when the "not clean" decision came (monotonic), ``detect_s`` how long it took.
    """
    world._revoke(world._global, world._shard)
    world._graveyard += [world._global, world._shard]
    old_alive = world.layout.alive_replicas
    base = world._global
    max_rounds = world.deadlines.max_repair_rounds or base.Get_size() + 2
    for rnd in range(1, max_rounds + 1):
        world._phase("shrink")
        try:
            with world._guard.call("Shrink", world.deadlines.repair_s):
                shrunk = base.Shrink()
        except MPI.Exception as e:
            log_line(f"rank {world.world_rank}: Shrink raised {errname(e)} (round {rnd}); retrying")
            continue
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        world._graveyard.append(shrunk)
        members = set(world._members(shrunk))
        complete = tuple(r for r in old_alive if members.issuperset(world.layout.ranks_of(r)))
        world._phase("rebuild")
        built, complete, new_global, new_shard = _rebuild(world, shrunk, members, complete,
                                                          old_alive, rnd)
        world._phase("agree-membership")
        if world._agree(shrunk, built):
            return _commit(world, old_alive, complete, new_global, new_shard, decided, detect_s, rnd)
        world._revoke(*(c for c in (new_global, new_shard) if c is not None))
        world._graveyard += [c for c in (new_global, new_shard) if c is not None]
        base = shrunk
    die(f"rank {world.world_rank}: no agreed membership after {max_rounds} repair rounds: dying "
        "rather than hanging")
    raise AssertionError("unreachable")


def _rebuild(world, shrunk: MPI.Comm, members: set[int], complete: tuple[int, ...],
             old_alive: tuple[int, ...], rnd: int):
    """One round's new communicators on ``shrunk``: (built, complete, new global, new shard).

    ``complete``: the replicas with every rank in ``members``; it becomes () when another side
    of a partition holds the claim. On an MPI error ``built`` is False and ``shrunk`` revoked."""
    new_global = new_shard = None
    try:
        # Whether this side holds the arbiter's claim ([Note: split brain]; its first rank
        # made it): the AND of its answer and everyone else's "yes", fault tolerant (an error
        # here is uniform: the round starts again).
        claim = _claim(world, members, old_alive) if shrunk.Get_rank() == 0 else True
        flag = np.array([1 if claim else 0], dtype=np.int32)
        with world._guard.call("Agree(claim)", world.deadlines.repair_s):
            shrunk.Iagree(flag).Wait()
        claim = bool(flag[0] & 1)
        if not claim:
            log_line(f"rank {world.world_rank}: another side of a partition holds the claim "
                     f"for epoch {world.epoch}: this side ({sorted(members)}) stops")
            complete = ()
        mine = world.replica in complete
        # Both Splits are collectives over `shrunk`, so one revoke of `shrunk` releases every
        # rank still inside them when any rank fails here.
        new_global = world._split(shrunk, 0 if mine else MPI.UNDEFINED, world.world_rank)
        new_shard = world._split(shrunk, world.shard if mine else MPI.UNDEFINED, world.replica)
    except MPI.Exception as e:
        log_line(f"rank {world.world_rank}: rebuild failed with {errname(e)} (round {rnd})")
        world._revoke(shrunk)
        return False, complete, new_global, new_shard
    return True, complete, new_global, new_shard


def _claim(world, members: set[int], old_alive: tuple[int, ...]) -> bool:
    """The arbiter's answer for this side ([Note: split brain]); the head start is waited
    with the hang watchdog paused."""
    def sleep_unwatched(seconds: float) -> None:
        with world._guard.paused():
            time.sleep(seconds)

    arbiter = SplitBrainArbiter(world.arbiter_dir, world.claim_delay_s, sleep=sleep_unwatched,
                                log=log_line)
    side = {world.layout.replica_of(w) for w in members}
    return arbiter.claim(world.epoch, old_alive, members, side, rank=world.world_rank)


def _commit(world, old_alive: tuple[int, ...], complete: tuple[int, ...], new_global: MPI.Comm,
            new_shard: MPI.Comm, decided: float, detect_s: float, rounds: int) -> ConsensusResult:
    """The agreed membership takes effect: epoch + 1, the layout's alive replicas, the new
    communicators (or, on ranks of a dead replica, ``retired``)."""
    world.epoch += 1
    world.layout = dataclasses.replace(world.layout, alive_replicas=complete)
    dead = frozenset(old_alive) - frozenset(complete)
    retire = world.replica not in complete
    if retire:
        world.retired = True
    else:
        world._global, world._shard = new_global, new_shard
        world._failed_at = None
    repair_s = time.monotonic() - decided
    log_line(f"rank {world.world_rank}: epoch {world.epoch}: dead replicas {sorted(dead)}, alive "
             f"{list(complete)}, detect {detect_s:.3f}s repair {repair_s:.3f}s rounds {rounds}"
             + (" -> retiring" if retire else ""))
    return ConsensusResult(False, world.epoch, dead, complete, retire, detect_s, repair_s, rounds)
