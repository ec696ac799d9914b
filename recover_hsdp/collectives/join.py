"""Replica rejoin at the MPI level: one survivor spawns replacement ranks, the world meets them.

[Note: rejoin] A lost replica comes back as new processes, at a step boundary, in four stages;
the first three use side channels and leave the world's communicators untouched, so a failure
there fails one attempt and nothing else:

  1. spawn + link: one survivor, the spawner, ``MPI_Comm_spawn``s S x k processes from its
     ``COMM_SELF`` (k replicas, each on the replica ids of dead ones) through PRRTE; once they
     are ready (a non-blocking barrier the spawner tests) both sides ``Merge`` that
     inter-communicator into the link (spawner + newcomers), kept across attempts;
  2. meet + offer: at a boundary the spawner ``Open_port``s and sends the port over the link;
     one agreement on the world says every survivor is there; the world as it is now
     ``Accept``s (root = the spawner), the newcomers' own world ``Connect``s, both ``Merge``
     (survivors first): the attempt's channel. Its first rank broadcasts the join offer (epoch,
     alive replicas, the replica ids the newcomers take, a payload: the step, the policy, ...);
     every member gathers every member's (original world rank, process) into the rank table;
  3. state: the caller moves the replica state from a donor to the newcomers over the channel
     (:meth:`JoinChannel.send` / :meth:`JoinChannel.recv`, chunked, guarded) and checks it;
     then a fault-tolerant agreement on the channel: all ok, or the attempt failed;
  4. grow: ``FaultTolerantWorld.grow`` (``growth.py``) makes the channel the global
     communicator, builds the shard communicators and bumps the epoch, under one more agreement.

Only the spawner is in the newcomers' start-up communicator, so a survivor that is not the
spawner may die while they start (or between attempts): the world repairs as usual and meets
them as it is at a later boundary. A death during 2-3 (the donor's too) makes the channel's
agreement fail uniformly (ULFM's agreement tolerates failed participants); the newcomers go
back to the link and the spawner and they agree on it that all of them are alive
(:meth:`PendingJoin.check`): yes, they wait for the next port (the caller retries, bounded);
no, a newcomer died and they exit. A survivor that died before the accept fails step 2's
agreement: nobody accepts, the newcomers stay connecting to the same port, accepted at the next
boundary. What still ends a join: the spawner's death (the link is the newcomers' only tie to
the job: they see ``MPI_ERR_PROC_FAILED`` on it at once, measured, and exit 0) and a newcomer's
own death. Residual: a death inside the ``Accept`` itself can leave the newcomers in
``Connect`` / ``Merge``; their deadline (``repair_s``) ends them.

Measured on this stack (docs/ULFM_NOTES.md, docs/probes/join22/): spawning from the survivors'
global communicator put every survivor into the newcomers' inter-communicator (any death
aborted the join), ``Shrink`` of an inter-communicator hung and ``Create_intercomm`` segfaulted
in coll/han; port + ``Accept``/``Connect`` within one job works. Why not ``Connect`` from a
separately started job: a second ``mpirun`` does not share the job's PMIx server (a
``Connect`` hung 30 s; ``prterun --dvm`` segfaulted), so ``recover-hsdp join`` asks the job to
spawn onto a host instead (same protocol).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np

from recover_hsdp.collectives.guard import log_line
from recover_hsdp.collectives.membership import JoinOffer
from recover_hsdp.collectives.mpi import MPI
from recover_hsdp.collectives.guarded import recv_chunked, send_chunked
from recover_hsdp.collectives.world import FaultTolerantWorld

__all__ = ["JoinChannel", "JoinOffer", "ParentLink", "PendingJoin", "accept", "agree",
           "parent_link", "spawn"]


class JoinChannel:
    """The merged communicator of one join (stages 2-3), guarded by the world's deadlines."""

    def __init__(self, world: FaultTolerantWorld, merged: MPI.Comm | None):
        self.world, self.merged = world, merged
        self.ranks: list[int] = []        # merged rank -> original world rank
        self.processes: list[Any] = []    # merged rank -> the member's process info
        self.ok = merged is not None      # None: a newcomer whose connect failed

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
        return send_chunked(self._call, self.merged, data, self.merged_rank_of(to_world_rank))

    def recv_bytes(self, from_world_rank: int, out: np.ndarray | None = None) -> np.ndarray | None:
        return recv_chunked(self._call, self.merged, self.merged_rank_of(from_world_rank), out)

    def agree(self, ok: bool) -> bool:
        """Stage 3's fault-tolerant agreement (uniform over the live members)."""
        if self.merged is None:
            return False
        return self.world._agree(self.merged, ok and self.ok)

    def abort(self) -> None:
        if self.merged is not None:
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
    """The spawner's side of newcomers that are starting or waiting between attempts (stage 1).

    The other survivors go on training meanwhile: the newcomers enter a non-blocking barrier on
    the inter-communicator once their trainer is built, the spawner tests it at every step (a
    local call) and, once it completed, merges the link (spawner + newcomers)."""

    def __init__(self, world: FaultTolerantWorld, inter: MPI.Comm, replicas: tuple[int, ...]):
        self.world, self.inter, self.replicas = world, inter, replicas
        self.request = inter.Ibarrier()
        self.started = time.monotonic()
        self.ready_at: float | None = None
        self.link: MPI.Comm | None = None
        self.port: str | None = None      # sent to the newcomers, not yet accepted

    def test(self) -> tuple[bool, bool]:
        """(ready, failed) as the spawner sees it; the totals reduce agrees on them."""
        if self.link is not None:
            return True, False
        try:
            if not self.request.Test():
                return False, False
            with self.world._guard.call("Merge(link)", self.world.deadlines.repair_s):
                link = self.inter.Merge(high=False)
        except MPI.Exception as err:
            log_line(f"rank {self.world.world_rank}: join: newcomers failed before they were "
                     f"ready ({err.Get_error_class()})")
            return False, True
        link.Set_errhandler(MPI.ERRORS_RETURN)
        self.link, self.ready_at = link, time.monotonic()
        return True, False

    def offer_port(self) -> bool:
        """Open a port and send it to the newcomers over the link, unless the last one is still
        outstanding (they are connecting to it). False: the link is lost (a newcomer died)."""
        if self.port is not None:
            return True
        port = MPI.Open_port()
        if not self._send_port(port):
            MPI.Close_port(port)
            return False
        self.port = port
        return True

    def accepted(self) -> None:
        """The survivors Accepted on the port (whatever came of it): the next attempt needs a
        new one."""
        if self.port is not None:
            try:
                MPI.Close_port(self.port)
            except MPI.Exception:
                pass
        self.port = None

    def check(self) -> bool:
        """After a failed attempt: agree with the newcomers (back on the link) that all of them
        are alive. False: a newcomer died (the others exit on the same answer)."""
        return self.link is not None and self.world._agree(self.link, True)

    def abort(self, tell: bool = True) -> None:
        """Give the newcomers up: an empty port on the link (or, before it, revoking the
        inter-communicator) ends their wait; they exit. ``tell=False``: they are lost anyway.
        Newcomers connecting to an outstanding port are not reached: their ``Connect``
        deadline ends them (or the job's end)."""
        if tell and self.link is not None and self.port is None:
            self._send_port("")
        self.accepted()
        self.world._revoke(self.inter)
        self.close()

    def close(self) -> None:
        """The join is over (the newcomers joined or were given up)."""
        self.accepted()
        self.world._graveyard += [c for c in (self.inter, self.link) if c is not None]

    def _send_port(self, port: str) -> bool:
        box = np.zeros(PORT_BYTES, dtype=np.uint8)
        raw = port.encode()
        box[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        try:
            with self.world._guard.call("Ibcast(port)", self.world.deadlines.call_s):
                self.link.Ibcast(box, root=0).Wait()  # the newcomers' Ibcast: a blocking
                # Bcast never matches a non-blocking one (measured: the port never arrived)
            return True
        except MPI.Exception as err:
            log_line(f"rank {self.world.world_rank}: join: the link to the newcomers is lost "
                     f"({err.Get_error_class()})")
            return False


PORT_BYTES = 1024


def spawn(world: FaultTolerantWorld, command: str, args: list[str], replicas: tuple[int, ...],
          host: str | None = None) -> PendingJoin | None:
    """The spawner alone (``COMM_SELF``): start S ranks per replica of ``replicas``. Blocks
    until they initialised MPI (their first act), not until they are ready. None when the spawn
    failed (the spawner then reports the join failed in the next totals)."""
    info = MPI.Info.Create()
    if host:
        info.Set("host", host)
    count = len(replicas) * world.layout.ranks_per_replica
    started = time.monotonic()
    try:
        with world._guard.call("Spawn", world.deadlines.repair_s):
            inter = MPI.COMM_SELF.Spawn(command, args, maxprocs=count, info=info, root=0)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
    except MPI.Exception as err:
        log_line(f"rank {world.world_rank}: join: spawn failed ({err.Get_error_class()})")
        return None
    finally:
        info.Free()
    log_line(f"rank {world.world_rank}: join: spawned {count} ranks in "
             f"{time.monotonic() - started:.2f}s")
    return PendingJoin(world, inter, tuple(replicas))


def agree(world: FaultTolerantWorld, flag: bool) -> bool:
    """Survivors: the fault-tolerant AND of ``flag`` over the world as it is (false too when a
    survivor died since the last step)."""
    return world._agree(world.global_comm, flag)


def accept(world: FaultTolerantWorld, pending: PendingJoin | None, spawner: int
           ) -> JoinChannel | None:
    """Survivors (collective over the global communicator): ``Accept`` the newcomers' connection
    on the spawner's port (root = world rank ``spawner``; ``pending`` is the spawner's), agree
    that every survivor got it, ``Merge`` (survivors first). None: the attempt failed."""
    root = _comm_rank(world, spawner)
    port = pending.port if pending is not None else None
    inter = None
    try:
        with world._guard.call("Accept", world.deadlines.repair_s):
            inter = world.global_comm.Accept(port, root=root)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
    except MPI.Exception as err:
        log_line(f"rank {world.world_rank}: join: accept failed ({err.Get_error_class()})")
        inter = None
    if pending is not None:
        pending.accepted()
    if not world._agree(world.global_comm, inter is not None):
        world._revoke(inter)  # the newcomers' merge fails: they go back to the link
        world._graveyard += [c for c in (inter,) if c is not None]
        return None
    try:
        with world._guard.call("Merge", world.deadlines.repair_s):
            merged = inter.Merge(high=False)
    except MPI.Exception as err:
        log_line(f"rank {world.world_rank}: join: merge failed ({err.Get_error_class()})")
        world._revoke(inter)
        world._graveyard.append(inter)
        return None
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    world._graveyard.append(inter)
    return JoinChannel(world, merged)


def _comm_rank(world: FaultTolerantWorld, world_rank: int) -> int:
    """The rank of original world rank ``world_rank`` in the global communicator."""
    return world._ranks_in_order(world.global_comm).index(world_rank)


class ParentLink:
    """A newcomer's side of stage 1: the link to its spawner, kept across attempts."""

    def __init__(self, world: FaultTolerantWorld, link: MPI.Comm):
        self.world, self.link = world, link
        self._own = MPI.COMM_WORLD.Dup()
        self._own.Set_errhandler(MPI.ERRORS_RETURN)

    def next_channel(self) -> JoinChannel | None:
        """Wait for the spawner's next port (polled: the spawner's death ends the wait), then
        ``Connect`` + ``Merge``. None: told to exit, or the spawner is lost."""
        box = np.zeros(PORT_BYTES, dtype=np.uint8)
        world = self.world
        try:
            request = self.link.Ibcast(box, root=0)
            with world._guard.paused():  # the survivors send it at a later step boundary
                while not request.Test():
                    time.sleep(POLL_S)
        except MPI.Exception as err:
            log_line(f"newcomer: the spawner is lost ({err.Get_error_class()})")
            return None
        port = bytes(box).rstrip(b"\0").decode()
        if not port:
            log_line("newcomer: join given up by the job")
            return None
        try:
            with world._guard.call("Connect", world.deadlines.repair_s):
                inter = self._own.Connect(port, root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            with world._guard.call("Merge", world.deadlines.repair_s):
                merged = inter.Merge(high=True)
        except MPI.Exception as err:
            log_line(f"newcomer: connect to the survivors failed ({err.Get_error_class()})")
            return JoinChannel(world, None)  # a failed attempt: ok is False
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        world._graveyard.append(inter)
        return JoinChannel(world, merged)

    def check(self) -> bool:
        """After a failed attempt: the spawner's :meth:`PendingJoin.check`."""
        return self.world._agree(self.link, True)


POLL_S = 0.05


def parent_link(world: FaultTolerantWorld) -> ParentLink | None:
    """Newcomers: stage 1 from the other side, once this rank's trainer is built: the barrier
    the spawner tests, then the merge into the link. None when the job gave the join up or the
    spawner is lost."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise RuntimeError("this process was not spawned by a recover-hsdp job")
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        request = parent.Ibarrier()
        with world._guard.paused():  # the spawner tests it at its next step
            while not request.Test():
                time.sleep(POLL_S)
        with world._guard.call("Merge(link)", world.deadlines.repair_s):
            link = parent.Merge(high=True)
    except MPI.Exception as err:
        log_line(f"newcomer: join given up by the job ({err.Get_error_class()})")
        return None
    link.Set_errhandler(MPI.ERRORS_RETURN)
    return ParentLink(world, link)
