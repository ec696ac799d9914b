"""The sub-sections of ``[recover]`` (``[recover.<section>]``, ``--recover.<section>.<field>``):
one dataclass per part, each with a docstring under every field and a ``check()`` that refuses a
bad value in one line naming the field by its full path and the fix. :data:`SECTIONS` lists
them; ``recover_hsdp.config`` puts them on ``Recover``."""

from dataclasses import dataclass, field
from typing import Literal, get_args

from recover_hsdp.errors import ConfigError


def _choice(section, name: str) -> None:
    """A Literal field holding one of its values, else a one-line ConfigError."""
    allowed = get_args(type(section).__annotations__[name])
    value = getattr(section, name)
    if value not in allowed:
        raise ConfigError(f"recover.{section.NAME}.{name}={value!r}: use one of "
                          f"{', '.join(allowed)}")


def _integer(section, name: str, minimum: int) -> None:
    value = getattr(section, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"recover.{section.NAME}.{name} must be an integer >= {minimum} "
                          f"(got {value!r})")


def _boolean(section, name: str) -> None:
    value = getattr(section, name)
    if not isinstance(value, bool):
        raise ConfigError(f"recover.{section.NAME}.{name}={value!r}: use true or false")


@dataclass
class Workload:
    """Which replica computes what (``[recover.workload]``); see :mod:`recover_hsdp.workload`."""

    NAME = "workload"

    data_assignment: Literal["exact", "stream"] = "exact"
    """``exact``: step t commits exactly global microbatch ids t*B..t*B+B-1, also after failures
    (needs an indexable dataset, e.g. local_corpus). ``stream``: each replica draws its quota from
    its own shard of an endless stream (the paper). Default ``exact``: a failure changes neither
    the data nor the trajectory."""

    keep_spares: bool = True
    """After G is raised, replicas beyond what the quota needs become spares (compute G, contribute
    zero unless promoted) instead of idling. Default on: a spare is promoted without waiting."""

    g_raise: Literal["ceil", "reserve"] = "ceil"
    """How G rises when replicas are lost: ``ceil`` (G = ceil(B / W)) or ``reserve`` (keep a spare
    while two or more replicas live). Default ``ceil``: the fewest microbatches per replica."""

    data_seed: int = 0
    """Seed of the fixed shuffle of the local corpus's packed sequences (a different seed gives
    a different data order with the same statistics)."""

    def check(self) -> None:
        from recover_hsdp.workload import validate_workload_fields

        try:
            validate_workload_fields(microbatches_per_replica=1, keep_spares=self.keep_spares,
                                     data_assignment=self.data_assignment, g_raise=self.g_raise)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        _integer(self, "data_seed", 0)


