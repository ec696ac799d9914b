"""TorchTitan's metrics processor plus this project's run outputs (TrainSpec extension point).

``recover_llama3`` sets ``TrainSpec.build_metrics_processor_fn`` to :func:`build_metrics_processor`,
so both paths write the same ``metrics.jsonl`` / ``summary.json`` (``recover_hsdp.outputs``):

* stock TorchTitan (``[recover] enable = false``, TorchTitan's own ``Trainer``): the trainer
  calls :meth:`RecoverMetricsProcessor.log` after every step (``should_log`` is always true, so
  the loss is reduced every step); the record is built from what TorchTitan passes in. The step
  time is the time between two ``log`` calls (step 1: since the processor was built, so it
  includes the warm-up); the ReCoVer path measures its step time the same way.
* ReCoVer (``RecoverTrainer``): the trainer passes the manager's committed-step record to
  :meth:`RecoverMetricsProcessor.log_step`; only the writer rank writes, and only it feeds
  TorchTitan's console / TensorBoard / W&B loggers (``recover/*`` extra metrics).
TorchTitan's own logging keeps its ``metrics.log_freq``. With
``recover.debug.save_final_params`` both paths write the unsharded final parameters
(``final_params.pt``) with the summary.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import MetricsProcessor

from recover_hsdp.config import microbatches_per_replica
from recover_hsdp.outputs import RunMetrics


class RecoverMetricsProcessor(MetricsProcessor):
    """``MetricsProcessor`` that also keeps ``outputs`` (a :class:`RunMetrics`)."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self.recover = job_config.recover.enable
        if self.recover:
            import os

            from recover_hsdp.groups.bootstrap import NEWCOMER_ENV, current_placement

            # the manager re-elects after failures; a replacement rank never starts as writer
            writer = current_placement().world_rank == 0 and NEWCOMER_ENV not in os.environ
        else:  # TorchTitan's loss is real on the last pipeline stage only: its first rank
            writer = not dist.is_initialized() or dist.get_rank() == \
                dist.get_world_size() // parallel_dims.pp * (parallel_dims.pp - 1)
        self.outputs = RunMetrics(job_config.job.dump_folder, is_writer=writer,
                                  mode="recover" if self.recover else "stock")
        self._last_log = time.perf_counter()

    def _titan_step(self, step: int) -> bool:
        return step == 1 or step % self.job_config.metrics.log_freq == 0

    # ------------------------------------------------------------------ stock TorchTitan path

    def should_log(self, step: int) -> bool:
        return True  # metrics.jsonl gets every step

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        now = time.perf_counter()
        if not self.recover:
            self.outputs.log_step(self._stock_record(step, float(global_avg_loss), now))
            self._last_log = now
        if self._titan_step(step):
            super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        else:
            self.ntokens_since_last_log = 0
            self.data_loading_times.clear()

    def _stock_record(self, step: int, loss: float, now: float) -> dict[str, Any]:
        training, parallelism = self.job_config.training, self.job_config.parallelism
        world = dist.get_world_size() if dist.is_initialized() else 1
        data_ranks = world // (parallelism.tensor_parallel_degree  # TP peers and pipeline
                               * parallelism.pipeline_parallel_degree)  # stages share data
        accumulation = microbatches_per_replica(training.local_batch_size,
                                                training.global_batch_size, data_ranks)
        replicas = max(1, parallelism.data_parallel_replicate_degree)
        tokens = training.local_batch_size * training.seq_len * data_ranks * accumulation
        step_time = now - self._last_log
        return {"step": step, "loss": loss, "step_time_s": step_time, "tokens": tokens,
                "alive_replicas": replicas, "committed_microbatches": accumulation * replicas,
                "tokens_per_s_per_rank": tokens / step_time / world}

    # ------------------------------------------------------------------ ReCoVer path

    def log_step(self, record: dict[str, Any], alive_ranks: int) -> None:
        """A committed ReCoVer step (every rank keeps it; the writer writes it). Its
        ``step_time_s`` is measured as on the stock path: the time between two step records
        (the whole loop iteration, each side's own loss reporting included), so the two
        paths' step times time the same work."""
        now = time.perf_counter()
        record["step_time_s"] = now - self._last_log
        record["tokens_per_s_per_rank"] = record["tokens"] / record["step_time_s"] / alive_ranks
        self._last_log = now
        self.outputs.log_step(record)
        if not self.outputs.is_writer:
            return
        self.ntokens_since_last_log += record["tokens"] // alive_ranks
        self.data_loading_times.append(0.0)
        self.log(record["step"], record["loss"], record["loss"], record["grad_norm"],
                 extra_metrics={"recover/alive_replicas": record["alive_replicas"],
                                "recover/epoch": record["epoch"],
                                "recover/committed_microbatches":
                                    record["committed_microbatches"],
                                "recover/reduced_microbatches": record["reduced_microbatches"],
                                "recover/sync_time_s": record["sync_time_s"]})

    # ------------------------------------------------------------------ end of run

    def write_run_outputs(self, final_params: dict[str, torch.Tensor] | None,
                          alive_replicas: int | None = None) -> dict[str, Any]:
        """``final_params.pt`` (when given) and ``summary.json``; the writer writes them.
        ``alive_replicas``: the replicas alive at the end, as the survivors agreed it ([Note:
        the end of a run]); a replica lost after the last step's record (in the final save)
        is not alive. None: the last step's record says (the stock path)."""
        if final_params is not None and self.outputs.is_writer:
            torch.save(final_params, f"{self.job_config.job.dump_folder}/final_params.pt")
        steps = self.outputs.steps
        last = steps[-1] if steps else {}
        summary = self.outputs.write_summary({
            "alive_replicas": (alive_replicas if alive_replicas is not None
                               else last.get("alive_replicas")),
            "completed": bool(steps) and last["step"] >= self.job_config.training.steps})
        if self.outputs.is_writer:
            print(f"[recover-hsdp] summary: {summary}", flush=True)
        return summary

    def close(self) -> None:
        """Stock path: final parameters and summary here (ReCoVer: the manager's end of run
        calls :meth:`write_run_outputs` on the writer, see [Note: the end of a run])."""
        if not self.recover:
            final = None
            if self.job_config.recover.debug.save_final_params and self.model_parts:
                final = full_tensors(self.model_parts, pipeline=pipeline_group(
                    self.parallel_dims))  # a collective of the stock world
            self.write_run_outputs(final)
        super().close()


