"""In-step recovery: FSDP2 bucket snapshots tagged by epoch; restore and re-reduce stale buckets.

Each FSDP unit calls the all-reduce hook once per synced backward with its flat fp32
reduce-scatter output, a "bucket" (the sum over the replica's S ranks: force-sum reduction and
divide factor 1, because TorchTitan already scales the loss by the global token count). The
hook of :class:`BucketSync`:

  1. snapshots the bucket (this replica's local gradient sum for that unit),
  2. zeroes it if this replica's work is not committed (an unpromoted spare),
  3. sums it across replicas in place with the guarded MPI all-reduce and tags it with the world
     epoch it was reduced under (``None`` when the epoch had already failed: not reduced).

[Note: why snapshots are taken before the reduce] A reduce that fails half way leaves the bucket
partly summed under a membership that no longer exists; nothing in the bucket can be trusted
after that. The snapshot is the only clean copy of this replica's contribution.

Invariant kept here: a committed gradient is reduced entirely under ONE membership. After a
consensus that was not clean, :meth:`BucketSync.rereduce` rebuilds every bucket whose tag is not
the current epoch from its snapshot (plus any extra microbatches' gradients) and reduces it
again under the new epoch; :meth:`BucketSync.all_current` checks that every bucket carries the
current epoch before the step may commit.

[Note: measured microbatches] Each bucket also carries how many microbatch gradients it holds,
counted where they are made, not from the plan: every FSDP unit's output registers a gradient
hook in forward, so each backward pass that reaches the unit adds one to the unit's pending
count (``count_backward``); the bucket takes the pending count when the unit's hook fires
(``computed``, and ``extras`` for extra microbatches), and ``reduced`` is what the last reduce
under an epoch summed: computed (zero for a replica that does not contribute) + extras.
:meth:`BucketSync.reduced_microbatches` is this rank's figure if every bucket agrees; the
manager sums it across replicas with the loss and refuses to commit a step whose sum is not B.

[Note: overlapped bucket sums] On a data plane that can enqueue a sum and return (the
``torch`` plane: gloo runs it on its own threads, NCCL on its own stream), the hook takes the
snapshot, enqueues the bucket's sum on a private copy and returns, so the rest of the last
microbatch's backward runs while earlier buckets are summed; :meth:`BucketSync.wait_sums`
completes every enqueued sum, in hook order, before the step's totals and the consensus (and
:meth:`BucketSync.rereduce` enqueues all its buckets, then waits). A bucket is tagged with the
epoch when its sum completed, which is the epoch it was enqueued under: the epoch changes only
in the repair, after the wait. Nothing reads a bucket between its hook and the wait (FSDP only
points ``.grad`` into it; the optimizer runs after the consensus). A sum that fails or is
abandoned leaves its bucket as the hook left it, stale like a failed synchronous reduce. Cost:
every bucket's wire copy is alive until the wait (one gradient copy at the wire dtype, beside
the snapshots). The ``mpi`` plane waits for each sum in its hook (a guarded blocking MPI call;
ob1/tcp progresses a non-blocking collective only inside MPI calls on this thread, so
``Iallreduce`` would not overlap either), and so does ``overlap_reduce = false``.

The FSDP2 behaviour all this relies on, and how it is checked, is [Note: FSDP2 contract] in
:mod:`recover_hsdp.recovery.fsdp_contract`; GPU stream ordering is [Note: hook streams] there.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule

from recover_hsdp.errors import one_line
from recover_hsdp.recovery.fsdp_contract import check_grads_are_bucket_views, check_unit
from recover_hsdp.recovery.planes import DataPlane, MpiDataPlane
from recover_hsdp.recovery.staging import HostStaging


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@dataclass
class Bucket:
    """One FSDP unit's reduce-scatter output for this step, with its snapshot and epoch tag."""

    tensor: torch.Tensor          # FSDP's buffer; the unit's .grad shards are views into it
    snapshot: torch.Tensor        # this replica's local contribution, taken before the reduce
    unit: int = 0                 # index of the FSDP unit whose hook produced it
    epoch: int | None = None      # epoch it was reduced under; None: not (successfully) reduced
    extra: torch.Tensor | None = field(default=None)  # gradients of extra microbatches
    computed: int = 0             # microbatch gradients in the snapshot ([Note: measured ...])
    extras: int = 0               # microbatch gradients in ``extra``
    reduced: int = 0              # microbatch gradients the last reduce summed on this rank
    pending: object = None        # an enqueued sum not yet waited for ([Note: overlapped ...])
    enqueued_under: int | None = None  # the epoch it was enqueued under


