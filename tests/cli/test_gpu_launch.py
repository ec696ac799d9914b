"""[Note: GPU placement] (collectives/mpirun.py) as fast unit tests: the command lines the launcher
builds for GPU hosts, the stock baseline across hosts and on CPU, the device check and its
one-line refusal, and the environment a spawned newcomer gets. No GPU needed (and none used)."""

from __future__ import annotations

import os
import threading
import types

import pytest

from conftest import DEBUG_CONFIG
from recover_hsdp.cli.hostfile import hostfile_hosts
from recover_hsdp.cli.arguments import parser as _parser
from recover_hsdp.cli.launch import build_command, mpi_interface_args
from recover_hsdp.collectives.mpirun import (EXPORTED_ENV, device_index, gpu_placement_args,
                                             job_environment)
from recover_hsdp.config import ConfigError
from recover_hsdp.titan.devices import NEWCOMER_ENV, bind_process, parse_cpulist, rank_slot

BATCH = ["--", "--training.global_batch_size", "32"]


def _command(tmp_path, *flags, replicas=2, ranks=8):
    args = _parser().parse_args(["train", "--config", str(DEBUG_CONFIG), "--replicas",
                                 str(replicas), "--ranks-per-replica", str(ranks), "--out",
                                 str(tmp_path / "out"), *flags, *BATCH])
    return build_command(args)[0]


def _exported(command) -> dict[str, str]:
    return dict(command[i + 1].split("=", 1) for i, a in enumerate(command) if a == "-x")


def _hostfile(tmp_path, *hosts):
    path = tmp_path / "hostfile"
    path.write_text("# nodes\n" + "".join(f"{h} slots=8\n" for h in hosts))
    return str(path)


def test_gpu_hosts_get_one_rank_per_gpu_and_no_oversubscribe(tmp_path):
    hostfile = _hostfile(tmp_path, "10.9.0.1", "10.9.0.2")
    command = _command(tmp_path, "--gpus-per-node", "8", "--hostfile", hostfile)
    line = " ".join(command)
    assert "--map-by ppr:8:node --bind-to none" in line
    assert "--oversubscribe" not in command
    assert f"--hostfile {hostfile}" in line and "--with-ft ulfm" in line
    assert command[command.index("-np") + 1] == "16"
    exported = _exported(command)
    assert exported["RECOVER_HSDP_GPUS_PER_NODE"] == "8"
    assert "RECOVER_HSDP_RANKS_PER_GPU" not in exported
    assert set(exported[EXPORTED_ENV].split(",")) >= {"OMP_NUM_THREADS", "PATH"}


def test_several_ranks_per_gpu_only_when_asked(tmp_path):
    command = _command(tmp_path, "--gpus-per-node", "1", "--ranks-per-gpu", "2",
                       replicas=2, ranks=1)
    assert "ppr:2:node" in " ".join(command)
    assert _exported(command)["RECOVER_HSDP_RANKS_PER_GPU"] == "2"


def test_cpu_hosts_keep_oversubscribe_and_no_placement(tmp_path):
    command = _command(tmp_path, "--gpus-per-node", "0", replicas=2, ranks=1)
    assert "--oversubscribe" in command and "--map-by" not in command


def test_stock_across_hosts_is_a_plain_mpirun_with_torch_env(tmp_path):
    hostfile = _hostfile(tmp_path, "10.9.0.7", "10.9.0.8")
    command = _command(tmp_path, "--stock", "--gpus-per-node", "0", "--hostfile", hostfile,
                       "--master-port", "29611", replicas=2, ranks=1)
    assert "torchrun" not in " ".join(command) and "--with-ft" not in command
    exported = _exported(command)
    assert exported["MASTER_ADDR"] == "10.9.0.7" and exported["MASTER_PORT"] == "29611"
    assert exported["RECOVER_HSDP_STOCK"] == "1"
    assert "--recover.no-enable" in command and "--hostfile" in command


def test_stock_on_one_host_stays_torchrun(tmp_path):
    command = _command(tmp_path, "--stock", replicas=2, ranks=1)
    assert command[1:4] == ["--standalone", "--nproc_per_node", "2"]


