"""The relaunch tier on a 4-node namespace cluster (tests/netns_cluster.py): 3 replicas (one per
node, nodes 0-2; node 3 stands by in the hostfile), exact mode, a checkpoint every 2 steps.
What PRRTE 3.0 cannot survive ends the MPI job; ``recover-hsdp train`` relaunches it from the
newest complete checkpoint on nodes 0, 1 and 3 ([Note: the relaunch tier]).

Each case: exit 0, metrics steps 1..N once each, B every step (measured), the loss of the
failure-free run within 1e-3, node 2 unused after the relaunch, the relaunch in events.jsonl
and summary.json, nothing of the job alive on the nodes still reachable. ~45-70 s each here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest

from conftest import DEBUG_CONFIG, PIPELINE_CONFIG, REPO, read_jsonl, run_cli
from netns_cluster import NetnsCluster, skip_unless_available
from recover_hsdp.workload.ledger import ledger_records
from test_node_loss import _finish, _names, _wait_for_step

pytestmark = skip_unless_available()

STEPS = 12
REPLICAS = 3
TRAIN = ["--training.steps", str(STEPS), "--recover.timeouts.hang_s", "30",
         "--checkpoint.enable", "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def failure_free_3x1(tmp_path_factory, local_corpus):
    """The same 3 x 1 job on one host without a fault: the reference trajectory."""
    root = tmp_path_factory.mktemp("ref3x1")
    result = run_cli(["train", "--config", str(DEBUG_CONFIG), "--replicas", str(REPLICAS),
                      "--out", str(root / "run"), "--", *TRAIN,
                      "--checkpoint.folder", str(root / "ckpt")], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_jsonl(root / "run" / "metrics.jsonl")


def _launch(cluster: NetnsCluster, root, train=TRAIN):
    """``recover-hsdp train`` from node 0 with the cluster's hostfile, one rank per node:
    3 replicas on nodes 0-2, node 3 (if any) a standby host."""
    out = root / "run"
    mpi = [*cluster.mpirun_args(), "--map-by", "ppr:1:node"]
    argv = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(DEBUG_CONFIG),
            "--replicas", str(REPLICAS), "--out", str(out), "--end-grace", "10",
            *[f"--mpi-arg={a}" for a in mpi], "--", *train,
            "--checkpoint.folder", str(root / "ckpt")]
    log = open(root / "run.log", "w")
    proc = cluster.popen(0, argv, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                         stdout=log, stderr=log, cwd=str(REPO))
    return out, proc, log


def _kill_at_startup(cluster: NetnsCluster, out, proc, rank: int = 2, timeout: float = 120):
    """SIGKILL ``rank`` as soon as its start-up record exists (right after MPI_Init, seconds
    before the bootstrap all-gather and the fault-tolerant world)."""
    path = out / "start" / f"rank{rank}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            record = json.loads(path.read_text())
            assert not (out / "procs.json").exists()   # the world is not built yet
            os.kill(record["pid"], signal.SIGKILL)
            return record
        assert proc.poll() is None, "job ended before the start-up record"
        time.sleep(0.05)
    raise AssertionError("no start-up record")


def _run(tmp_path, fault: str, salt: int, nodes: int = 4, train=TRAIN):
    root = tmp_path
    prefix, subnet = _names(f"r{fault[0]}", salt)
    with NetnsCluster(nodes, prefix=prefix, subnet=subnet) as cluster:
        out, proc, log = _launch(cluster, root, train)
        if fault == "startup":
            _kill_at_startup(cluster, out, proc)
        else:
            _wait_for_step(out, 3, proc)
            if fault == "link_down":
                cluster.link_down(2)
            else:
                cluster.kill_node(2)   # every process of node 2, its prted included
        rc, wall, _ = _finish(proc, out, timeout=400)
        log.close()
        text = (root / "run.log").read_text()
        left = _left_on(cluster, [cluster.names[i] for i in range(nodes) if i != 2])
        return out, rc, text, left, cluster.addrs[2], cluster.names[2]


def _left_on(cluster, reachable, within_s=30.0):
    """Processes of the job still alive on the ``reachable`` nodes, waited for up to
    ``within_s`` (the launcher ends them after the summary)."""
    deadline = time.monotonic() + within_s
    while True:
        left = {n: p for n, p in cluster.leftover_pids().items() if n in reachable}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.5)


def _check(out, rc, text, left, lost_addr, lost_name, reference, startup=False, lossless=False):
    assert rc == 0, text[-5000:]
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), text[-3000:]
    assert all(s["reduced_microbatches"] == REPLICAS for s in steps), steps   # B, measured
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, reference)]
    assert max(diffs) <= 1e-3, diffs
    assert [s["step"] for s in read_jsonl(out / "ledger.jsonl")] == list(range(STEPS))
    relaunches = [e for e in read_jsonl(out / "events.jsonl") if e.get("phase") == "relaunch"]
    assert len(relaunches) == 1, relaunches
    record = relaunches[0]
    assert list(record["lost_hosts"]) == [lost_addr], record
    assert lost_addr not in record["hosts"] and record["replicas"] == REPLICAS
    assert record["failure_to_training_s"] is not None
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["attempts"] == 2 and summary["steps"] == STEPS
    assert [r["attempt"] for r in summary["relaunches"]] == [1]
    hosts = [p["host"] for p in json.loads((out / "procs.json").read_text())]
    assert lost_name not in hosts and len(hosts) == REPLICAS, hosts   # the lost host unused
    if startup:
        assert record["resume_step"] == 0 and record["steps_lost"] == 0
    elif lossless:   # [Note: emergency checkpoint]: saved after the repair, relaunched from it
        assert record["resume_step"] >= 3 and record["steps_lost"] == 0, record
        assert "emergency checkpoint" in text, text[-3000:]
    else:
        assert record["resume_step"] >= 2 and record["steps_lost"] <= 3, record
    assert not left, left
    print(f"relaunch: {record['cause']}; resumed from step {record['resume_step']}, "
          f"{record['steps_lost']} step(s) redone, failure to training again "
          f"{record['failure_to_training_s']:.1f} s")
    return record


@pytest.mark.soak  # CI time: a node killed with its daemon is the no-standby case below (slow)
def test_node_killed_with_its_daemon_is_relaunched(tmp_path, failure_free_3x1):
    """Real process: node 2 SIGKILLed with its PRRTE daemon after step 3: PRRTE ends the job,
    the launcher relaunches it without node 2, from the step-2 checkpoint, on the standby."""
    _check(*_run(tmp_path, "kill", 41), failure_free_3x1)


@pytest.mark.slow  # the in-process driver tests and the default suite's memory cut link show it
def test_cut_link_is_relaunched(tmp_path, failure_free_3x1):
    """Real process: node 2's link cut after step 3 (no RST): the survivors repair in-job and
    save an emergency checkpoint at the next step boundary; the launcher finds node 2 silent,
    ends the job before PRRTE would (recover.tiers.daemon_keepalive_s) and relaunches without node 2
    from that checkpoint: no step redone."""
    _check(*_run(tmp_path, "link_down", 43), failure_free_3x1, lossless=True)


@pytest.mark.slow  # the in-process tests check the start-up evidence (lost_hosts)
def test_death_before_the_world_is_built_is_relaunched(tmp_path, failure_free_3x1):
    """Real process: rank 2 SIGKILLed right after MPI_Init, before the bootstrap: the others
    fail in the bootstrap all-gather, the job ends; the launcher relaunches from scratch
    without node 2 (its start-up record says its rank died hard)."""
    _check(*_run(tmp_path, "startup", 47), failure_free_3x1, startup=True)


@pytest.mark.slow  # the in-process driver test shows the arguments; one real job proves the path
def test_lost_node_without_standby_or_checkpoint_keeps_b(tmp_path, failure_free_3x1):
    """[Note: the relaunch keeps B] Real process: 3 nodes, no standby host, no checkpoint and no
    host-memory state;
    node 2 SIGKILLed with its daemon after step 3: PRRTE ends the job and the launcher relaunches
    it from step 0 onto the 2 replicas that fit, with recover.initial_replicas = 3: B = 3 every
    step (measured; the ledger: a major of 2, a minor of 1), the failure-free loss (exact mode), exit 0."""
    train = [a for a in TRAIN if a not in ("--checkpoint.enable", "--checkpoint.interval", "2")]
    train += ["--recover.tiers.memory_snapshot_interval", "0"]   # nothing saved at all
    out, rc, text, left, lost_addr, lost_name = _run(tmp_path, "kill", 53, nodes=3, train=train)
    assert rc == 0, text[-5000:]
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), text[-3000:]
    assert all(s["reduced_microbatches"] == REPLICAS for s in steps), steps   # B, measured
    assert [s["alive_replicas"] for s in steps] == [2] * STEPS   # every step redone on 2
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, failure_free_3x1)]
    assert max(diffs) <= 1e-3, diffs
    (record,) = [e for e in read_jsonl(out / "events.jsonl") if e.get("phase") == "relaunch"]
    assert list(record["lost_hosts"]) == [lost_addr] and record["replicas"] == 2, record
    assert record["resume_step"] == 0, record
    assert "no relaunch" not in text
    ledger = ledger_records(out)
    assert [e["step"] for e in ledger] == list(range(STEPS))
    for entry in ledger:   # the policy's roles for 2 of W_init = 3, every id of the step once
        roles = {r: (a["role"], len(a["committed"])) for r, a in entry["replicas"].items()}
        assert roles == {"0": ("major", 2), "1": ("minor", 1)}, entry
        ids = sorted(i for a in entry["replicas"].values() for i in a["committed"])
        assert ids == list(range(entry["step"] * 3, entry["step"] * 3 + 3)), entry
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["attempts"] == 2 and summary["steps"] == STEPS
    hosts = [p["host"] for p in json.loads((out / "procs.json").read_text())]
    assert lost_name not in hosts and len(hosts) == 2, hosts
    assert not left, left


# [Note: host-memory state] (recovery/host_state.py): no DCP checkpoint, no shared filesystem
# needed (the namespace nodes share /dev/shm, so each host reads only its own host-name folder)
MEMORY = ["--training.steps", str(STEPS), "--recover.timeouts.hang_s", "30",
          "--recover.tiers.memory_snapshot_interval", "2"]


def _memory_left(out) -> list[str]:
    from recover_hsdp.host_files import job_root

    root = job_root("/dev/shm/recover-hsdp", out)
    return [str(p) for p in root.rglob("*")] if root.exists() else []


def _check_memory(out, record, text):
    assert record["from_memory"], record
    loads = [e for e in read_jsonl(out / "events.jsonl") if e.get("phase") == "host state load"]
    assert len(loads) == 1 and loads[0]["step"] == record["resume_step"], loads
    assert "resumed from the host-memory generation" in text, text[-3000:]
    assert re.search(r"host-memory state: \d+ generation\(s\) every 2 step\(s\), [\d.]+ MiB per "
                     r"rank; on the step's critical path", text), text[-3000:]   # its cost, said
    assert not _memory_left(out), _memory_left(out)   # every byte removed at the end
    return loads[0]


def test_cut_link_is_relaunched_from_host_memory(tmp_path, failure_free_3x1):
    """Real process, checkpoint.enable = false: node 2's link cut after step 3; the survivors
    write the emergency host-memory generation at the next step boundary, the launcher finds
    node 2 silent and relaunches on nodes 0, 1 and the standby node 3 from the survivors'
    copies (node 3's rank gets its shard from a peer): no step redone, B every step, the
    failure-free loss, nothing left in /dev/shm."""
    out, rc, text, left, addr, name = _run(tmp_path, "link_down", 59, train=MEMORY)
    record = _check(out, rc, text, left, addr, name, failure_free_3x1, lossless=True)
    load = _check_memory(out, record, text)
    assert load["ranks"] == REPLICAS and load["from_peer"] == 1, load   # the standby's rank


@pytest.mark.slow  # the cut link above shows the memory path; this one the periodic generation
def test_node_killed_is_relaunched_from_host_memory(tmp_path, failure_free_3x1):
    """Real process, checkpoint.enable = false: node 2 SIGKILLed with its daemon after step 3:
    relaunched from the last periodic generation (every 2 steps) on the survivors' copies:
    at most 2 steps redone."""
    out, rc, text, left, addr, name = _run(tmp_path, "kill", 61, train=MEMORY)
    record = _check(out, rc, text, left, addr, name, failure_free_3x1)
    _check_memory(out, record, text)
    assert record["steps_lost"] <= 2, record


@pytest.mark.slow  # ~90 s: the 3 x 1 cut link above is the default suite's memory relaunch
@pytest.mark.parametrize("config", [DEBUG_CONFIG,
                                    pytest.param(PIPELINE_CONFIG, marks=pytest.mark.soak)],
                         ids=["fsdp", "pipeline"])
def test_replica_of_two_ranks_per_node_relaunched_from_host_memory(tmp_path, local_corpus, config):
    """Real process, checkpoint.enable = false, no standby: 3 replicas x 2 ranks (FSDP 2, or a
    pipeline of 2 stages), one replica per node; node 2's link cut after step 3: relaunched
    onto the 2 replicas that fit from the emergency generation (each survivor's 2 shard
    positions from its own host), no step redone, B = 3 every step (a major of 2 and a minor
    of 1 from the relaunch on), the failure-free loss, nothing left in /dev/shm."""
    ref = run_cli(["train", "--config", str(config), "--replicas", str(REPLICAS),
                   "--ranks-per-replica", "2", "--out", str(tmp_path / "ref"), "--", *MEMORY],
                  timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    reference = read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    prefix, subnet = _names("rm", 67)
    with NetnsCluster(3, prefix=prefix, subnet=subnet) as cluster:
        out = tmp_path / "run"
        mpi = [*cluster.mpirun_args(), "--map-by", "ppr:2:node"]
        argv = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config",
                str(config), "--replicas", str(REPLICAS), "--ranks-per-replica", "2",
                "--out", str(out), "--end-grace", "10", *[f"--mpi-arg={a}" for a in mpi], "--",
                *MEMORY]
        with open(tmp_path / "run.log", "w") as log:
            proc = cluster.popen(0, argv, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                                 stdout=log, stderr=log, cwd=str(REPO))
            _wait_for_step(out, 3, proc)
            cluster.link_down(2)
            rc, _, _ = _finish(proc, out, timeout=400)
        text = (tmp_path / "run.log").read_text()
        left = _left_on(cluster, [cluster.names[i] for i in range(2)])
    assert rc == 0, text[-5000:]
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), text[-3000:]
    assert all(s["reduced_microbatches"] == REPLICAS for s in steps), steps   # B, measured
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, reference)) <= 1e-3
    (record,) = [e for e in read_jsonl(out / "events.jsonl") if e.get("phase") == "relaunch"]
    assert record["replicas"] == 2 and record["steps_lost"] == 0, record
    load = _check_memory(out, record, text)
    assert load["ranks"] == 4 and load["from_peer"] == 0, load
    for entry in ledger_records(out)[record["resume_step"]:]:   # the policy's roles for 2 of 3
        roles = sorted((a["role"], len(a["committed"])) for a in entry["replicas"].values())
        assert roles == [("major", 2), ("minor", 1)], entry
    assert not left, left