class BucketSync:
    """Installs the cross-replica all-reduce hook on every FSDP unit of a model.

    Build it with :meth:`for_model` (the FSDP2 units of a model, contract checked) or directly
    from ``units``: objects with FSDP2's ``set_all_reduce_hook``,
    ``set_force_sum_reduction_for_comms`` and ``set_gradient_divide_factor`` (fakes in tests).

    Args:
        units: the FSDP units, in module order. Unit ``i``'s hook fills bucket ``i``.
        world: a ``World`` (collectives/interface.py): ``epoch``, ``epoch_failed``,
            ``fail_epoch`` and, for the ``mpi`` plane, ``allreduce``.
        host_snapshots: keep snapshots in (pinned) host memory instead of device memory (GPU).
        on_bucket: ``on_bucket(index, rereduce)`` called right before each bucket's reduce
            (fault-injection point "after k of n buckets were reduced").
        hook_stream: GPU only: the stream FSDP runs the hook on (see [Note: hook streams]);
            ``None`` on CPU.
        plane: the ``DataPlane`` of the sums (recovery/planes.py; [Note: overlapped bucket
            sums] when its ``overlap`` is true); ``None``: ``MpiDataPlane``, the world's MPI
            all-reduce through host staging.
        passes_per_microbatch: backward passes a unit sees per microbatch: the pieces a
            pipeline schedule cuts one microbatch into ([Note: pipeline stages in a replica]
            in titan/pipeline.py); 1 without pipeline stages.
    """

    def __init__(self, units, world, host_snapshots: bool = False, on_bucket=None,
                 hook_stream=None, plane=None, passes_per_microbatch: int = 1):
        self.world = world
        self.on_bucket = on_bucket or (lambda index, rereduce: None)
        self.host_snapshots = host_snapshots
        self.units = list(units)
        if not self.units:
            raise RuntimeError("model has no FSDP units: the cross-replica reduce needs FSDP2")
        self.hook_stream = hook_stream
        self.buckets: list[Bucket] = []
        self._by_unit: dict[int, Bucket] = {}
        self.contributes = True
        self.collecting_extras = False
        self._audit: list[torch.Tensor] | None = None  # [Note: gradient audits]: statistics
        self.error: str | None = None  # first error raised inside the hook this step (not MPI's)
        self.reduce_s = 0.0  # seconds inside the cross-replica reduces this step (waiting for
        # the slowest replica: not this replica's compute, [Note: straggler quotas])
        self.staging = HostStaging()  # GPU buckets' host chunks
        self.plane: DataPlane = plane if plane is not None else MpiDataPlane(world, self.staging)
        self.overlap = self.plane.overlap
        self._pending = [0] * len(self.units)  # backward passes per unit since its last hook
        self.passes_per_microbatch = passes_per_microbatch
        self.counting = True  # False: forwards now are no microbatch's (a schedule's set-up)
        for index, unit in enumerate(self.units):
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(1.0)
            hook = functools.partial(self._hook, index)
            if hook_stream is None:
                unit.set_all_reduce_hook(hook)
            else:
                unit.set_all_reduce_hook(hook, stream=hook_stream)

    @classmethod
    def for_model(cls, model: torch.nn.Module, world, host_snapshots: bool = False,
                  on_bucket=None, plane=None, passes_per_microbatch: int = 1) -> "BucketSync":
        """The FSDP2 units of ``model`` (root included), checked against
        [Note: FSDP2 contract]; on GPU the hook gets a stream of its own."""
        units = fsdp_units(model)
        for unit in units:
            check_unit(unit)
        stream = None
        if any(p.device.type == "cuda" for p in model.parameters()):
            stream = torch.cuda.Stream()
        sync = cls(units, world, host_snapshots, on_bucket, hook_stream=stream, plane=plane,
                   passes_per_microbatch=passes_per_microbatch)
        for index, unit in enumerate(units):
            unit.register_forward_hook(functools.partial(_count_backward_of, sync, index))
        return sync

    # ------------------------------------------------------------------ step lifecycle

    def begin_step(self, contributes: bool) -> None:
        """Forget last step's buckets; ``contributes`` False: reduce zeros (unpromoted spare)."""
        self.buckets = []
        self._by_unit = {}
        self._pending = [0] * len(self.units)
        self.error = None
        self.reduce_s = 0.0
        self.contributes = contributes
        self.collecting_extras = False
        self.plane.prepare()  # before the backward, on this (the main) thread

    def begin_extras(self) -> None:
        """Following synced backwards compute extra microbatches: their buckets are added to the
        step's buckets (in the same unit order) instead of being reduced."""
        self.collecting_extras = True

    def begin_audit(self) -> None:
        """The next synced backward is an audit's signature pass ([Note: gradient audits] in
        manager/audits.py): each bucket's statistics are taken and the bucket zeroed (FSDP's
        accumulation into ``.grad`` then adds nothing); nothing is snapshot, counted or
        reduced. Call only when no unsynced gradient is pending (after the step's sync)."""
        self._audit = []

    def end_audit(self) -> list[float]:
        """The pass's statistics over this rank's buckets: (sum, sum of |g|, sum of g^2),
        read at once (one host sync on a GPU)."""
        stats, self._audit = self._audit or [], None
        self._join_hook_stream()
        if not stats:
            return [0.0, 0.0, 0.0]
        return [float(x) for x in torch.stack(stats).sum(dim=0).cpu().tolist()]

    def check_contract(self) -> None:
        """Raise if a gradient is not a view of its bucket (item 3 of [Note: FSDP2 contract]).
        Call after a synced backward, before anything rebinds ``.grad``."""
        for bucket in self.buckets:
            unit = self.units[bucket.unit]
            if not isinstance(unit, torch.nn.Module):
                continue  # a stand-in unit (tests): it has no parameters to check
            problem = check_grads_are_bucket_views(unit, bucket.tensor)
            if problem:
                raise RuntimeError(problem)

    def count_backward(self, unit: int) -> None:
        """One backward pass reached unit ``unit`` ([Note: measured microbatches])."""
        self._pending[unit] += 1

    def reduced_microbatches(self) -> tuple[int, bool]:
        """(microbatch gradients this rank's buckets summed in their last reduce, whether every
        bucket holds that many). The count is the smallest of the buckets': a gradient missing
        from one bucket is missing from the step. (Units without parameters of their own
        produce no bucket.)"""
        counts = [b.reduced for b in self.buckets]
        agree = len(set(counts)) == 1
        return (min(counts) if counts else 0), agree

    def snapshot_bytes(self) -> int:
        return sum(b.snapshot.numel() * b.snapshot.element_size() for b in self.buckets)

    def all_current(self) -> bool:
        """Every bucket was reduced under the current epoch (cheap run-time invariant check)."""
        return bool(self.buckets) and all(b.epoch == self.world.epoch for b in self.buckets)

    # ------------------------------------------------------------------ the hook

    def _hook(self, unit: int, tensor: torch.Tensor) -> None:
        try:
            if self._audit is not None:
                self._take_statistics(unit, tensor)
            elif self.collecting_extras:
                self._collect_extra(unit, tensor)
            else:
                self._snapshot_and_reduce(unit, tensor)
        except Exception as err:  # never raise out of the hook: see [Note: FSDP2 contract]
            if self.error is None:
                self.error = f"all-reduce hook: {one_line(err)}"
            self.world.fail_epoch(self.error)

    def _snapshot_and_reduce(self, unit: int, tensor: torch.Tensor) -> None:
        if unit in self._by_unit:
            raise RuntimeError(f"FSDP unit {unit} synced twice in one step: each bucket must "
                               "reach the hook once (sync only on the last microbatch)")
        if self.host_snapshots and tensor.device.type != "cpu":
            snapshot = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            snapshot.copy_(tensor)
        else:
            snapshot = tensor.detach().clone()
        bucket = Bucket(tensor=tensor, snapshot=snapshot, unit=unit,
                        computed=self._take_pending(unit))
        bucket.reduced = bucket.computed if self.contributes else 0
        self.buckets.append(bucket)
        self._by_unit[unit] = bucket
        if not self.contributes:
            tensor.zero_()
        self.on_bucket(len(self.buckets) - 1, False)
        started = time.perf_counter()
        self._reduce(bucket)
        self.reduce_s += time.perf_counter() - started

    def _take_statistics(self, unit: int, tensor: torch.Tensor) -> None:
        """An audit's bucket: its statistics, then zeroed ([Note: gradient audits])."""
        flat = tensor.detach().reshape(-1)
        self._audit.append(torch.stack([
            flat.sum(dtype=torch.float64), torch.linalg.vector_norm(flat, 1, dtype=torch.float64),
            torch.linalg.vector_norm(flat, 2, dtype=torch.float64).square()]))
        self._pending[unit] = 0
        tensor.zero_()

    def _collect_extra(self, unit: int, tensor: torch.Tensor) -> None:
        bucket = self._by_unit.get(unit)
        if bucket is None or bucket.tensor.shape != tensor.shape:
            raise RuntimeError(f"extra microbatch gradient of FSDP unit {unit} has no matching "
                               "bucket of this step (see [Note: FSDP2 contract])")
        extra = tensor.detach().to(bucket.snapshot.device)
        bucket.extra = extra.clone() if bucket.extra is None else bucket.extra.add_(extra)
        bucket.extras += self._take_pending(unit)
        # FSDP accumulates this buffer into .grad after the hook: make that a no-op; the extra
        # gradient enters through rereduce().
        tensor.zero_()

    def _take_pending(self, unit: int) -> int:
        """The microbatches unit ``unit``'s backward passes since its last hook make; passes
        that do not fill whole microbatches raise (a lost pipeline piece: the hook fails the
        epoch)."""
        passes, self._pending[unit] = self._pending[unit], 0
        microbatches, rest = divmod(passes, self.passes_per_microbatch)
        if rest:
            raise RuntimeError(f"FSDP unit {unit} saw {passes} backward passes, not a multiple "
                               f"of the {self.passes_per_microbatch} pieces of a microbatch")
        return microbatches

    def _reduce(self, bucket: Bucket) -> None:
        """Guarded cross-replica SUM of one bucket, tagged with the epoch it succeeded under,
        through the data plane when one is set; enqueued only when the plane overlaps ([Note:
        overlapped bucket sums]: :meth:`wait_sums` tags it). On MPI, GPU buckets go through
        reused pinned host chunks ([Note: no device tensor reaches MPI] in
        recovery/staging.py; CUDA-aware MPI is not assumed); CPU buckets are reduced in place."""
        bucket.epoch = None
        if self.overlap:
            bucket.pending = self.plane.start(bucket.tensor)
            bucket.enqueued_under = self.world.epoch
            return
        ok = self.plane.reduce(bucket.tensor)
        bucket.epoch = self.world.epoch if ok else None

    def wait_sums(self) -> None:
        """Complete the enqueued sums ([Note: overlapped bucket sums]); a no-op when the plane
        does not overlap. Called by the manager before the step's totals."""
        waiting = [b for b in self.buckets if b.pending is not None]
        if not waiting:
            return
        started = time.perf_counter()
        self._join_hook_stream()  # the sums' copies back run on the caller's stream
        results = self.plane.wait([b.pending for b in waiting])
        for bucket, ok in zip(waiting, results):
            bucket.epoch = bucket.enqueued_under if ok else None
            bucket.pending = None
        self.reduce_s += time.perf_counter() - started

    def _join_hook_stream(self) -> None:
        """[Note: hook streams] order the caller's stream after the hook's work (GPU only)."""
        if self.hook_stream is None:
            return
        current = torch.cuda.current_stream()
        current.wait_stream(self.hook_stream)
        for bucket in self.buckets:
            for tensor in (bucket.tensor, bucket.snapshot, bucket.extra):
                if tensor is not None and tensor.is_cuda:
                    tensor.record_stream(current)

    # ------------------------------------------------------------------ recovery

    def nonfinite_buckets(self) -> list[int]:
        """Indices of the buckets whose snapshot or extra microbatches' gradients on this rank
        are not finite (a non-contributing replica's too: harmless, it commits nothing). A pass
        over them: called only on the bad path ([Note: bad replicas] in manager/culprits.py)."""
        self._join_hook_stream()
        bad = []
        for index, bucket in enumerate(self.buckets):
            parts = [bucket.snapshot] + ([bucket.extra] if bucket.extra is not None else [])
            if any(not bool(torch.isfinite(part).all()) for part in parts):
                bad.append(index)
        return bad

    def invalidate(self) -> None:
        """Every bucket is stale: the sum it holds is poisoned (a non-finite contribution), so
        the next :meth:`rereduce` rebuilds all of them from their snapshots."""
        for bucket in self.buckets:
            bucket.epoch = None

    def drop_extras(self) -> None:
        """This replica's extra microbatches are no longer committed (it is a culprit)."""
        for bucket in self.buckets:
            bucket.extra, bucket.extras = None, 0

    def rereduce(self, contributes: bool) -> int:
        """Restore every stale bucket from its snapshot (+ extras) and reduce it under the
        current epoch. Returns how many buckets were re-reduced. A failure during it leaves
        those buckets stale again: the caller runs the consensus and loops."""
        self.contributes = contributes
        self.collecting_extras = False
        self._join_hook_stream()
        redone = 0
        for index, bucket in enumerate(self.buckets):
            if bucket.epoch == self.world.epoch and bucket.extra is None:
                continue
            source = bucket.snapshot if contributes else torch.zeros_like(bucket.snapshot)
            with torch.no_grad():
                bucket.tensor.copy_(source)
                if bucket.extra is not None:
                    bucket.tensor.add_(bucket.extra.to(bucket.tensor.device))
            bucket.reduced = (bucket.computed if contributes else 0) + bucket.extras
            self.on_bucket(index, True)
            self._reduce(bucket)
            redone += 1
        self.wait_sums()
        return redone


def _count_backward_of(sync: BucketSync, index: int, module, args, output) -> None:
    """Forward hook of FSDP unit ``index``: its output's gradient hook counts the backward
    passes that reach the unit ([Note: measured microbatches]). Not during a backward pass
    (activation checkpointing recomputes forwards there), nor while ``sync.counting`` is off
    (a pipeline schedule's metadata pass: [Note: pipeline stages in a replica])."""
    if not sync.counting or not torch.is_grad_enabled() \
            or torch._C._current_graph_task_id() != -1:
        return
    tensor = next((t for t in torch.utils._pytree.tree_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if tensor is not None:
        tensor.register_hook(lambda grad: sync.count_backward(index))