@dataclass
class Timeouts:
    """How a dead or hung rank is found (``[recover.timeouts]``); [Note: a hang bound from
    progress] in collectives/guard.py."""

    NAME = "timeouts"

    detect_s: float = 4.0
    """A rank whose heartbeats stop for this long is declared dead: a frozen process (SIGSTOP, a
    kernel stall), a host that lost power or its link (no connection reset is ever seen). Open
    MPI's heartbeat detector on its own thread, period ``detect_s / 4``; it beats while the main
    thread computes, so a long step is never mistaken for a death. Default 4 s: found in about
    that long, with margin for a loaded host (docs/ULFM_NOTES.md "Config field history"). Lower:
    faster detection, less margin for an overloaded host's start-up. 0 disables it (then only
    deaths that close their sockets are seen, and the hang watchdog). Launch-time setting
    (mpirun flags)."""

    slow_phase_s: float = 30.0
    """Both liveness signals' silence bound while a rank is in a phase allowed to be slow (its
    start-up until the first committed step, a checkpoint save or load, a rejoin's transfer):
    [Note: detection margins by phase] in groups/heartbeat.py. Open MPI's detector is launched
    with it and each rank lowers its own to ``detect_s`` once steady ([Note: Open MPI's detector
    timeout by phase] in collectives/detector.py). A dead process is still found at once (its
    sockets close); a frozen rank or a silent host during such a phase waits this long. Default
    30 s: above the longest beat gap measured at a loaded start-up (docs/failures.md), far below
    ``hang_s``. Also the cap of the steady bound each observer learns from late beats (3 x the
    largest gap of the last minute, never below ``detect_s``: [Note: a steady timeout learned
    from beat gaps] in groups/gap_bound.py); set it to ``detect_s`` for no margin at all."""

    preconnect_max_ranks: int = 512
    """Jobs of at most this many ranks open every MPI connection inside MPI_Init
    (``mpi_preconnect_mpi``; 0: never): lazily, the detector thread's first heartbeat to a rank on
    another host waited on the TCP handshake and missed its deadline (a false "suspected dead" at
    start-up: [Note: detection margins by phase]). Costs a socket per other rank per rank and
    O(ranks) rounds in MPI_Init, hence the bound. Launch-time setting."""

    hang_s: float = 300.0
    """A rank whose main thread shows no progress for this long kills itself, so that a hung rank
    becomes an ordinary death (MPI-call deadlines are derived from it). From the second step on
    the bound is learned from the rank's own progress (``hang_floor_s``) and this is its
    ceiling. Default 300 s: longer than any step or start-up phase of the configs here."""

    hang_floor_s: float = 30.0
    """The learned hang bound's floor: a stuck rank is found after max(this,
    ``hang_progress_factor`` x its longest gap between two beats (microbatch, FSDP bucket, MPI
    call) in the last 20 steps), at most ``hang_s``. Default 30 s: a hang is found in about
    that long rather than ``hang_s``. Set it to ``hang_s`` for a fixed bound."""

    hang_progress_factor: float = 40.0
    """How many times longer than its longest recent gap a rank may go without progress. A gap
    that grows less than this at once (a microbatch 20x slower) is never taken for a hang."""

    def check(self) -> None:
        if self.detect_s != 0 and self.detect_s < 1.0:
            raise ConfigError(f"recover.timeouts.detect_s={self.detect_s}: use 0 (off) or >= 1 "
                              "second (heartbeat period = timeout / 4)")
        if self.detect_s and self.slow_phase_s < self.detect_s:
            raise ConfigError(f"recover.timeouts.slow_phase_s={self.slow_phase_s} is below "
                              f"recover.timeouts.detect_s={self.detect_s}: set it >= detect_s "
                              "(the margin of a slow phase; default 30)")
        if not isinstance(self.preconnect_max_ranks, int) or self.preconnect_max_ranks < 0:
            raise ConfigError(f"recover.timeouts.preconnect_max_ranks must be an integer >= 0 "
                              f"(got {self.preconnect_max_ranks!r}); 0 never preconnects")
        if self.hang_s <= 0:
            raise ConfigError(f"recover.timeouts.hang_s must be > 0 (got {self.hang_s})")
        if self.hang_floor_s <= 0:
            raise ConfigError(f"recover.timeouts.hang_floor_s must be > 0 (got "
                              f"{self.hang_floor_s}); set it to recover.timeouts.hang_s for a "
                              "fixed hang bound")
        if self.hang_progress_factor < 1:
            raise ConfigError(f"recover.timeouts.hang_progress_factor must be >= 1 (got "
                              f"{self.hang_progress_factor}); the default is 40")


