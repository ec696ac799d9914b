"""``[recover]`` in sections: the old flat names (TOML and ``--recover.<field>``) parse to the
same values as the new ``[recover.<section>]`` fields, each with one warning line; unknown keys
and conflicts are refused in one line; each section checks itself. Through TorchTitan's own
ConfigManager, as the launcher reads a config."""

from dataclasses import fields

import pytest

from conftest import DEBUG_CONFIG
from recover_hsdp import config
from recover_hsdp.config import aliases
from recover_hsdp.cli.launch import read_job_config
from recover_hsdp.config import (ALIASES, SECTIONS, ConfigError, deprecation_lines, load_toml,
                                 resolve_aliases, validate, warn_deprecated)

OLD = {  # every flat field of the first releases, each at a value that is not its default
    "data_assignment": "stream", "keep_spares": False, "g_raise": "reserve", "data_seed": 7,
    "detect_timeout_s": 2.0, "hang_timeout_s": 60.0, "hang_floor_s": 5.0,
    "hang_progress_factor": 10.0, "data_plane": "torch", "overlap_reduce": False,
    "wire_dtype": "bf16", "transport": "ofi", "host_snapshots": True,
    "nonfinite_max_offences": 5, "nonfinite_window_steps": 50, "straggler_slow_ratio": 1.5,
    "straggler_recover_ratio": 1.1, "straggler_patience": 4, "consistency_check_interval": 1,
    "respawn_after_steps": 2, "max_relaunches": 0, "daemon_keepalive_s": 45.0,
    "emergency_checkpoint": False, "save_final_params": True, "dump_step_gradients": ["2", "5"],
    "log_samples": True,
}
HEADER = '[job]\ncustom_config_module = "recover_hsdp.config"\n'


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _write(path, recover: dict, sections: dict | None = None):
    text = HEADER + "[recover]\nenable = true\n"
    text += "".join(f"{k} = {_toml(v)}\n" for k, v in recover.items())
    for name, values in (sections or {}).items():
        text += f"[recover.{name}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in values.items())
    path.write_text(text)
    return path


def _new_sections(values: dict) -> dict:
    out: dict = {}
    for old, value in values.items():
        section, new = ALIASES[old]
        out.setdefault(section, {})[new] = value
    return out


def _sections_of(job) -> dict:
    rc = job.recover
    return {name: {f.name: getattr(getattr(rc, name), f.name) for f in fields(cls)}
            for name, cls in SECTIONS.items()}


def _cli(old_or_new: str, section: str, name: str, value) -> list[str]:
    prefix = "--recover." if old_or_new == "old" else f"--recover.{section}."
    if isinstance(value, bool):
        return [f"{prefix}{name}" if value else f"{prefix}no-{name}"]
    if isinstance(value, list):
        return [f"{prefix}{name}", ",".join(value)]
    return [f"{prefix}{name}", str(value)]


def test_aliases_cover_every_flat_field_and_nothing_else():
    assert set(ALIASES) == set(OLD)
    for old, (section, new) in ALIASES.items():
        assert new in {f.name for f in fields(SECTIONS[section])}, old
        assert getattr(config.Recover(), old) is None  # the alias's "not given"


def test_old_flat_file_parses_to_the_new_sections(tmp_path):
    old_file = _write(tmp_path / "old.toml", OLD)
    new_file = _write(tmp_path / "new.toml", {}, _new_sections(OLD))
    old, new = read_job_config(old_file, []), read_job_config(new_file, [])
    lines = deprecation_lines(old)
    assert deprecation_lines(new) == []
    assert _sections_of(old) == _sections_of(new)
    assert len(lines) == len(OLD)
    for name in OLD:  # one line per alias, naming the new place
        section, field_name = ALIASES[name]
        mine = [ln for ln in lines if f"[recover] {name} is deprecated" in ln]
        assert len(mine) == 1 and f"use [recover.{section}] {field_name}" in mine[0], name
    assert all(getattr(old.recover, name) is None for name in OLD)  # reset: resolved once
    assert resolve_aliases(old) == []


