"""``build_manager``: the RecoverManager of one rank of a real job, wired from the config."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from recover_hsdp.collectives.processes import ProcessInfo
from recover_hsdp.manager.manager import RecoverManager
from recover_hsdp.outputs import RunMetrics
from recover_hsdp.workload import WorkloadPolicy


def build_manager(job_config, placement, model, outputs: RunMetrics,
                  procs: Sequence[ProcessInfo] = (), newcomer: bool = False) -> RecoverManager:
    """The manager of one rank of a job: the ULFM world over ``MPI.COMM_WORLD``, the policy from
    the ``[training]``/``[recover]`` sections, ``BucketSync`` on ``model``'s FSDP units, this
    rank's faults. ``placement`` is the launch-time ``ProcessPlacement`` (bootstrap)."""
    from recover_hsdp.collectives import MPI, Deadlines, FaultTolerantWorld
    from recover_hsdp.config import data_ranks_per_replica, microbatches_per_replica
    from recover_hsdp.faults import build_injector
    from recover_hsdp.recovery import BucketSync, local_parameter_checksum

    rc, training = job_config.recover, job_config.training
    hang = rc.hang_timeout_s
    out_dir = job_config.job.dump_folder
    run = procs[0] if procs else None  # rank 0's process names the run: claims never mix runs
    arbiter = (Path(out_dir) / "membership" / f"{run.host}-{run.pid}-{run.start}") if run else None
    deadlines = Deadlines(call_s=2 * hang + 30, repair_s=3 * hang + 30, hang_timeout_s=hang,
                          retire_grace_s=min(2.0, hang / 4))
    if newcomer:  # spawned to replace a lost replica: [Note: rejoin] (collectives/join.py)
        world = FaultTolerantWorld.newcomer(placement.ranks_per_replica, deadlines,
                                            arbiter_dir=arbiter)
        world.assume_rank(placement.world_rank)
    else:
        world = FaultTolerantWorld(MPI.COMM_WORLD, placement.ranks_per_replica, deadlines,
                                   arbiter_dir=arbiter)
    tp = job_config.parallelism.tensor_parallel_degree  # [Note: replica layout] (config.py)
    fsdp_degree = data_ranks_per_replica(placement.ranks_per_replica, tp)
    g = microbatches_per_replica(training.local_batch_size, training.global_batch_size,
                                 placement.replicas * fsdp_degree)
    policy = WorkloadPolicy(initial_replicas=placement.replicas, microbatches_per_replica=g,
                            keep_spares=rc.keep_spares, data_assignment=rc.data_assignment,
                            g_raise=rc.g_raise)
    manager = RecoverManager(
        world=world, bucket_sync=BucketSync.for_model(model, world, rc.host_snapshots),
        policy=policy,
        faults=build_injector(rc.faults, placement.replicas, placement.replica, placement.shard,
                              out_dir),
        outputs=outputs, out_dir=out_dir,
        tokens_per_microbatch=fsdp_degree * training.local_batch_size * training.seq_len,
        counts_data=placement.shard % tp == 0,
        consistency_check_interval=rc.consistency_check_interval,
        parameter_checksum=lambda: local_parameter_checksum(model), procs=procs)
    manager.respawn_after_steps = rc.respawn_after_steps
    return manager