def test_stock_refuses_a_loopback_first_host(tmp_path):
    args = _parser().parse_args(["train", "--config", str(DEBUG_CONFIG), "--replicas", "2",
                                 "--ranks-per-replica", "1", "--stock", "--gpus-per-node", "0",
                                 "--hostfile", _hostfile(tmp_path, "localhost", "10.9.0.2"),
                                 "--out", str(tmp_path / "o"), *BATCH])
    with pytest.raises(ConfigError, match="resolves to the loopback address 127.0.0.1 here"):
        build_command(args)
    assert hostfile_hosts(args.hostfile) == ["localhost", "10.9.0.2"]


def test_device_check_refuses_more_ranks_than_gpus_in_one_line():
    assert device_index(3, 8, 8) == 3
    with pytest.raises(ValueError) as err:
        device_index(5, 8, 1, visible_names="0")  # a hostfile without slots=8: 8 ranks, 1 GPU
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("8 ranks on this host (this one is #5) but 1 visible GPU(s) "
                              "(CUDA_VISIBLE_DEVICES=0) x 1 rank(s) per GPU")
    assert "RECOVER_HSDP_RANKS_PER_GPU=8" in message
    assert device_index(1, 2, 1, ranks_per_gpu=2) == 0  # the 1-GPU check, on purpose
    assert device_index(5, 8, 1, own_device=True) == 0  # per-rank CUDA_VISIBLE_DEVICES (Slurm)
    with pytest.raises(ValueError):
        device_index(0, 9, 8)


def test_a_newcomer_takes_the_device_of_the_rank_it_replaces():
    from recover_hsdp.groups.bootstrap import NEWCOMER_ENV as BOOTSTRAP_MARKER

    assert NEWCOMER_ENV == BOOTSTRAP_MARKER
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
           NEWCOMER_ENV: "3:4", "RECOVER_HSDP_GPUS_PER_NODE": "4"}
    # replica 3 of S=2, shard 1: world rank 7, placed 4 per node -> slot 3 of 4
    assert rank_slot(env, world_rank=1, ranks_per_replica=2) == (3, 4)
    plain = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert rank_slot(plain, world_rank=1, ranks_per_replica=2) == (1, 4)
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert gpu_placement_args(8) == ["--map-by", "ppr:8:node", "--bind-to", "none"]


def test_spawned_ranks_inherit_the_job_environment(monkeypatch):
    from recover_hsdp.titan.trainer import RecoverTrainer

    for name, value in {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_SOCKET_IFNAME": "ib0",
                        "LD_LIBRARY_PATH": "/opt/x", "HF_HOME": "/data/hf", "MY_FLAG": "7",
                        "OMPI_COMM_WORLD_RANK": "3", EXPORTED_ENV: "MY_FLAG,OMP_NUM_THREADS",
                        "OMP_NUM_THREADS": "4", "UNRELATED": "x"}.items():
        monkeypatch.setenv(name, value)
    work = types.SimpleNamespace(replica_world=types.SimpleNamespace(
        layout=types.SimpleNamespace(replicas=4)))
    program, args = RecoverTrainer.spawn_command(work, [1, 3])
    assert program == "/usr/bin/env"
    env = dict(a.split("=", 1) for a in args[:args.index(__import__("sys").executable)])
    for name in ("NCCL_SOCKET_IFNAME", "LD_LIBRARY_PATH", "HF_HOME",
                 "MY_FLAG", "OMP_NUM_THREADS", "PATH"):
        assert name in env, name
    assert "OMPI_COMM_WORLD_RANK" not in env and "UNRELATED" not in env
    assert "CUDA_VISIBLE_DEVICES" not in env   # the spawner's host's devices, not the newcomer's
    assert env[NEWCOMER_ENV] == "1,3:4"
    assert job_environment({"RECOVER_HSDP_NEWCOMER": "1:2"}) == {}


