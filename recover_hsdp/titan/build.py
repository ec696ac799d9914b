"""The glue that wires one rank of a real job from its config: the world, the faults, the
manager (``RecoverTrainer`` is the only caller)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from recover_hsdp.collectives.processes import ProcessInfo
from recover_hsdp.manager.manager import RecoverManager
from recover_hsdp.outputs import RunMetrics
from recover_hsdp.workload import WorkloadPolicy


def build_world(job_config, placement, procs: Sequence[ProcessInfo] = (), comm=None,
                newcomer: bool = False):
    """The ULFM world over ``comm``, the job's communicator ([Note: host-interleaved ranks] in
    collectives/ranks.py; default ``MPI.COMM_WORLD``; a newcomer's: over its spawn, [Note:
    rejoin] in collectives/join.py). Built right after the bootstrap, before the model: a
    death while the trainer builds the model, the data and loads a checkpoint is then an
    ordinary death found by step 1's collectives, not a failed MPI call of the start-up."""
    from recover_hsdp.collectives import MPI, FaultTolerantWorld
    from recover_hsdp.groups.timeouts import job_deadlines

    run = procs[0] if procs else None  # rank 0's process names the run: claims never mix runs
    arbiter = (Path(job_config.job.dump_folder) / "membership" / f"{run.host}-{run.pid}-{run.start}"
               if run else None)
    deadlines = job_deadlines(job_config)  # ordered: [Note: a replica leaves as a unit]
    if newcomer:
        world = FaultTolerantWorld.newcomer(placement.ranks_per_replica, deadlines,
                                            arbiter_dir=arbiter)
        world.assume_rank(placement.world_rank)
        return world
    return FaultTolerantWorld(comm or MPI.COMM_WORLD, placement.ranks_per_replica, deadlines,
                             arbiter_dir=arbiter)


def build_injector_for(job_config, placement):
    """This rank's faults (``[recover.faults]``)."""
    from recover_hsdp.faults import build_injector

    return build_injector(job_config.recover.faults, placement.replicas, placement.replica,
                          placement.shard, job_config.job.dump_folder)


def build_manager(job_config, placement, model, outputs: RunMetrics, world, faults,
                  procs: Sequence[ProcessInfo] = (), heartbeat=None,
                  passes_per_microbatch: int = 1) -> RecoverManager:
    """The manager of one rank of a job: its ``world`` (:func:`build_world`), the policy from
    the ``[training]``/``[recover]`` sections, ``BucketSync`` on ``model``'s FSDP units, this
    rank's ``faults``. ``placement`` is the launch-time ``ProcessPlacement`` (bootstrap);
    ``heartbeat``: the replica group's (``ReplicaGroup.heartbeat``; None: none). ``model``:
    this rank's model parts (its pipeline stages in a ``ModuleList``), ``passes_per_microbatch``
    their schedule's pieces per microbatch ([Note: pipeline stages in a replica])."""
    from recover_hsdp.config import (data_ranks_per_replica, initial_replica_count,
                                     microbatches_per_replica)
    from recover_hsdp.recovery import BucketSync, parameter_fingerprint
    from recover_hsdp.status import RankStatus

    rc, training = job_config.recover, job_config.training
    out_dir = job_config.job.dump_folder
    tp = job_config.parallelism.tensor_parallel_degree  # [Note: replica layout] (config/checks.py)
    pp = job_config.parallelism.pipeline_parallel_degree
    fsdp_degree = data_ranks_per_replica(placement.ranks_per_replica, tp, pp)
    last_stage = placement.shard // (fsdp_degree * tp) == pp - 1  # it alone has the loss
    # [Note: the relaunch keeps B] (cli/relaunch.py): W_init may exceed the launched count
    w_init = initial_replica_count(rc.initial_replicas, placement.replicas)
    g = microbatches_per_replica(training.local_batch_size, training.global_batch_size,
                                 w_init * fsdp_degree)
    policy = WorkloadPolicy(initial_replicas=w_init, microbatches_per_replica=g,
                            alive_replicas=range(placement.replicas),
                            keep_spares=rc.workload.keep_spares,
                            data_assignment=rc.workload.data_assignment,
                            g_raise=rc.workload.g_raise,
                            straggler=rc.bad_replicas.straggler_rule())
    manager = RecoverManager(
        world=world, bucket_sync=BucketSync.for_model(
            model, world, rc.reduce.host_snapshots, plane=_data_plane(job_config, world, model),
            passes_per_microbatch=passes_per_microbatch),
        policy=policy,
        faults=faults,
        outputs=outputs, out_dir=out_dir,
        tokens_per_microbatch=fsdp_degree * training.local_batch_size * training.seq_len,
        counts_data=placement.shard % tp == 0 and last_stage,
        bad_replicas=rc.bad_replicas, tiers=rc.tiers,
        parameter_fingerprint=lambda: parameter_fingerprint(model), procs=procs,
        status=RankStatus(out_dir, placement.world_rank, placement.replica, placement.shard),
        stopped_peer_s=rc.timeouts.detect_s)  # [Note: stopped peers outside the detector]
    if heartbeat is not None:  # a rank leaving normally says goodbye to its replica peers
        world.on_leave = heartbeat.stand_down
    return manager


def _data_plane(job_config, world, model):
    """[Note: control plane and data plane] (groups/data_plane.py). The torch group's own
    timeout is the replica group's (a last resort: the control plane's poll abandons a
    blocked call first)."""
    from recover_hsdp.collectives.mpirun import RANKS_PER_GPU_ENV
    from recover_hsdp.groups.data_plane import build_data_plane
    from recover_hsdp.groups.timeouts import replica_group_timeout_s

    device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    return build_data_plane(job_config.recover.reduce, world, device=device,
                            timeout_s=replica_group_timeout_s(job_config),
                            ranks_per_gpu=int(os.environ.get(RANKS_PER_GPU_ENV, "1") or 1))