@dataclass
class Reduce:
    """How the cross-replica gradient sums travel (``[recover.reduce]``): [Note: control plane
    and data plane] in groups/data_plane.py."""

    NAME = "reduce"

    plane: Literal["auto", "mpi", "torch"] = "auto"
    """Where the bytes of the cross-replica gradient sums travel: ``mpi``, the fault-tolerant
    world's guarded all-reduce (host staging, btl/tcp); ``torch``, a torch.distributed group (gloo
    on CPU, NCCL on GPU) of the same-shard ranks of the alive replicas, rebuilt for every world
    epoch. Either way ULFM decides who is alive and whether an epoch was clean (the consensus),
    so B per step is unchanged. ``auto`` (default): ``torch`` when the model is on GPUs (NCCL:
    device buffers, no host staging, RDMA, overlapped with the backward), ``mpi`` on CPU (both
    are TCP there, and the MPI path is the faster one: docs/data_plane.md)."""

    overlap: bool = True
    """``torch`` plane: each bucket's sum is enqueued in its FSDP hook and waited for before the
    consensus, so the backward goes on meanwhile ([Note: overlapped bucket sums] in
    recovery/buckets.py); false: each sum is waited for in its hook. The ``mpi`` plane always
    waits in the hook."""

    wire_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of the cross-replica sum on the wire: ``fp32`` (default, exact: the failure-free
    trajectory to fp32 summation order) or ``bf16`` (half the bytes; each contribution is rounded
    to bf16 and summed in bf16, so the loss drifts from fp32's: docs/data_plane.md gives the
    effect). ``bf16`` needs ``plane = "torch"`` (MPI has no bf16 sum) and is refused with the
    ``[recover.debug]`` outputs that need bitwise equality to stock TorchTitan."""

    transport: Literal["tcp", "uct", "ofi"] = "tcp"
    """Open MPI's byte transport for the control plane and the ``mpi`` plane: ``tcp`` (btl tcp,
    the default: what every test here runs), ``uct`` (btl uct: InfiniBand/RoCE verbs through
    UCX's UCT) or ``ofi`` (btl ofi: libfabric, e.g. EFA); both are fault tolerant in Open MPI
    5.0.10+. Checked at launch (:func:`recover_hsdp.collectives.mpirun.check_transport`): the btl
    component must be in the installed Open MPI and its libraries (libibverbs / libuct,
    libfabric) loadable, or the launch stops with one line naming this field."""

    host_snapshots: bool = False
    """GPU runs: keep gradient-bucket snapshots in pinned host memory instead of device memory.
    Default off: device snapshots restore fastest; turn on when device memory is short."""

    def check(self) -> None:
        _boolean(self, "overlap")
        _boolean(self, "host_snapshots")
        for name in ("plane", "wire_dtype", "transport"):
            _choice(self, name)
        from recover_hsdp.collectives.mpirun import check_transport

        try:
            check_transport(self.transport)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.wire_dtype == "bf16" and self.plane != "torch":
            raise ConfigError("recover.reduce.wire_dtype=bf16 needs recover.reduce.plane=torch "
                              "(MPI has no bf16 sum): set plane = \"torch\" or wire_dtype = "
                              "\"fp32\" in [recover.reduce]")


@dataclass
class BadReplicas:
    """Replicas that stay alive but hurt the step (``[recover.bad_replicas]``): non-finite
    contributions ([Note: bad replicas] in manager/culprits.py), stragglers ([Note: straggler
    quotas] in workload/rebalance.py) and diverged parameters."""

    NAME = "bad_replicas"

    max_offences: int = 3
    """A replica whose contribution to a step is non-finite (NaN/Inf gradient or loss) is excluded
    from that step only; after this many such offences within ``offence_window_steps`` steps it
    is retired as a unit instead (it may come back fresh through the rejoin path,
    ``recover.tiers.respawn_after_steps``). >= 1."""

    offence_window_steps: int = 100
    """The window, in steps, over which ``max_offences`` counts a replica's offences. >= 1."""

    slow_ratio: float = 0.0
    """Straggler rebalancing: a replica whose measured compute seconds per microbatch stay above
    this many times the median of the others' for ``slow_patience`` steps gets a quota
    proportional to its speed (B kept, exact mode's ids unchanged) until it recovers. 0: off (the
    default: plans never depend on timing); else > 1, e.g. 1.5."""

    recover_ratio: float = 1.2
    """A rebalanced replica gets its full quota back after ``slow_patience`` steps under this many
    times the others' median; in [1, ``slow_ratio``): the band between the two is the hysteresis
    that keeps quotas from oscillating."""

    slow_patience: int = 3
    """Steps in a row a replica must be out of its band before its quota changes (either way).
    >= 1."""

    consistency_check_interval: int = 1
    """Every this many steps the replicas vote on an exact fingerprint of their parameter
    shards ([Note: divergence votes] in manager/divergence.py): a replica whose bits differ
    from a strict majority's leaves before the update; no strict majority refuses the step.
    One read of the local shard, no message of its own (it rides in the step's totals
    all-reduce); 0 disables. Default 1: only a vote every step keeps a diverged replica's
    gradient out of every commit (with K > 1 up to K - 1 steps of it are summed into everyone's
    update, where no later vote can see it); measured cost (benchmarks/fingerprint_bench.py,
    CPU, the debug model): 1.7-3.8% of a 256-token step, 0.14% of a 4 x 1024-token one; it falls
    with the tokens per step (on a GPU the read runs at memory bandwidth)."""

    audit_interval: int = 0
    """Every this many steps each replica that commits work has one of its microbatches
    computed again by another replica and the two compared ([Note: gradient audits] in
    manager/audits.py): a pair that differs is settled by a third computation and its culprit
    excluded from the step like a non-finite one (``max_offences`` retire it). Finds a backward
    that is wrong but finite (a bad ALU), which nothing else sees. 0: off (the default). Costs 2
    microbatches of compute per replica per audit step (``benchmarks/fingerprint_bench.py``);
    exact data assignment only."""

    audit_tolerance: float = 1e-5
    """Two signatures of the same microbatch agree when each statistic (loss, gradient sum, sum
    of |g|, sum of g^2) differs by at most this much relative to its scale. On CPU the two
    computations are bitwise equal (measured 0); on a GPU with non-deterministic kernels set it
    above their noise (each step's record carries ``audit.max_rel_diff``). A corruption
    smaller than this is not found. In [0, 1)."""

    def check(self) -> None:
        _integer(self, "max_offences", 1)
        _integer(self, "offence_window_steps", 1)
        _integer(self, "consistency_check_interval", 0)
        _integer(self, "audit_interval", 0)
        tolerance = self.audit_tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) \
                or not 0 <= tolerance < 1:
            raise ConfigError(f"recover.bad_replicas.audit_tolerance must be a number in [0, 1), "
                              f"e.g. 1e-5 (got {tolerance!r})")
        try:
            self.straggler_rule().check()
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def straggler_rule(self):
        """The straggler thresholds as the policy's ``StragglerRule``."""
        from recover_hsdp.workload import StragglerRule

        return StragglerRule(slow_ratio=float(self.slow_ratio),
                             recover_ratio=float(self.recover_ratio), patience=self.slow_patience)


