"""Fault-tolerant collectives across replicas (ULFM MPI): guarded all-reduce, consensus, shrink, epoch.

The bottom layer of recover-hsdp; it imports mpi4py, numpy and the stdlib only. One
``FaultTolerantWorld`` per process owns:

* the global communicator (every rank of every alive replica; consensus and small scalars),
* the shard communicator of this rank (for shard index s: the ranks of all alive replicas holding
  shard s, ordered by replica; the cross-replica gradient reduce),
* the replica layout: ORIGINAL world rank w is replica ``w // S``, shard index ``w % S``,
* the world epoch: 0 at start, +1 after every consensus that was not clean.

Contract of the guarded collectives: they never raise and never abort on a process failure. The first
MPI error of an epoch revokes every communicator of this rank ([Note: revoke everything]) and the call
returns False; later guarded calls of the same epoch return False at once. The caller then runs
``consensus(ok)``, which is uniform: every survivor returns the same ``ConsensusResult``.

Buffers are host numpy arrays (C-contiguous float32/float64/int32/int64), reduced in place (SUM) in
chunks of <= 4 MB ([Note: chunked reduces]). GPU tensors are staged through host memory by the
recovery layer, not here. Import this module before anything imports ``mpi4py.MPI`` (it sets mpi4py.rc,
in ``mpi.py``).

The guarded calls and how a failure is noted are in ``guarded.py`` (``GuardedCalls``, the base of
``FaultTolerantWorld``), the consensus's repair (shrink, claim, rebuild, agree, commit) in
``repair.py``, the split-brain arbiter it asks in ``arbiter.py``, and the growth at a rejoin in
``growth.py``.

Usage (one step; ``world.finish()`` once at the end of the job):
    ok = world.allreduce(grad_bucket) and world.allreduce_global(token_counts)
    res = world.consensus(ok)           # uniform; repairs when not clean
    if res.retire: world.retire()       # this rank's replica lost a rank: log, exit 0
    if not res.clean: ...               # restore buckets, redo the step under res.epoch
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from recover_hsdp.collectives import growth
from recover_hsdp.collectives.guard import Deadlines, MpiGuard, die, log_line
from recover_hsdp.collectives.guarded import CHUNK_BYTES, GuardedCalls
from recover_hsdp.collectives.membership import ConsensusResult, JoinOffer, ReplicaLayout
from recover_hsdp.collectives.mpi import MPI, finalize_disabled
from recover_hsdp.collectives.repair import repair

__all__ = ["CHUNK_BYTES", "MPI", "ConsensusResult", "Deadlines", "FaultTolerantWorld",
           "ReplicaLayout"]



class FaultTolerantWorld(GuardedCalls):
    """Communicators, layout and epoch of one rank; see the module docstring for the contract.

    Args:
        comm: Base communicator; its ranks are the ORIGINAL world ranks. Default ``MPI.COMM_WORLD``.
            It is ``Dup()``ed; every communicator of this object has ``MPI.ERRORS_RETURN``.
        ranks_per_replica: S, the FSDP ranks of one replica; must divide the size of ``comm``.
        deadlines: Time bounds (``Deadlines``); create the world on the main thread.
        arbiter_dir: A folder every rank sees (the job's output folder on a shared file system): after a
            repair one rank of each side creates a claim there, and only the side that created it goes
            on ([Note: split brain]). ``None``: no arbiter (every side goes on).
        on_phase: Optional callback ``on_phase(name)`` invoked on the main thread right before each
            step of ``consensus`` ("consensus", "shrink", "rebuild", "agree-membership"): metrics,
            tracing, fault injection in tests.

    Initial construction is collective over ``comm`` and not fault tolerant (a failure raises).
    The hang watchdog starts here: beat ``heartbeat()`` during long computations or use
    ``watchdog_paused()`` (see ``recover_hsdp.collectives.guard``). One thread at a time may call it:
    [Note: MPI from autograd's thread].
    """

    def __init__(self, comm: MPI.Comm | None = None, ranks_per_replica: int = 1,
                 deadlines: Deadlines | None = None, *,
                 on_phase: Callable[[str], None] | None = None,
                 arbiter_dir: str | os.PathLike | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        size = comm.Get_size()
        if not isinstance(ranks_per_replica, int) or ranks_per_replica < 1 or size % ranks_per_replica:
            raise ValueError(f"ranks_per_replica={ranks_per_replica!r} must be a positive divisor of the "
                             f"world size {size} (world = replicas x ranks_per_replica)")
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            raise RuntimeError("MPI was initialised with THREAD_MULTIPLE: import recover_hsdp.collectives "
                               "before mpi4py.MPI (or set mpi4py.rc.thread_level = 'serialized')")
        world_rank = comm.Get_rank()
        self._setup(ranks_per_replica, deadlines, arbiter_dir, on_phase, f"world rank {world_rank}")
        self.world_rank = world_rank
        self.replica, self.shard = divmod(self.world_rank, ranks_per_replica)
        if not finalize_disabled():
            log_line("warning: mpi4py.rc.finalize is not False (mpi4py.MPI was imported before "
                     "recover_hsdp.collectives); MPI_Finalize at exit can hang after a failure")
        with self._guard.call("Dup", self.deadlines.repair_s):
            self._global = comm.Dup()
        self._global.Set_errhandler(MPI.ERRORS_RETURN)
        self._base_group = self._global.Get_group()
        self._shard = self._split(self._global, self.shard, self.replica)
        self.layout = ReplicaLayout(ranks_per_replica, size // ranks_per_replica,
                                    tuple(range(size // ranks_per_replica)))

    def _setup(self, ranks_per_replica: int, deadlines: Deadlines | None,
               arbiter_dir: str | os.PathLike | None, on_phase: Callable[[str], None] | None,
               name: str) -> None:
        """The state of a world before it has communicators (a newcomer's until :meth:`grow`):
        no rank, no replicas alive, epoch 0. ``__init__`` then brings it up over its ``comm``."""
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self.arbiter_dir = None if arbiter_dir is None else os.fspath(arbiter_dir)
        self.claim_delay_s = 10.0  # a minority side's head start for the majority (< repair_s)
        self.on_phase = on_phase  # public: the manager installs its fault points here
        # public: on_failed(world ranks) when a guarded call fails with ranks known failed
        self.on_failed: Callable[[list[int]], None] | None = None
        # public: on_leave() when this rank leaves normally (retire, close): the replica's
        # heartbeat says goodbye ([Note: a replica leaves as a unit], groups/replica_group.py)
        self.on_leave: Callable[[], None] | None = None
        self.world_rank, self.replica, self.shard = -1, -1, -1
        self._guard = MpiGuard(self.deadlines, name=name)
        # public: on_hung(reason) on the watchdog thread just before it kills this hung rank
        self.on_hung: Callable[[str], None] | None = None
        self._guard.on_hung = lambda reason: self.on_hung and self.on_hung(reason)
        # public: on_blocked(now) on the watchdog thread while a guarded call waits (the
        # manager's sweep for stopped peers: [Note: stopped peers outside the detector])
        self.on_blocked: Callable[[float], None] | None = None
        self._guard.on_blocked = lambda now: self.on_blocked and self.on_blocked(now)
        self._global: MPI.Comm | None = None
        self._shard: MPI.Comm | None = None
        self._base_group: MPI.Group | None = None
        self._logical: list[int] | None = None  # base-group rank -> original world rank (rejoin)
        self.layout = ReplicaLayout(ranks_per_replica, 0, ())
        self.epoch = 0
        self.retired = False
        self._failed_at: float | None = None  # monotonic start of this epoch's first failed call
        # Old communicators are parked here, never freed: MPI_Comm_free on revoked or failed
        # communicators is not what ULFM users exercise, and a few handles per failure cost nothing.
        self._graveyard: list[MPI.Comm] = []

    # -- state ------------------------------------------------------------------------------------
    @property
    def global_comm(self) -> MPI.Comm:
        return self._global

    @property
    def shard_comm(self) -> MPI.Comm:
        return self._shard

    @property
    def alive_replicas(self) -> tuple[int, ...]:
        return self.layout.alive_replicas

    @property
    def epoch_failed(self) -> bool:
        """This rank saw a failure in the current epoch (its communicators are revoked)."""
        return self._failed_at is not None

    def shard_members(self) -> tuple[int, ...]:
        """Original world ranks in my shard communicator, in its rank order (by replica)."""
        return self.layout.shard_ranks(self.shard)

    # -- hang watchdog ----------------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Tell the hang watchdog the main thread is making progress (every guarded call also beats)."""
        self._guard.beat()

    def step_done(self, longest_unit_s: float = 0.0) -> None:
        """A training step ended; its longest unit of work (a microbatch) took ``longest_unit_s``:
        the hang bound learns from its progress ([Note: a hang bound from progress] in
        ``recover_hsdp.collectives.guard``)."""
        self._guard.step_done(longest_unit_s)

    def watchdog_paused(self):
        """Context manager: no hang detection inside (MPI-call deadlines still apply)."""
        return self._guard.paused()


    # -- consensus and repair ---------------------------------------------------------------------
    def consensus(self, ok: bool) -> ConsensusResult:
        """Uniformly agree that this epoch was clean on every rank (``ok`` is this rank's verdict).

        Clean: returns ``clean=True``; nothing changes. Otherwise every survivor revokes, shrinks the
        global communicator, drops every replica that lost a rank, increments the epoch and rebuilds the
        global and shard communicators; failures during the repair loop it (bounded by
        ``Deadlines.max_repair_rounds``; past the bound this rank dies, it never hangs). All survivors
        return the same result; ranks of dead replicas get ``retire=True``.
        """
        self._check_usable()
        started = time.monotonic()
        if not ok:
            self.fail_epoch("caller reported a failed epoch")
        self._phase("consensus")
        clean = self._agree(self._global, self._failed_at is None)
        if clean:
            return ConsensusResult(True, self.epoch, frozenset(), self.layout.alive_replicas, False)
        decided = time.monotonic()
        detect_s = decided - (self._failed_at if self._failed_at is not None else started)
        return repair(self, decided, detect_s)

    def _agree(self, comm: MPI.Comm, flag: bool) -> bool:
        """Uniform AND of ``flag`` over the live members of ``comm`` (works on a revoked comm).
        Agree raises (uniformly) while any participant has unacknowledged failures: "someone failed",
        so the flag becomes 0, Ack_failed, agree again. Each retry needs a new failure: bounded."""
        buf = np.zeros(1, dtype=np.int32)
        value = 1 if flag else 0
        for _ in range(comm.Get_size() + 2):
            buf[0] = value
            try:
                with self._guard.call("Agree", self.deadlines.repair_s):
                    comm.Iagree(buf).Wait()
                return bool(buf[0] & 1)
            except MPI.Exception:
                value = 0
                try:
                    with self._guard.call("Ack_failed", self.deadlines.repair_s):
                        comm.Ack_failed()
                except MPI.Exception:
                    pass
        die(f"rank {self.world_rank}: Agree kept failing: dying rather than hanging")
        raise AssertionError("unreachable")

    # -- leaving ----------------------------------------------------------------------------------
    def retire(self, message: str = "") -> NoReturn:
        """Leave the job after ``consensus`` returned ``retire=True``: log one line and end.

        [Note: exiting without Finalize] MPI_Finalize after failures hangs on this stack, so a
        process never calls it; and a process that leaves while the job goes on ends by SIGKILL
        (``guard.die``), never by an exit without Finalize: PRRTE 3.0 tolerates any number of
        ranks killed by a signal, but takes an exit without Finalize (status 0 included) for an
        improper exit, and after a spawned rank was killed by a signal that can end the whole
        job (measured, tests/collectives/test_leaving.py: spawned rank A SIGKILLed, then
        spawned rank B's spawner SIGKILLed and B's ``os._exit(0)``: prterun reported B's
        improper exit in 9 of 9 runs and killed other ranks in 2; with B SIGKILLing itself, 0
        of 6). The soak of issue 32 lost 177 steps to it (a replacement's spawner died while
        it started; the replacement gave up, exited 0, prterun ended the job and the relaunch
        tier started again from step 0). Since every job PRRTE starts is recoverable
        (``state_base_recoverable``, collectives/mpirun.py), that exit no longer ends the job
        (4 of 4 runs, the slow test); SIGKILL stays the one way out, the exit being PRRTE's
        policy to keep. Only the end of a run exits (every rank at once, after
        the last agreement). A retiring rank first waits
        ``Deadlines.retire_grace_s``: an immediate end made a slower peer, still finishing the
        last agreement, see a new failure.
        """
        if not self.retired:
            raise RuntimeError("retire() called but consensus did not ask this rank to retire")
        print(f"RETIRE rank {self.world_rank} (replica {self.replica}, shard {self.shard}): replica "
              f"{self.replica} lost a rank; retiring at epoch {self.epoch}, SIGKILL"
              + (f": {message}" if message else ""), flush=True)
        self._left()
        self._guard.close()
        time.sleep(self.deadlines.retire_grace_s)
        die(f"rank {self.world_rank}: retired ([Note: exiting without Finalize])")

    def finish(self) -> bool:
        """End of the job on every surviving rank: agree that all are done, linger, stop the watchdog.

        Not a Barrier: a rank returning from a Barrier and exiting can make a slower peer's Barrier
        fail with ERR_PROC_FAILED (1 in ~25 runs here). Agreement is fault tolerant, and the
        ``retire_grace_s`` wait lets slower peers finish it before this rank's exit is visible.
        Returns whether every survivor ended its last epoch cleanly."""
        self._check_usable()
        clean = self._agree(self._global, self._failed_at is None)
        self.close()
        time.sleep(self.deadlines.retire_grace_s)
        return clean

    def close(self) -> None:
        """Stop the watchdog and disarm deadlines (communicators are left to process exit)."""
        self._left()
        self._guard.close()

    def _left(self) -> None:
        if self.on_leave is not None:
            on_leave, self.on_leave = self.on_leave, None
            on_leave()

    # -- helpers ----------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.retired:
            raise RuntimeError(f"rank {self.world_rank} has retired (its replica is dead); call retire()")

    def _phase(self, name: str) -> None:
        self._guard.beat()
        if self.on_phase is not None:
            self.on_phase(name)

    def _split(self, comm: MPI.Comm, color: int, key: int) -> MPI.Comm | None:
        with self._guard.call("Split", self.deadlines.repair_s):
            new = comm.Split(color, key)
        if new == MPI.COMM_NULL:
            return None
        new.Set_errhandler(MPI.ERRORS_RETURN)
        return new

    def _members(self, comm: MPI.Comm) -> list[int]:
        return sorted(self._ranks_in_order(comm))

    def _ranks_in_order(self, comm: MPI.Comm) -> list[int]:
        """The original world ranks of ``comm``'s members, in ``comm``'s rank order."""
        group = comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), self._base_group)
        finally:
            group.Free()
        return self._original_ranks(ranks)

    def _original_ranks(self, base_ranks) -> list[int]:
        """Ranks of the base group as original world ranks (they differ after a rejoin)."""
        if self._logical is None:
            return list(base_ranks)
        return [self._logical[r] for r in base_ranks]

    # -- rejoin ([Note: rejoin] in recover_hsdp/collectives/join.py) ------------------------------
    @classmethod
    def newcomer(cls, ranks_per_replica: int, deadlines: Deadlines | None = None, *,
                 arbiter_dir: str | os.PathLike | None = None) -> "FaultTolerantWorld":
        """The world of a rank spawned to replace a lost replica: no communicators until
        :meth:`grow`; its original world rank comes with the join offer (:meth:`assume_rank`)."""
        world = cls.__new__(cls)
        world._setup(ranks_per_replica, deadlines, arbiter_dir, None, "newcomer")
        return world

    def assume_rank(self, world_rank: int) -> None:
        """A newcomer takes the original world rank (replica, shard) the join offer gave it."""
        self.world_rank = world_rank
        self.replica, self.shard = divmod(world_rank, self.layout.ranks_per_replica)

    def adopt(self, offer: JoinOffer) -> None:
        """A newcomer takes the job's layout (ranks per replica, replicas, alive replicas) and
        arbiter folder (``offer.payload["arbiter"]``, None when absent) from the join offer."""
        if self._global is not None:
            raise RuntimeError("adopt() is for a newcomer's world (it has no communicators yet)")
        self.layout = ReplicaLayout(offer.ranks_per_replica, offer.num_replicas,
                                    offer.alive_replicas)
        arbiter_dir = offer.payload.get("arbiter")
        self.arbiter_dir = None if arbiter_dir is None else os.fspath(arbiter_dir)

    def grow(self, merged: MPI.Comm, ranks: list[int], alive_replicas: tuple[int, ...],
             num_replicas: int, epoch: int) -> bool:
        """Stage 4 of [Note: rejoin] on survivors and newcomers alike (``growth.grow``): ``merged``
        becomes the global communicator, epoch ``epoch`` + 1. False: nothing changed."""
        return growth.grow(self, merged, ranks, alive_replicas, num_replicas, epoch)
