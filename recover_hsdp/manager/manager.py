"""RecoverManager: the ReCoVer step protocol as a component the trainer calls.

Like TorchTitan's ``FTManager`` (torchtitan/components/ft/manager.py) this is a component, not a
trainer: ``RecoverTrainer`` (``recover_hsdp.titan.trainer``) computes microbatches and applies the
optimizer; the manager decides what to compute, keeps the cross-replica sums consistent and tells
the trainer when it may update. It holds the three layers and the run's outputs:

  world         layer 1, ``recover_hsdp.collectives.FaultTolerantWorld`` (a fake in tests)
  bucket_sync   layer 2, ``recover_hsdp.recovery.BucketSync`` (FSDP2 all-reduce hook)
  policy        layer 3, ``recover_hsdp.workload.WorkloadPolicy`` (roles, quotas, G)
  faults        real failure injection points (``recover_hsdp.faults``)
  outputs       metrics / events / ledger / writer election (``RunMetrics``, ``LedgerWriter``)

[Note: the step protocol] One step on a surviving rank (docs/DESIGN.md section 3):
  1. plan: the policy maps (step, alive replicas) to this replica's role and microbatch ids;
     it is computed identically everywhere from the agreed membership, so it needs no messages;
  2. compute: forward/backward of each id, FSDP gradient sync on the last one only
     (``StepWork.set_gradient_sync``); a replica-local error fails the epoch;
  3. sync: during the last backward the all-reduce hook of every FSDP unit snapshots its bucket
     and sums it across replicas under the current epoch; then (loss, tokens) of the committed
     microbatches are summed the same way;
  4. consensus: every rank agrees the epoch was clean -> commit: the trainer rescales, clips and
     steps the optimizer (``StepWork.apply_update``); ledger line, metrics record;
  5. otherwise the world shrinks (epoch + 1), ranks of dead replicas retire, the policy re-plans
     the step (promote a spare, deal extra microbatches), the extras are computed, stale buckets
     are restored from their snapshots and reduced again, and back to 4. A failure during 5
     loops again; each loop needs a new death, so it ends.
Invariant: every committed step sums exactly B microbatch gradients: the policy asserts it per
plan, and the step is measured before it commits ([Note: measured microbatches] in
recovery/buckets.py): the microbatch gradients the buckets really summed and the token positions
really computed, summed across replicas with the loss, must equal B and B x tokens per
microbatch, or the step is refused; each bucket reduced under one membership
(``BucketSync.all_current`` asserted before ``apply_update``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Protocol, Sequence

import numpy as np

from recover_hsdp.collectives.processes import ProcessInfo
from recover_hsdp.errors import one_line
from recover_hsdp.faults import ConsensusPoint, FaultInjector, Phase
from recover_hsdp.manager.between_steps import BetweenSteps
from recover_hsdp.manager.rejoin import Rejoin
from recover_hsdp.outputs import RunMetrics, backfill_jsonl
from recover_hsdp.workload import DataAssignment, DataRef, Role, StepPlan, WorkloadPolicy
from recover_hsdp.workload.ledger import LedgerWriter, plan_record


class StepWork(Protocol):
    """What the trainer does for the manager inside one step (one replica, this rank)."""

    def set_gradient_sync(self, enabled: bool) -> None:
        """FSDP gradient sync on (last microbatch) or off (accumulate locally)."""

    def forward_backward(self, data: DataRef, nominal_tokens: int,
                         before_backward: Callable[[], None]) -> tuple[float, int, int]:
        """Forward + backward of the microbatch at ``data`` (a global id, or a position in a
        stream slot), loss divided by ``nominal_tokens``; ``before_backward()`` between the two
        (a fault-injection point). Returns (that loss as a float, valid label tokens, label
        positions: tokens of the microbatch on this rank, valid or not)."""

    def apply_update(self, grad_scale: float) -> float:
        """Scale the reduced gradient by ``grad_scale`` (1.0: no-op), clip, optimizer and LR
        scheduler step. Returns the gradient norm before clipping."""


@dataclass
class _StepState:
    """What one step accumulates on this rank while the protocol runs."""

    stats: dict[int, tuple[float, int, int]] = field(default_factory=dict)  # id -> (loss,
    # valid tokens, token positions) of this rank's part
    extras_done: tuple[int, ...] = ()
    sync_time_s: float = 0.0


class RecoverManager(BetweenSteps, Rejoin):
    """Drives one ReCoVer step per call to :meth:`step`; see [Note: the step protocol].

    Args:
        world: the fault-tolerant world (``FaultTolerantWorld`` or a fake with its interface).
        bucket_sync: the ``BucketSync`` installed on this rank's FSDP model.
        policy: the workload policy (same initial state on every rank).
        faults: this rank's ``FaultInjector``.
        outputs: ``RunMetrics`` of this rank (writes only while this rank is the writer).
        out_dir: the run's output folder (ledger).
        tokens_per_microbatch: label tokens of one microbatch of one replica (D x batch x seq:
            its FSDP ranks' parts, [Note: replica layout] in config.py).
        consistency_check_interval: every this many steps compare parameter checksums across
            replicas (0: never); ``parameter_checksum`` computes this rank's.
        procs: every world rank's process (bootstrap), to end excluded ones on this host
            ([Note: nothing left behind] in ``recover_hsdp.collectives.processes``).
        die: ends this rank after a replica-local error (default: exit the process at once;
            tests pass the fake world's kill).
        counts_data: this rank's loss and token counts enter the step's totals (False on the
            tensor-parallel peers of an FSDP rank: they computed the same microbatch).
    """

    def __init__(self, *, world, bucket_sync, policy: WorkloadPolicy, faults: FaultInjector,
                 outputs: RunMetrics, out_dir: str | Path, tokens_per_microbatch: int,
                 consistency_check_interval: int = 0,
                 parameter_checksum: Callable[[], float] | None = None,
                 procs: Sequence[ProcessInfo] = (), die: Callable[[], None] | None = None,
                 counts_data: bool = True):
        self.world = world
        self.bucket_sync = bucket_sync
        self.policy = policy
        self.faults = faults
        self.outputs = outputs
        self.out_dir = Path(out_dir)
        self.tokens_per_microbatch = tokens_per_microbatch
        self.consistency_check_interval = consistency_check_interval
        self.parameter_checksum = parameter_checksum
        self.procs = list(procs)
        self.die = die or _exit_now
        self.counts_data = counts_data
        self.replica, self.shard = world.replica, world.shard
        self._ledger_records: list[dict] = []  # every rank keeps them: a new writer back-fills
        self.outputs.set_writer(self.is_writer)
        self.ledger = None
        if self.is_writer:  # the run's first writer starts the ledger afresh
            (self.out_dir / "ledger.jsonl").unlink(missing_ok=True)
            self.ledger = LedgerWriter(self.out_dir)
        self.committed_data: list[DataRef] = []  # this replica's data in the last committed step
        self._contract_checked = False
        self._current_step = 0
        self._decided_at = 0.0
        bucket_sync.on_bucket = self._bucket_fault_point
        world.on_phase = self._consensus_fault_point  # phase=consensus fires inside it
        world.on_failed = self._end_failed  # a frozen rank on this host is ended at once

    # ---------------------------------------------------------------- roles of this rank

    @property
    def is_writer(self) -> bool:
        """Rank 0's duties (metrics, events, ledger, summary) belong to shard 0 of the lowest
        surviving replica."""
        alive = self.world.alive_replicas
        return bool(alive) and self.replica == min(alive) and self.shard == 0

    @property
    def saves_checkpoints(self) -> bool:
        """DCP checkpoints are written by one replica, the writer's (every rank of it)."""
        alive = self.world.alive_replicas
        return bool(alive) and self.replica == min(alive)

    # ---------------------------------------------------------------- one step

    def step(self, step: int, work: StepWork) -> dict[str, Any]:
        """Run [Note: the step protocol] for ``step``; returns the committed step's record."""
        world, sync = self.world, self.bucket_sync
        self._current_step = step
        state = _StepState()
        plan = self.policy.plan(step - 1, world.alive_replicas)
        mine = plan.assignment(self.replica)
        nominal_tokens = plan.global_microbatches * self.tokens_per_microbatch
        sync.begin_step(contributes=mine.commits_compute)
        sync_started = self._compute(step, work, mine, mine.compute_ids, nominal_tokens, state)
        self.faults.at(step, Phase.GRAD_SYNC, bucket=len(sync.buckets),
                       buckets_total=len(sync.buckets))
        state.sync_time_s = time.perf_counter() - sync_started
        totals = self._committed_totals(mine, state)
        while True:
            if sync.error:
                self.replica_error(step, sync.error)
            result = world.consensus(not world.epoch_failed and sync.all_current())
            self._decided_at = time.time()  # wall clock: benchmarks relate it to a fault's time
            if result.retire:
                world.retire(f"step {step}")
            if result.clean:
                break
            self._end_excluded()
            plan, mine, totals = self._recover(step, work, plan, result, nominal_tokens, state)
        return self._commit(step, work, plan, totals, nominal_tokens, state)

    def _compute(self, step: int, work: StepWork, mine, ids: Sequence[int],
                 nominal_tokens: int, state: _StepState) -> float:
        """Forward/backward of ``ids`` (FSDP syncs on the last one). Returns when sync began.

        An idle replica computes one microbatch (the next of its stream, not consumed) and
        contributes zeros (its buckets must still reach the collectives). An error raised
        inside the replica (a gloo error because a peer of this replica died, an OOM) ends this
        rank: [Note: replica-local errors]."""
        data_ids = [mine.data_ref(i) for i in ids] or [mine.data_ref(mine.stream_start or 0)]
        sync_started = time.perf_counter()
        try:
            for index, data_id in enumerate(data_ids):
                last = index == len(data_ids) - 1
                work.set_gradient_sync(last)
                if last:
                    sync_started = time.perf_counter()
                self.faults.at(step, Phase.FORWARD)
                measured = work.forward_backward(
                    data_id, nominal_tokens, lambda: self.faults.at(step, Phase.BACKWARD))
                if ids:
                    state.stats[ids[index]] = measured
                self.world.heartbeat()
        except Exception as err:  # noqa: BLE001 - any error inside the replica: it leaves
            self.replica_error(step, one_line(err))
        return sync_started

    def replica_error(self, step: int, reason: str) -> NoReturn:
        """[Note: replica-local errors] An error inside a replica (forward, backward, the
        all-reduce hook, the optimizer; an OOM; a gloo error because a peer of the replica died)
        is turned into the death of this rank, like the hang watchdog turns a hang into one: a
        replica lives or dies as a unit, and a death is what every layer already handles. Its
        peers in the replica see their intra-replica collective fail at once (the kernel closes
        the dead process's sockets; a live process blocked in gloo/NCCL would hold them), take
        this path or retire at the consensus, and the other replicas go on as after any death;
        nothing they wait for is left alive. Before dying the rank writes its reason to
        ``errors/`` in the output folder (and stderr); the writer puts it in events.jsonl."""
        record = {"step": step, "replica": self.replica, "shard": self.shard,
                  "rank": self.world.world_rank, "reason": reason, "time": time.time()}
        print(f"[recover-hsdp] replica {self.replica} shard {self.shard}: error inside the "
              f"replica at step {step}, this rank leaves: {reason}", flush=True)
        try:
            folder = self.out_dir / "errors"
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"rank{self.world.world_rank}.json", "w") as handle:
                handle.write(json.dumps(record) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError:
            pass  # the reason is on stderr
        self.die()
        raise AssertionError("die() returned")

    def _replica_errors(self, replicas) -> dict[str, list[str]]:
        """Reasons the ranks of ``replicas`` wrote before leaving ([Note: replica-local errors])."""
        found: dict[str, list[str]] = {}
        for path in sorted((self.out_dir / "errors").glob("rank*.json")):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if record["replica"] in replicas:
                found.setdefault(str(record["replica"]), []).append(
                    f"rank {record['rank']} step {record['step']}: {record['reason']}")
        return found

    def _committed_totals(self, mine, state: _StepState) -> np.ndarray:
        """Global sums of (loss, valid tokens, token positions, microbatch gradients reduced,
        ranks whose buckets disagree) of the committed microbatches, all measured ([Note: measured
        microbatches]): every rank adds its buckets' count, so the sum must come to S x B
        microbatch gradients; one rank per FSDP rank adds its loss and tokens, so the positions
        must come to B x tokens per microbatch. A failed reduce returns garbage and fails the epoch
        (recomputed after the repair)."""
        local = np.zeros(8, np.float64)
        for microbatch in mine.committed_ids if self.counts_data else ():
            local[:3] += state.stats.get(microbatch, (0.0, 0, 0))  # missing: not computed
        count, agree = self.bucket_sync.reduced_microbatches()
        local[3:5] = count, not agree
        local[5:] = self.join_totals()  # ride along: [Note: rejoin at a boundary]
        self.world.allreduce_global(local)
        return local

    def _recover(self, step: int, work: StepWork, plan: StepPlan, result, nominal_tokens: int,
                 state: _StepState):
        """Re-plan the step after a shrink; compute new extras; restore + re-reduce buckets.
        A failed epoch in which nobody died (a transient MPI error) keeps the plan: every
        bucket is reduced again under the new epoch."""
        started = time.perf_counter()
        if result.dead_replicas:
            plan = self.policy.replan(plan, result.dead_replicas)
        mine = plan.assignment(self.replica)
        new_extras = mine.extra_ids[len(state.extras_done):]
        self._take_over_writer_duties()
        if new_extras:
            self.bucket_sync.begin_extras()
            self._compute(step, work, mine, new_extras, nominal_tokens, state)
            work.set_gradient_sync(True)
        state.extras_done = mine.extra_ids
        extra_s = time.perf_counter() - started
        rebuilt = self.bucket_sync.rereduce(contributes=mine.commits_compute)
        totals = self._committed_totals(mine, state)
        self.outputs.log_event({
            "step": step, "epoch": result.epoch, "dead_replicas": sorted(result.dead_replicas),
            "alive_replicas": list(result.alive_replicas), "detect_s": result.detect_s,
            "repair_s": result.repair_s, "extra_compute_s": extra_s,
            "restore_s": time.perf_counter() - started - extra_s, "rebuilt_buckets": rebuilt,
            "extra_microbatches": plan.extras_total(), "promoted": list(plan.promoted()),
            "repair_rounds": result.rounds, "decided_at": self._decided_at,
            "errors": self._replica_errors(result.dead_replicas),
            **self._unread_streams(result.dead_replicas),
        })
        return plan, mine, totals

    def _take_over_writer_duties(self) -> None:
        """The old writer died: this rank writes from now on, first what it had not written."""
        if self.ledger is None and self.is_writer:
            backfill_jsonl(self.out_dir / "ledger.jsonl", self._ledger_records,
                           lambda r: r["step"])
            self.ledger = LedgerWriter(self.out_dir)
        self.outputs.set_writer(self.is_writer)

    def _commit(self, step: int, work: StepWork, plan: StepPlan, totals: np.ndarray,
                nominal_tokens: int, state: _StepState) -> dict[str, Any]:
        assert self.bucket_sync.all_current(), "a bucket was reduced under an older epoch"
        if not self._contract_checked:  # once: [Note: FSDP2 contract] item 3
            self.bucket_sync.check_contract()
            self._contract_checked = True
        loss_sum, tokens, positions = float(totals[0]), int(totals[1]), int(totals[2])
        ranks = self.world.layout.ranks_per_replica
        reduced = totals[3] / ranks
        if reduced != plan.committed_total() or positions != nominal_tokens or totals[4]:
            raise RuntimeError(
                f"step {step}: refusing to commit: the buckets summed {reduced:g} microbatch "
                f"gradients over {positions} token positions (buckets disagree on "
                f"{int(totals[4])} ranks), the plan commits B = {plan.committed_total()} over "
                f"{nominal_tokens} ([Note: measured microbatches])")
        scale = 1.0
        if tokens and tokens != nominal_tokens:  # keep the loss normalised by committed tokens
            scale = nominal_tokens / tokens
            loss_sum *= scale
        try:
            self.faults.at(step, Phase.OPTIMIZER)
            grad_norm = work.apply_update(scale)
        except Exception as err:  # noqa: BLE001 - committed elsewhere; this replica's state is lost
            self.replica_error(step, "optimizer: " + one_line(err))
        self.policy.commit(plan)
        self.agree_join_totals(totals[5:])
        mine = plan.assignment(self.replica)
        self.committed_data = [mine.data_ref(i) for i in sorted(mine.committed_ids)]
        self._ledger_records.append(plan_record(plan, self.world.epoch))
        if self.ledger is not None:
            self.ledger.append(plan, self.world.epoch)
        interval = self.consistency_check_interval
        if interval > 0 and step % interval == 0 and self.parameter_checksum is not None:
            self._check_replicas_identical(step)
        return {
            "step": step, "loss": loss_sum, "grad_norm": float(grad_norm), "tokens": tokens,
            "alive_replicas": len(self.world.alive_replicas),
            "committed_microbatches": plan.committed_total(), "reduced_microbatches": int(reduced),
            "epoch": self.world.epoch,
            "g": plan.g, "roles": {r.value: plan.count(r) for r in Role},
            "quota": plan.assignment(self.replica).quota, "sync_time_s": state.sync_time_s,
            "snapshot_bytes_per_rank": self.bucket_sync.snapshot_bytes(),
        }

    def _check_replicas_identical(self, step: int) -> None:
        values = self.world.allgather(self.parameter_checksum())
        if values is not None and len(set(values)) != 1:
            raise RuntimeError(f"step {step}: replicas diverged: parameter checksums "
                               f"{values} for shard {self.shard}")

    def _bucket_fault_point(self, index: int, rereduce: bool) -> None:
        phase = Phase.REREDUCE if rereduce else Phase.GRAD_SYNC
        self.faults.at(self._current_step, phase, bucket=index)

    def _consensus_fault_point(self, name: str) -> None:
        self.faults.at(self._current_step, Phase.CONSENSUS, point=ConsensusPoint(name))

    # ---------------------------------------------------------------- state, end of run

    def state_dict(self) -> dict[str, Any]:
        """The workload policy (B, G, stream cursors): a restart with fewer replicas keeps B."""
        return self.policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy = WorkloadPolicy.from_state_dict(state,
                                                     alive_replicas=self.world.alive_replicas)
        unread = self.policy.orphaned_slots()
        if unread:
            self.outputs.log_event({
                "step": self.policy.step, "phase": "restart",
                "unread_streams": {str(s): cursor for s, cursor in unread.items()},
                "slots": {str(r): self.policy.slot_of(r) for r in self.policy.alive}})

    def _unread_streams(self, dead) -> dict[str, Any]:
        """[Note: stream slots] the stream slots of ``dead`` replicas stop at their cursor:
        the record of what is left unread (stream mode; nothing in exact mode)."""
        if self.policy.data_assignment is not DataAssignment.STREAM:
            return {}
        slots = {self.policy.slot_of(r) for r in dead}
        unread = self.policy.orphaned_slots(dead)
        return {"unread_streams": {str(s): unread[s] for s in sorted(slots)}}


def _exit_now() -> None:
    """A replica-local error ends the process ([Note: replica-local errors]) by SIGKILL, no
    MPI_Finalize: mpirun (PRRTE 3.0) tolerates any number of ranks killed by a signal, but ends
    the job at the second rank that exits with a non-zero status (measured: survivors orphaned)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
