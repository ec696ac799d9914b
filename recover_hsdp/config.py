"""The ``[recover]`` TOML section: a TorchTitan JobConfig extension.

TorchTitan merges this module's ``JobConfig`` into its own when a config sets
``[job] custom_config_module = "recover_hsdp.config"`` (or ``--job.custom_config_module``).
``[recover]`` holds ``enable`` and ``ranks_per_replica``; everything else lives in one
sub-section per part (one dataclass each, TOML ``[recover.<section>]``, command line
``--recover.<section>.<field>``): ``workload``, ``timeouts``, ``reduce``, ``bad_replicas``,
``tiers``, ``debug`` and ``faults``. ``enable = false`` gives exactly stock TorchTitan behaviour.

The flat names of the first releases (``[recover] detect_timeout_s``,
``--recover.detect_timeout_s``) still work as deprecated aliases (:data:`ALIASES`): each parse
moves them into their sections ([Note: deprecated flat names]) and the launcher warns once per
alias used, in one line (:func:`deprecation_lines`).

Validation happens once, at start-up, in :func:`validate`: each section checks itself
(``check()``), then the checks that span sections or other TorchTitan sections; every error is
one line that names the field by its full path and the fix (:class:`ConfigError`).
"""


import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args

from tyro.conf import DisallowNone, Suppress

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib


