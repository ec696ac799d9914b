"""Start-up validation of a parsed JobConfig (:func:`validate`) and the replica-layout
arithmetic the launcher and the ranks share (G, D, R), each error one line naming the field and
the fix."""

from pathlib import Path

from recover_hsdp.config.aliases import resolve_aliases
from recover_hsdp.config.sections import SECTIONS
from recover_hsdp.errors import ConfigError


def microbatches_per_replica(local_batch_size: int, global_batch_size: int,
                             data_parallel_ranks: int) -> int:
    """G: gradient-accumulation steps as TorchTitan derives them (global -1: one microbatch)."""
    if global_batch_size < 0:
        return 1
    return global_batch_size // (local_batch_size * data_parallel_ranks)


def check_batch_sizes(local_batch_size: int, global_batch_size: int, replicas: int,
                      data_ranks_per_replica: int) -> int:
    """Return G (microbatches per replica per step) or raise a one-line ConfigError.
    ``data_ranks_per_replica``: D = S / tensor_parallel_degree ([Note: replica layout])."""
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1 (got {replicas})")
    if data_ranks_per_replica < 1:
        raise ConfigError(f"recover.ranks_per_replica must be >= 1 (got "
                          f"{data_ranks_per_replica}): set --ranks-per-replica to the number of "
                          "ranks in one replica (FSDP degree x TP degree)")
    if local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size must be >= 1 (got {local_batch_size})")
    per_microbatch = local_batch_size * replicas * data_ranks_per_replica
    if global_batch_size >= 0 and (global_batch_size == 0 or global_batch_size % per_microbatch):
        raise ConfigError(
            f"training.global_batch_size={global_batch_size} is not a positive multiple of "
            f"local_batch_size x replicas x FSDP ranks per replica = {local_batch_size} x "
            f"{replicas} x {data_ranks_per_replica} = {per_microbatch}: set it to a multiple of "
            f"{per_microbatch}")
    return microbatches_per_replica(local_batch_size, global_batch_size,
                                    replicas * data_ranks_per_replica)


def initial_replica_count(initial_replicas: int, launched: int) -> int:
    """W_init of the batch contract (``recover.initial_replicas``; 0: the ``launched`` count R),
    or a one-line ConfigError when it is below R or negative."""
    if isinstance(initial_replicas, bool) or not isinstance(initial_replicas, int) \
            or initial_replicas < 0:
        raise ConfigError(f"recover.initial_replicas must be an integer >= 0 (got "
                          f"{initial_replicas!r}): 0 means the launched replica count")
    if initial_replicas and initial_replicas < launched:
        raise ConfigError(f"recover.initial_replicas={initial_replicas} is below the {launched} "
                          "replicas launched: set it to 0 (the launched count) or to at least "
                          f"{launched}")
    return initial_replicas or launched


def data_ranks_per_replica(ranks_per_replica: int, tensor_parallel_degree: int,
                           pipeline_parallel_degree: int = 1) -> int:
    """D, the FSDP (data-parallel) degree inside a replica of S = P x D x T ranks, or a
    one-line ConfigError.

    [Note: replica layout] A replica is TorchTitan's own parallel dims over its S ranks:
    pipeline degree P (``parallelism.pipeline_parallel_degree``) x FSDP degree D x
    tensor-parallel degree T (``parallelism.tensor_parallel_degree``), ranks ordered as
    TorchTitan's mesh orders them (replica rank s = p * D * T + d * T + t). The T ranks of one
    FSDP rank d compute the same microbatch (TP splits the layers, not the data), and so do its
    P stages (PP splits the model: [Note: pipeline stages in a replica] in titan/pipeline.py):
    data is read per FSDP rank (D parts per replica), and the step's loss / token counts are
    counted once per FSDP rank (its t = 0 rank of the last stage, which alone has the loss).
    Every rank holds its own gradient shard (stage x FSDP x TP), so the cross-replica reduce
    is per replica rank s: the shard communicators of :mod:`recover_hsdp.collectives` join the
    ranks at the same s of every replica, whatever the inner layout."""
    if pipeline_parallel_degree < 1 or tensor_parallel_degree < 1 \
            or ranks_per_replica % (tensor_parallel_degree * pipeline_parallel_degree):
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={tensor_parallel_degree} x "
            f"pipeline_parallel_degree={pipeline_parallel_degree} does not divide "
            f"recover.ranks_per_replica={ranks_per_replica}: a replica is PP x FSDP x TP ranks; "
            "set --ranks-per-replica to pipeline_parallel_degree x FSDP degree x "
            "tensor_parallel_degree")
    return ranks_per_replica // (tensor_parallel_degree * pipeline_parallel_degree)


