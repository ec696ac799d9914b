"""RecoverManager: the ReCoVer step protocol as a component the trainer calls.

Like TorchTitan's ``FTManager`` (torchtitan/components/ft/manager.py) this is a component, not a
trainer: ``RecoverTrainer`` (``recover_hsdp.titan.trainer``) computes microbatches and applies the
optimizer; the manager decides what to compute, keeps the cross-replica sums consistent and tells
the trainer when it may update. It holds the three layers and its parts, each owning its state:

  world          layer 1, ``recover_hsdp.collectives.FaultTolerantWorld`` (a fake in tests)
  bucket_sync    layer 2, ``recover_hsdp.recovery.BucketSync`` (FSDP2 all-reduce hook)
  policy         layer 3, ``recover_hsdp.workload.WorkloadPolicy`` (roles, quotas, G)
  phases         ``PhaseHooks``: every phase announced once ([Note: phases as data]); the fault
                 injector, the profiler labels and the phase timer subscribe
  writer         ``WriterDuties``: who writes the outputs and the ledger ([Note: the writer])
  failures       ``FailureLog``: [Note: replica-local errors], the record of every repair
  processes      ``LocalProcesses``: [Note: nothing left behind]
  between_steps  ``BetweenSteps``: the checkpoint gather, [Note: the end of a run]
  certifier      ``Certifier``: [Note: certified checkpoints], saves certified, loads verified
  rejoin         ``Rejoin``: [Note: rejoin at a boundary]
  culprits       ``Culprits``: [Note: bad replicas], non-finite contributions absorbed
  audits         ``Audits``: [Note: gradient audits], a microbatch computed again by another
                 replica, a culprit settled by a third
  (divergence)   ``diverged_replicas``: [Note: divergence votes], a replica whose parameters
                 differ from a strict majority's leaves

[Note: the step protocol] One step on a surviving rank (docs/DESIGN.md section 3); ``step``
walks these phases in this order (``recover_hsdp.phases.Phase``, a profile shows each):
  1. plan: the policy maps (step, alive replicas) to this replica's role and microbatch ids;
     it is computed identically everywhere from the agreed membership, so it needs no messages;
  2. compute: forward/backward of each id, FSDP gradient sync on the last one only
     (``StepWork.set_gradient_sync``; a replica of pipeline stages runs each id as one step of
     its schedule with the stages' sync held: [Note: pipeline stages in a replica] in
     titan/pipeline.py says what the schedule owns and what the step owns); a replica-local
     error fails the epoch;
  3. grad_sync: during the last backward the all-reduce hook of every FSDP unit snapshots its
     bucket and sums it across replicas under the current epoch (on the torch data plane the
     sums are enqueued and waited for here: [Note: overlapped bucket sums]); in an audit step
     the audited microbatches are computed again ([Note: gradient audits]); then the step's
     totals (``StepTotals``: loss, tokens, the measured microbatches, the audit's signatures)
     are summed the same way;
  4. consensus: every rank agrees the epoch was clean -> commit: the trainer rescales, clips and
     steps the optimizer (``StepWork.apply_update``); ledger line, metrics record;
  5. otherwise the world shrinks (epoch + 1), ranks of dead replicas retire; repair: the policy
     re-plans the step (promote a spare, deal extra microbatches) and the extras are computed;
     rereduce: stale buckets are restored from their snapshots and reduced again, the totals
     summed again; back to 4. A failure during 5 loops again; each loop needs a new death, so
     it ends. A clean epoch whose loss or gradient norm is not finite has culprits
     ([Note: bad replicas], manager/culprits.py): they are excluded from the step, the others
     compute their microbatches as extras, every bucket is reduced again; back to 4. A
     replica whose parameter fingerprint (in the totals of 3) differs from a strict majority's
     leaves before the update ([Note: divergence votes], manager/divergence.py): a death,
     back to 4; no strict majority refuses the step. An audited pair that differs is settled
     by a third computation and its culprit excluded like a non-finite one ([Note: gradient
     audits], manager/audits.py). Each committed step feeds the replicas'
     compute seconds per microbatch to the policy ([Note: straggler quotas]).
Invariant: every committed step sums exactly B microbatch gradients: the policy asserts it per
plan, and the step is measured before it commits ([Note: measured microbatches] in
recovery/buckets.py): the microbatch gradients the buckets really summed and the token positions
really computed, summed across replicas with the loss, must equal B and B x tokens per
microbatch, or the step is refused; each bucket reduced under one membership
(``BucketSync.all_current`` asserted before ``apply_update``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import numpy as np

from recover_hsdp import handshake
from recover_hsdp.collectives.processes import ProcessInfo
from recover_hsdp.errors import one_line
from recover_hsdp.config import BadReplicas, Tiers
from recover_hsdp.faults import ConsensusPoint, FaultInjector
from recover_hsdp.manager.audits import SLOTS, Audits
from recover_hsdp.manager.between_steps import BetweenSteps
from recover_hsdp.manager.certify import Certifier
from recover_hsdp.manager.culprits import Culprits
from recover_hsdp.manager.divergence import diverged_replicas
from recover_hsdp.manager.failures import FailureLog
from recover_hsdp.manager.heap import release_free_heap
from recover_hsdp.manager.local_processes import LocalProcesses
from recover_hsdp.manager.phases import PhaseHooks, PhaseTimer
from recover_hsdp.manager.rejoin import JoinWork, Rejoin
from recover_hsdp.manager.totals import StepTotals, observe_speeds
from recover_hsdp.manager.work import StepState, StepWork
from recover_hsdp.manager.writer import WriterDuties
from recover_hsdp.outputs import RunMetrics
from recover_hsdp.phases import Phase, profiler_labels
from recover_hsdp.recovery.fingerprint import flip_bit, from_halves, halves
from recover_hsdp.status import RankStatus
from recover_hsdp.workload import DataRef, Role, WorkloadPolicy

#: The step record's ``compute_s_per_microbatch`` names this many replicas, the slowest (all of
#: them up to this many): a bounded record however large the job ([Note: a plan in O(1) per
#: step] in workload/plan.py); the straggler rule's own event names every replica it weighs.
SECONDS_SHOWN = 16


class RecoverManager:
    """Drives one ReCoVer step per call to :meth:`step`; see [Note: the step protocol].

    Args:
        world: a ``World`` (collectives/interface.py): ``FaultTolerantWorld``, or a fake.
        bucket_sync: the ``BucketSync`` installed on this rank's FSDP model.
        policy: the workload policy (same initial state on every rank).
        faults: this rank's ``FaultInjector`` (subscribed to the phase hooks).
        outputs: ``RunMetrics`` of this rank (writes only while this rank is the writer).
        out_dir: the run's output folder (ledger).
        tokens_per_microbatch: label tokens of one microbatch of one replica (D x batch x seq:
            its FSDP ranks' parts, [Note: replica layout] in config/checks.py).
        bad_replicas: the ``[recover.bad_replicas]`` section (config.BadReplicas): the culprits'
            offence limits ([Note: bad replicas]) and ``consistency_check_interval``, every this
            many steps the replicas vote on their parameter fingerprints ([Note: divergence
            votes]; ``parameter_fingerprint`` computes this rank's, an unsigned 64-bit int).
            Default: the section's defaults with the vote off (0).
        restart_point: what a refused vote names to restart from (default: the newest
            certified checkpoint).
        tiers: the ``[recover.tiers]`` section (config.Tiers): ``respawn_after_steps`` for
            :class:`Rejoin` (0: only on request) and ``emergency_checkpoint`` ([Note: emergency
            checkpoint]). Default: the section's defaults.
        procs: every world rank's process (bootstrap), to end excluded ones on this host.
        die: ends this rank after a replica-local error (default: SIGKILL itself; tests pass
            the fake world's kill).
        counts_data: this rank's loss and token counts enter the step's totals (False on the
            tensor-parallel peers of an FSDP rank: they computed the same microbatch).
        joins: the join primitives for :class:`Rejoin` (tests: the fake world's).
        status: this rank's ``RankStatus`` ([Note: rank status] in recover_hsdp/status.py): every
            phase point kept current on disk, where a hang was recorded (None: none).
        stopped_peer_s: while a guarded call waits, a process of the job on this host stopped
            this long is ended ([Note: stopped peers outside the detector] in
            collectives/processes.py; ``[recover.timeouts] detect_s``); 0: never.
    """

    def __init__(self, *, world, bucket_sync, policy: WorkloadPolicy, faults: FaultInjector,
                 outputs: RunMetrics, out_dir: str | Path, tokens_per_microbatch: int,
                 bad_replicas: BadReplicas | None = None, tiers: Tiers | None = None,
                 parameter_fingerprint: Callable[[], int] | None = None, restart_point: str = "",
                 procs: Sequence[ProcessInfo] = (), die: Callable[[], None] | None = None,
                 counts_data: bool = True, joins=None, status: RankStatus | None = None,
                 stopped_peer_s: float = 0.0):
        bad_replicas = bad_replicas or BadReplicas(consistency_check_interval=0)
        tiers = tiers or Tiers()
        self.world, self.bucket_sync, self.policy = world, bucket_sync, policy
        self.outputs, self.out_dir = outputs, Path(out_dir)
        self.tokens_per_microbatch = tokens_per_microbatch
        self.consistency_check_interval = bad_replicas.consistency_check_interval
        self.parameter_fingerprint, self.restart_point = parameter_fingerprint, restart_point
        self.counts_data = counts_data
        self.phases, self.timer = PhaseHooks(), PhaseTimer()
        self.faults = faults  # also asked for the loss a microbatch reports (mode=inf_loss)
        # every point is progress for the hang bound ([Note: a hang bound from progress] in
        # collectives/guard.py): before the injector, whose hang then starts a measured gap
        self.phases.subscribe(lambda step, phase, detail: world.heartbeat())
        self.status = status
        if status is not None:  # [Note: rank status]: before the injector, whose hang then
            self.phases.subscribe(status.point)  # shows the point it stopped at
        self.phases.subscribe(faults.on_phase)
        self.phases.open_spans_with(profiler_labels)
        self.phases.open_spans_with(self.timer)
        self.writer = WriterDuties(world, outputs, out_dir)
        self.failures = FailureLog(world, outputs, out_dir, die)
        self.processes = LocalProcesses(world, procs)
        self.processes.watch_stopped(stopped_peer_s)
        self.between_steps = BetweenSteps(world=world, writer=self.writer,
                                          failures=self.failures, processes=self.processes,
                                          phases=self.phases)
        self.certifier = Certifier(world=world, between_steps=self.between_steps,
                                   writer=self.writer)
        self.rejoin = Rejoin(world=world, writer=self.writer, outputs=outputs,
                             processes=self.processes, phases=self.phases, out_dir=out_dir,
                             checksum=parameter_fingerprint,
                             respawn_after_steps=tiers.respawn_after_steps, joins=joins)
        self.culprits = Culprits(world=world, bucket_sync=bucket_sync, outputs=outputs,
                                 initial_replicas=policy.initial_replicas, limits=bad_replicas)
        self.audits = Audits(world=world, outputs=outputs, initial_replicas=policy.initial_replicas,
                             interval=bad_replicas.audit_interval,
                             tolerance=bad_replicas.audit_tolerance)
        self._last_microbatch_s: float | None = None  # this rank's, measured (its own work)
        self.committed_data: list[DataRef] = []  # this replica's data in the last committed step
        self._contract_checked = False
        self._current_step = 0
        self._heap_epoch = world.epoch  # the epoch of the last release_free_heap()
        self._decided_at = 0.0
        self._rest_fingerprint: int | None = None  # [Note: divergence votes], at rest
        self.emergency_checkpoint = False  # [Note: emergency checkpoint]
        self._emergency_on = tiers.emergency_checkpoint
        self._emptied_hosts: set[str] = set()  # since the last emergency checkpoint
        bucket_sync.on_bucket = self._bucket_point
        world.on_phase = self._consensus_point  # the consensus's stages are points of it
        world.on_failed = self._on_failed
        if status is not None:
            world.on_hung = lambda reason: self.failures.hung(reason, status.latest)

    # ---------------------------------------------------------------- this rank

    @property
    def replica(self) -> int:
        return self.world.replica

    @property
    def shard(self) -> int:
        return self.world.shard

    @property
    def is_writer(self) -> bool:
        """[Note: the writer] (manager/writer.py)."""
        return self.writer.is_writer

    def take_emergency_checkpoint(self) -> bool:
        """[Note: emergency checkpoint] A host lost as a whole (every rank of it out of the
        world at once: a crash, a cut link) may be a failure PRRTE 3.0 does not survive: it
        ends the job when it notices the lost daemon (at once for a crashed host, not before
        ``recover.tiers.daemon_keepalive_s`` after a cut). So the step boundary after such a repair
        saves a checkpoint whatever the interval. Once the survivors agree it is complete, the
        writer tells the launcher (recover_hsdp/handshake.py) and waits for its verdict: the
        launcher asks every host of the job over its agent; a host that does not answer means
        the runtime will end the job, so the launcher ends it now and relaunches from this
        checkpoint ([Note: the relaunch tier], cli/relaunch.py): no step is redone. If every
        host answers (the host's ranks died, its daemon lives) the verdict is "go on" and the
        in-job tier carries on. True once per such repair; the same on every rank (the alive
        set and the process table are agreed)."""
        due, self.emergency_checkpoint = self.emergency_checkpoint, False
        return due

    def emergency_checkpoint_saved(self, step: int) -> None:
        """[Note: emergency checkpoint] ``step``'s emergency checkpoint is agreed complete: the
        writer tells the launcher (``handshake.write_request``), which relaunches from it at
        once if a lost host does not answer, rather than when PRRTE notices its lost daemon
        (``daemon_keepalive_s`` later: steps a relaunch would redo)."""
        hosts, self._emptied_hosts = sorted(self._emptied_hosts), set()
        if not self.writer.is_writer:
            return  # it waits for the writer in the next step's collectives
        handshake.write_request(self.out_dir, step, hosts)
        if not handshake.supervised():
            return
        # The launcher's verdict: ends the job (a host does not answer) or "go on". Waiting
        # here (everyone else waits in the next step) is what makes the relaunch redo no step.
        with self.world.watchdog_paused():
            handshake.wait_for_verdict(self.out_dir, step)

    @property
    def saves_checkpoints(self) -> bool:
        """DCP checkpoints are written by one replica, the writer's (every rank of it)."""
        return self.writer.saves_checkpoints

    # ---------------------------------------------------------------- one step

    def step(self, step: int, work: StepWork) -> dict[str, Any]:
        """Run [Note: the step protocol] for ``step``; returns the committed step's record."""
        span, self._current_step = self.phases.span, step
        self.timer.new_step()
        with span(step, Phase.PLAN):                                     # 1
            alive = self.world.alive_replicas  # agreed: a scheduled fault draws among them
            self.phases.point(step, Phase.PLAN, alive=alive)
            plan = self.policy.plan(step - 1, alive)
            state = StepState(plan, plan.global_microbatches * self.tokens_per_microbatch)
        with span(step, Phase.COMPUTE):                                  # 2 (+ 3's buckets)
            mine = plan.assignment(self.replica)
            self.bucket_sync.begin_step(contributes=mine.commits_compute)
            sync_started = self._compute(step, work, mine.compute_ids, state)
        with span(step, Phase.GRAD_SYNC):                                # 3
            self.bucket_sync.wait_sums()  # [Note: overlapped bucket sums] (buckets.py)
            buckets = len(self.bucket_sync.buckets)
            self.phases.point(step, Phase.GRAD_SYNC, bucket=buckets, buckets_total=buckets)
            state.sync_time_s = time.perf_counter() - sync_started
        state.audit_pairs = self.audits.due(step, plan)
        if state.audit_pairs:                                            # 3 (an audit step)
            with span(step, Phase.AUDIT):
                self._audit_signatures(step, work, state)
        else:
            state.audit = {}
        with span(step, Phase.GRAD_SYNC):
            self._sum_totals(state)
        while True:
            self._until_clean(step, work, state)                         # 4, 5
            with span(step, Phase.COMMIT):                               # 4 -> commit
                record = self._commit(step, work, state)
            if record is not None:
                break
            if state.audit_culprits:                 # [Note: gradient audits]
                self._absorb_culprits(step, work, state, found=state.audit_culprits)
            elif not (state.diverged or state.audit_failed):  # (their ranks left, or the
                self._absorb_culprits(step, work, state)  # third computations' reduce failed:
        record["phase_s"] = dict(self.timer.seconds)      # a death, repaired first)
        self.world.step_done(state.longest_microbatch_s)
        if self.world.epoch != self._heap_epoch:  # a repair or a join since the last time:
            self._heap_epoch = self.world.epoch   # [Note: the heap after a repair] (heap.py)
            release_free_heap()
        return record

    def _until_clean(self, step: int, work: StepWork, state: StepState) -> None:
        """Consensus; while the epoch was not clean: repair, rereduce, consensus again."""
        span = self.phases.span
        while True:
            with span(step, Phase.CONSENSUS):                            # 4
                result = self._consensus(step)
            if result.clean:
                return
            with span(step, Phase.REPAIR):                               # 5
                started = time.perf_counter()
                self._repair(step, work, result, state)
                extra_s = time.perf_counter() - started
            with span(step, Phase.REREDUCE):                             # 5
                rebuilt = self._rereduce(state)
            self.failures.log_repair(
                step, result, self.policy, extra_compute_s=extra_s,
                restore_s=time.perf_counter() - started - extra_s, rebuilt_buckets=rebuilt,
                extra_microbatches=state.plan.extras_total(),
                promoted=list(state.plan.promoted()), decided_at=self._decided_at)

    def _absorb_culprits(self, step: int, work: StepWork, state: StepState,
                         found: tuple[int, ...] = ()) -> None:
        """[Note: bad replicas] (manager/culprits.py): exclude the agreed culprits from this
        step, compute their microbatches as extras, reduce every bucket again; ``found``: an
        audit's culprits ([Note: gradient audits])."""
        state.audit_culprits = ()
        summary = state.audit
        self.culprits.absorb(step, state, self.policy, self.phases.span, self.replica_error,
                             lambda: self._compute_new_extras(step, work, state),
                             lambda: self._rereduce(state), found=found,
                             log_found=lambda counts, retiring: self.audits.log(
                                 step, summary, counts, retiring))

    def _audit_signatures(self, step: int, work: StepWork, state: StepState) -> None:
        """[Note: gradient audits] 1-2: this rank's signatures of the step's audited
        microbatches, after the step's own sync."""
        state.signatures = self.audits.signatures(
            state.audit_pairs, lambda data: self._signature(step, work, state, data))

    def _signature(self, step: int, work: StepWork, state: StepState, data) -> list[float]:
        """One audit pass of the microbatch at ``data`` on this rank: its loss (0 on a
        tensor-parallel peer: counted once) and its gradient's statistics, nothing reduced
        across replicas nor kept in ``.grad`` (``BucketSync.begin_audit``)."""
        self.phases.point(step, Phase.AUDIT, microbatch=data.index)
        try:
            work.set_gradient_sync(True)
            self.bucket_sync.begin_audit()
            measured = work.forward_backward(data, state.nominal_tokens, lambda: None,
                                             grad_factor=self.faults.gradient_factor(step))
            statistics = self.bucket_sync.end_audit()
            (loss, _, _), = work.measures([measured])
        except Exception as err:  # noqa: BLE001 - any error inside the replica: it leaves
            self.replica_error(step, one_line(err))
        self.world.heartbeat()
        return [loss if self.counts_data else 0.0, *statistics]

    def _compute(self, step: int, work: StepWork, ids: Sequence[int], state: StepState) -> float:
        """Forward/backward of ``ids`` (FSDP syncs on the last one). Returns when sync began.

        An idle replica computes one microbatch (the next of its stream, not consumed) and
        contributes zeros (its buckets must still reach the collectives). An error raised
        inside the replica (a gloo error because a peer of this replica died, an OOM) ends this
        rank: [Note: replica-local errors]."""
        mine = state.plan.assignment(self.replica)
        data_ids = [mine.data_ref(i) for i in ids] or [mine.data_ref(mine.stream_start or 0)]
        point = self.phases.point
        sync_started = started = time.perf_counter()
        pending: list[tuple[int | None, tuple]] = []  # (microbatch id, what the work measured)
        try:
            for index, data_id in enumerate(data_ids):
                last = index == len(data_ids) - 1
                work.set_gradient_sync(last)
                microbatch_started = time.perf_counter()
                waited = self.bucket_sync.reduce_s
                if last:
                    sync_started = microbatch_started
                point(step, Phase.FORWARD, last_microbatch_s=self._last_microbatch_s,
                      microbatch=ids[index] if ids else None)
                pending.append((ids[index] if ids else None, work.forward_backward(
                    data_id, state.nominal_tokens, lambda: point(step, Phase.BACKWARD),
                    grad_factor=self.faults.gradient_factor(step))))
                self.world.heartbeat()
                # the microbatch's own work, less its waits in the cross-replica reduces
                self._last_microbatch_s = (time.perf_counter() - microbatch_started
                                           - (self.bucket_sync.reduce_s - waited))
                state.longest_microbatch_s = max(state.longest_microbatch_s,
                                                 self._last_microbatch_s)
            # read once per step, not per microbatch (on a GPU each read is a host sync)
            for (microbatch, _), (loss, *counts) in zip(pending, work.measures(
                    [measured for _, measured in pending])):
                loss = self.faults.loss_of(step, loss)
                if microbatch is not None:
                    state.stats[microbatch] = (loss, *counts)
        except Exception as err:  # noqa: BLE001 - any error inside the replica: it leaves
            self.replica_error(step, one_line(err))
        if not self.bucket_sync.collecting_extras:  # [Note: straggler quotas]: the compute
            busy = time.perf_counter() - started - self.bucket_sync.reduce_s  # less the waits
            state.compute_s = max(busy, 0.0) / len(data_ids)                 # for the others
        return sync_started

    def _on_failed(self, ranks: list[int]) -> None:
        """A failed MPI call named failed ``ranks``: frozen ones on this host are ended at once
        ([Note: nothing left behind]); one of this replica makes this rank leave now, before
        it blocks in its next intra-replica collective ([Note: a replica leaves as a unit])."""
        self.processes.end_failed(ranks)
        size = self.world.layout.ranks_per_replica
        mine = [r for r in ranks if r // size == self.replica and r != self.world.world_rank]
        if mine:
            self.replica_error(self._current_step, f"rank {mine[0]} of this replica failed "
                                                   "(reported by MPI)")

    def replica_error(self, step: int, reason: str) -> NoReturn:
        """[Note: replica-local errors] (manager/failures.py): this rank leaves."""
        self.failures.leave(step, reason)

    def _sum_totals(self, state: StepState) -> None:
        """``StepTotals`` of the committed microbatches, summed over every rank, all measured
        ([Note: measured microbatches]): every rank adds its buckets' count, so the sum must
        come to S x B microbatch gradients; one rank per FSDP rank adds its loss and tokens, so
        the positions must come to B x tokens per microbatch. A failed reduce returns garbage
        and fails the epoch (summed again after the repair)."""
        totals = StepTotals()
        mine = state.plan.assignment(self.replica)
        for microbatch in mine.committed_ids if self.counts_data else ():
            totals.add_microbatch(*state.stats.get(microbatch, (0.0, 0, 0)))  # missing: not
        count, agree = self.bucket_sync.reduced_microbatches()           # computed
        totals.reduced, totals.disagree = count, float(not agree)
        totals.join_requests, totals.join_ready, totals.join_failed = self.rejoin.totals()
        width = self.policy.initial_replicas  # [Note: straggler quotas]: a replica's mean
        totals.compute_s = np.zeros(width)
        totals.compute_s[self.replica] = state.compute_s / self.world.layout.ranks_per_replica
        totals.fingerprints = np.zeros(2 * width)  # [Note: divergence votes]
        if self._fingerprint(state) is not None:
            totals.fingerprints[2 * self.replica:2 * self.replica + 2] = halves(state.fingerprint)
        if self.audits.interval > 0:  # [Note: gradient audits]
            totals.signatures = (np.asarray(state.signatures, np.float64)
                                 if state.signatures is not None else np.zeros(SLOTS * width))
        values = totals.to_array()  # rejoin's counts ride along: [Note: rejoin at a boundary]
        self.world.allreduce_global(values)
        state.totals = StepTotals.from_array(values, width)

    def _consensus(self, step: int):
        """Was the epoch clean everywhere? A rank whose replica lost a rank retires."""
        sync = self.bucket_sync
        if sync.error:
            self.replica_error(step, sync.error)
        result = self.world.consensus(not self.world.epoch_failed and sync.all_current())
        self._decided_at = time.time()  # wall clock: benchmarks relate it to a fault's time
        if result.retire:
            self.world.retire(f"step {step}")
        if not result.clean:
            self.processes.end_excluded()
        return result

    def _repair(self, step: int, work: StepWork, result, state: StepState) -> None:
        """Re-plan the step after a shrink and compute the new extras. A failed epoch in which
        nobody died (a transient MPI error) keeps the plan: every bucket is reduced again."""
        if result.dead_replicas:
            state.plan = self.policy.replan(state.plan, result.dead_replicas)
            emptied = self.processes.hosts_emptied()  # [Note: emergency checkpoint]
            self.emergency_checkpoint |= self._emergency_on and bool(emptied)
            self._emptied_hosts |= emptied if self._emergency_on else set()
        self.writer.refresh()
        self._compute_new_extras(step, work, state)

    def _compute_new_extras(self, step: int, work: StepWork, state: StepState) -> None:
        """Compute the extras the plan gave this replica since the last call."""
        mine = state.plan.assignment(self.replica)
        new_extras = mine.extra_ids[len(state.extras_done):]
        if new_extras:
            self.bucket_sync.begin_extras()
            self._compute(step, work, new_extras, state)
            work.set_gradient_sync(True)
        state.extras_done = mine.extra_ids

    def _rereduce(self, state: StepState) -> int:
        """Restore the stale buckets from their snapshots, reduce them again, sum the totals
        again. Returns how many buckets were rebuilt."""
        mine = state.plan.assignment(self.replica)
        rebuilt = self.bucket_sync.rereduce(contributes=mine.commits_compute)
        self._sum_totals(state)
        return rebuilt

    def _commit(self, step: int, work: StepWork, state: StepState) -> dict[str, Any] | None:
        """The epoch was clean: check what was measured, update, record. None: the loss or the
        gradient norm is not finite, nothing was updated ([Note: bad replicas])."""
        plan, totals, sync = state.plan, state.totals, self.bucket_sync
        assert sync.all_current(), "a bucket was reduced under an older epoch"
        if not self._contract_checked:  # once: [Note: FSDP2 contract] item 3
            sync.check_contract()
            self._contract_checked = True
        reduced = totals.check_measured(step, plan.committed_total(),
                                        self.world.layout.ranks_per_replica, state.nominal_tokens)
        state.diverged = self._diverged(step, totals)
        if state.diverged or not math.isfinite(totals.loss) or not self._audited(step, work,
                                                                                   state):
            return None
        loss_sum, tokens = totals.loss, int(totals.tokens)
        scale = 1.0
        if tokens and tokens != state.nominal_tokens:  # normalise by the committed tokens
            scale = state.nominal_tokens / tokens
            loss_sum *= scale
        try:
            self.phases.point(step, Phase.OPTIMIZER)
            grad_norm = work.apply_update(scale)
        except Exception as err:  # noqa: BLE001 - committed elsewhere; this replica's state is lost
            self.replica_error(step, "optimizer: " + one_line(err))
        if not math.isfinite(grad_norm):
            return None
        self._after_update(step, work)
        self.policy.commit(plan)
        observe_speeds(self.policy, self.outputs, step, plan, totals.compute_s)
        self.rejoin.agree_totals(totals.join_requests, totals.join_ready, totals.join_failed)
        mine = plan.assignment(self.replica)
        self.committed_data = [mine.data_ref(i) for i in sorted(mine.committed_ids)]
        self.writer.record_commit(plan, self.world.epoch)
        audit = {k: v for k, v in (state.audit or {}).items() if k != "differ"}
        return {
            "step": step, "loss": loss_sum, "grad_norm": float(grad_norm), "tokens": tokens,
            **({"audit": audit} if audit else {}),
            "alive_replicas": len(self.world.alive_replicas),
            "committed_microbatches": plan.committed_total(), "reduced_microbatches": reduced,
            "epoch": self.world.epoch,
            "g": plan.g, "roles": {r.value: plan.count(r) for r in Role},
            "quota": mine.quota, "sync_time_s": state.sync_time_s,
            "compute_s_per_microbatch": totals.slowest(SECONDS_SHOWN),
            "snapshot_bytes_per_rank": sync.snapshot_bytes(),
        }

    def _audited(self, step: int, work: StepWork, state: StepState) -> bool:
        """[Note: gradient audits] 3: True when the step may go on to its update (no audit,
        or every pair agrees, or its culprits were already absorbed); False with
        ``state.audit_culprits`` set (to be excluded), or with ``state.audit_failed`` (the
        third computations' reduce failed: the consensus repairs first)."""
        state.audit_failed = False
        if state.audit is not None:
            return True
        found = self.audits.verdict(step, state.plan, state.audit_pairs, state.totals.signatures,
                                    lambda data: self._signature(step, work, state, data))
        if found is None:
            state.audit_failed = True
            return False
        state.audit_culprits, state.audit = found
        return not state.audit_culprits

    def _after_update(self, step: int, work: StepWork) -> None:
        """Right after the update: the fingerprint this rank's next vote must find again if
        nothing changed its parameters at rest ([Note: divergence votes]); the fault points
        around it (``mode=update_bitflip`` before it, ``mode=bitflip`` after it)."""
        flip = lambda element, bit: flip_bit(work.parameter_shards(), element, bit)  # noqa: E731
        self.phases.point(step, Phase.OPTIMIZER, updated=flip, inside_update=True)
        if self._votes_at(step + 1):
            self._rest_fingerprint = self.parameter_fingerprint()
        self.phases.point(step, Phase.OPTIMIZER, updated=flip)

    def _votes_at(self, step: int) -> bool:
        interval = self.consistency_check_interval
        return self.parameter_fingerprint is not None and interval > 0 and step % interval == 0

    def _fingerprint(self, state: StepState) -> int | None:
        """This rank's parameter fingerprint for the step's vote, taken once per voting step
        (before the update; a rereduce sums it again): [Note: divergence votes]. Parameters
        that differ from this rank's own fingerprint right after its last update changed at
        rest (a flipped bit in memory): this rank leaves at once, no vote needed."""
        if state.fingerprint is None and self._votes_at(self._current_step):
            state.fingerprint = self.parameter_fingerprint()
            rest, self._rest_fingerprint = self._rest_fingerprint, None
            if rest is not None and rest != state.fingerprint:
                self.replica_error(self._current_step, f"diverged: this rank's parameters changed "
                                   f"at rest since its own update (fingerprint {rest:016x} -> "
                                   f"{state.fingerprint:016x}) ([Note: divergence votes])")
        return state.fingerprint

    def _diverged(self, step: int, totals: StepTotals) -> tuple[int, ...]:
        """[Note: divergence votes]: the replicas that differ from a strict majority (their
        ranks leave here; the others return them and the consensus sees a death); no strict
        majority raises ``NoMajority``."""
        alive = self.world.alive_replicas
        if not totals.fingerprints.any() or totals.fingerprints_agree(alive):
            return ()
        votes = {r: from_halves(*totals.replica_fingerprint(r))
                 for r in alive}
        diverged = diverged_replicas(step, votes, self.restart_point)
        if not diverged:
            return ()
        self.outputs.log_event({
            "step": step, "phase": "diverged", "epoch": self.world.epoch,
            "fingerprints": {str(r): f"{v:016x}" for r, v in sorted(votes.items())},
            "diverged": list(diverged),
            "action": "the diverged replicas leave before the update; the step is re-planned "
                      "without them and every bucket reduced again"})
        if self.replica in diverged:
            self.replica_error(step, f"diverged: this replica's parameter fingerprint "
                                     f"{votes[self.replica]:016x} differs from a strict "
                                     "majority's ([Note: divergence votes])")
        return diverged

    def _bucket_point(self, index: int, rereduce: bool) -> None:
        phase = Phase.REREDUCE if rereduce else Phase.GRAD_SYNC
        bucket = self.bucket_sync.buckets[index]  # a mode=nan fault poisons it (and its snapshot)
        self.phases.point(self._current_step, phase, bucket=index,
                          buckets_total=len(self.bucket_sync.units),
                          tensors=(bucket.tensor, bucket.snapshot))

    def _consensus_point(self, name: str) -> None:
        self.phases.point(self._current_step, Phase.CONSENSUS, point=ConsensusPoint(name))

    # ---------------------------------------------------------------- between steps

    def checkpoint_point(self, step: int) -> None:
        """Inside a checkpoint save of ``step`` (``phase=checkpoint`` fires here)."""
        self.phases.point(step, Phase.CHECKPOINT)

    def gather_for_checkpoint(self, local: Any) -> dict[int, Any]:
        """``BetweenSteps.gather_for_checkpoint`` after the current step."""
        return self.between_steps.gather_for_checkpoint(local, self._current_step, self.policy)

    def gather_global(self, local: Any, phase: str) -> list[Any]:
        """``BetweenSteps.gather_global`` after the current step: every alive rank's
        ``local``, agreed (e.g. a host-memory generation written or loaded everywhere:
        [Note: host-memory state] in recovery/host_state.py)."""
        return self.between_steps.gather_global(local, phase, self._current_step, self.policy)

    def share_state(self, has: bool, read: Callable[[], bytes]) -> tuple[Any, list[int]]:
        """``BetweenSteps.share_state`` after the current step: a host-memory generation from
        a rank that holds it to the ranks of its shard position that do not ([Note: host-memory
        state] in recovery/host_state.py)."""
        return self.between_steps.share_state(has, read, self._current_step, self.policy)

    def save_checkpoint(self, step: int, save: Callable[[], str | None]) -> bool:
        """``BetweenSteps.save_checkpoint``: [Note: a checkpoint the survivors agree on]."""
        return self.between_steps.save_checkpoint(save, step, self.policy)

    def certify_checkpoint(self, step: int, folder: str | Path, restart_point: bool,
                           fingerprint: Callable[[], int]) -> bool:
        """``Certifier.certify``: [Note: certified checkpoints] (recover_hsdp/certificates.py)."""
        return self.certifier.certify(step, folder, restart_point, fingerprint, self.policy,
                                      self.replica_error)

    def verify_checkpoint(self, step: int, folder: str | Path, fingerprint: int | None,
                          error: str = "") -> str | None:
        """``Certifier.verify``: None when every replica loaded the certified state."""
        return self.certifier.verify(step, folder, fingerprint, error, self.policy)

    def maybe_admit(self, step: int, work: JoinWork) -> None:
        """Survivors, before ``step``: [Note: rejoin at a boundary]."""
        self.rejoin.maybe_admit(step, work, self.policy)

    def join_as_newcomer(self, work: JoinWork) -> int:
        """A spawned rank: join the survivors; returns the step they are about to run."""
        step, self.policy = self.rejoin.join_as_newcomer(work)
        return step

    def finish_run(self, write_outputs: Callable[[], None]) -> None:
        """[Note: the end of a run] (manager/between_steps.py); newcomers still starting are
        told to exit first."""
        self.rejoin.abandon(self._current_step)
        self.between_steps.finish_run(write_outputs, self._current_step, self.policy)
        if self.status is not None:
            self.status.close()

    def close(self) -> None:
        """Without ``finish_run`` (a run that failed): close the ledger, then the world's last
        fault-tolerant agreement."""
        self.writer.close()
        if self.status is not None:
            self.status.close()
        self.world.finish()

    # ---------------------------------------------------------------- state

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