def full_tensors(parts, grads: bool = False, pipeline=None) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU copies of the parameters (or gradients) of a model's ``parts`` (a
    module or this rank's pipeline stages): a collective inside the torch.distributed world
    they are sharded over. ``pipeline``: the pipeline group; every stage's tensors are then
    gathered, so each rank returns the whole model (the same names as without stages)."""
    full = {}
    for part in [parts] if isinstance(parts, torch.nn.Module) else parts:
        for name, param in part.named_parameters():
            tensor = param.grad if grads else param
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            full[name] = tensor.detach().to("cpu", torch.float32).clone()
    if pipeline is not None:
        stages = [None] * dist.get_world_size(pipeline)
        dist.all_gather_object(stages, full, group=pipeline)
        full = {name: tensor for stage in stages for name, tensor in stage.items()}
    return full


def pipeline_group(parallel_dims):
    """The pipeline group of this rank, or None without pipeline stages."""
    if not parallel_dims.pp_enabled:
        return None
    return parallel_dims.get_mesh("pp").get_group()


def build_metrics_processor(job_config, parallel_dims, model_args=None,
                            tag: str | None = None) -> RecoverMetricsProcessor:
    """``TrainSpec.build_metrics_processor_fn`` of ``recover_llama3``."""
    return RecoverMetricsProcessor(job_config, parallel_dims, tag)
