"""Replica rejoin at the MPI level: survivors spawn replacement ranks and merge them in.

[Note: rejoin] A lost replica comes back as new processes, at a step boundary, in four stages;
the first three use a side channel (the merged inter-communicator) and leave the world's
communicators untouched, so a failure there aborts the join and nothing else:

  1. spawn + merge: the survivors' global communicator ``MPI_Comm_spawn``s S x k processes
     (k replicas, each on the replica ids of dead ones) through PRRTE and both sides
     ``Merge`` the inter-communicator (survivors first, newcomers after);
  2. offer: the survivors' first rank broadcasts the join offer (epoch, alive replicas, the
     replica ids the newcomers take, an opaque payload: the step, the policy, ...); every member
     gathers every member's (original world rank, process) into the rank table;
  3. state: the caller moves the replica state from a donor to the newcomers over the merged
     communicator (:meth:`JoinChannel.send` / :meth:`JoinChannel.recv`, chunked, guarded) and
     checks it; then a fault-tolerant agreement on the merged communicator: all ok or the
     join is aborted (survivors go on with their old world; the newcomers exit);
  4. grow: ``FaultTolerantWorld.grow`` (``growth.py``) makes the merged communicator the global
     one, builds the shard communicators and bumps the epoch, under one more agreement.

A death of the donor, of a survivor or of a newcomer during 1-3 makes the agreement fail
uniformly (ULFM's agreement tolerates failed participants). A survivor's death also surfaces,
as usual, in the next step's collectives on the old world. Why spawn and not
``MPI_Comm_connect/accept`` between separately started jobs: on this stack (Open MPI 5.0.x,
PRRTE 3.0.x) a ``Connect`` from a second ``mpirun`` to a port opened by the job hung (30 s,
measured) and ``prterun --dvm`` segfaulted: two ``mpirun`` s do not share a PMIx server, so
``recover-hsdp join`` asks the job to spawn onto a host instead (same protocol).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np

from recover_hsdp.collectives.guard import log_line
from recover_hsdp.collectives.membership import JoinOffer
from recover_hsdp.collectives.mpi import MPI
from recover_hsdp.collectives.world import CHUNK_BYTES, FaultTolerantWorld

__all__ = ["JoinChannel", "JoinOffer", "PendingJoin", "parent_channel", "spawn"]


class JoinChannel:
    """The merged communicator of one join (stages 2-3), guarded by the world's deadlines."""

    def __init__(self, world: FaultTolerantWorld, merged: MPI.Comm):
        self.world, self.merged = world, merged
        self.ranks: list[int] = []        # merged rank -> original world rank
        self.processes: list[Any] = []    # merged rank -> the member's process info
        self.ok = True

    # -- stage 2 ----------------------------------------------------------------------------------
    def exchange(self, offer: JoinOffer | None, world_rank: int | None, process: Any
                 ) -> JoinOffer | None:
        """Broadcast ``offer`` from the survivors' first rank; gather the rank table. A newcomer
        passes ``world_rank=None`` and learns it from the offer (by its merged rank)."""
        box: list[Any] = []
        if not self._call("bcast(offer)", lambda: box.append(self.merged.bcast(offer, root=0))):
            return None
        offer = box[0]
        if world_rank is None:
            first_newcomer = len(offer.alive_replicas) * offer.ranks_per_replica
            index = self.merged.Get_rank() - first_newcomer
            s = offer.ranks_per_replica
            world_rank = offer.new_replicas[index // s] * s + index % s
        table: list[Any] = []
        if not self._call("allgather(ranks)", lambda: table.extend(
                self.merged.allgather((world_rank, process)))):
            return None
        self.ranks = [r for r, _ in table]
        self.processes = [p for _, p in table]
        return offer

    # -- stage 3 ----------------------------------------------------------------------------------
    def merged_rank_of(self, world_rank: int) -> int:
        return self.ranks.index(world_rank)

    def send(self, obj: Any, to_world_rank: int) -> bool:
        """Send a picklable object (header) and then its bytes in chunks."""
        data = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
        return self.send_bytes(data, to_world_rank)

    def recv(self, from_world_rank: int) -> Any:
        data = self.recv_bytes(from_world_rank)
        return None if data is None else pickle.loads(data.tobytes())

    def send_bytes(self, data: np.ndarray, to_world_rank: int) -> bool:
        dest = self.merged_rank_of(to_world_rank)
        size = np.array([data.size], dtype=np.int64)
        if not self._call("Send(size)", lambda: self.merged.Send(size, dest=dest, tag=71)):
            return False
        for lo in range(0, data.size, CHUNK_BYTES):
            chunk = data[lo:lo + CHUNK_BYTES]
            if not self._call("Send(state)", lambda c=chunk: self.merged.Send(
                    [c, MPI.BYTE], dest=dest, tag=72)):
                return False
        return True

    def recv_bytes(self, from_world_rank: int, out: np.ndarray | None = None) -> np.ndarray | None:
        source = self.merged_rank_of(from_world_rank)
        size = np.zeros(1, dtype=np.int64)
        if not self._call("Recv(size)", lambda: self.merged.Recv(size, source=source, tag=71)):
            return None
        if out is None or out.size != int(size[0]):
            out = np.empty(int(size[0]), dtype=np.uint8)
        for lo in range(0, out.size, CHUNK_BYTES):
            view = out[lo:lo + CHUNK_BYTES]
            if not self._call("Recv(state)", lambda v=view: self.merged.Recv(
                    [v, MPI.BYTE], source=source, tag=72)):
                return None
        return out

    def agree(self, ok: bool) -> bool:
        """Stage 3's fault-tolerant agreement (uniform over the live members)."""
        return self.world._agree(self.merged, ok and self.ok)

    def abort(self) -> None:
        self.world._revoke(self.merged)
        self.world._graveyard.append(self.merged)

    def _call(self, name: str, fn) -> bool:
        if not self.ok:
            return False
        try:
            with self.world._guard.call(name, self.world.deadlines.call_s):
                fn()
            return True
        except MPI.Exception as err:
            log_line(f"rank {self.world.world_rank}: join: {name} failed ({err.Get_error_class()})")
            self.ok = False
            self.world._revoke(self.merged)
            return False


class PendingJoin:
    """Spawned ranks that are still starting (stage 1, survivors' side). The survivors go on
    training meanwhile: the newcomers enter a non-blocking barrier on the inter-communicator
    once their trainer is built, and each survivor tests it at every step (a local call)."""

    def __init__(self, world: FaultTolerantWorld, inter: MPI.Comm, replicas: tuple[int, ...]):
        self.world, self.inter, self.replicas = world, inter, replicas
        self.request = inter.Ibarrier()
        self.started = time.monotonic()
        self.ready_at: float | None = None

    def test(self) -> tuple[bool, bool]:
        """(ready, failed) as this rank sees it; the caller agrees on them across survivors."""
        try:
            ready = bool(self.request.Test())
        except MPI.Exception as err:
            log_line(f"rank {self.world.world_rank}: join: newcomers failed before they were "
                     f"ready ({err.Get_error_class()})")
            return False, True
        if ready and self.ready_at is None:
            self.ready_at = time.monotonic()
        return ready, False

    def merge(self) -> JoinChannel | None:
        """Stage 1's end, once every survivor saw the newcomers ready (collective)."""
        try:
            with self.world._guard.call("Merge", self.world.deadlines.repair_s):
                merged = self.inter.Merge(high=False)
        except MPI.Exception as err:
            log_line(f"rank {self.world.world_rank}: join: merge failed ({err.Get_error_class()})")
            self.abort()
            return None
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        self.world._graveyard.append(self.inter)
        return JoinChannel(self.world, merged)

    def abort(self) -> None:
        """Give the newcomers up: revoking the inter-communicator ends their wait (they exit)."""
        self.world._revoke(self.inter)
        self.world._graveyard.append(self.inter)


def spawn(world: FaultTolerantWorld, command: str, args: list[str], replicas: tuple[int, ...],
          host: str | None = None) -> PendingJoin | None:
    """Survivors (collective over the world's global communicator): start S ranks per replica
    of ``replicas``. Blocks until they initialised MPI (their first act), not until they are
    ready. None when the spawn failed (the world's epoch is then failed: the caller's next
    consensus repairs it)."""
    info = MPI.Info.Create()
    if host:
        info.Set("host", host)
    count = len(replicas) * world.layout.ranks_per_replica
    started = time.monotonic()
    try:
        with world._guard.call("Spawn", world.deadlines.repair_s):
            inter = world.global_comm.Spawn(command, args, maxprocs=count, info=info, root=0)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
    except MPI.Exception as err:
        log_line(f"rank {world.world_rank}: join: spawn failed ({err.Get_error_class()})")
        world.fail_epoch("spawn failed")
        return None
    finally:
        info.Free()
    log_line(f"rank {world.world_rank}: join: spawned {count} ranks in "
             f"{time.monotonic() - started:.2f}s")
    return PendingJoin(world, inter, tuple(replicas))


def parent_channel(world: FaultTolerantWorld) -> JoinChannel | None:
    """Newcomers: stage 1 from the other side, once this rank's trainer is built: the barrier
    the survivors test, then the merge. None when the survivors gave the join up."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise RuntimeError("this process was not spawned by a recover-hsdp job")
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        with world._guard.paused():  # the survivors take it at a later step boundary
            parent.Ibarrier().Wait()
        with world._guard.call("Merge", world.deadlines.repair_s):
            merged = parent.Merge(high=True)
    except MPI.Exception as err:
        log_line(f"newcomer: join given up by the job ({err.Get_error_class()})")
        return None
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return JoinChannel(world, merged)