@dataclass
class Tiers:
    """The recovery tiers beyond in-step repair (``[recover.tiers]``): rejoin, the emergency
    checkpoint and the relaunch."""

    NAME = "tiers"

    respawn_after_steps: int = 0
    """Replica rejoin ([Note: rejoin at a boundary] in manager/rejoin.py): this many steps after a
    replica was lost the survivors spawn a replacement (through mpirun's PRRTE, on the job's
    hosts) at a step boundary; it receives the live state from a replica and G goes back toward
    G_init. 0 (default): off (``recover-hsdp join --out DIR`` still brings one back on
    request)."""

    max_relaunches: int = 2
    """The relaunch tier ([Note: the relaunch tier] in cli/relaunch.py): when the MPI job ends
    without a completed summary (PRRTE lost a daemon: a host crashed or was cut off; a death
    before the fault-tolerant world was built), ``recover-hsdp train`` starts it again, at most
    this many times, from the newest complete checkpoint, on the hostfile's hosts minus the lost
    ones (plus the hostfile's unused hosts), with as many replicas as fit and B unchanged. 0:
    off (the job's abnormal end is the launcher's error). Launch-time setting. >= 0."""

    daemon_keepalive_s: float = 30.0
    """The earliest PRRTE may give up on a cut-off host's daemon (TCP keepalive: 5 s idle, then 3
    probes this / 3 apart: ``--prtemca oob_tcp_keepalive_time/intvl/probes``); PRRTE then ends the
    job between this and this + 5 s after the cut. Until then the in-job tier trains on, the
    survivors save an emergency checkpoint and the launcher, finding the host silent, ends the job
    itself and relaunches from it, redoing no step ([Note: emergency checkpoint] in
    manager/manager.py). So this must exceed ``recover.timeouts.detect_s`` + a step + the save +
    the launcher's probe (10 s): raise it for large checkpoints. A live host's kernel answers the
    probes even while its daemon is busy. 0: PRRTE's defaults (300 s + 9 x 20 s). Launch-time
    setting."""

    emergency_checkpoint: bool = True
    """After a repair that took every rank of a host out of the world (a crash, a cut link: a
    failure PRRTE ends the job for, soon after), save the state at that step boundary whatever
    the intervals say ([Note: emergency checkpoint] in manager/manager.py): a host-memory
    generation (``memory_snapshot_interval`` > 0) and a DCP checkpoint (``checkpoint.enable``),
    so a relaunch redoes no step."""

    memory_snapshot_interval: int = 5
    """Host-memory state ([Note: host-memory state] in recovery/host_state.py): every this many
    steps each rank copies its shard of the training state to host memory and writes it in the
    background under ``memory_snapshot_dir`` on its own host; a relaunch after a lost node
    resumes from the survivors' copies (no shared filesystem, no ``checkpoint.enable``): no step
    redone after a cut link (the emergency boundary), at most this many after a host killed
    with its daemon. The default comes from the measured cost (benchmarks/relaunch_bench.py).
    0: off (the emergency boundary too)."""

    memory_snapshot_dir: str = "/dev/shm/recover-hsdp"
    """Where the host-memory state lives on each host (absolute; host-local memory by default:
    it must outlive a rank's process, not its host). The job's folder in it is removed when the
    run ends."""

    resume_from_memory: int = 0
    """Set by the relaunch tier ([Note: the relaunch tier] in cli/relaunch.py): the step of the
    host-memory generation the relaunched ranks load. 0: none (a DCP checkpoint or step 0)."""

    def check(self) -> None:
        """``max_relaunches`` and ``daemon_keepalive_s`` ([Note: the relaunch tier])."""
        _integer(self, "respawn_after_steps", 0)
        if self.max_relaunches < 0:
            raise ConfigError(f"recover.tiers.max_relaunches={self.max_relaunches}: use 0 (off) "
                              "or a positive number of relaunches")
        if self.daemon_keepalive_s != 0 and self.daemon_keepalive_s < 1:
            raise ConfigError(f"recover.tiers.daemon_keepalive_s={self.daemon_keepalive_s}: use 0 "
                              "(PRRTE's defaults) or >= 1 second")
        _boolean(self, "emergency_checkpoint")
        _integer(self, "memory_snapshot_interval", 0)
        _integer(self, "resume_from_memory", 0)
        if not str(self.memory_snapshot_dir).startswith("/"):
            raise ConfigError(f"recover.tiers.memory_snapshot_dir={self.memory_snapshot_dir!r}: "
                              "use an absolute path on each host's local memory or disk "
                              "(e.g. /dev/shm/recover-hsdp)")