def test_old_command_line_overrides_parse_to_the_new_sections(tmp_path):
    base = _write(tmp_path / "base.toml", {})
    old_args, new_args = [], []
    for name, value in OLD.items():
        section, field_name = ALIASES[name]
        old_args += _cli("old", section, name, value)
        new_args += _cli("new", section, field_name, value)
    old, new = read_job_config(base, old_args), read_job_config(base, new_args)
    assert len(deprecation_lines(old)) == len(OLD)
    assert deprecation_lines(new) == []
    assert _sections_of(old) == _sections_of(new)
    assert _sections_of(new)["debug"]["dump_step_gradients"] == ["2", "5"]


def test_one_warning_line_per_alias_printed_once_per_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(aliases, "_WARNED", set())
    path = _write(tmp_path / "old.toml", {"detect_timeout_s": 2})
    for _ in range(2):  # a relaunch re-reads the config
        job = read_job_config(path, ["--recover.hang_timeout_s", "9"])
        warn_deprecated(deprecation_lines(job))
    err = capsys.readouterr().err.splitlines()
    assert err == ["recover-hsdp: [recover] detect_timeout_s is deprecated: use [recover.timeouts] "
                   "detect_s (--recover.timeouts.detect_s)",
                   "recover-hsdp: [recover] hang_timeout_s is deprecated: use [recover.timeouts] "
                   "hang_s (--recover.timeouts.hang_s)"]


def test_a_command_line_alias_overrides_the_file_as_before(tmp_path):
    path = _write(tmp_path / "old.toml", {"hang_timeout_s": 60})
    job = read_job_config(path, ["--recover.hang_timeout_s", "10"])
    assert job.recover.timeouts.hang_s == 10


@pytest.mark.parametrize("sections,args", [
    ({"timeouts": {"detect_s": 3.0}}, ["--recover.detect_timeout_s", "2"]),
    ({}, ["--recover.timeouts.detect_s", "3", "--recover.detect_timeout_s", "2"]),
])
def test_alias_and_new_field_that_disagree_are_refused(tmp_path, sections, args):
    with pytest.raises(ConfigError) as err:
        read_job_config(_write(tmp_path / "c.toml", {}, sections), args)
    words = str(err.value)
    assert "recover.detect_timeout_s=2.0" in words and "recover.timeouts.detect_s=3.0" in words
    assert "\n" not in words


def test_alias_and_new_field_that_agree_are_fine(tmp_path):
    path = _write(tmp_path / "c.toml", {"detect_timeout_s": 3.0}, {"timeouts": {"detect_s": 3.0}})
    job = read_job_config(path, [])
    assert len(deprecation_lines(job)) == 1
    assert job.recover.timeouts.detect_s == 3.0


@pytest.mark.parametrize("recover,sections,words", [
    ({"shards": 3}, {}, "[recover] shards: unknown key"),
    ({}, {"timeouts": {"detect_timeout_s": 3}}, "[recover.timeouts] detect_timeout_s: unknown key"),
    ({}, {"faults": {"phases": "x"}}, "[recover.faults] phases: unknown key"),
    ({"tiers": 3}, {}, "[recover] tiers = 3"),
])
def test_unknown_keys_are_refused_in_one_line(tmp_path, recover, sections, words):
    with pytest.raises(ConfigError) as err:
        load_toml(_write(tmp_path / "bad.toml", recover, sections))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert "valid keys" in str(err.value) or "is a section" in str(err.value)


def test_sections_and_aliases_are_known_keys(tmp_path):
    load_toml(_write(tmp_path / "ok.toml", OLD, _new_sections({"detect_timeout_s": 2.0})))
    load_toml(DEBUG_CONFIG)