def test_stock_ranks_read_torch_env_from_mpirun():
    from recover_hsdp.train import torch_env_from_mpirun

    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    torch_env_from_mpirun(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == \
        ("3", "4", "1", "2")


def test_no_cuda_no_device_selection(monkeypatch):
    from recover_hsdp.titan.devices import select_device

    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert select_device(1, own_device=lambda: pytest.fail("no collective without CUDA")) is None


def test_a_gpu_job_whose_rank_sees_no_device_is_refused_in_one_line(monkeypatch):
    """No silent CPU: a rank of a GPU job (the launcher exported its GPUs per node) that sees
    no CUDA device refuses, naming why; a CPU job's rank goes on."""
    from recover_hsdp.titan.devices import check_cpu_is_expected, select_device

    env = {"OMPI_COMM_WORLD_RANK": "3", "RECOVER_HSDP_GPUS_PER_NODE": "8",
           "CUDA_VISIBLE_DEVICES": ""}
    with pytest.raises(ConfigError, match=r"rank 3 on .* sees no CUDA device "
                       r"\(CUDA_VISIBLE_DEVICES=''\) but the job was launched for 8 GPU\(s\) "
                       "per node: .* --gpus-per-node 0"):
        check_cpu_is_expected(env, "12.8")
    with pytest.raises(ConfigError, match=r"this torch has no CUDA \(a CPU wheel\)"):
        check_cpu_is_expected({"RECOVER_HSDP_GPUS_PER_NODE": "1"}, None)
    check_cpu_is_expected({"RECOVER_HSDP_GPUS_PER_NODE": "0"}, None)   # a CPU job
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    monkeypatch.setenv("RECOVER_HSDP_GPUS_PER_NODE", "1")
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        select_device(1)


def _gpu_check(path_dir=None):
    import os
    import subprocess

    from conftest import REPO

    env = dict(os.environ)
    if path_dir is not None:
        env["PATH"] = f"{path_dir}:{env['PATH']}"
    return subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)


def test_gpu_check_skips_in_one_line_only_without_an_nvidia_gpu():
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("an NVIDIA driver is here: run scripts/gpu_check.sh itself")
    result = _gpu_check()
    assert result.returncode == 0
    assert result.stdout.strip() == ("gpu_check: SKIP: no NVIDIA GPU on this machine "
                                     "(nvidia-smi -L lists none); nothing was run")


