"""The ``[recover]`` TOML section: a TorchTitan JobConfig extension.

TorchTitan merges this module's ``JobConfig`` into its own when a config sets
``[job] custom_config_module = "recover_hsdp.config"`` (or ``--job.custom_config_module``).
Every field is also a ``--recover.<field>`` command-line override. ``enable = false`` gives
exactly stock TorchTitan behaviour.

Validation happens once, at start-up, in :func:`validate`; every error is one line that names the
field and the fix (:class:`ConfigError`).
"""


from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib


from recover_hsdp.errors import ConfigError  # noqa: F401  (re-exported: the config's error type)


@dataclass
class Faults:
    """Real failure injection (``[recover.faults]``); see :mod:`recover_hsdp.faults`."""

    inject: str = ""
    """Faults, separated by ";" (one string: each spec contains commas): ``replica=R,step=N,phase=P[,rank=K][,mode=M][,bucket=B]`` with
    P in forward|backward|grad_sync|consensus|rereduce|optimizer|checkpoint|finish and M in
    sigkill|exit|hang|stop|raise|busy, or a replica that stays alive but is bad: nan (grad_sync,
    ``bucket=B``), inf_loss, slow (forward, ``seconds=S`` per microbatch, ``steps=K``) (see
    :mod:`recover_hsdp.faults`)."""

    every: int = 0
    """Paper-like schedule: one replica failure per ``every`` steps at a seeded random step in
    each interval (0: off)."""

    max_failures: int = 0
    """Schedule: stop after this many replicas were lost."""

    phase: Literal["forward", "backward", "grad_sync", "consensus", "rereduce", "optimizer",
                   "checkpoint", "finish", "join"] = "grad_sync"
    """Schedule: the phase the scheduled failures hit."""

    seed: int = 0
    """Schedule: seed of the failure steps and victims."""


