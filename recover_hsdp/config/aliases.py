"""[Note: deprecated flat names] The flat ``[recover]`` names of the first releases
(``[recover] detect_timeout_s``, ``--recover.detect_timeout_s``) still work: :data:`ALIASES` maps
each to its section and field, ``Recover`` keeps one field per alias (None: not given), and
:func:`_move_aliases` moves each given one into its section when ``Recover`` is built.

This runs at construction, so every parse is resolved for every reader (the launcher, every rank,
stock ranks too): TorchTitan's ConfigManager builds ``Recover`` from the TOML file, then tyro
builds it again with the command line, taking the first one's values (``aliases_used`` included:
a suppressed field) as defaults. So a command-line alias overrides the same alias in the file, as
it always did. An alias and its new field both given with different values is a one-line
ConfigError; "given" for the new field means "not at its default and not put there by an alias"
(a parsed config cannot tell an explicit default from an absent one, so an alias wins over a new
field set to its default value). The launcher prints one line per alias used
(:func:`deprecation_lines`, :func:`warn_deprecated`); the ranks stay quiet."""

import sys
from dataclasses import fields

from recover_hsdp.errors import ConfigError

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


def resolve_aliases(job_config) -> list[str]:
    """Move every deprecated flat ``[recover]`` alias still set on ``job_config.recover`` into its
    section (:meth:`Recover.__post_init__` already did so for a parsed config: this is for one
    changed since, e.g. by hand); return their old names. Idempotent."""
    return _move_aliases(job_config.recover)


def _move_aliases(rc) -> list[str]:
    """Each alias of ``rc`` (a ``Recover``) given (not None) goes into its section field, is
    reset to None and recorded in ``rc.aliases_used``; returns the old names moved. Called by
    ``Recover.__post_init__`` ([Note: deprecated flat names]: why at construction, and what
    counts as a conflict)."""
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
