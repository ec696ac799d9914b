"""The ``[recover]`` TOML section: a TorchTitan JobConfig extension.

TorchTitan merges this module's ``JobConfig`` into its own when a config sets
``[job] custom_config_module = "recover_hsdp.config"`` (or ``--job.custom_config_module``).
``[recover]`` holds ``enable`` and ``ranks_per_replica``; everything else lives in one
sub-section per part (one dataclass each, TOML ``[recover.<section>]``, command line
``--recover.<section>.<field>``): ``workload``, ``timeouts``, ``reduce``, ``bad_replicas``,
``tiers``, ``debug`` and ``faults``. ``enable = false`` gives exactly stock TorchTitan behaviour.

The sections are in :mod:`recover_hsdp.config.sections` (a docstring under every field). The
flat names of the first releases (``[recover] detect_timeout_s``, ``--recover.detect_timeout_s``)
still work as deprecated aliases: each parse moves them into their sections and the launcher
warns once per alias used, in one line (:mod:`recover_hsdp.config.aliases`, [Note: deprecated
flat names]).

Validation happens once, at start-up, in :func:`validate` (:mod:`recover_hsdp.config.checks`):
each section checks itself (``check()``), then the checks that span sections or other TorchTitan
sections; every error is one line that names the field by its full path and the fix
(:class:`ConfigError`). Everything is importable from ``recover_hsdp.config``.
"""

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from tyro.conf import DisallowNone, Suppress

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib


from recover_hsdp.config.aliases import (ALIASES, _move_aliases, deprecation_lines,  # noqa: F401
                                         resolve_aliases, warn_deprecated)
from recover_hsdp.config.checks import (STREAMING_DATASETS, check_batch_sizes,  # noqa: F401
                                        check_pipeline,
                                        check_world_size, data_ranks_per_replica,
                                        initial_replica_count, microbatches_per_replica,
                                        validate)
from recover_hsdp.config.sections import (SECTIONS, BadReplicas, Debug, Faults,  # noqa: F401
                                          Reduce, Tiers, Timeouts, Workload)
from recover_hsdp.errors import ConfigError  # noqa: F401  (re-exported: the config's error type)


@dataclass
class Recover:
    enable: bool = False
    """Train with ReCoVer: one MPI rank per device, replicas of ``ranks_per_replica`` FSDP ranks,
    cross-replica gradient reduce through fault-tolerant MPI. False: stock TorchTitan."""

    ranks_per_replica: int = 1
    """S, the ranks of one replica (its torch.distributed world): FSDP degree x
    ``parallelism.tensor_parallel_degree`` ([Note: replica layout]). The number of replicas R is
    the MPI world size divided by S. A replica lives or dies as a unit."""

    initial_replicas: int = 0
    """W_init, the replica count the batch contract B = W_init x G_init is set for (G_init from
    ``training.global_batch_size`` over W_init replicas); 0: the launched count R. Larger than R:
    the run starts as one that lost replicas R .. W_init-1 before step 1, the survivors hold B
    with the policy's roles (majors, a minor). The relaunch tier sets it when it relaunches onto
    fewer replicas ([Note: the relaunch keeps B] in cli/relaunch.py)."""

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