@dataclass
class Recover:
    enable: bool = False
    """Train with ReCoVer: one MPI rank per device, replicas of ``ranks_per_replica`` FSDP ranks,
    cross-replica gradient reduce through fault-tolerant MPI. False: stock TorchTitan."""

    ranks_per_replica: int = 1
    """S, the ranks of one replica (its torch.distributed world): FSDP degree x
    ``parallelism.tensor_parallel_degree`` ([Note: replica layout]). The number of replicas R is
    the MPI world size divided by S. A replica lives or dies as a unit."""

    data_assignment: Literal["exact", "stream"] = "exact"
    """``exact``: step t commits exactly global microbatch ids t*B..t*B+B-1, also after failures
    (needs an indexable dataset, e.g. local_corpus). ``stream``: each replica draws its quota from
    its own shard of an endless stream (the paper)."""

    keep_spares: bool = True
    """After G is raised, replicas beyond what the quota needs become spares (compute G, contribute
    zero unless promoted) instead of idling."""

    g_raise: Literal["ceil", "reserve"] = "ceil"
    """How G rises when replicas are lost: ``ceil`` (G = ceil(B / W)) or ``reserve`` (keep a spare
    while two or more replicas live)."""

    detect_timeout_s: float = 4.0
    """A rank whose heartbeats stop for this long is declared dead: a frozen process (SIGSTOP, a kernel
    stall), a host that lost power or its link (no connection reset is ever seen). Open MPI's
    heartbeat detector on its own thread, period ``detect_timeout_s / 4``; it beats while the main
    thread computes, so a long step is never mistaken for a death. Measured here: a frozen rank or a
    cut link found in 3.2-4.3 s at 4 s (1.7-2.0 s at 2 s), no false positive with a rank computing
    60 s without MPI, no measurable failure-free cost. Lower: faster detection, less margin for an
    overloaded host's start-up. 0 disables it (then only deaths that close their sockets are seen,
    and the hang watchdog below). Launch-time setting (mpirun flags)."""

    hang_timeout_s: float = 300.0
    """A rank whose main thread shows no progress for this long kills itself, so that a hung
    rank becomes an ordinary death (MPI-call deadlines are derived from it). From the second
    step on the bound is learned from the rank's own progress (below) and this is its ceiling
    ([Note: a hang bound from progress] in collectives/guard.py)."""

    hang_floor_s: float = 30.0
    """The learned hang bound's floor: a stuck rank is found after max(this,
    ``hang_progress_factor`` x its longest gap between two beats (microbatch, FSDP bucket,
    MPI call) in the last 20 steps), at most ``hang_timeout_s``. Measured here (4 x 1, a main
    thread stuck at step 3): the whole 10-step run took ~50 s with the defaults, 324 s with a
    fixed 300 s. Set it to ``hang_timeout_s`` for a fixed bound."""

    hang_progress_factor: float = 40.0
    """How many times longer than its longest recent gap a rank may go without progress. A gap
    that grows less than this at once (a microbatch 20x slower) is never taken for a hang."""

    respawn_after_steps: int = 0
    """Replica rejoin ([Note: rejoin at a boundary] in manager/rejoin.py): this many steps after a
    replica was lost the survivors spawn a replacement (through mpirun's PRRTE, on the job's
    hosts) at a step boundary; it receives the live state from a replica and G goes back toward
    G_init. 0: off (``recover-hsdp join --out DIR`` still brings one back on request)."""

    host_snapshots: bool = False
    """GPU runs: keep gradient-bucket snapshots in pinned host memory instead of device memory."""

    data_seed: int = 0
    """Seed of the fixed shuffle of the local corpus's packed sequences (a different seed gives
    a different data order with the same statistics)."""

    save_final_params: bool = False
    """At the end of the run write the full (unsharded) parameters to ``final_params.pt`` in
    ``job.dump_folder`` (used by the equivalence tests; costs one gather of the model)."""

    dump_step_gradients: list[str] = field(default_factory=list)
    """Steps (comma-separated on the command line) at which the writer saves the full parameters before the update and
    the committed (reduced, unclipped) gradient to ``grads_step<N>.pt`` (oracle tests)."""

    log_samples: bool = False
    """Each rank writes what its replica committed to ``samples/rank<N>.jsonl`` in
    ``job.dump_folder`` (data reference, sequence ids, CRC-32 of each sequence's tokens): a
    per-step audit of the data (tests check it against data recomputed on one process)."""

    consistency_check_interval: int = 50
    """Every this many steps compare a float64 checksum of each parameter shard across replicas
    and stop with an error if they diverged (one pass over the local shard + one float per rank
    on the wire; 1 in tests, 0 disables)."""

    nonfinite_max_offences: int = 3
    """A replica whose contribution to a step is non-finite (NaN/Inf gradient or loss) is
    excluded from that step only ([Note: bad replicas] in manager/culprits.py); after this many
    such offences within ``nonfinite_window_steps`` steps it is retired as a unit instead (it may
    come back fresh through the rejoin path, ``respawn_after_steps``). >= 1."""

    nonfinite_window_steps: int = 100
    """The window, in steps, over which ``nonfinite_max_offences`` counts a replica's offences.
    >= 1."""

    straggler_slow_ratio: float = 0.0
    """Straggler rebalancing ([Note: straggler quotas] in workload/rebalance.py): a replica whose
    measured compute seconds per microbatch stay above this many times the median of the
    others' for ``straggler_patience`` steps gets a quota proportional to its speed (B kept,
    exact mode's ids unchanged) until it recovers. 0: off (the default: plans never depend on
    timing); else > 1, e.g. 1.5."""

    straggler_recover_ratio: float = 1.2
    """A rebalanced replica gets its full quota back after ``straggler_patience`` steps under
    this many times the others' median; in [1, ``straggler_slow_ratio``): the band between the
    two is the hysteresis that keeps quotas from oscillating."""

    straggler_patience: int = 3
    """Steps in a row a replica must be out of its band before its quota changes (either way).
    >= 1."""

    data_plane: Literal["auto", "mpi", "torch"] = "auto"
    """Where the bytes of the cross-replica gradient sums travel ([Note: control plane and
    data plane] in groups/data_plane.py): ``mpi``, the fault-tolerant world's guarded
    all-reduce (host staging, btl/tcp); ``torch``, a torch.distributed group (gloo on CPU,
    NCCL on GPU) of the same-shard ranks of the alive replicas, rebuilt for every world
    epoch. Either way ULFM decides who is alive and whether an epoch was clean (the
    consensus), so B per step is unchanged. ``auto`` (default): ``torch`` when the model is
    on GPUs (NCCL: device buffers, no host staging, RDMA, overlapped with the backward),
    ``mpi`` on CPU (both are TCP there, and the MPI path's all-reduce measured faster on
    CPU: docs/data_plane.md)."""

    overlap_reduce: bool = True
    """``torch`` data plane: each bucket's sum is enqueued in its FSDP hook and waited for
    before the consensus, so the backward goes on meanwhile ([Note: overlapped bucket sums] in
    recovery/buckets.py); false: each sum is waited for in its hook. The ``mpi`` plane always
    waits in the hook."""

    wire_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of the cross-replica sum on the wire: ``fp32`` (exact: the failure-free
    trajectory to fp32 summation order) or ``bf16`` (half the bytes; each contribution is
    rounded to bf16 and summed in bf16, so the loss drifts from fp32's: docs/data_plane.md
    gives the measured effect). ``bf16`` needs ``data_plane = "torch"`` (MPI has no bf16
    sum) and is refused with the checks that need bitwise equality to stock TorchTitan
    (``save_final_params``, ``dump_step_gradients``)."""

    transport: Literal["tcp", "uct", "ofi"] = "tcp"
    """Open MPI's byte transport for the control plane and the ``mpi`` data plane: ``tcp``
    (btl tcp, what every test here runs), ``uct`` (btl uct: InfiniBand/RoCE verbs through
    UCX's UCT) or ``ofi`` (btl ofi: libfabric, e.g. EFA); both are fault tolerant in Open MPI
    5.0.10+. Checked at launch: the btl component must be in the installed Open MPI and its
    libraries (libibverbs / libuct, libfabric) loadable, or the launch stops with one line
    naming this field."""

    max_relaunches: int = 2
    """The relaunch tier ([Note: the relaunch tier] in cli/relaunch.py): when the MPI job ends
    without a completed summary (PRRTE lost a daemon: a host crashed or was cut off; a death
    before the fault-tolerant world was built), ``recover-hsdp train`` starts it again, at most
    this many times, from the newest complete checkpoint, on the hostfile's hosts minus the
    lost ones (plus the hostfile's unused hosts), with as many replicas as fit and B unchanged.
    0: off (the job's abnormal end is the launcher's error). Launch-time setting. >= 0."""

    daemon_keepalive_s: float = 30.0
    """The earliest PRRTE may give up on a cut-off host's daemon (TCP keepalive: 5 s idle, then 3
    probes this / 3 apart: ``--prtemca oob_tcp_keepalive_time/intvl/probes``); PRRTE 3.0 then
    ends the job, between this and this + 5 s after the cut. Until then the in-job tier trains
    on, the survivors save an emergency checkpoint and the launcher, finding the host silent,
    ends the job itself and relaunches from it, redoing no step ([Note: emergency checkpoint]
    in manager/manager.py). So this must exceed detect_timeout_s + a step + the save + the
    launcher's probe (10 s): raise it for large checkpoints. Measured before on the namespace
    cluster: 5 s idle + 2 x 1 s ended the job 2-7 s after a cut (before the checkpoint in most
    runs); PRRTE's defaults (300 s + 9 x 20 s) 488 s after. A live host's kernel answers the
    probes even while its daemon is busy. 0: PRRTE's defaults. Launch-time setting."""

    emergency_checkpoint: bool = True
    """After a repair that took every rank of a host out of the world (a crash, a cut link:
    a failure PRRTE ends the job for, soon after), save a DCP checkpoint at that step boundary
    whatever ``checkpoint.interval`` says ([Note: emergency checkpoint] in manager/manager.py),
    so a relaunch redoes at most the steps after it. Needs ``checkpoint.enable``."""

    faults: Faults = field(default_factory=Faults)
    """Failure injection for tests and demos."""


@dataclass
class JobConfig:
    """TorchTitan JobConfig extension adding the ``[recover]`` section."""

    recover: Recover = field(default_factory=Recover)


def recover_field_names() -> list[str]:
    return [f.name for f in fields(Recover)]


def load_toml(path: str | Path) -> dict:
    """Load a TOML config, turning every problem into a one-line ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: file {str(path)!r} not found: pass the path of a TOML "
                          "config, e.g. torchtitan_configs/debug_cpu.toml")
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config: {path} is not valid TOML ({err}): fix the syntax") from None
    section = data.get("recover", {})
    unknown = sorted(set(section) - set(recover_field_names()))
    unknown_faults = sorted(set(section.get("faults", {})) - {f.name for f in fields(Faults)})
    if unknown_faults:
        raise ConfigError(f"[recover.faults] {unknown_faults[0]}: unknown key in {path}: valid keys "
                          f"are {', '.join(f.name for f in fields(Faults))}; remove or rename it")
    if unknown:
        raise ConfigError(
            f"[recover] {unknown[0]}: unknown key in {path}: valid keys are "
            f"{', '.join(recover_field_names())}; remove or rename it")
    return data


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


def data_ranks_per_replica(ranks_per_replica: int, tensor_parallel_degree: int) -> int:
    """D, the FSDP (data-parallel) degree inside a replica of S = D x T ranks, or a one-line
    ConfigError.

    [Note: replica layout] A replica is TorchTitan's own parallel dims over its S ranks:
    FSDP degree D x tensor-parallel degree T (``parallelism.tensor_parallel_degree``), ranks
    ordered as TorchTitan's mesh orders them (replica rank s = d * T + t). The T ranks of one
    FSDP rank d compute the same microbatch (TP splits the layers, not the data): data is read
    per FSDP rank (D parts per replica), and the step's loss / token counts are counted once
    per FSDP rank (its t = 0 rank). Every rank holds its own gradient shard (FSDP x TP), so
    the cross-replica reduce is per replica rank s: the shard communicators of
    :mod:`recover_hsdp.collectives` join the ranks at the same s of every replica, whatever the
    inner layout."""
    if tensor_parallel_degree < 1 or ranks_per_replica % tensor_parallel_degree:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={tensor_parallel_degree} does not divide "
            f"recover.ranks_per_replica={ranks_per_replica}: a replica is FSDP x TP ranks; set "
            "--ranks-per-replica to FSDP degree x tensor_parallel_degree")
    return ranks_per_replica // tensor_parallel_degree


def check_world_size(world_size: int, ranks_per_replica: int) -> int:
    """Return R for an MPI world of ``world_size`` ranks, or raise a one-line ConfigError."""
    if ranks_per_replica < 1 or world_size % ranks_per_replica:
        raise ConfigError(
            f"recover.ranks_per_replica={ranks_per_replica} does not divide the MPI world size "
            f"{world_size}: launch R x S ranks (mpirun -np R*S) or change ranks_per_replica")
    return world_size // ranks_per_replica


def _check_relaunch_fields(rc) -> None:
    """``max_relaunches`` and ``daemon_keepalive_s`` ([Note: the relaunch tier])."""
    if rc.max_relaunches < 0:
        raise ConfigError(f"recover.max_relaunches={rc.max_relaunches}: use 0 (off) or a "
                          "positive number of relaunches")
    if rc.daemon_keepalive_s != 0 and rc.daemon_keepalive_s < 1:
        raise ConfigError(f"recover.daemon_keepalive_s={rc.daemon_keepalive_s}: use 0 (PRRTE's "
                          "defaults) or >= 1 second")


def validate(job_config, world_size: int | None = None) -> None:
    """Start-up validation of a parsed JobConfig (raises ConfigError)."""
    rc = job_config.recover
    if not rc.enable:
        return
    if world_size is not None:
        replicas = check_world_size(world_size, rc.ranks_per_replica)
        check_batch_sizes(job_config.training.local_batch_size,
                          job_config.training.global_batch_size, replicas,
                          data_ranks_per_replica(rc.ranks_per_replica,
                                                 job_config.parallelism.tensor_parallel_degree))
    from recover_hsdp.workload import validate_workload_fields

    try:
        validate_workload_fields(microbatches_per_replica=1, keep_spares=rc.keep_spares,
                                 data_assignment=rc.data_assignment, g_raise=rc.g_raise)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_dataset(job_config)
    _check_bad_replica_fields(rc)
    bad_steps = [s for s in rc.dump_step_gradients if not str(s).strip().isdigit()]
    if bad_steps:
        raise ConfigError(f"recover.dump_step_gradients={bad_steps[0]!r} is not a step number: "
                          "give step numbers, e.g. 3,7")
    phases = get_args(Faults.__annotations__["phase"])
    if rc.faults.phase not in phases:
        raise ConfigError(f"recover.faults.phase={rc.faults.phase!r}: use one of "
                          f"{', '.join(phases)}")
    _refuse_unsupported(job_config)
    _check_data_plane(rc)
    if job_config.training.mixed_precision_reduce != "float32":
        raise ConfigError("training.mixed_precision_reduce must be float32 with recover.enable: "
                          "gradient-bucket snapshots restore the fp32 reduce buffer in place")
    if rc.detect_timeout_s != 0 and rc.detect_timeout_s < 1.0:
        raise ConfigError(f"recover.detect_timeout_s={rc.detect_timeout_s}: use 0 (off) or >= 1 "
                          "second (heartbeat period = timeout / 4)")
    if rc.hang_timeout_s <= 0:
        raise ConfigError(f"recover.hang_timeout_s must be > 0 (got {rc.hang_timeout_s})")
    if rc.hang_floor_s <= 0:
        raise ConfigError(f"recover.hang_floor_s must be > 0 (got {rc.hang_floor_s}); set it to "
                          "hang_timeout_s for a fixed hang bound")
    if rc.hang_progress_factor < 1:
        raise ConfigError(f"recover.hang_progress_factor must be >= 1 (got "
                          f"{rc.hang_progress_factor}); the default is 40")
    _check_relaunch_fields(rc)
    par = job_config.parallelism
    data_ranks_per_replica(rc.ranks_per_replica, par.tensor_parallel_degree)
    if par.pipeline_parallel_degree != 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={par.pipeline_parallel_degree}: pipeline "
            "parallelism inside a replica is not supported (TorchTitan's pipeline schedule "
            "syncs FSDP gradients at the end of every schedule step, the step protocol needs one "
            "sync after a variable quota of microbatches; see docs/data_and_parallelism.md 'Parallelism inside a "
            "replica'); set it to 1")
    for name in ("context_parallel_degree", "expert_parallel_degree"):
        if getattr(par, name) != 1:
            raise ConfigError(f"parallelism.{name}={getattr(par, name)}: recover-hsdp supports "
                              "FSDP x TP inside a replica; set it to 1")


def _check_data_plane(rc) -> None:
    """``data_plane``, ``overlap_reduce``, ``wire_dtype`` and ``transport`` (the launch checks the transport's
    libraries: ``collectives.transport``)."""
    if not isinstance(rc.overlap_reduce, bool):
        raise ConfigError(f"recover.overlap_reduce={rc.overlap_reduce!r}: use true or false")
    for name in ("data_plane", "wire_dtype", "transport"):
        allowed = get_args(Recover.__annotations__[name])
        if getattr(rc, name) not in allowed:
            raise ConfigError(f"recover.{name}={getattr(rc, name)!r}: use one of "
                              f"{', '.join(allowed)}")
    from recover_hsdp.collectives.mpirun import check_transport

    try:
        check_transport(rc.transport)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if rc.wire_dtype == "bf16" and rc.data_plane != "torch":
        raise ConfigError("recover.wire_dtype=bf16 needs recover.data_plane=torch (MPI has no "
                          "bf16 sum): set data_plane = \"torch\" or wire_dtype = \"fp32\"")
    if rc.wire_dtype == "bf16" and (rc.save_final_params or rc.dump_step_gradients):
        field_name = "save_final_params" if rc.save_final_params else "dump_step_gradients"
        raise ConfigError(f"recover.wire_dtype=bf16 with recover.{field_name}: those outputs "
                          "are compared bitwise against fp32 runs, which bf16 sums cannot "
                          "match; use wire_dtype = \"fp32\"")


STREAMING_DATASETS = ("c4", "c4_validation")
"""TorchTitan datasets whose loader streams (``load_dataset(..., streaming=True)``); any other
dataset that loads as a stream is refused at start-up by the exact-mode packer."""


def _check_bad_replica_fields(rc) -> None:
    """The non-finite culprit and straggler fields, each refused in one line."""
    for name in ("nonfinite_max_offences", "nonfinite_window_steps"):
        value = getattr(rc, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"recover.{name} must be an integer >= 1 (got {value!r})")
    try:
        straggler_rule(rc).check()
    except ValueError as err:
        raise ConfigError(str(err)) from None


def straggler_rule(rc):
    """The ``[recover]`` straggler thresholds as the policy's ``StragglerRule``."""
    from recover_hsdp.workload import StragglerRule

    return StragglerRule(slow_ratio=float(rc.straggler_slow_ratio),
                         recover_ratio=float(rc.straggler_recover_ratio),
                         patience=rc.straggler_patience)


def _check_dataset(job_config) -> None:
    """Dataset x data assignment combinations that cannot work, each refused in one line."""
    training, rc = job_config.training, job_config.recover
    if rc.data_assignment == "exact" and training.dataset in STREAMING_DATASETS:
        raise ConfigError(f"recover.data_assignment=exact needs a map-style dataset (global "
                          f"microbatch ids), and training.dataset={training.dataset!r} is a "
                          "stream: use data_assignment = \"stream\", or a map-style dataset "
                          "(e.g. \"local_corpus\", \"c4_test\")")
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
