"""``GuardedCalls``: the collectives of a ``FaultTolerantWorld`` that never raise and never hang.

[Note: guarded calls] Every call runs under the world's ``MpiGuard`` deadline
(``Deadlines.call_s``). The first MPI error of an epoch is noted once (:meth:`_note_failure`:
the time, the failed ranks handed to ``on_failed``, every communicator revoked) and the call
returns False; every later guarded call of the same epoch returns False at once, without MPI.
The caller then runs the world's ``consensus``, which decides for everyone.

The base class of ``FaultTolerantWorld`` (world.py), which owns the state these methods use:
``_global`` / ``_shard`` (communicators), ``_base_group`` and ``_original_ranks`` (rank
translation), ``_guard`` and ``deadlines``, ``_failed_at`` (this epoch's first failure),
``epoch``, ``world_rank``, ``on_failed`` and ``_check_usable``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from recover_hsdp.collectives.guard import log_line
from recover_hsdp.collectives.mpi import MPI, buffer_type, errname

# [Note: chunked reduces] An Open MPI use-after-free on a failed collective's temporary buffer crashed
# survivors later in Shrink (2/80 unchunked 64 MB runs, 0/260 with <= 4 MB chunks); chunking is also
# faster on btl/tcp here. Keep every single MPI reduce at or below this size.
CHUNK_BYTES = 4 << 20


def send_chunked(call: Callable[[str, Callable[[], Any]], bool], comm: MPI.Comm,
                 data: np.ndarray, dest: int) -> bool:
    """``data`` (uint8, C-contiguous) to rank ``dest`` of ``comm``: its size, then chunks of at
    most :data:`CHUNK_BYTES`. ``call(name, fn)`` runs each MPI call under the caller's guard and
    returns False once one failed; so does this, at the first failure."""
    size = np.array([data.size], dtype=np.int64)
    if not call("Send(size)", lambda: comm.Send(size, dest=dest, tag=71)):
        return False
    return all(call("Send(state)", lambda lo=lo: comm.Send(
        [data[lo:lo + CHUNK_BYTES], MPI.BYTE], dest=dest, tag=72))
        for lo in range(0, data.size, CHUNK_BYTES))


def recv_chunked(call: Callable[[str, Callable[[], Any]], bool], comm: MPI.Comm, source: int,
                 out: np.ndarray | None = None) -> np.ndarray | None:
    """What :func:`send_chunked` sends from rank ``source`` of ``comm`` (into ``out`` when it
    has the right size), or None once a call failed."""
    size = np.zeros(1, dtype=np.int64)
    if not call("Recv(size)", lambda: comm.Recv(size, source=source, tag=71)):
        return None
    if out is None or out.size != int(size[0]):
        out = np.empty(int(size[0]), dtype=np.uint8)
    ok = all(call("Recv(state)", lambda lo=lo: comm.Recv(
        [out[lo:lo + CHUNK_BYTES], MPI.BYTE], source=source, tag=72))
        for lo in range(0, out.size, CHUNK_BYTES))
    return out if ok else None


class GuardedCalls:
    """The guarded collectives and the failure bookkeeping of a world ([Note: guarded calls])."""

    def allreduce(self, buf: np.ndarray) -> bool:
        """SUM-all-reduce ``buf`` in place over my shard communicator. False: this epoch saw a failure
        (``buf`` is then garbage: restore it from a snapshot after the consensus)."""
        return self._allreduce(self._shard, buf, "shard")

    def allreduce_global(self, buf: np.ndarray) -> bool:
        """SUM-all-reduce a small ``buf`` in place over the global communicator (same contract)."""
        return self._allreduce(self._global, buf, "global")

    def allgather(self, obj: Any) -> list[Any] | None:
        """Allgather a small picklable object (e.g. a parameter checksum) over my shard communicator,
        in replica order. None: this epoch saw a failure."""
        return self._allgather(self._shard, obj, "shard")

    def allgather_global(self, obj: Any) -> list[Any] | None:
        """Allgather a small picklable object over the global communicator, in world-rank order."""
        return self._allgather(self._global, obj, "global")

    def send_bytes(self, data: np.ndarray, to_replicas: list[int]) -> bool:
        """Send ``data`` (uint8, C-contiguous) to the ranks of my shard position in
        ``to_replicas`` (point to point over my shard communicator, in chunks: only they
        receive it), one after the other. False: this epoch saw a failure."""
        comm = self._shard
        call = lambda name, fn: self._guarded(name, fn, comm)  # noqa: E731
        return all(send_chunked(call, comm, data, self.alive_replicas.index(replica))
                   for replica in to_replicas)  # stops at the first failure

    def recv_bytes(self, from_replica: int) -> np.ndarray | None:
        """What the rank of my shard position in ``from_replica`` sends me with
        :meth:`send_bytes`. None: this epoch saw a failure."""
        comm = self._shard
        return recv_chunked(lambda name, fn: self._guarded(name, fn, comm), comm,
                            self.alive_replicas.index(from_replica))

    def barrier(self) -> bool:
        """Barrier on the global communicator. False: this epoch saw a failure."""
        return self._guarded("Barrier(global)", self._global.Barrier, self._global)

    def fail_epoch(self, reason: str) -> None:
        """Record a failure seen outside MPI (e.g. a gloo error inside the replica) and revoke every
        communicator, so no peer stays blocked in a collective this rank will skip. Idempotent."""
        self._check_usable()
        if self._failed_at is None:
            self._failed_at = time.monotonic()
            log_line(f"rank {self.world_rank} epoch {self.epoch}: failure ({reason}); revoking")
        self._revoke(self._global, self._shard)

    def peers_failed(self) -> bool:
        """Non-blocking: has this epoch failed, as far as this rank can tell now? Lets MPI make
        progress (an ``Iprobe`` on the global and shard communicators), so the failure
        detector's notices and peers' revokes arrive while the main thread waits in something
        else (a data-plane collective: [Note: control plane and data plane] in
        groups/data_plane.py). A new failure is handled like a failed guarded call (every
        communicator revoked, ``on_failed`` told). Any thread, one at a time: [Note: MPI from autograd's
        thread] in collectives/guard.py."""
        self._check_usable()
        if self._failed_at is not None:
            return True
        for comm, which in ((self._global, "global"), (self._shard, "shard")):
            if comm is None:
                continue
            try:
                with self._guard.call(f"Iprobe({which})", self.deadlines.call_s):
                    comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
                group = comm.Get_failed()
                try:
                    failed = group.Get_size()
                finally:
                    group.Free()
                if not failed and comm.Is_revoked():
                    failed = -1
            except MPI.Exception as e:
                self._note_failure(f"Iprobe({which})", errname(e), comm)
                return True
            if failed:
                self._note_failure(f"Iprobe({which})", "revoked" if failed < 0 else
                                   f"{failed} failed rank(s)", comm)
                return True
        return False

    def _note_failure(self, name: str, what: str, comm: MPI.Comm | None,
                      started: float | None = None) -> None:
        """The first failure of this epoch seen in ``name``: record, report, revoke all."""
        self._failed_at = time.monotonic() if started is None else started
        log_line(f"rank {self.world_rank} epoch {self.epoch}: {name} failed with "
                 f"{what}; revoking all communicators")
        self._report_failed(comm)
        # [Note: revoke everything] Revoking only the global communicator HANGS a rank blocked in
        # a shard-communicator collective whose members are all alive: revoke every communicator.
        self._revoke(self._global, self._shard)

    def _allreduce(self, comm: MPI.Comm, buf: np.ndarray, which: str) -> bool:
        mpitype = buffer_type(buf)
        flat = buf.reshape(-1)  # a view: buf is C-contiguous
        step = max(1, CHUNK_BYTES // buf.itemsize)
        return all(self._guarded(f"Allreduce({which})", lambda lo=lo: comm.Allreduce(
            MPI.IN_PLACE, [flat[lo:lo + step], mpitype], op=MPI.SUM), comm)
            for lo in range(0, max(flat.size, 1), step))  # stops at the first failure

    def _report_failed(self, comm: MPI.Comm | None) -> None:
        """Hand the ranks this rank knows to have failed on ``comm`` to ``on_failed`` (the
        manager ends the frozen ones on this host at once: a frozen rank's replica peers are
        blocked in an intra-replica collective with it until it really dies)."""
        if self.on_failed is None or comm is None:
            return
        try:
            group = comm.Get_failed()
            try:
                failed = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                   self._base_group)
            finally:
                group.Free()
        except MPI.Exception:
            return
        failed = self._original_ranks(r for r in failed if r != MPI.UNDEFINED)
        if failed:
            self.on_failed(sorted(failed))

    def _allgather(self, comm: MPI.Comm, obj: Any, which: str) -> list[Any] | None:
        out: list[Any] = []
        ok = self._guarded(f"allgather({which})", lambda: out.extend(comm.allgather(obj)), comm)
        return out if ok else None

    def _guarded(self, name: str, fn: Callable[[], Any], comm: MPI.Comm | None = None) -> bool:
        self._check_usable()
        if self._failed_at is not None:
            return False
        started = time.monotonic()
        try:
            with self._guard.call(name, self.deadlines.call_s):
                fn()
            return True
        except MPI.Exception as e:
            self._note_failure(name, errname(e), comm, started)
            return False

    def _revoke(self, *comms: MPI.Comm | None) -> None:
        for c in comms:
            if c is None or c == MPI.COMM_NULL:
                continue
            try:
                if not c.Is_revoked():
                    with self._guard.call("Revoke", self.deadlines.repair_s):
                        c.Revoke()
            except MPI.Exception:
                pass