from recover_hsdp.errors import ConfigError  # noqa: F401  (re-exported: the config's error type)


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

    consistency_check_interval: int = 50
    """Every this many steps compare a float64 checksum of each parameter shard across replicas
    and stop with an error if they diverged (one pass over the local shard + one float per rank
    on the wire; 0 disables). Default 50: the cost is negligible at that interval."""

    def check(self) -> None:
        _integer(self, "max_offences", 1)
        _integer(self, "offence_window_steps", 1)
        _integer(self, "consistency_check_interval", 0)
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
    failure PRRTE ends the job for, soon after), save a DCP checkpoint at that step boundary
    whatever ``checkpoint.interval`` says ([Note: emergency checkpoint] in manager/manager.py),
    so a relaunch redoes at most the steps after it. Needs ``checkpoint.enable``."""

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

    def check(self) -> None:
        _choice(self, "phase")


SECTIONS = {"workload": Workload, "timeouts": Timeouts, "reduce": Reduce,
            "bad_replicas": BadReplicas, "tiers": Tiers, "debug": Debug, "faults": Faults}
"""The sub-sections of ``[recover]``: field name on :class:`Recover` -> dataclass."""

ALIASES = {
    "data_assignment": ("workload", "data_assignment"),
    "keep_spares": ("workload", "keep_spares"),
    "g_raise": ("workload", "g_raise"),
    "data_seed": ("workload", "data_seed"),
    "detect_timeout_s": ("timeouts", "detect_s"),
    "hang_timeout_s": ("timeouts", "hang_s"),
    "hang_floor_s": ("timeouts", "hang_floor_s"),
    "hang_progress_factor": ("timeouts", "hang_progress_factor"),
    "data_plane": ("reduce", "plane"),
    "overlap_reduce": ("reduce", "overlap"),
    "wire_dtype": ("reduce", "wire_dtype"),
    "transport": ("reduce", "transport"),
    "host_snapshots": ("reduce", "host_snapshots"),
    "nonfinite_max_offences": ("bad_replicas", "max_offences"),
    "nonfinite_window_steps": ("bad_replicas", "offence_window_steps"),
    "straggler_slow_ratio": ("bad_replicas", "slow_ratio"),
    "straggler_recover_ratio": ("bad_replicas", "recover_ratio"),
    "straggler_patience": ("bad_replicas", "slow_patience"),
    "consistency_check_interval": ("bad_replicas", "consistency_check_interval"),
    "respawn_after_steps": ("tiers", "respawn_after_steps"),
    "max_relaunches": ("tiers", "max_relaunches"),
    "daemon_keepalive_s": ("tiers", "daemon_keepalive_s"),
    "emergency_checkpoint": ("tiers", "emergency_checkpoint"),
    "save_final_params": ("debug", "save_final_params"),
    "dump_step_gradients": ("debug", "dump_step_gradients"),
    "log_samples": ("debug", "log_samples"),
}
"""Deprecated flat ``[recover]`` names (the first releases') -> (section, field)."""


@dataclass
class Recover:
    enable: bool = False
    """Train with ReCoVer: one MPI rank per device, replicas of ``ranks_per_replica`` FSDP ranks,
    cross-replica gradient reduce through fault-tolerant MPI. False: stock TorchTitan."""

    ranks_per_replica: int = 1
    """S, the ranks of one replica (its torch.distributed world): FSDP degree x
    ``parallelism.tensor_parallel_degree`` ([Note: replica layout]). The number of replicas R is
    the MPI world size divided by S. A replica lives or dies as a unit."""

    workload: Workload = field(default_factory=Workload)
    """Which replica computes what: data assignment, spares, how G rises."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    """Failure detection: the heartbeat detector and the hang watchdog."""

    reduce: Reduce = field(default_factory=Reduce)
    """The cross-replica gradient sums: data plane, wire dtype, transport, snapshots."""

    bad_replicas: BadReplicas = field(default_factory=BadReplicas)
    """Live but bad replicas: non-finite culprits, stragglers, parameter consistency."""

    tiers: Tiers = field(default_factory=Tiers)
    """Recovery beyond the step: rejoin, emergency checkpoint, relaunch."""

    debug: Debug = field(default_factory=Debug)
    """Test and audit outputs."""

    faults: Faults = field(default_factory=Faults)
    """Failure injection for tests and demos."""

    # Deprecated flat aliases (ALIASES): None = not given. __post_init__ moves each given one into
    # its section and resets it ([Note: deprecated flat names]); nothing else reads them.
    data_assignment: DisallowNone[Literal["exact", "stream"] | None] = None
    """Deprecated alias of ``recover.workload.data_assignment``."""
    keep_spares: DisallowNone[bool | None] = None
    """Deprecated alias of ``recover.workload.keep_spares``."""
    g_raise: DisallowNone[Literal["ceil", "reserve"] | None] = None
    """Deprecated alias of ``recover.workload.g_raise``."""
    data_seed: DisallowNone[int | None] = None
    """Deprecated alias of ``recover.workload.data_seed``."""
    detect_timeout_s: DisallowNone[float | None] = None
    """Deprecated alias of ``recover.timeouts.detect_s``."""
    hang_timeout_s: DisallowNone[float | None] = None
    """Deprecated alias of ``recover.timeouts.hang_s``."""
    hang_floor_s: DisallowNone[float | None] = None
    """Deprecated alias of ``recover.timeouts.hang_floor_s``."""
    hang_progress_factor: DisallowNone[float | None] = None
    """Deprecated alias of ``recover.timeouts.hang_progress_factor``."""
    data_plane: DisallowNone[Literal["auto", "mpi", "torch"] | None] = None
    """Deprecated alias of ``recover.reduce.plane``."""
    overlap_reduce: DisallowNone[bool | None] = None
    """Deprecated alias of ``recover.reduce.overlap``."""
    wire_dtype: DisallowNone[Literal["fp32", "bf16"] | None] = None
    """Deprecated alias of ``recover.reduce.wire_dtype``."""
    transport: DisallowNone[Literal["tcp", "uct", "ofi"] | None] = None
    """Deprecated alias of ``recover.reduce.transport``."""
    host_snapshots: DisallowNone[bool | None] = None
    """Deprecated alias of ``recover.reduce.host_snapshots``."""
    nonfinite_max_offences: DisallowNone[int | None] = None
    """Deprecated alias of ``recover.bad_replicas.max_offences``."""
    nonfinite_window_steps: DisallowNone[int | None] = None
    """Deprecated alias of ``recover.bad_replicas.offence_window_steps``."""
    straggler_slow_ratio: DisallowNone[float | None] = None
    """Deprecated alias of ``recover.bad_replicas.slow_ratio``."""
    straggler_recover_ratio: DisallowNone[float | None] = None
    """Deprecated alias of ``recover.bad_replicas.recover_ratio``."""
    straggler_patience: DisallowNone[int | None] = None
    """Deprecated alias of ``recover.bad_replicas.slow_patience``."""
    consistency_check_interval: DisallowNone[int | None] = None
    """Deprecated alias of ``recover.bad_replicas.consistency_check_interval``."""
    respawn_after_steps: DisallowNone[int | None] = None
    """Deprecated alias of ``recover.tiers.respawn_after_steps``."""
    max_relaunches: DisallowNone[int | None] = None
    """Deprecated alias of ``recover.tiers.max_relaunches``."""
    daemon_keepalive_s: DisallowNone[float | None] = None
    """Deprecated alias of ``recover.tiers.daemon_keepalive_s``."""
    emergency_checkpoint: DisallowNone[bool | None] = None
    """Deprecated alias of ``recover.tiers.emergency_checkpoint``."""
    save_final_params: DisallowNone[bool | None] = None
    """Deprecated alias of ``recover.debug.save_final_params``."""
    dump_step_gradients: DisallowNone[list[str] | None] = None
    """Deprecated alias of ``recover.debug.dump_step_gradients`` (comma-separated steps)."""
    log_samples: DisallowNone[bool | None] = None
    """Deprecated alias of ``recover.debug.log_samples``."""

    aliases_used: Suppress[dict] = field(default_factory=dict)
    """Bookkeeping, not a setting: deprecated alias -> the value it moved into its section
    ([Note: deprecated flat names]); neither TOML nor the command line can set it."""

    def __post_init__(self):
        _move_aliases(self)  # [Note: deprecated flat names]


@dataclass
class JobConfig:
    """TorchTitan JobConfig extension adding the ``[recover]`` section."""

    recover: Recover = field(default_factory=Recover)


def recover_field_names() -> list[str]:
    """The keys ``[recover]`` accepts: its own fields, its sections and the deprecated aliases."""
    return [f.name for f in fields(Recover) if f.name != "aliases_used"]


def resolve_aliases(job_config) -> list[str]:
    """Move every deprecated flat ``[recover]`` alias still set on ``job_config.recover`` into its
    section (:meth:`Recover.__post_init__` already did so for a parsed config: this is for one
    changed since, e.g. by hand); return their old names. Idempotent."""
    return _move_aliases(job_config.recover)


def _move_aliases(rc: "Recover") -> list[str]:
    """[Note: deprecated flat names] Each alias given (not None) goes into its section field,
    is reset to None and recorded in ``rc.aliases_used``; the old names moved are returned.
    This runs at construction, so every parse is resolved for every reader (the launcher, every
    rank, stock ranks too): TorchTitan's ConfigManager builds ``Recover`` from the TOML file,
    then tyro builds it again with the command line, taking the first one's values (the record
    included: a suppressed field) as defaults. So a command-line alias overrides the same alias
    in the file, as it always did. An alias and its new field both given with different values
    is a one-line ConfigError; "given" for the new field means "not at its default and not put
    there by an alias" (a parsed config cannot tell an explicit default from an absent one, so
    an alias wins over a new field set to its default value)."""
    moved = []
    for old, (section_name, new) in ALIASES.items():
        value = getattr(rc, old)
        if value is None:
            continue
        if old == "dump_step_gradients":  # the list[str] rule splits on commas; keep that
            value = [part for s in value for part in str(s).split(",") if part.strip()]
        section = getattr(rc, section_name)
        current = getattr(section, new)
        from_alias = old in rc.aliases_used and rc.aliases_used[old] == current
        if current != _default(type(section), new) and current != value and not from_alias:
            raise ConfigError(
                f"recover.{old}={value!r} (deprecated alias) and recover.{section_name}.{new}="
                f"{current!r} disagree: keep only [recover.{section_name}] {new}")
        setattr(section, new, value)
        setattr(rc, old, None)
        rc.aliases_used = {**rc.aliases_used, old: value}
        moved.append(old)
    return moved


def deprecation_lines(job_config) -> list[str]:
    """One warning line per deprecated alias the config used (file or command line), in
    :data:`ALIASES` order."""
    used = getattr(job_config.recover, "aliases_used", {})
    return [f"recover-hsdp: [recover] {old} is deprecated: use [recover.{section}] {new} "
            f"(--recover.{section}.{new})"
            for old, (section, new) in ALIASES.items() if old in used]


_WARNED: set[str] = set()
"""Lines this process has printed already (a relaunch re-reads the config)."""


def warn_deprecated(lines: list[str]) -> None:
    """Print each line to stderr, once per process (the launcher; the ranks stay quiet)."""
    for line in lines:
        if line not in _WARNED:
            _WARNED.add(line)
            print(line, file=sys.stderr, flush=True)


def _default(cls, name: str):
    f = next(f for f in fields(cls) if f.name == name)
    return f.default_factory() if callable(f.default_factory) else f.default


def load_toml(path: str | Path) -> dict:
    """Load a TOML config, turning every problem into a one-line ConfigError (unknown keys in
    ``[recover]`` and its sections included; the deprecated aliases are known keys)."""
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
    for name, cls in SECTIONS.items():
        if name not in section:
            continue
        if not isinstance(section[name], dict):
            raise ConfigError(f"[recover] {name} = {section[name]!r} in {path}: {name} is a "
                              f"section; write its fields under [recover.{name}]")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(section[name]) - set(valid))
        if unknown:
            raise ConfigError(f"[recover.{name}] {unknown[0]}: unknown key in {path}: valid keys "
                              f"are {', '.join(valid)}; remove or rename it")
    unknown = sorted(set(section) - set(recover_field_names()))
    if unknown:
        raise ConfigError(
            f"[recover] {unknown[0]}: unknown key in {path}: valid keys are enable, "
            f"ranks_per_replica and the sections {', '.join(f'[recover.{s}]' for s in SECTIONS)} "
            "(the old flat names still work as deprecated aliases); remove or rename it")
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
                          job_config.training.global_batch_size, replicas,
                          data_ranks_per_replica(rc.ranks_per_replica,
                                                 job_config.parallelism.tensor_parallel_degree))
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
    data_ranks_per_replica(rc.ranks_per_replica, par.tensor_parallel_degree)
    if par.pipeline_parallel_degree != 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={par.pipeline_parallel_degree}: pipeline "
            "parallelism inside a replica is not supported (TorchTitan's pipeline schedule "
            "syncs FSDP gradients at the end of every schedule step, the step protocol needs one "
            "sync after a variable quota of microbatches; see docs/data_and_parallelism.md "
            "'Parallelism inside a replica'); set it to 1")
    for name in ("context_parallel_degree", "expert_parallel_degree"):
        if getattr(par, name) != 1:
            raise ConfigError(f"parallelism.{name}={getattr(par, name)}: recover-hsdp supports "
                              "FSDP x TP inside a replica; set it to 1")


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