def test_gpu_check_fails_when_the_gpu_is_there_and_torch_cannot_use_it(tmp_path):
    """A driver that lists a GPU (a fake nvidia-smi) and this machine's torch without CUDA:
    FAIL, exit non-zero; never the skip that passes without running anything."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run scripts/gpu_check.sh itself")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-fake)'\n")
    fake.chmod(0o755)
    result = _gpu_check(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("gpu_check: FAIL: nvidia-smi lists 1 GPU(s) but torch in ")
    assert "sees 0 (torch.version.cuda=None) CUDA devices" in result.stdout


@pytest.mark.slow  # default suite time (~30 s of imports): the refusal itself is tested above
def test_a_gpu_job_on_ranks_without_a_gpu_is_refused_not_trained_on_cpu(tmp_path):
    """No silent CPU: ``--gpus-per-node 1`` here, where no rank sees a CUDA device: the ranks
    refuse in one line each naming why, the job ends without a step and is not relaunched (it
    would end the same way: one rank's configuration error is enough, the other may have been
    ended by mpirun before its own line), and none of its processes is left.
    Real process: the launcher's GPU layout and the ranks' device check under mpirun."""
    import json

    import torch

    from conftest import run_cli
    from recover_hsdp.collectives.processes import ProcessInfo

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    out = tmp_path / "run"
    result = run_cli(["train", "--config", str(DEBUG_CONFIG), "--replicas", "2",
                      "--gpus-per-node", "1", "--ranks-per-gpu", "2", "--out", str(out), "--",
                      "--training.steps", "2"], timeout=180)
    assert result.returncode != 0, result.stdout[-2000:]
    refusals = [line for line in result.stderr.splitlines() if "sees no CUDA device" in line]
    ranks = [line.split("rank ", 1)[1].split()[0] for line in refusals]
    # one line per rank that got to its check, no rank twice (a relaunch would repeat them)
    assert 1 <= len(refusals) <= 2 and len(set(ranks)) == len(ranks), result.stderr[-3000:]
    assert "but the job was launched for 1 GPU(s) per node" in refusals[0]
    assert "not relaunched" in result.stderr, result.stderr[-2000:]
    assert "recover-hsdp: relaunch " not in result.stderr, result.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()
    records = sorted((out / "start").glob("rank*.json"))
    assert len(records) == 2, records   # both ranks started, and are checked below
    for record in records:
        rank = ProcessInfo(**{k: v for k, v in json.loads(record.read_text()).items()
                              if k in ("host", "pid", "start")})
        # exited: gone, or a zombie its new parent (init) has not reaped yet. A recoverable job's
        # prterun can return before it waits for a rank that exited on its own (measured: the
        # rank a zombie of pid 1 for ~1 s after the launcher returned)
        assert rank.state() in (None, "Z"), f"rank process {rank.pid} outlived the job"


def test_binding_to_a_device_node_binds_every_thread_of_the_process():
    """Issue 31 (launch): ``sched_setaffinity(0, ...)`` binds the calling thread only; threads
    already running (MPI's detector, the watchdog, torch's pools) and the ones they start must
    follow too."""
    before = os.sched_getaffinity(0)
    started, release = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def already_running():
        started.set()
        release.wait(10)
        seen["old"] = os.sched_getaffinity(0)
        child = threading.Thread(target=lambda: seen.update(child=os.sched_getaffinity(0)))
        child.start()
        child.join(10)

    thread = threading.Thread(target=already_running)
    thread.start()
    assert started.wait(10)
    one = {min(before)}
    try:
        bound = bind_process(one)
        assert thread.native_id in bound and threading.get_native_id() in bound
        release.set()
        thread.join(10)
        assert seen == {"old": one, "child": one}
        assert os.sched_getaffinity(0) == one
    finally:
        release.set()
        bind_process(before)


def test_mpi_gets_the_network_that_routes_to_the_other_hosts(capsys):
    """[Note: MPI interfaces]: across hosts both Open MPI's and PRRTE's TCP traffic go over the
    network this host routes from to the first other host; the user's own choice wins."""
    routes = {"10.9.0.2": ("ib0", "10.9.0.0/16")}
    resolve = {"node-b": "10.9.0.2", "node-c": "10.9.0.3"}.get
    args = mpi_interface_args(["localhost", "node-b", "node-c"], [], {}, resolve, routes.get)
    assert args == ["--mca", "btl_tcp_if_include", "10.9.0.0/16",
                    "--prtemca", "oob_tcp_if_include", "10.9.0.0/16"]
    assert "MPI over ib0 (10.9.0.0/16, the route to node-b)" in capsys.readouterr().out
    # the user's override, on the command line or in the environment: nothing added
    assert mpi_interface_args(["node-b"], ["--mca", "btl_tcp_if_include", "eth1"], {},
                              resolve, routes.get) == []
    assert mpi_interface_args(["node-b"], [], {"OMPI_MCA_btl_tcp_if_exclude": "docker0"},
                              resolve, routes.get) == []
    # one host, or no route found: Open MPI's own choice, said once when hosts are several
    assert mpi_interface_args(["localhost"], [], {}, resolve, routes.get) == []
    assert capsys.readouterr().out == ""
    assert mpi_interface_args(["node-c", "node-b"], [], {}, resolve, lambda a: None) == []
    assert "no route to another host" in capsys.readouterr().out


def test_a_hostfile_launch_line_names_the_mpi_network(tmp_path):
    hostfile = _hostfile(tmp_path, "10.9.0.1", "10.9.0.2")
    line = " ".join(_command(tmp_path, "--gpus-per-node", "8", "--hostfile", hostfile))
    from recover_hsdp.groups.rendezvous import route_network

    found = route_network("10.9.0.1")
    if found is None:
        pytest.skip("this machine has no route to 10.9.0.1 (no packet is sent to it)")
    assert f"--mca btl_tcp_if_include {found[1]} --prtemca oob_tcp_if_include {found[1]}" in line


def test_a_job_across_hosts_is_numbered_round_robin(tmp_path):
    """[Note: host-interleaved ranks]: a host's ranks are not neighbours in the detector's ring."""
    hostfile = _hostfile(tmp_path, "10.9.0.1", "10.9.0.2")
    line = " ".join(_command(tmp_path, "--gpus-per-node", "8", "--hostfile", hostfile))
    assert "--map-by ppr:8:node --bind-to none" in line and "--rank-by node" in line
    stock = _command(tmp_path, "--stock", "--gpus-per-node", "0", "--hostfile", hostfile,
                     replicas=2, ranks=1)
    assert "--rank-by" not in stock  # stock TorchTitan reads mpirun's ranks as torch's
    assert "--rank-by" not in _command(tmp_path, "--gpus-per-node", "0", replicas=2, ranks=1)
