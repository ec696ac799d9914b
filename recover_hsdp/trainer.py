"""RecoverTrainer: TorchTitan's Trainer, kept alive through replica deaths.

Selected by ``[recover] enable = true`` and launched by mpirun (one rank per device). With
``enable = false`` it is stock TorchTitan (it only adds ``metrics.jsonl``/``summary.json``).

One step on a surviving rank (DESIGN.md section 3):
  1. plan: the workload policy gives this replica its role and microbatch ids (no messages);
  2. compute: forward/backward of each microbatch, FSDP gradient sync on the last one only;
  3. sync: the all-reduce hook of every FSDP unit snapshots its bucket and sums it across
     replicas under the current epoch (:class:`recover_hsdp.recovery.BucketSync`);
  4. consensus: all ranks agree the epoch was clean; then clip, optimizer step, ledger, metrics;
  5. otherwise the collectives layer shrinks the world (epoch + 1), ranks of dead replicas
     retire, the policy re-plans the step (promoted spares, extra microbatches), stale buckets
     are restored from their snapshots and reduced again, and back to 4.
Invariant: every committed step sums exactly B microbatch gradients (asserted by the policy and
the ledger), each bucket reduced under one membership (asserted before the optimizer step).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.train import Trainer

from recover_hsdp.config import microbatches_per_replica, validate
from recover_hsdp.faults import Phase, build_injector
from recover_hsdp.ledger import plan_record
from recover_hsdp.metrics import RunMetrics
from recover_hsdp.workload import Role


class RecoverTrainer(Trainer):
    """TorchTitan Trainer whose data-parallel replicas talk over fault-tolerant MPI."""

    def __init__(self, job_config):
        self.recover_config = job_config.recover
        self.replica_world = None
        if self.recover_config.enable:
            from recover_hsdp.bootstrap import bootstrap_replica
            from recover_hsdp.collectives import MPI

            validate(job_config, world_size=MPI.COMM_WORLD.Get_size())
            self.replica_world = bootstrap_replica(
                self.recover_config.ranks_per_replica, job_config.comm.init_timeout_seconds)
        super().__init__(job_config)
        mode = "recover" if self.recover_config.enable else "stock"
        if self.recover_config.enable:
            self._init_resilience()
            writer = self._is_writer()
        else:
            writer = dist.get_rank() == 0
            self.metrics_processor.should_log = lambda step: True
        self.run_metrics = RunMetrics(job_config.job.dump_folder, is_writer=writer, mode=mode)
        if self.recover_config.enable:
            self.ledger = self._open_ledger(writer)
            self._ledger_records: list[dict] = []  # every rank: what the writer appends
        self._last_loss = None
        self._wrap_metrics_log()

    # ---------------------------------------------------------------- process model

    def init_distributed(self) -> ParallelDims:
        if not self.recover_config.enable:
            return super().init_distributed()
        layout = self.replica_world.layout
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, store=self.replica_world.store, rank=layout.shard,
            world_size=layout.ranks_per_replica,
            timeout=timedelta(seconds=self.job_config.comm.init_timeout_seconds))
        parallelism = self.job_config.parallelism
        parallelism.data_parallel_replicate_degree = 1
        parallelism.data_parallel_shard_degree = layout.ranks_per_replica
        return ParallelDims(dp_shard=layout.ranks_per_replica, dp_replicate=1, cp=1, tp=1, pp=1,
                            ep=1, etp=1, world_size=layout.ranks_per_replica)

    def _init_resilience(self) -> None:
        from recover_hsdp.collectives import MPI, Deadlines, FaultTolerantWorld
        from recover_hsdp.recovery import BucketSync
        from recover_hsdp.workload import WorkloadPolicy

        rc, training = self.recover_config, self.job_config.training
        layout = self.replica_world.layout
        hang = rc.hang_timeout_s
        self.world = FaultTolerantWorld(
            MPI.COMM_WORLD, layout.ranks_per_replica,
            Deadlines(call_s=2 * hang + 30, repair_s=3 * hang + 30, hang_timeout_s=hang,
                      retire_grace_s=min(2.0, hang / 4)))
        self.replica, self.shard = layout.replica, layout.shard
        g = microbatches_per_replica(training.local_batch_size, training.global_batch_size,
                                     layout.replicas * layout.ranks_per_replica)
        self.policy = WorkloadPolicy(initial_replicas=layout.replicas, microbatches_per_replica=g,
                                     keep_spares=rc.keep_spares,
                                     data_assignment=rc.data_assignment, g_raise=rc.g_raise)
        self.tokens_per_microbatch = (layout.ranks_per_replica * training.local_batch_size
                                      * training.seq_len)
        self.bucket_sync = BucketSync(self.model_parts[0], self.world, rc.host_snapshots,
                                      on_bucket=self._bucket_fault_point)
        self.faults = build_injector(rc.faults, layout.replicas, self.replica, self.shard,
                                     self.job_config.job.dump_folder)
        self._wrap_checkpoint_save()

    def _is_writer(self) -> bool:
        """Rank 0's duties belong to the lowest surviving rank."""
        return self.replica == min(self.world.alive_replicas) and self.shard == 0

    def _open_ledger(self, writer: bool):
        from recover_hsdp.ledger import LedgerWriter

        return LedgerWriter(self.job_config.job.dump_folder) if writer else None

    # ---------------------------------------------------------------- one step

    def train_step(self, data_iterator):
        started = time.perf_counter()
        if self.recover_config.enable:
            record = self._resilient_step()
        else:
            super().train_step(data_iterator)
            record = self._stock_record()
        record["step_time_s"] = time.perf_counter() - started
        alive_ranks = record["alive_replicas"] * max(1, self.recover_config.ranks_per_replica)
        record["tokens_per_s_per_rank"] = record["tokens"] / record["step_time_s"] / alive_ranks
        self.run_metrics.log_step(record)
        if self.recover_config.enable and self.run_metrics.is_writer:
            self._log_torchtitan_metrics(record, alive_ranks)

    def _log_torchtitan_metrics(self, record: dict, alive_ranks: int) -> None:
        """Console/TensorBoard/W&B through TorchTitan's own metrics processor (writer only)."""
        processor = self.metrics_processor
        processor.ntokens_since_last_log += record["tokens"] // alive_ranks
        processor.data_loading_times.append(0.0)
        processor.log(self.step, record["loss"], record["loss"], record["grad_norm"],
                      extra_metrics={"recover/alive_replicas": record["alive_replicas"],
                                     "recover/epoch": record["epoch"],
                                     "recover/committed_microbatches":
                                         record["committed_microbatches"],
                                     "recover/sync_time_s": record["sync_time_s"]})

    def _stock_record(self) -> dict:
        training, parallelism = self.job_config.training, self.job_config.parallelism
        accumulation = self.gradient_accumulation_steps
        return {
            "step": self.step, "loss": self._last_loss,
            "tokens": training.local_batch_size * training.seq_len * dist.get_world_size()
            * accumulation,
            "alive_replicas": parallelism.data_parallel_replicate_degree,
            "committed_microbatches": accumulation * parallelism.data_parallel_replicate_degree,
        }

    def _resilient_step(self) -> dict:
        world, sync = self.world, self.bucket_sync
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        plan = self.policy.plan(self.step - 1, world.alive_replicas)
        mine = plan.assignment(self.replica)
        nominal_tokens = plan.global_microbatches * self.tokens_per_microbatch
        self._stats = {}  # microbatch id -> (local loss sum / nominal tokens, valid tokens)
        sync.begin_step(contributes=mine.commits_compute)
        sync_started = self._compute(mine.compute_ids, mine.replica, nominal_tokens)
        self.faults.at(self.step, Phase.GRAD_SYNC, bucket=len(sync.buckets),
                       buckets_total=len(sync.buckets))
        sync_time = time.perf_counter() - sync_started
        totals = self._committed_totals(mine)
        done_extras: tuple[int, ...] = ()
        while True:
            self.faults.at(self.step, Phase.CONSENSUS)
            result = world.consensus(not world.epoch_failed and sync.all_current())
            if result.retire:
                world.retire(f"step {self.step}")
            if result.clean:
                break
            plan, mine, done_extras, totals = self._recover(plan, result, done_extras,
                                                            nominal_tokens)
        return self._commit(plan, totals, nominal_tokens, lr, sync_time)

    def _compute(self, ids, replica, nominal_tokens: int) -> float:
        """Forward/backward of ``ids`` (FSDP syncs on the last one). Returns when sync began.
        A gloo error (a peer of this replica died) marks the epoch failed; this rank's replica
        then retires at the consensus."""
        model = self.model_parts[0]
        data_ids = [self._data_id(replica, i) for i in ids] or [0]  # idle: compute, contribute 0
        sync_started = time.perf_counter()
        try:
            for index, data_id in enumerate(data_ids):
                last = index == len(data_ids) - 1
                model.set_requires_gradient_sync(last)
                if last:
                    sync_started = time.perf_counter()
                self._forward_backward(ids[index] if ids else None, data_id, nominal_tokens)
                self.world.heartbeat()
        except RuntimeError as err:
            self.world.fail_epoch(f"replica-local error: {str(err).splitlines()[0][:120]}")
        return sync_started

    def _forward_backward(self, microbatch, data_id: int, nominal_tokens: int) -> None:
        input_dict, labels = self.dataloader.batch(data_id)
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
            {k: v.to(self.device) for k, v in input_dict.items()}, labels.to(self.device))
        self.faults.at(self.step, Phase.FORWARD)
        with self.train_context(), self.maybe_enable_amp:
            pred = self.model_parts[0](inputs, **extra_inputs, **extra_kwargs)
            loss = self.loss_fn(pred, labels) / nominal_tokens
        del pred
        self.faults.at(self.step, Phase.BACKWARD)
        loss.backward()
        if microbatch is not None:
            self._stats[microbatch] = (float(loss.detach()),
                                       int((labels != IGNORE_INDEX).sum()))

    def _data_id(self, replica: int, microbatch: int) -> int:
        """Dataset microbatch id: global ids in exact mode; in stream mode replica r's shard of
        the endless stream is ids r, r + W_init, r + 2 W_init, ..."""
        if self.recover_config.data_assignment == "exact":
            return microbatch
        return microbatch * self.policy.initial_replicas + replica

    def _committed_totals(self, mine) -> np.ndarray:
        """Global (loss, valid tokens) of the committed microbatches; a failed reduce returns
        garbage and fails the epoch (recomputed after the repair)."""
        local = np.zeros(2, np.float64)
        for microbatch in mine.committed_ids:
            loss, tokens = self._stats.get(microbatch, (0.0, 0))
            local += (loss, tokens)
        self.world.allreduce_global(local)
        return local

    def _recover(self, plan, result, done_extras, nominal_tokens):
        """Re-plan the step after a shrink; compute new extras; restore + re-reduce buckets."""
        started = time.perf_counter()
        plan = self.policy.replan(plan, result.dead_replicas)
        mine = plan.assignment(self.replica)
        new_extras = mine.extra_ids[len(done_extras):]
        if self.ledger is None and self._is_writer():  # the old writer died: take over
            from recover_hsdp.metrics import backfill_jsonl

            backfill_jsonl(Path(self.job_config.job.dump_folder) / "ledger.jsonl",
                           self._ledger_records, lambda r: r["step"])
            self.ledger = self._open_ledger(True)
        self.run_metrics.set_writer(self._is_writer())
        if new_extras:
            self.bucket_sync.begin_extras()
            self._compute(new_extras, self.replica, nominal_tokens)
            self.model_parts[0].set_requires_gradient_sync(True)
        extra_s = time.perf_counter() - started
        rebuilt = self.bucket_sync.rereduce(contributes=mine.commits_compute)
        totals = self._committed_totals(mine)
        self.run_metrics.log_event({
            "step": self.step, "epoch": result.epoch, "dead_replicas": sorted(result.dead_replicas),
            "alive_replicas": list(result.alive_replicas), "detect_s": result.detect_s,
            "repair_s": result.repair_s, "extra_compute_s": extra_s,
            "restore_s": time.perf_counter() - started - extra_s, "rebuilt_buckets": rebuilt,
            "extra_microbatches": plan.extras_total(), "promoted": list(plan.promoted()),
            "repair_rounds": result.rounds,
        })
        return plan, mine, mine.extra_ids, totals

    def _commit(self, plan, totals, nominal_tokens: int, lr: float, sync_time: float) -> dict:
        assert self.bucket_sync.all_current(), "a bucket was reduced under an older epoch"
        loss_sum, tokens = float(totals[0]), int(totals[1])
        if tokens and tokens != nominal_tokens:  # keep the loss normalised by committed tokens
            scale = nominal_tokens / tokens
            for param in self.model_parts[0].parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)
            loss_sum *= scale
        if str(self.step) in self.recover_config.dump_step_gradients.split(","):
            self._dump_step_gradients()
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm, foreach=True)
        self.faults.at(self.step, Phase.OPTIMIZER)
        self.optimizers.step()
        self.lr_schedulers.step()
        self.policy.commit(plan)
        self._ledger_records.append(plan_record(plan, self.world.epoch))
        if self.ledger is not None:
            self.ledger.append(plan, self.world.epoch)
        self.ntokens_seen += tokens
        interval = self.recover_config.consistency_check_interval
        if interval > 0 and self.step % interval == 0:
            self._check_replicas_identical()
        return {
            "step": self.step, "loss": loss_sum, "lr": lr, "grad_norm": float(grad_norm),
            "tokens": tokens, "alive_replicas": len(self.world.alive_replicas),
            "committed_microbatches": plan.committed_total(), "epoch": self.world.epoch,
            "g": plan.g, "roles": {r.value: plan.count(r) for r in Role},
            "quota": plan.assignment(self.replica).quota, "sync_time_s": sync_time,
            "snapshot_bytes_per_rank": self.bucket_sync.snapshot_bytes(),
        }

    def _check_replicas_identical(self) -> None:
        from recover_hsdp.recovery import local_parameter_checksum

        values = self.world.allgather(local_parameter_checksum(self.model_parts[0]))
        if values is not None and len(set(values)) != 1:
            raise RuntimeError(f"step {self.step}: replicas diverged: parameter checksums "
                               f"{values} for shard {self.shard}")

    def _bucket_fault_point(self, index: int, rereduce: bool) -> None:
        phase = Phase.REREDUCE if rereduce else Phase.GRAD_SYNC
        self.faults.at(self.step, phase, bucket=index)

    # ---------------------------------------------------------------- outputs, checkpoints

    def _wrap_metrics_log(self) -> None:
        original = self.metrics_processor.log

        def log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            self._last_loss = float(global_avg_loss)
            return original(step, global_avg_loss, global_max_loss, grad_norm,
                            extra_metrics=extra_metrics)

        self.metrics_processor.log = log

    def _wrap_checkpoint_save(self) -> None:
        """DCP checkpoints are saved by one replica: the writer's (lowest surviving)."""
        original = self.checkpointer.save

        def save(curr_step, last_step=False):
            if self.replica == min(self.world.alive_replicas):
                with self.world.watchdog_paused():
                    original(curr_step, last_step=last_step)

        self.checkpointer.save = save

    def state_dict(self):
        """Checkpointed train state; on the MPI path it carries the workload policy (B, G,
        stream cursors) so that a restart with fewer replicas keeps the same B."""
        state = super().state_dict()
        if self.recover_config.enable:
            state["workload"] = json.dumps(self.policy.state_dict())
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if self.recover_config.enable and "workload" in state_dict:
            from recover_hsdp.workload import WorkloadPolicy

            self.policy = WorkloadPolicy.from_state_dict(json.loads(state_dict["workload"]),
                                                         alive_replicas=self.world.alive_replicas)

    def _full_tensors(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded parameters (or gradients): a collective inside the replica's torch world."""
        full = {}
        for name, param in self.model_parts[0].named_parameters():
            tensor = param.grad if grads else param
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            full[name] = tensor.detach().to("cpu", torch.float32).clone()
        return full

    def _dump_step_gradients(self) -> None:
        params, grads = self._full_tensors(), self._full_tensors(grads=True)
        if self.run_metrics.is_writer:
            torch.save({"params": params, "grads": grads},
                       f"{self.job_config.job.dump_folder}/grads_step{self.step}.pt")

    def _save_final_params(self) -> None:
        full = self._full_tensors()
        if self.run_metrics.is_writer:
            torch.save(full, f"{self.job_config.job.dump_folder}/final_params.pt")

    def train(self):
        super().train()
        self._completed = True

    def close(self) -> None:
        if hasattr(self, "run_metrics"):
            if self.recover_config.save_final_params:
                self._save_final_params()
            alive = (len(self.world.alive_replicas) if self.recover_config.enable
                     else self.job_config.parallelism.data_parallel_replicate_degree)
            summary = self.run_metrics.write_summary(
                {"alive_replicas": alive, "completed": getattr(self, "_completed", False)})
            if self.run_metrics.is_writer:
                print(f"[recover-hsdp] summary: {summary}", flush=True)
        if getattr(self, "ledger", None) is not None:
            self.ledger.close()
        if self.recover_config.enable and hasattr(self, "world"):
            self.world.finish()  # fault-tolerant last agreement, then linger, then exit
        super().close()
