"""RecoverTrainer: TorchTitan's Trainer whose replicas are kept alive by a RecoverManager.

Selected by ``[recover] enable = true`` and launched by mpirun (one rank per device); with
``enable = false`` ``recover_hsdp.train`` runs TorchTitan's own ``Trainer``. This class only
adapts TorchTitan to the manager:

* ``init_distributed``: the replica's torch.distributed world (S ranks, bootstrapped over MPI);
  TorchTitan sees only that world, so FSDP2 shards over the replica;
* ``train_step``: ``RecoverManager.step`` runs [Note: the step protocol] (manager/manager.py)
  and calls back into this class, a ``StepWork``: ``set_gradient_sync``, ``forward_backward``,
  ``apply_update``;
* outputs go through the TrainSpec's metrics processor (``recover_hsdp.titan.metrics``), DCP
  checkpoints through :class:`ReplicaCheckpointer`, the policy state through ``state_dict``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.train import Trainer

from recover_hsdp import certificates
from recover_hsdp.collectives.guard import log_line
from recover_hsdp.collectives.mpirun import job_environment
from recover_hsdp.collectives.ranks import job_communicator
from recover_hsdp.collectives.processes import write_registry
from recover_hsdp.config import validate
from recover_hsdp.errors import ConfigError, one_line
from recover_hsdp.faults import Phase
from recover_hsdp.groups.bootstrap import NEWCOMER_ENV, bootstrap_replica, newcomer_placement
from recover_hsdp.groups.liveness import build_liveness
from recover_hsdp.groups.replica_group import init_replica_group
from recover_hsdp.recovery.fingerprint import state_fingerprint
from recover_hsdp.recovery.staging import HostStaging, to_host
from recover_hsdp.titan.build import build_injector_for, build_manager, build_world
from recover_hsdp.titan.host_state import HostState
from recover_hsdp.titan.metrics import full_tensors, pipeline_group
from recover_hsdp.titan.pipeline import (HeldGradientSync, pieces_per_microbatch,
                                         schedule_stages)
from recover_hsdp.titan.sources import SampleLog
from recover_hsdp.workload import DataRef


class ReplicaCheckpointer:
    """TorchTitan's ``CheckpointManager`` that saves on the writer's replica only.

    [Note: one replica saves] Every replica holds the same parameters (checked every
    ``consistency_check_interval`` steps), and each replica's DCP save is a collective of its
    own S ranks writing the same files: one replica (the lowest alive) writes, the others skip
    and wait in the agreement that it is complete ([Note: a checkpoint the survivors agree on]
    in manager/between_steps.py: a saver lost mid-save is replaced and the step saved again).
    The hang watchdog is paused during the save (a long write is not a hang); MPI-call
    deadlines still apply. Every agreed save is certified and every load verified ([Note:
    certified checkpoints] in recover_hsdp/certificates.py): ``state_fingerprint()`` is this
    rank's (parameters and optimizer state); a newcomer (``verify`` False) loads as TorchTitan
    does, its state comes from a donor. Everything else is delegated unchanged."""

    def __init__(self, inner, manager, slow_phase=contextlib.nullcontext, *,
                 state_fingerprint=None, verify: bool = True, host_state=None,
                 resume_from_memory: int = 0):
        self._inner, self._manager, self._slow_phase = inner, manager, slow_phase
        self._state_fingerprint, self._verify = state_fingerprint, verify
        self._host_state, self._resume_from_memory = host_state, resume_from_memory

    def save(self, curr_step: int, last_step: bool = False) -> None:
        inner, memory = self._inner, self._host_state
        due = inner._should_save(curr_step, last_step)
        # [Note: emergency checkpoint] (manager/manager.py): DCP and/or host memory
        lost_host = self._manager.take_emergency_checkpoint()
        emergency = lost_host and inner.enable and not inner.load_only
        memory_emergency = lost_host and memory is not None and memory.on
        if memory is not None and memory.due(curr_step, last_step) and not memory_emergency:
            memory.snapshot(curr_step)  # [Note: host-memory state]: copied now, written later
        if not (due or emergency or memory_emergency):
            return
        with self._slow_phase():  # [Note: detection margins by phase] (groups/heartbeat.py)
            written = memory_emergency and memory.snapshot(curr_step, wait=True)
            saved = (due or emergency) and self._save(curr_step, last_step, due)
            if written or (emergency and saved):
                self._manager.emergency_checkpoint_saved(curr_step)

    def _save(self, curr_step: int, last_step: bool, due: bool) -> bool:
        inner = self._inner
        if not (last_step and inner.last_save_model_only):  # the loader state goes in too
            source = inner.states["dataloader"]
            if source.gathers_state:
                states = self._manager.gather_for_checkpoint(to_host(source.checkpoint_state()))
                source.set_gathered(states.values())
        saved = self._manager.save_checkpoint(
            curr_step, lambda: self._save_here(curr_step, last_step, due))
        if saved and self._state_fingerprint is not None:  # [Note: certified checkpoints]
            self._manager.certify_checkpoint(
                curr_step, inner._create_checkpoint_id(curr_step),
                restart_point=not (last_step and inner.last_save_model_only),
                fingerprint=self._state_fingerprint)
        return saved

    def load(self, step: int = -1) -> bool:
        """TorchTitan's load, of certified restart points only, each verified once loaded:
        [Note: certified checkpoints]. ``step`` (-1: the newest) that is not a certified
        restart point or does not verify is refused in one line and the next older certified
        one is tried; none left: a ``ConfigError`` naming the folder. Folders without one
        (none written yet, TorchTitan's seed checkpoint step-0) load as TorchTitan does."""
        inner = self._inner
        if self._resume_from_memory and self._verify and self._host_state is not None:
            self._host_state.restore(self._resume_from_memory)  # [Note: host-memory state]
            return True
        steps = certificates.complete_checkpoints(inner.folder) if inner.enable else []
        if not self._verify or self._state_fingerprint is None or not steps or steps == [0]:
            return inner.load(step=step)
        wanted = steps[0] if step == -1 else step
        refused: dict[int, str] = {}
        if wanted not in steps:
            refused[wanted] = "not a complete checkpoint (no .metadata)"
        for candidate in [s for s in steps if s <= wanted]:  # newest first
            why = certificates.why_not_restart_point(
                certificates.folder_of(inner.folder, candidate)) or self._load_verified(candidate)
            if why is None:
                self._report(refused, loaded=candidate)
                return True
            refused[candidate] = why
        self._report(refused, loaded=None)
        raise ConfigError(
            f"checkpoint.folder {inner.folder}: no certified restart point at or before step "
            f"{wanted} verifies ({'; '.join(f'step-{s}: {w}' for s, w in sorted(refused.items()))})"
            ": move the folder away to start from scratch")

    def _load_verified(self, step: int) -> str | None:
        """Load ``step``, then agree every replica holds its certificate's state."""
        error, fingerprint = "", None
        try:
            self._inner.load(step=step)
            fingerprint = self._state_fingerprint()
        except Exception as err:  # noqa: BLE001 - agreed as refused, the next one is tried
            error = one_line(err)
        return self._manager.verify_checkpoint(
            step, certificates.folder_of(self._inner.folder, step), fingerprint, error)

    def _report(self, refused: dict[int, str], loaded: int | None) -> None:
        """One line per refused checkpoint (the writer's), one ``events.jsonl`` line."""
        manager = self._manager
        if manager.is_writer:
            for step, why in sorted(refused.items(), reverse=True):
                print(f"[recover-hsdp] checkpoint step-{step} refused: {why}", flush=True)
        if refused:
            manager.outputs.log_event({"phase": "checkpoint load", "step": loaded or 0,
                                       "epoch": manager.world.epoch,
                                       "loaded": loaded,
                                       "refused": {str(s): w for s, w in refused.items()}})

    def _save_here(self, curr_step: int, last_step: bool, due: bool) -> str | None:
        """This rank's part of the saving replica's DCP save; None, or why it failed.
        ``due``: False for an emergency save ([Note: emergency checkpoint] in
        manager/manager.py), which TorchTitan's interval would skip."""
        inner = self._inner
        with self._manager.world.watchdog_paused():
            # phase=checkpoint: in the save call of that step (choose a step a save is due)
            self._manager.checkpoint_point(curr_step)
            interval = inner.interval
            inner.interval = 1 if not due else interval  # the emergency save is due now
            try:
                if self._manager.shard == 0:  # before any rank of the replica can write
                    mark_incomplete(inner._create_checkpoint_id(curr_step))
                inner.save(curr_step, last_step=last_step)
            except Exception as err:  # noqa: BLE001 - agreed as not saved (or a peer died)
                return f"checkpoint save: {one_line(err)}"
            finally:
                inner.interval = interval
        return None

    def __getattr__(self, name):
        return getattr(self._inner, name)


class RecoverTrainer(Trainer):
    """TorchTitan Trainer whose data-parallel replicas talk over fault-tolerant MPI."""

    def __init__(self, job_config):
        from recover_hsdp.collectives import MPI

        ranks_per_replica = job_config.recover.ranks_per_replica
        self._join_staging = HostStaging()  # [Note: no device tensor reaches MPI]
        self._join_staged: tuple[list, list] = ([], [])
        newcomer = newcomer_placement(ranks_per_replica)  # [Note: rejoin at a boundary]
        self._joining = newcomer is not None
        validate(job_config, world_size=newcomer.world_size if newcomer
                 else MPI.COMM_WORLD.Get_size())
        if torch.cuda.is_available():  # the launcher checked a CPU layout's RAM
            _check_fits_the_gpu(job_config, ranks_per_replica)
        # the job's order of ranks, whatever mpirun's: [Note: host-interleaved ranks]
        comm = MPI.COMM_WORLD if newcomer else job_communicator()
        self.replica_world = bootstrap_replica(ranks_per_replica,
                                               job_config.comm.init_timeout_seconds,
                                               comm=comm, placement=newcomer)
        # The world exists before the model is built (build_world): a death from here on is an
        # ordinary death that step 1 finds; building the model, the data and loading a
        # checkpoint can take longer than the hang timeout, hence the pause.
        layout = self.replica_world.layout
        world = build_world(job_config, layout, self.replica_world.procs, comm=comm,
                            newcomer=self._joining)
        self._faults = build_injector_for(job_config, layout)  # phase startup: init_distributed
        with world.watchdog_paused():
            super().__init__(job_config)
        self._held_sync, pieces = None, 1  # [Note: pipeline stages in a replica]
        if self.parallel_dims.pp_enabled:
            self._held_sync = HeldGradientSync(schedule_stages(self.pp_schedule),
                                               self._not_a_microbatch)
            pieces = pieces_per_microbatch(self.pp_schedule)
        self.manager = build_manager(job_config, layout, self._model,
                                     self.metrics_processor.outputs, world, self._faults,
                                     self.replica_world.procs, self.replica_group.heartbeat,
                                     passes_per_microbatch=pieces)
        if layout.world_rank == 0 and not self._joining:
            write_registry(job_config.job.dump_folder, self.replica_world.procs)  # launcher's
        self.host_state = HostState(self, job_config.recover.tiers, job_config.job.dump_folder)
        self.checkpointer = ReplicaCheckpointer(
            self.checkpointer, self.manager, self._slow_phase, verify=not self._joining,
            state_fingerprint=self.state_fingerprint, host_state=self.host_state,
            resume_from_memory=job_config.recover.tiers.resume_from_memory)
        if job_config.recover.debug.log_samples:
            self.dataloader.sample_log = SampleLog(job_config.job.dump_folder,
                                                   self.replica_world.layout.world_rank)

    def init_distributed(self) -> ParallelDims:
        layout = self.replica_world.layout
        # timeouts ordered against MPI's, and the replica heartbeat: [Note: a replica leaves
        # as a unit] (groups/replica_group.py)
        self.replica_group = init_replica_group(self.replica_world, self.job_config,
                                                lambda: getattr(self, "step", 0))
        from recover_hsdp.collectives import MPI

        timeouts = self.job_config.recover.timeouts
        self.liveness = build_liveness(self.replica_group.heartbeat, timeouts.detect_s,
                                       timeouts.slow_phase_s, rank=MPI.COMM_WORLD.Get_rank(),
                                       size=MPI.COMM_WORLD.Get_size(), log=log_line)
        if not self._joining:  # the replica's group exists, the model does not yet
            self._faults.at(0, Phase.STARTUP)
        parallelism = self.job_config.parallelism  # [Note: replica layout] (config/checks.py)
        tp, pp = parallelism.tensor_parallel_degree, parallelism.pipeline_parallel_degree
        fsdp = layout.ranks_per_replica // (tp * pp)
        parallelism.data_parallel_replicate_degree = 1
        parallelism.data_parallel_shard_degree = fsdp
        return ParallelDims(dp_shard=fsdp, dp_replicate=1, cp=1, tp=tp, pp=pp, ep=1, etp=1,
                            world_size=layout.ranks_per_replica)

    @property
    def _model(self) -> torch.nn.Module:
        """This rank's model: its one part, or its pipeline stages' parts as one module."""
        parts = self.model_parts
        return parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)

    def state_fingerprint(self) -> int:
        """This rank's parameters and optimizer state: [Note: certified checkpoints]."""
        return state_fingerprint(self._model, self.optimizers.optimizers)

    # ---------------------------------------------------------------- one step

    def _slow_phase(self):
        """A phase allowed to be slow for both liveness signals ([Note: detection margins by
        phase] in groups/heartbeat.py; groups/liveness.py)."""
        return self.liveness.slow_phase()

    def train_step(self, data_iterator) -> None:
        with self._slow_phase():  # a rejoin's transfer
            if self._joining:  # a replacement rank: take the live state, then the survivors' step
                self.step = self.manager.join_as_newcomer(self)
                self._joining = False
                self.metrics_processor._last_log = time.perf_counter()  # its steps start now
            else:
                self.manager.maybe_admit(self.step, self)
        self._join_staged = ([], [])  # a join is over by now: its host copy can go
        self._join_staging.release()
        started = time.perf_counter()
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        record = self.manager.step(self.step, self)
        self.liveness.steady()  # committed: start-up is over
        self.dataloader.consume(self.step, self.manager.committed_data)
        record["lr"] = lr
        record["train_step_s"] = time.perf_counter() - started
        alive_ranks = record["alive_replicas"] * self.replica_world.layout.ranks_per_replica
        self.ntokens_seen += record["tokens"]
        self.metrics_processor.log_step(record, alive_ranks)

    # StepWork (recover_hsdp.manager.StepWork) --------------------------------------------

    def set_gradient_sync(self, enabled: bool) -> None:
        if self._held_sync is not None:  # [Note: pipeline stages in a replica]
            self._held_sync.enabled = enabled
        else:
            self.model_parts[0].set_requires_gradient_sync(enabled)

    def forward_backward(self, data: DataRef, nominal_tokens: int, before_backward,
                         grad_factor: float = 1.0):
        input_dict, labels = self.dataloader.microbatch(data)  # [Note: microbatch sources]
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
            {k: v.to(self.device) for k, v in input_dict.items()}, labels.to(self.device))
        if self._held_sync is not None:
            loss = self._pipeline_step(inputs, labels, extra_inputs, extra_kwargs,
                                       nominal_tokens, before_backward, grad_factor)
            return loss, (labels != IGNORE_INDEX).sum(), labels.numel()
        with self.train_context():  # loss parallel (TP) covers the backward too, as in TorchTitan
            with self.maybe_enable_amp:
                pred = self.model_parts[0](inputs, **extra_inputs, **extra_kwargs)
                loss = self.loss_fn(pred, labels) / nominal_tokens
            del pred
            before_backward()
            (loss * grad_factor if grad_factor != 1.0 else loss).backward()
        return loss.detach(), (labels != IGNORE_INDEX).sum(), labels.numel()

    @contextlib.contextmanager
    def _not_a_microbatch(self):
        """A pipeline schedule's set-up pass: neither counted nor a loss ([Note: pipeline
        stages in a replica])."""
        sync = self.manager.bucket_sync
        sync.counting = self.loss_fn.recording = False
        try:
            yield
        finally:
            sync.counting = self.loss_fn.recording = True

    def _pipeline_step(self, inputs, labels, extra_inputs, extra_kwargs, nominal_tokens: int,
                       before_backward, grad_factor: float) -> torch.Tensor:
        """One microbatch through TorchTitan's schedule: [Note: pipeline stages in a replica].
        The backward runs inside the schedule, interleaved with the forward pieces, so
        ``before_backward`` comes first. Its loss: zero on a stage other than the last."""
        self.loss_fn.begin(1.0 / nominal_tokens, grad_factor)
        before_backward()
        targets = labels if self.pp_has_last_stage else None
        with self.train_context():
            if self.pp_has_first_stage:
                self.pp_schedule.step(inputs, **extra_inputs, **extra_kwargs, target=targets,
                                      return_outputs=False)
            else:
                self.pp_schedule.step(**extra_kwargs, target=targets, return_outputs=False)
        loss = self.loss_fn.total()
        return loss if loss is not None else torch.zeros((), device=self.device)

    def measures(self, measured: list[tuple]) -> list[tuple[float, int, int]]:
        """This step's losses and valid-token counts, still on the device until now: one copy
        to the host for the whole step (``StepWork.measures``)."""
        if not measured:
            return []
        values = torch.stack([torch.stack([_replicated(loss).double().reshape(()),
                                           tokens.double().reshape(())])
                              for loss, tokens, _ in measured]).cpu().tolist()
        return [(loss, int(tokens), positions)
                for (loss, tokens), (_, _, positions) in zip(values, measured)]

    def apply_update(self, grad_scale: float) -> float:
        params = [p for m in self.model_parts for p in m.parameters()]
        if grad_scale != 1.0:
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(grad_scale)
        if str(self.step) in {s.strip() for s in self.job_config.recover.debug.dump_step_gradients}:
            self._dump_step_gradients()
        grad_norm = dist_utils.clip_grad_norm_(
            params, self.job_config.training.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"))
        if not math.isfinite(float(grad_norm)):  # [Note: bad replicas]: nothing is updated,
            return float(grad_norm)              # the manager rebuilds the gradient
        self.optimizers.step()
        self.lr_schedulers.step()
        return float(grad_norm)

    def parameter_shards(self) -> list[torch.Tensor]:
        """This rank's parameters, local shards: [Note: divergence votes] (manager)."""
        return [_local(p) for m in self.model_parts for p in m.parameters()]

    # JoinWork (recover_hsdp.manager.work.JoinWork) -----------------------------------------

    def join_meta(self) -> dict:
        """Pickled over MPI: tensors in it (an LR held as a tensor) go to the CPU first."""
        return to_host({
            "ntokens_seen": self.ntokens_seen,
            "lr_schedulers": self.lr_schedulers.state_dict(),
            # stream mode: the loader states of the last checkpoint (a resumed slot then
            # replays from there, not from the start of its part)
            "dataloader": self.dataloader.state_dict(),
            "param_groups": [[{k: v for k, v in group.items() if k != "params"}
                              for group in optimizer.param_groups]
                             for optimizer in self.optimizers.optimizers]})

    def load_join_meta(self, meta: dict) -> None:
        """Rejoin calls this once the arrays of :meth:`join_tensors` hold the donor's state:
        staged copies go back to the device first."""
        tensors, arrays = self._join_staged
        self._join_staging.copy_back(tensors, arrays)
        self.apply_join_meta(meta)

    def apply_join_meta(self, meta: dict) -> None:
        """:meth:`join_meta`'s state (a donor's, or a host-memory generation's) into this rank."""
        self.ntokens_seen = meta["ntokens_seen"]
        self.lr_schedulers.load_state_dict(meta["lr_schedulers"])
        self.dataloader.load_state_dict(meta["dataloader"])
        for optimizer, groups in zip(self.optimizers.optimizers, meta["param_groups"]):
            for group, saved in zip(optimizer.param_groups, groups):
                group.update(saved)

    def join_tensors(self) -> list:
        """This rank's parameters (local FSDP x TP shards), then every optimizer state tensor,
        in parameter order: the same list on every replica of a layout, as numpy arrays for
        MPI. CPU tensors are shared with numpy (zero-copy); device tensors are staged through
        one host buffer ([Note: no device tensor reaches MPI] in recovery/staging.py), copied
        back by :meth:`load_join_meta` on a newcomer and released at the next step."""
        tensors = self._join_state()
        self._join_staged = (tensors, self._join_staging.to_numpy(tensors, key="join"))
        return self._join_staged[1]

    def join_nbytes(self) -> int:
        """The bytes :meth:`join_tensors` would move, from sizes alone (nothing staged)."""
        return sum(t.numel() * t.element_size() for t in self._join_state())

    def _join_state(self) -> list[torch.Tensor]:
        params = [p for m in self.model_parts for p in m.parameters()]
        if any(not opt.state for opt in self.optimizers.optimizers):
            self._materialize_optimizer_state(params)
        tensors = [_local(p) for p in params]
        for optimizer in self.optimizers.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    state = optimizer.state.get(param, {})
                    tensors += [_local(state[k]) for k in sorted(state)
                                if isinstance(state[k], torch.Tensor)]
        return [t.detach() for t in tensors]

    def _materialize_optimizer_state(self, params) -> None:
        """A newcomer's optimizer has no state before its first step: one step on zero
        gradients creates it (its values are then overwritten by the donor's)."""
        for param in params:
            param.grad = torch.zeros_like(param)
        self.optimizers.step()
        self.optimizers.zero_grad()

    def spawn_command(self, replicas: list[int]) -> tuple[str, list[str]]:
        """``/usr/bin/env NAME=VALUE ... python -m recover_hsdp.train <this rank's arguments>``:
        the newcomer gets the job's environment (``job_environment``: what the launcher
        exported with -x, NCCL_*, LD_LIBRARY_PATH, PATH, ...; MPI_Comm_spawn passes none of it;
        never CUDA_VISIBLE_DEVICES, its host's own) and the newcomer marker."""
        env = {**job_environment(os.environ),
               NEWCOMER_ENV: f"{','.join(map(str, replicas))}:"
                             f"{self.replica_world.layout.replicas}"}
        return "/usr/bin/env", [*(f"{k}={v}" for k, v in env.items()), sys.executable, "-m",
                                "recover_hsdp.train", *sys.argv[1:]]

    # ---------------------------------------------------------------- state, outputs

    def state_dict(self):
        """Checkpointed train state, with the workload policy (B, G, stream cursors) so that a
        restart with fewer replicas keeps the same B."""
        state = super().state_dict()
        state["workload"] = json.dumps(self.manager.state_dict())
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if "workload" in state_dict:
            self.manager.load_state_dict(json.loads(state_dict["workload"]))

    def _dump_step_gradients(self) -> None:
        """Oracle tests: full parameters before the update and the committed gradient."""
        pipeline = pipeline_group(self.parallel_dims)
        params = full_tensors(self.model_parts, pipeline=pipeline)
        grads = full_tensors(self.model_parts, grads=True, pipeline=pipeline)
        if self.manager.is_writer:
            torch.save({"params": params, "grads": grads},
                       f"{self.job_config.job.dump_folder}/grads_step{self.step}.pt")

    def train(self):
        super().train()
        self._trained = True

    def close(self) -> None:
        liveness = getattr(self, "liveness", None)
        if liveness is not None:  # what the learned bounds cost, where they widened
            layout = self.replica_world.layout
            for line in liveness.close():
                log_line(f"replica {layout.replica} shard {layout.shard}: {line}")
        manager = getattr(self, "manager", None)
        if manager is None:
            return super().close()
        final = None
        if self.job_config.recover.debug.save_final_params:
            try:  # a collective inside the replica: a peer lost here makes the replica leave
                final = full_tensors(self.model_parts,
                                     pipeline=pipeline_group(self.parallel_dims))
            except Exception as err:  # noqa: BLE001
                manager.replica_error(self.step, f"final parameter gather: {one_line(err)}")
        if getattr(self, "_trained", False):
            self.host_state.drain()  # no write lands after the end's agreement
            manager.finish_run(lambda: self.metrics_processor.write_run_outputs(
                final, alive_replicas=len(manager.world.alive_replicas)))  # agreed at the end
            self.host_state.finish()
        else:  # training raised on every rank (e.g. replicas diverged): record what there is
            self.metrics_processor.write_run_outputs(final)
            manager.close()
        super().close()  # checkpointer, TorchTitan's loggers


def _check_fits_the_gpu(job_config, ranks_per_replica: int) -> None:
    """This rank's GPU (shared by ``ranks_per_gpu`` ranks) holds its training state, or one
    line (recover_hsdp/titan/fit.py)."""
    from recover_hsdp.collectives.mpirun import RANKS_PER_GPU_ENV
    from recover_hsdp.titan.fit import check_fits

    device = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0) or 0))
    check_fits(job_config, ranks_per_replica, int(os.environ.get(RANKS_PER_GPU_ENV, 1) or 1),
               device.total_memory, f"this rank's GPU ({device.name})")


def mark_incomplete(checkpoint_dir: str) -> None:
    """Remove ``.metadata`` from a DCP checkpoint folder about to be (re)written: DCP renames
    it in last, so until the new save completes the folder is incomplete and TorchTitan's
    loader skips it ([Note: a checkpoint the survivors agree on]); without this, a save
    overwriting an older save of the same step that died midway would leave new and old shard
    files under the old, complete-looking ``.metadata``."""
    try:
        os.unlink(os.path.join(checkpoint_dir, ".metadata"))
    except FileNotFoundError:
        pass


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    """A loss as one plain tensor: TP's loss-parallel loss is a (replicated) DTensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
