"""The data plane: where the bytes of the cross-replica bucket sums travel.

[Note: control plane and data plane] The fault-tolerant world (ULFM: detector, agreement,
shrink, epoch, membership, the consensus) is the one source of truth about who is alive and
whether an epoch is clean. The bucket sums themselves go through the data plane chosen by
``[recover.reduce] plane``:

* ``mpi`` (the default on CPU): the world's guarded all-reduce over the shard communicator
  (``MpiDataPlane``, recovery/planes.py), chunked, btl/tcp.
* ``torch`` (the default on GPU: ``auto``): a torch.distributed group (gloo on CPU, NCCL on
  GPU) of the same-position ranks (same shard index) of the alive replicas, in replica order -- the
  members of this rank's
  shard communicator. One group per world epoch: every change of membership (a shrink, a
  rejoin) gives a new epoch, and the first reduce under a new epoch builds a new group before
  it is used. The rendezvous rides on the repaired world: the group's first member (lowest
  alive replica) opens a fresh TCPStore, and its address reaches the others in one guarded
  allgather over the shard communicator; the group's keys live under ``dp/e<epoch>/s<shard>``.
  gloo cannot shrink, and ``ncclCommShrink`` would need the dead members' consent to nothing
  we can rely on, so a new group is always built (cheap next to a repair).

The failure contract is the MPI path's: a data-plane call that errors (gloo: connection
reset by a dead peer) fails the epoch (``world.fail_epoch``: every communicator revoked, so
the peers blocked in their own data-plane call learn it too) and returns False; the bucket
stays stale and is restored and reduced again under the next epoch. A call that blocks (a
frozen or cut-off peer never closes its sockets; NCCL never errors on a dead peer) is waited
for by polling: the main thread tests the work for completion and, every ``poll_s``, asks the
control plane (``world.peers_failed``: a non-blocking MPI probe that lets the failure
detector's and the revokes' notices in) whether the epoch failed; if so the call is
abandoned: False. Past ``Deadlines.call_s`` the rank dies, as an MPI call past its deadline
does. An abandoned group is never used again and never destroyed collectively (its members
are dead); NCCL communicators are aborted. Every call reduces a private copy of the bucket,
so an abandoned call can never write into a bucket after it was restored from its snapshot.

[Note: no watchdog decides on the data plane] torch's NCCL watchdog tears the whole process
down on an asynchronous NCCL error when ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 3 (torch's
default, and the replica group's own setting: a replica leaves as a unit). A dead peer of a
data-plane group is such an error on every survivor, and the watchdog's poll (~100 ms) would
beat the control plane's (``poll_s``): healthy survivors killed. So every data-plane NCCL
group is built with the variable at 0 (``DATA_PLANE_NCCL_ENV``, set around the constructor
that reads it, under a lock): its watchdog only records errors, the control plane abandons
the call and aborts the communicator. (GPU-only: checked on CPU on the environment the
constructor sees, tests/groups/test_data_plane.py; not run on a GPU yet.)

Invariant kept: which replicas are alive and whether an epoch was clean is decided only by
the consensus, exactly as on the MPI plane, so B per step and the epoch tags are unchanged.

``wire_dtype = "bf16"``: the copy is cast to bfloat16 before the sum and back after it (half
the bytes; each rank's contribution is rounded once, the sum is accumulated in bf16 by the
backend): replicas stay bitwise identical to each other, the trajectory is no longer the
fp32 one (docs/data_plane.md).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from recover_hsdp.collectives.guard import die, log_line
from recover_hsdp.config import ConfigError
from recover_hsdp.errors import one_line
from recover_hsdp.groups import rendezvous
from recover_hsdp.groups.teardown import (ABORT_WAIT_S, NEVER_DESTROYED, PendingBuild,
                                          abort_bounded)
from recover_hsdp.recovery.planes import MpiDataPlane

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: [Note: no watchdog decides on the data plane]: the environment a data-plane NCCL group is
#: built under (read by ProcessGroupNCCL's constructor)
DATA_PLANE_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(overrides: dict[str, str]):
    """``overrides`` in os.environ for the block (one block at a time), then the old values."""
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

class PendingSum(NamedTuple):
    """One enqueued bucket sum: the bucket, the private wire copy being summed, the backend's
    work (None with one member) and the group it runs on."""

    tensor: torch.Tensor
    wire: torch.Tensor
    work: Any
    group: Any


class TorchDataPlane:
    """[Note: control plane and data plane], the ``torch`` side: a ``DataPlane``
    (recovery/planes.py).

    Args:
        world: a ``World`` (collectives/interface.py).
        backend: "gloo" or "nccl" (default: NCCL when CUDA is available).
        wire_dtype: "fp32" or "bf16".
        timeout_s: the backend's own timeout (a last resort: the poll decides first).
        poll_s: how often a waiting rank asks the control plane.
        device: the CUDA device of the NCCL group (None on gloo).
        overlap: ``BucketSync`` enqueues each bucket's sum in the hook and waits for all of
            them before the consensus ([Note: overlapped bucket sums]); False: each sum is
            waited for in its hook.
    """

    name = "torch"

    def __init__(self, world, backend: str | None = None, wire_dtype: str = "fp32",
                 timeout_s: float = 1800.0, poll_s: float = 0.01, device=None,
                 overlap: bool = True) -> None:
        self.world = world
        self.overlap = overlap
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.wire_dtype = WIRE_DTYPES[wire_dtype]
        self.timeout = timedelta(seconds=timeout_s)
        self.poll_s = poll_s
        self.device = device
        self._key: tuple | None = None   # (epoch, alive replicas) the group was built for
        self._group: Any = None          # None with one member: the sum is the tensor itself
        self._stores: list[Any] = []     # the TCPStores this rank serves (kept for the run)
        self.abandoned: list[Any] = []   # groups given up after a failure (never reused)
        self.builds = 0                  # groups built (tests: one per epoch)
        self.build_s = 0.0               # seconds spent building them

    # ------------------------------------------------------------------ the reduce

    def prepare(self) -> None:
        """The group of the current epoch, built now (the step's start, the main thread), so
        the first hook of the backward finds it; a failed build fails the epoch as in a hook."""
        if not self.world.epoch_failed:
            self._ready()

    def reduce(self, tensor: torch.Tensor) -> bool:
        """SUM of ``tensor`` over the same-shard ranks of the alive replicas, in place, waited
        for. False: the epoch failed (``tensor`` is then untouched: restore it anyway)."""
        return self.wait([self.start(tensor)])[0]

    def start(self, tensor: torch.Tensor) -> "PendingSum | None":
        """Enqueue the SUM of ``tensor`` and return at once ([Note: overlapped bucket sums]);
        :meth:`wait` completes it. None: not enqueued (the epoch had failed, or the group could
        not be built: the epoch is failed then)."""
        world = self.world
        if world.epoch_failed or not self._ready():
            return None
        wire = tensor.detach().to(self.wire_dtype, copy=True).view(-1)
        if self._group is None:  # one member: the sum is the tensor itself
            return PendingSum(tensor, wire, None, None)
        try:
            work = self._group.allreduce([wire], dist.AllreduceOptions())
        except Exception as err:  # noqa: BLE001 - an enqueue error fails the epoch
            self._failed(f"data plane allreduce: {one_line(err)}")
            return None
        return PendingSum(tensor, wire, work, self._group)

    def wait(self, pending: "list[PendingSum | None]") -> list[bool]:
        """Complete enqueued sums in order (the order every member enqueued them in): each
        done one is copied back into its tensor. A failure (an error, or the control plane
        reporting one while a call is blocked) abandons the group; that sum and every later
        one is then False, their tensors untouched."""
        results: list[bool] = []
        for item in pending:
            results.append(item is not None and all(results) and self._complete(item))
        return results

    def _complete(self, item: "PendingSum") -> bool:
        if item.work is not None:
            if item.group is not self._group:  # abandoned since it was enqueued
                return False
            if not self._wait(item.work.is_completed, "allreduce"):
                return False
            try:
                item.work.wait()  # on GPU: the caller's stream waits for NCCL's
            except Exception as err:  # noqa: BLE001 - gloo: a dead peer's connection reset
                return self._failed(f"data plane allreduce: {one_line(err)}")
        with torch.no_grad():
            item.tensor.view(-1).copy_(item.wire)
        if item.wire.is_cuda:  # freed on the host now: not reused before the copy ran
            item.wire.record_stream(torch.cuda.current_stream())
        return True

    def _wait(self, done: Callable[[], bool], what: str) -> bool:
        """Wait for ``done()`` while the control plane says nobody failed; False: abandoned."""
        world = self.world
        started = time.monotonic()
        deadline = started + world.deadlines.call_s
        next_poll = started
        while not done():
            now = time.monotonic()
            if now >= next_poll:
                if world.peers_failed():
                    log_line(f"rank {world.world_rank} epoch {world.epoch}: data plane {what} "
                             f"abandoned after {now - started:.3f} s: the control plane "
                             "reports a failure")
                    self._abandon()
                    return False
                next_poll = now + self.poll_s
            if now > deadline:
                die(f"rank {world.world_rank}: data plane {what} still blocked after "
                    f"{now - started:.1f} s (deadline): killing this rank so that ULFM sees an "
                    "ordinary death")
            world.heartbeat()
            time.sleep(0.0005)
        return True

    def _failed(self, reason: str) -> bool:
        self.world.fail_epoch(reason)
        self._abandon()
        return False

    def _abandon(self) -> None:
        """Give the group up: never used again, kept referenced, NCCL communicators aborted
        within a bound ([Note: bounded teardown] in groups/teardown.py)."""
        group, self._group, self._key = self._group, None, None
        if group is None:
            return
        self.abandoned.append(group)
        NEVER_DESTROYED.append(group)
        if self.backend == "nccl":
            abort_bounded(group, ABORT_WAIT_S)

    # ------------------------------------------------------------------ the group

    def _ready(self) -> bool:
        """The group of the current epoch, built now if the membership changed."""
        world = self.world
        key = (world.epoch, tuple(world.alive_replicas))
        if key == self._key:
            return True
        if self._group is not None:  # an old epoch's group: its members may be dead
            self._abandon()
        started = time.monotonic()
        ok = self._build(key)
        self.build_s += time.monotonic() - started
        return ok

    def _build(self, key: tuple) -> bool:
        world = self.world
        members = list(world.shard_members())
        me = members.index(world.world_rank)
        if len(members) == 1:
            self._key, self._group = key, None
            return True
        mine = rendezvous.this_host()
        port = None
        if me == 0:
            store = dist.TCPStore(rendezvous.LOCAL, 0, len(members), is_master=True,
                                  wait_for_workers=False, timeout=self.timeout)
            self._stores.append(store)
            port = store.port
        gathered = world.allgather((mine, port))  # guarded, shard communicator
        if gathered is None:
            return False
        hosts = [h for h, _ in gathered]
        try:
            local, _ = rendezvous.local_address(hosts, me)
            leader = rendezvous.leader_address(hosts[0], mine)
        except ValueError as err:
            return self._failed(f"data plane rendezvous: {err}")
        prefix = f"dp/e{key[0]}/s{world.shard}"
        built = PendingBuild(nccl=self.backend == "nccl")

        def make() -> None:  # on a helper thread: the rendezvous blocks on every member
            try:
                store = (self._stores[-1] if me == 0 else
                         dist.TCPStore(leader, gathered[0][1], len(members), is_master=False,
                                       timeout=self.timeout))
                group = self._new_group(dist.PrefixStore(prefix, store), me, len(members),
                                        local)
                if built.offer(group) and built.nccl and self.device is not None:
                    group.eager_connect_single_device(self.device)  # the communicator, now
            except Exception as err:  # noqa: BLE001 - reported by the waiting main thread
                built.error = one_line(err)

        helper = threading.Thread(target=make, name="recover-hsdp-data-plane", daemon=True)
        helper.start()
        if not self._wait(lambda: not helper.is_alive(), "rendezvous"):
            self._give_up_build(built)
            return False
        if built.error is not None:
            self._give_up_build(built)
            return self._failed(f"data plane rendezvous: {built.error}")
        self._key, self._group = key, built.group
        self.builds += 1
        return True

    def _give_up_build(self, built: "PendingBuild") -> None:
        """A group whose rendezvous was abandoned (a member lost meanwhile) or failed: never
        used; an NCCL communicator still connecting is aborted, so the helper thread stuck in
        its connect returns, and so is one the helper finishes later (``_Build.offer``)."""
        group = built.abandon()
        if group is not None:
            NEVER_DESTROYED.append(group)
            if self.backend == "nccl":
                abort_bounded(group, ABORT_WAIT_S)

    def _new_group(self, store, rank: int, size: int, address: str):
        if self.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            return dist.ProcessGroupGloo(store, rank, size, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        with _environment(DATA_PLANE_NCCL_ENV):  # [Note: no watchdog decides on the data plane]
            group = dist.ProcessGroupNCCL(store, rank, size, options)
        return group  # its communicator: eager, on the helper thread (``_build``)


def resolve_data_plane(name: str, device=None, ranks_per_gpu: int = 1) -> str:
    """``[recover.reduce] plane`` for a model on ``device``: ``auto`` is ``torch`` on CUDA with
    one rank per GPU, ``mpi`` otherwise (config/sections.py says why). NCCL takes one rank per GPU in a
    communicator, so ``torch`` on GPUs shared by several ranks is refused (one line)."""
    on_gpu = device is not None and torch.device(device).type == "cuda"
    if name == "auto":
        return "torch" if on_gpu and ranks_per_gpu == 1 else "mpi"
    if name == "torch" and on_gpu and ranks_per_gpu > 1:
        raise ConfigError(f"recover.reduce.plane=torch with {ranks_per_gpu} ranks per GPU: NCCL "
                          "needs one rank per GPU in a group; use plane = \"mpi\" (or "
                          "\"auto\") in [recover.reduce] or --ranks-per-gpu 1")
    return name


def build_data_plane(reduce, world, device=None, timeout_s: float = 1800.0,
                     ranks_per_gpu: int = 1):
    """The data plane the ``[recover.reduce]`` section (config.Reduce) names for ``world``
    (``auto`` resolved for ``device``): an ``MpiDataPlane`` (recovery/planes.py: the world's own
    all-reduce) or a :class:`TorchDataPlane`; either is a ``DataPlane``."""
    plane = resolve_data_plane(reduce.plane, device, ranks_per_gpu)
    if world.world_rank == 0:
        how = "" if plane == "mpi" else (f", wire {reduce.wire_dtype}, sums "
                                         + ("overlapped" if reduce.overlap else "in the hook"))
        log_line(f"data plane: {plane} (plane = {reduce.plane}){how}")
    if plane == "mpi":
        return MpiDataPlane(world)
    return TorchDataPlane(world, wire_dtype=reduce.wire_dtype, timeout_s=timeout_s, device=device,
                          overlap=reduce.overlap)