@dataclass
class Debug:
    """Outputs for tests and audits (``[recover.debug]``); all off by default."""

    NAME = "debug"

    save_final_params: bool = False
    """At the end of the run write the full (unsharded) parameters to ``final_params.pt`` in
    ``job.dump_folder`` (the equivalence tests; costs one gather of the model)."""

    dump_step_gradients: list[str] = field(default_factory=list)
    """Steps (comma-separated on the command line) at which the writer saves the full parameters
    before the update and the committed (reduced, unclipped) gradient to ``grads_step<N>.pt``
    (oracle tests)."""

    log_samples: bool = False
    """Each rank writes what its replica committed to ``samples/rank<N>.jsonl`` in
    ``job.dump_folder`` (data reference, sequence ids, CRC-32 of each sequence's tokens): a
    per-step audit of the data (tests check it against data recomputed on one process)."""

    def check(self) -> None:
        bad_steps = [s for s in self.dump_step_gradients if not str(s).strip().isdigit()]
        if bad_steps:
            raise ConfigError(f"recover.debug.dump_step_gradients={bad_steps[0]!r} is not a step "
                              "number: give step numbers, e.g. 3,7")


@dataclass
class Faults:
    """Real failure injection (``[recover.faults]``); see :mod:`recover_hsdp.faults`."""

    NAME = "faults"

    inject: str = ""
    """Faults, separated by ";" (one string: each spec contains commas):
    ``replica=R,step=N,phase=P[,rank=K][,mode=M][,bucket=B]`` with P in
    forward|backward|grad_sync|consensus|rereduce|optimizer|checkpoint|finish and M in
    sigkill|exit|hang|stop|raise|busy, or a replica that stays alive but is bad: nan (grad_sync,
    ``bucket=B``), inf_loss, slow (forward, ``seconds=S`` per microbatch, ``steps=K``), bitflip
    (optimizer, ``element=E``, ``bit=K``: one bit of the parameter shard after the update) (see
    :mod:`recover_hsdp.faults`)."""

    every: int = 0
    """Paper-like schedule: one failure per ``every`` steps at a seeded random step in each
    interval (0: off); its victim is drawn among the replicas alive at that step, newcomers
    included, never the lowest alive one."""

    max_failures: int = 0
    """Schedule: this many failures in all."""

    modes: str = "sigkill"
    """Schedule: the modes each failure is drawn from, comma-separated (sigkill, exit, hang,
    stop, raise, nan, inf_loss, bitflip; e.g. ``"sigkill,stop,raise,nan,bitflip"``); nan fires
    at grad_sync and bitflip at optimizer whatever ``phase`` says."""

    phase: Literal["forward", "backward", "grad_sync", "consensus", "rereduce", "optimizer",
                   "checkpoint", "finish", "join"] = "grad_sync"
    """Schedule: the phase the scheduled failures hit."""

    seed: int = 0
    """Schedule: seed of the failure steps and victims."""

    def check(self) -> None:
        _choice(self, "phase")
        _integer(self, "every", 0)
        _integer(self, "max_failures", 0)
        from recover_hsdp.faults import Phase, schedule_modes

        schedule_modes(self.modes, Phase(self.phase))


SECTIONS = {"workload": Workload, "timeouts": Timeouts, "reduce": Reduce,
            "bad_replicas": BadReplicas, "tiers": Tiers, "debug": Debug, "faults": Faults}
"""The sub-sections of ``[recover]``: field name on :class:`Recover` -> dataclass."""