@pytest.mark.parametrize("section,name,value,words", [
    ("workload", "keep_spares", "yes", "recover.workload.keep_spares must be true or false"),
    ("workload", "g_raise", "double", "recover.workload.g_raise must be 'ceil' or 'reserve'"),
    ("workload", "data_seed", -1, "recover.workload.data_seed must be an integer >= 0"),
    ("timeouts", "detect_s", 0.5, "recover.timeouts.detect_s=0.5: use 0 (off) or >= 1"),
    ("timeouts", "slow_phase_s", 2, "recover.timeouts.slow_phase_s=2 is below "
                                   "recover.timeouts.detect_s=4.0: set it >= detect_s"),
    ("timeouts", "hang_s", 0, "recover.timeouts.hang_s must be > 0"),
    ("timeouts", "hang_floor_s", -1, "recover.timeouts.hang_floor_s must be > 0"),
    ("timeouts", "hang_progress_factor", 0.5, "recover.timeouts.hang_progress_factor must be >= 1"),
    ("reduce", "plane", "nccl", "recover.reduce.plane='nccl': use one of auto, mpi, torch"),
    ("reduce", "wire_dtype", "bf16", "recover.reduce.wire_dtype=bf16 needs "
                                     "recover.reduce.plane=torch"),
    ("reduce", "host_snapshots", "no", "recover.reduce.host_snapshots='no': use true or false"),
    ("bad_replicas", "max_offences", 0, "recover.bad_replicas.max_offences must be an integer"),
    ("bad_replicas", "slow_patience", 0, None),  # checked only with slow_ratio set: below
    ("bad_replicas", "consistency_check_interval", -1,
     "recover.bad_replicas.consistency_check_interval must be an integer >= 0"),
    ("tiers", "respawn_after_steps", -2, "recover.tiers.respawn_after_steps must be an integer"),
    ("tiers", "max_relaunches", -1, "recover.tiers.max_relaunches=-1"),
    ("tiers", "daemon_keepalive_s", 0.5, "recover.tiers.daemon_keepalive_s=0.5"),
    ("debug", "dump_step_gradients", ["x"], "recover.debug.dump_step_gradients='x' is not a step"),
    ("faults", "phase", "lunch", "recover.faults.phase='lunch': use one of"),
])
def test_each_section_checks_itself_in_one_line(section, name, value, words):
    part = SECTIONS[section]()
    part.check()  # the defaults are valid
    setattr(part, name, value)
    if words is None:
        part.check()
        part.slow_ratio = 1.5
        words = "recover.bad_replicas.slow_patience must be an integer >= 1"
    with pytest.raises(ConfigError) as err:
        part.check()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_validate_resolves_aliases_and_checks_across_sections():
    from torchtitan.config import ConfigManager

    job = ConfigManager().parse_args(["--job.config_file", str(DEBUG_CONFIG),
                                      "--recover.hang_timeout_s", "11"])
    assert job.recover.timeouts.hang_s == 11 and job.recover.hang_timeout_s is None  # parsed
    assert job.recover.bad_replicas.consistency_check_interval == 1  # debug_cpu.toml's
    job.recover.hang_floor_s = 2.0  # an alias set by hand after parsing
    validate(job)  # resolves it first
    assert job.recover.timeouts.hang_floor_s == 2.0 and resolve_aliases(job) == []
    job = ConfigManager().parse_args(["--job.config_file", str(DEBUG_CONFIG),
                                      "--recover.reduce.plane", "torch",
                                      "--recover.reduce.wire_dtype", "bf16",
                                      "--recover.debug.save_final_params"])
    with pytest.raises(ConfigError) as err:
        validate(job)
    assert "recover.reduce.wire_dtype=bf16 with recover.debug.save_final_params" in str(err.value)


def test_the_launcher_warns_once_per_alias_and_passes_the_ranks_the_same_arguments(
        tmp_path, capsys, monkeypatch):
    """``recover-hsdp train`` with an old flat file and an old override: one line each in the
    launcher's output; the ranks' command line is the user's, unchanged (each rank parses it to
    the same sections, quietly)."""
    from recover_hsdp.cli.arguments import parser
    from recover_hsdp.cli.launch import build_job

    monkeypatch.setattr(aliases, "_WARNED", set())
    old = tmp_path / "old.toml"
    old.write_text(DEBUG_CONFIG.read_text().replace("[recover]\n",
                                                    "[recover]\ndetect_timeout_s = 2\n"))
    args = parser().parse_args(["train", "--config", str(old), "--replicas", "2", "--out",
                                str(tmp_path / "out"), "--", "--recover.hang_timeout_s", "9"])
    for _ in range(2):  # a relaunch builds the job again
        command, _, job = build_job(args)
    assert (job.recover.timeouts.detect_s, job.recover.timeouts.hang_s) == (2, 9)
    assert command[-2:] == ["--recover.hang_timeout_s", "9"]
    err = [ln for ln in capsys.readouterr().err.splitlines() if "deprecated" in ln]
    assert err == ["recover-hsdp: [recover] detect_timeout_s is deprecated: use [recover.timeouts] "
                   "detect_s (--recover.timeouts.detect_s)",
                   "recover-hsdp: [recover] hang_timeout_s is deprecated: use [recover.timeouts] "
                   "hang_s (--recover.timeouts.hang_s)"]