def check_world_size(world_size: int, ranks_per_replica: int) -> int:
    """Return R for an MPI world of ``world_size`` ranks, or raise a one-line ConfigError."""
    if ranks_per_replica < 1 or world_size % ranks_per_replica:
        raise ConfigError(
            f"recover.ranks_per_replica={ranks_per_replica} does not divide the MPI world size "
            f"{world_size}: launch R x S ranks (mpirun -np R*S) or change ranks_per_replica")
    return world_size // ranks_per_replica


def validate(job_config, world_size: int | None = None) -> None:
    """Start-up validation of a parsed JobConfig (raises ConfigError): any deprecated alias set
    since parsing resolved (:func:`resolve_aliases`), each section's own ``check()``, then the
    checks that span sections or involve TorchTitan's."""
    resolve_aliases(job_config)
    rc = job_config.recover
    if not rc.enable:
        return
    if world_size is not None:
        replicas = check_world_size(world_size, rc.ranks_per_replica)
        check_batch_sizes(job_config.training.local_batch_size,
                          job_config.training.global_batch_size,
                          initial_replica_count(rc.initial_replicas, replicas),
                          data_ranks_per_replica(rc.ranks_per_replica,
                                                 job_config.parallelism.tensor_parallel_degree,
                                                 job_config.parallelism.pipeline_parallel_degree))
    for name in SECTIONS:
        getattr(rc, name).check()
    _check_dataset(job_config)
    if rc.reduce.wire_dtype == "bf16" and (rc.debug.save_final_params
                                           or rc.debug.dump_step_gradients):
        field_name = "save_final_params" if rc.debug.save_final_params else "dump_step_gradients"
        raise ConfigError(f"recover.reduce.wire_dtype=bf16 with recover.debug.{field_name}: those "
                          "outputs are compared bitwise against fp32 runs, which bf16 sums cannot "
                          "match; use wire_dtype = \"fp32\"")
    _refuse_unsupported(job_config)
    if job_config.training.mixed_precision_reduce != "float32":
        raise ConfigError("training.mixed_precision_reduce must be float32 with recover.enable: "
                          "gradient-bucket snapshots restore the fp32 reduce buffer in place")
    par = job_config.parallelism
    data_ranks_per_replica(rc.ranks_per_replica, par.tensor_parallel_degree,
                           par.pipeline_parallel_degree)
    check_pipeline(job_config)
    for name in ("context_parallel_degree", "expert_parallel_degree"):
        if getattr(par, name) != 1:
            raise ConfigError(f"parallelism.{name}={getattr(par, name)}: recover-hsdp supports "
                              "PP x FSDP x TP inside a replica; set it to 1")


PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
"""Schedules whose every stage syncs through ``PipelineStage.perform_reduce_grad``, which the
step holds ([Note: pipeline stages in a replica] in titan/pipeline.py), and which run full
backwards (a zero-bubble schedule's split weight backward is not counted per microbatch)."""


