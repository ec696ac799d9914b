"""Bad input: one clear line naming the field and the fix, a non-zero exit, nothing started."""

import os
import stat
import subprocess
import sys

import pytest

from conftest import DEBUG_CONFIG, REPO, run_cli


def _error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def test_missing_config_file(tmp_path):
    result = run_cli(["train", "--config", str(tmp_path / "nope.toml")])
    assert result.returncode == 2
    assert "--config" in _error_line(result) and "not found" in _error_line(result)


def test_unknown_recover_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(DEBUG_CONFIG.read_text().replace("[recover]\n", "[recover]\nshards = 3\n"))
    result = run_cli(["train", "--config", str(bad)])
    assert result.returncode == 2
    line = _error_line(result)
    assert "[recover] shards" in line and "valid keys" in line


def test_invalid_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    result = run_cli(["train", "--config", str(bad)])
    assert result.returncode == 2 and "not valid TOML" in _error_line(result)


def test_batch_sizes_that_do_not_divide():
    result = run_cli(["train", "--config", str(DEBUG_CONFIG), "--replicas", "3", "--",
                      "--training.global_batch_size", "8"])
    assert result.returncode == 2
    line = _error_line(result)
    assert "training.global_batch_size=8" in line and "multiple of 6" in line


def test_pipeline_schedule_not_run_refused_in_one_line():
    """[Note: pipeline stages in a replica]: a schedule whose sync the step cannot hold is
    refused by the launcher, with the reason, nothing started."""
    result = run_cli(["train", "--config", str(DEBUG_CONFIG), "--replicas", "2",
                      "--ranks-per-replica", "2", "--", "--parallelism.pipeline_parallel_degree",
                      "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    assert result.returncode == 2
    line = _error_line(result)
    assert "parallelism.pipeline_parallel_schedule='ZBVZeroBubble'" in line
    assert "1F1B, GPipe, Interleaved1F1B" in line


def test_inner_degrees_that_cannot_work():
    from types import SimpleNamespace

    from recover_hsdp.config import ConfigError, data_ranks_per_replica
    from recover_hsdp.titan.model_spec import check_model_parallelism

    assert data_ranks_per_replica(4, 2) == 2
    assert data_ranks_per_replica(8, 2, 2) == 2
    with pytest.raises(ConfigError, match="tensor_parallel_degree=2 x pipeline_parallel_degree=1 "
                                          "does not divide recover.ranks_per_replica=3"):
        data_ranks_per_replica(3, 2)
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=4 does not divide "
                                          "recover.ranks_per_replica=6"):
        data_ranks_per_replica(6, 1, 4)
    job = SimpleNamespace(model=SimpleNamespace(flavor="1B"),
                          parallelism=SimpleNamespace(tensor_parallel_degree=2,
                                                      pipeline_parallel_degree=1))
    with pytest.raises(ConfigError, match="tied to the token embedding"):
        check_model_parallelism(job)
    job.parallelism.tensor_parallel_degree, job.parallelism.pipeline_parallel_degree = 1, 2
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=2 .* different stages"):
        check_model_parallelism(job)
    job.model.flavor = "debugmodel"
    check_model_parallelism(job)


def test_pipeline_pieces_that_do_not_divide():
    from types import SimpleNamespace

    from recover_hsdp.config import ConfigError, check_pipeline

    job = SimpleNamespace(
        training=SimpleNamespace(local_batch_size=4),
        parallelism=SimpleNamespace(pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B",
                                    pipeline_parallel_schedule_csv="",
                                    pipeline_parallel_microbatch_size=3))
    with pytest.raises(ConfigError, match="pipeline_parallel_microbatch_size=3 does not divide "
                                          "training.local_batch_size=4"):
        check_pipeline(job)
    job.parallelism.pipeline_parallel_microbatch_size = 2
    check_pipeline(job)
    job.parallelism.pipeline_parallel_schedule_csv = "my.csv"
    with pytest.raises(ConfigError, match="with a schedule csv"):
        check_pipeline(job)


def test_world_size_not_matching_ranks_per_replica_is_refused_in_one_line():
    from recover_hsdp.config import check_world_size
    from recover_hsdp.errors import ConfigError

    with pytest.raises(ConfigError, match="recover.ranks_per_replica=2 does not divide the MPI "
                       r"world size 3: launch R x S ranks \(mpirun -np R\*S\)"):
        check_world_size(3, 2)
    assert check_world_size(4, 2) == 2



def test_initial_replicas_below_the_launched_count_is_refused_in_one_line():
    """[Note: the relaunch keeps B]: W_init is at least R; 0 is R."""
    from recover_hsdp.config import initial_replica_count
    from recover_hsdp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"recover.initial_replicas=2 is below the 3 replicas "
                       "launched: set it to 0"):
        initial_replica_count(2, 3)
    with pytest.raises(ConfigError, match="recover.initial_replicas must be an integer >= 0"):
        initial_replica_count(-1, 3)
    assert initial_replica_count(0, 3) == 3 and initial_replica_count(3, 2) == 3

@pytest.mark.soak  # CI time: the check itself is tested above, in-process
def test_world_size_not_matching_ranks_per_replica(tmp_path):
    """mpirun -np 3 with ranks_per_replica 2: every rank stops with the one-line error.
    Only a real mpirun proves: every rank stops by itself (none waits for the others)."""
    from recover_hsdp.cli.launch import resolve_mpirun
    from recover_hsdp.collectives.mpirun import mpirun_prefix

    command = [*mpirun_prefix(3, mpirun=resolve_mpirun()), sys.executable, "-m", "recover_hsdp.train",
               "--job.config_file", str(DEBUG_CONFIG), "--job.dump_folder", str(tmp_path),
               "--recover.ranks_per_replica", "2"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [ln for ln in result.stderr.splitlines() if "config error" in ln]
    assert len(errors) == 3, result.stderr[-2000:]
    assert all("recover.ranks_per_replica=2 does not divide the MPI world size 3" in ln
               for ln in errors)
    assert not (tmp_path / "metrics.jsonl").exists()


def _fake_tool(directory, name, output):
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_no_mpirun(tmp_path):
    result = run_cli(["train", "--config", str(DEBUG_CONFIG)],
                     env={"RECOVER_HSDP_MPIRUN": str(tmp_path / "missing" / "mpirun")})
    assert result.returncode == 2
    assert "mpirun not found" in _error_line(result)


@pytest.mark.parametrize("version,info,expected", [
    ("HYDRA build details: mpich 4.2", "", "is not Open MPI"),
    ("mpirun (Open MPI) 5.0.11", "  FT MPI support: no", "without ULFM"),
])
def test_mpi_without_ulfm(tmp_path, version, info, expected):
    mpirun = _fake_tool(tmp_path, "mpirun", version)
    _fake_tool(tmp_path, "ompi_info", info)
    result = run_cli(["train", "--config", str(DEBUG_CONFIG)],
                     env={"RECOVER_HSDP_MPIRUN": str(mpirun)})
    assert result.returncode == 2
    assert expected in _error_line(result)
