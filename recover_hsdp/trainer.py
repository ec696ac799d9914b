"""RecoverTrainer: TorchTitan's Trainer with the cross-replica reduce done through MPI.

Selected by ``[recover] enable = true`` and launched by mpirun (one rank per device). With
``enable = false`` it is stock TorchTitan (it only adds ``metrics.jsonl``/``summary.json``).

One step on the MPI path (DESIGN.md section 3):
  1. plan: the microbatch ids this replica computes (failure-free: ``t*B + r*G + g``);
  2. compute: forward/backward of each microbatch, FSDP gradient sync on the last one only;
  3. sync: FSDP reduce-scatters inside the replica and calls the all-reduce hook of every FSDP
     unit, which sums the bucket across replicas over MPI (:mod:`recover_hsdp.recovery`);
  4. clip, optimizer step, metrics.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.train import Trainer

from recover_hsdp.config import validate
from recover_hsdp.data import microbatches_per_replica
from recover_hsdp.metrics import RunMetrics


class RecoverTrainer(Trainer):
    """TorchTitan Trainer whose data-parallel replicas talk over (fault-tolerant) MPI."""

    def __init__(self, job_config):
        self.recover_config = job_config.recover
        self.replica_world = None
        if self.recover_config.enable:
            from recover_hsdp.bootstrap import bootstrap_replica
            from recover_hsdp.mpi_env import MPI

            validate(job_config, world_size=MPI.COMM_WORLD.Get_size())
            self.replica_world = bootstrap_replica(
                self.recover_config.ranks_per_replica, job_config.comm.init_timeout_seconds)
        super().__init__(job_config)
        if self.recover_config.enable:
            self._init_cross_replica()
            writer = self.world.is_writer()
        else:
            writer = dist.get_rank() == 0
            self.metrics_processor.should_log = lambda step: True
        mode = "recover" if self.recover_config.enable else "stock"
        self.run_metrics = RunMetrics(job_config.job.dump_folder, is_writer=writer, mode=mode)
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

    def _init_cross_replica(self) -> None:
        from recover_hsdp.recovery import CrossReplicaReduce, StaticWorld

        layout = self.replica_world.layout
        self.world = StaticWorld(layout)
        self.replicas = layout.replicas
        self.microbatches = microbatches_per_replica(self.job_config,
                                                     layout.replicas * layout.ranks_per_replica)
        self.global_microbatches = self.replicas * self.microbatches
        self.reducer = CrossReplicaReduce(self.model_parts[0], self.world)

    # ---------------------------------------------------------------- one step

    def train_step(self, data_iterator):
        started = time.perf_counter()
        if self.recover_config.enable:
            record = self._recover_train_step()
        else:
            super().train_step(data_iterator)
            record = self._stock_record()
        record["step_time_s"] = time.perf_counter() - started
        self.run_metrics.log_step(record)

    def _stock_record(self) -> dict:
        training = self.job_config.training
        ranks = dist.get_world_size()
        return {
            "step": self.step, "loss": self._last_loss,
            "tokens": training.local_batch_size * training.seq_len * ranks
            * self.gradient_accumulation_steps,
            "alive_replicas": self.job_config.parallelism.data_parallel_replicate_degree,
            "committed_microbatches": self.gradient_accumulation_steps
            * self.job_config.parallelism.data_parallel_replicate_degree,
        }

    def _recover_train_step(self) -> dict:
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        step_index = self.step - 1
        replica = self.replica_world.layout.replica
        ids = [step_index * self.global_microbatches + replica * self.microbatches + g
               for g in range(self.microbatches)]
        batches = [self.dataloader.batch(m) for m in ids]
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
        global_tokens = int(self.world.global_sum(np.array([local_tokens], np.int64))[0])

        model = self.model_parts[0]
        losses = []
        sync_started = None
        for index, (input_dict, labels) in enumerate(batches):
            last = index == len(batches) - 1
            model.set_requires_gradient_sync(last)
            if last:
                sync_started = time.perf_counter()
            loss = self.forward_backward_step(input_dict=input_dict, labels=labels,
                                              global_valid_tokens=global_tokens)
            losses.append(loss.detach())
        sync_time = time.perf_counter() - sync_started

        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm, foreach=True)
        self.optimizers.step()
        self.lr_schedulers.step()
        self.ntokens_seen += local_tokens

        local_loss = float(torch.sum(torch.stack(losses)))
        loss = float(self.world.global_sum(np.array([local_loss], np.float64))[0])
        if self.recover_config.check_replica_consistency:
            self.world.check_replicas_identical(model, self.step)
        return {
            "step": self.step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
            "tokens": global_tokens, "alive_replicas": self.replicas,
            "committed_microbatches": self.global_microbatches, "epoch": 0,
            "sync_time_s": sync_time,
        }

    # ---------------------------------------------------------------- outputs

    def _wrap_metrics_log(self) -> None:
        original = self.metrics_processor.log

        def log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            self._last_loss = float(global_avg_loss)
            return original(step, global_avg_loss, global_max_loss, grad_norm,
                            extra_metrics=extra_metrics)

        self.metrics_processor.log = log

    def _save_final_params(self) -> None:
        """Gather full parameters (a collective inside the torch world) and write them."""
        full = {}
        for name, param in self.model_parts[0].named_parameters():
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            full[name] = tensor.detach().to("cpu", torch.float32).clone()
        if self.run_metrics.is_writer:
            torch.save(full, f"{self.job_config.job.dump_folder}/final_params.pt")

    def close(self) -> None:
        if hasattr(self, "run_metrics") and self.recover_config.save_final_params:
            self._save_final_params()
        if hasattr(self, "run_metrics"):
            extra = {"replicas": getattr(self, "replicas",
                                         self.job_config.parallelism.data_parallel_replicate_degree)}
            summary = self.run_metrics.write_summary(extra)
            if self.run_metrics.is_writer:
                print(f"[recover-hsdp] summary: {summary}", flush=True)
        super().close()