def check_pipeline(job_config) -> None:
    """Pipeline parallelism inside a replica (both paths), each refusal one line."""
    par, training = job_config.parallelism, job_config.training
    if par.pipeline_parallel_degree == 1:
        return
    if par.pipeline_parallel_degree < 1:
        raise ConfigError(f"parallelism.pipeline_parallel_degree must be >= 1 (got "
                          f"{par.pipeline_parallel_degree})")
    if par.pipeline_parallel_schedule not in PIPELINE_SCHEDULES or \
            par.pipeline_parallel_schedule_csv:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule={par.pipeline_parallel_schedule!r}"
            f"{' with a schedule csv' if par.pipeline_parallel_schedule_csv else ''}: "
            f"recover-hsdp runs {', '.join(PIPELINE_SCHEDULES)} (no schedule csv); choose one")
    size = par.pipeline_parallel_microbatch_size
    if size < 1 or training.local_batch_size % size:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatch_size={size} does not divide "
            f"training.local_batch_size={training.local_batch_size}: a microbatch runs through "
            "the pipeline as local_batch_size / pipeline_parallel_microbatch_size pieces; set "
            "it to a divisor")


STREAMING_DATASETS = ("c4", "c4_validation")
"""TorchTitan datasets whose loader streams (``load_dataset(..., streaming=True)``); any other
dataset that loads as a stream is refused at start-up by the exact-mode packer."""


def _check_dataset(job_config) -> None:
    """Dataset x data assignment combinations that cannot work, each refused in one line."""
    training, rc = job_config.training, job_config.recover
    if rc.workload.data_assignment == "exact" and training.dataset in STREAMING_DATASETS:
        raise ConfigError(f"recover.workload.data_assignment=exact needs a map-style dataset "
                          f"(global microbatch ids), and training.dataset={training.dataset!r} "
                          "is a stream: use data_assignment = \"stream\", or a map-style dataset "
                          "(e.g. \"local_corpus\", \"c4_test\")")
    if rc.workload.data_assignment == "stream" and rc.bad_replicas.audit_interval > 0:
        raise ConfigError("recover.bad_replicas.audit_interval needs data_assignment = \"exact\" "
                          "(an auditor reads the audited replica's microbatch by its global id; "
                          "in stream mode it cannot read another replica's stream): set "
                          "audit_interval = 0 or use exact mode ([Note: gradient audits])")
    if training.dataset in STREAMING_DATASETS and not training.dataset_path:
        raise ConfigError(f"training.dataset_path is empty for training.dataset="
                          f"{training.dataset!r}: jobs never download; point it at a local copy "
                          "of allenai/c4 (its README.md and en/c4-*.json.gz, see docs/cluster.md)")
    if training.dataset_path and training.dataset != "local_corpus" \
            and not Path(training.dataset_path).exists():
        raise ConfigError(f"training.dataset_path={training.dataset_path!r} does not exist: "
                          f"point it at the local copy of {training.dataset!r}")


def _refuse_unsupported(job_config) -> None:
    """TorchTitan settings that break an assumption of the MPI path, each refused in one line."""
    training, checkpoint = job_config.training, job_config.checkpoint
    if training.enable_cpu_offload:
        raise ConfigError("training.enable_cpu_offload=true: FSDP then copies gradients to host, "
                          "so they are no longer views of the reduce buffer that in-step recovery "
                          "restores ([Note: FSDP2 contract]); set it to false with recover.enable")
    if getattr(checkpoint, "async_mode", "disabled") != "disabled":
        raise ConfigError(f"checkpoint.async_mode={checkpoint.async_mode!r}: a background save "
                          "would outlive the replica's fault-tolerant step boundary; use "
                          "\"disabled\" with recover.enable")
    if job_config.parallelism.data_parallel_replicate_degree not in (1, -1):
        raise ConfigError(
            f"parallelism.data_parallel_replicate_degree="
            f"{job_config.parallelism.data_parallel_replicate_degree}: with recover.enable the "
            "replicas are MPI ranks (--replicas R), not a TorchTitan mesh dimension; set it to 1")
