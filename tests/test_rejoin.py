"""Replica rejoin ([Note: rejoin at a boundary] in recover_hsdp/manager/rejoin.py), real jobs.

A replica is SIGKILLed at step 3; a replacement is spawned one step later (``respawn_after_steps
= 1``) or on ``recover-hsdp join`` and joins once it is ready. Every test asserts: the job exits
0, every step commits B microbatch gradients (measured), the loss stays within 1e-3 of the
failure-free run (exact mode: the same microbatch ids every step, whoever computes them), the
parameters of all replicas are equal every step (``consistency_check_interval = 1``; the join
itself checks the newcomer's checksum against the donor's), and no process of the job (the
newcomers included) outlives it. The newcomer and the donor are also SIGKILLed in the middle of
the state transfer (``phase=join``): the join is aborted, the job goes on, a later join works.
"""

import json
import subprocess
import sys
import time

import pytest

from conftest import DEBUG_CONFIG, REPO, read_jsonl, run_cli
from recover_hsdp.collectives.processes import read_registry

STEPS = 40
COMMON = ("--training.steps", str(STEPS), "--recover.hang_timeout_s", "10",
          "--recover.consistency_check_interval", "1")


def _train_args(out, replicas, ranks, faults=(), extra=()):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas),
            "--ranks-per-replica", str(ranks), "--out", str(out)]
    for fault in faults:
        args += ["--fault", fault]
    return args + ["--", *COMMON, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, local_corpus):
    """Failure-free runs of the same length (the LR schedule depends on it), per layout, run
    when a test first needs one."""
    runs = {}

    def get(replicas, ranks):
        if (replicas, ranks) not in runs:
            out = tmp_path_factory.mktemp(f"ref{replicas}x{ranks}")
            result = run_cli(_train_args(out, replicas, ranks), timeout=400)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            runs[(replicas, ranks)] = read_jsonl(out / "metrics.jsonl")
        return runs[(replicas, ranks)]

    return get


def _check(out, reference, replicas, ranks):
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["reduced_microbatches"] == replicas for s in steps)   # B, measured
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, reference(replicas, ranks))]
    assert max(diffs) <= 1e-3, diffs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"]
    deadline = time.monotonic() + 20
    procs = read_registry(out)
    while any(p.state() not in (None, "Z") for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p.pid for p in procs if p.state() not in (None, "Z")] == []  # newcomers included
    joins = [e for e in read_jsonl(out / "events.jsonl") if e.get("phase") == "join"]
    return steps, joins, summary


def _assert_rejoined(steps, joins, summary, replicas, lost):
    ok = [j for j in joins if j["ok"]]
    assert ok and ok[-1]["joined_replicas"] == lost, joins
    joined_at = ok[-1]["step"]
    assert steps[-1]["alive_replicas"] == replicas and summary["alive_replicas"] == replicas
    for record in steps:
        if record["step"] >= joined_at:
            assert record["alive_replicas"] == replicas and record["g"] == 1, record
    assert ok[-1]["bytes_per_donor_rank"] > 0 and ok[-1]["join_stall_s"] < 30


@pytest.mark.slow  # default suite time: test_node_loss::test_replacement_joins_on_a_standby_host
# joins for real, test_rejoin_inprocess proves the protocol
@pytest.mark.parametrize("data_plane", ["mpi", "torch"])
def test_respawn_4x1(tmp_path, reference, data_plane):
    """Real process: MPI_Comm_spawn through PRRTE and the transfer of TorchTitan's real state."""
    out = tmp_path / "run"
    result = run_cli(_train_args(out, 4, 1, ["replica=1,step=3,phase=grad_sync"],
                                 ("--recover.respawn_after_steps", "1", "--recover.data_plane",
                                  data_plane)), timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps, joins, summary = _check(out, reference, 4, 1)
    assert [s["alive_replicas"] for s in steps[2:4]] == [3, 3]
    _assert_rejoined(steps, joins, summary, 4, [1])
    assert joins[-1]["step_started"] == 5  # lost before step 4, respawned 1 step later
    assert summary["failures"] == 1 and summary["joins"] == 1


@pytest.mark.slow  # default suite time: tests/test_rejoin_inprocess.py kills both in-process
@pytest.mark.parametrize("victim", ["newcomer", "donor"])
def test_death_during_the_transfer_aborts_the_join_only(tmp_path, reference, victim):
    """SIGKILL mid-transfer of the join started before step 5: the newcomer (replica 1's
    replacement) or the donor (replica 0, the writer's replica). The join is aborted, the
    survivors go on (after the donor's death: without replica 0 too), and a later join
    brings the lost replicas back.
    Real process: (slow: test_rejoin_inprocess proves both victims) a real SIGKILL mid-transfer."""
    out = tmp_path / "run"
    target = 1 if victim == "newcomer" else 0
    result = run_cli(_train_args(out, 4, 1, ["replica=1,step=3,phase=grad_sync",
                                             f"replica={target},step=5,phase=join"],
                                 ("--recover.respawn_after_steps", "1")), timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps, joins, summary = _check(out, reference, 4, 1)
    fired = read_jsonl(out / "faults_fired.jsonl")
    assert [(f["replica"], f["phase"]) for f in fired] == [(1, "grad_sync"), (target, "join")]
    assert joins[0]["step_started"] == 5 and not joins[0]["ok"], joins
    lost = [1] if victim == "newcomer" else [0, 1]
    _assert_rejoined(steps, joins, summary, 4, lost)


@pytest.mark.slow
def test_join_command_2x2(tmp_path, reference):
    """A replica of 2 ranks comes back on ``recover-hsdp join --out DIR`` (no respawn).
    Real process: the `recover-hsdp join` command against a running job."""
    out = tmp_path / "run"
    job = subprocess.Popen(
        [sys.executable, "-m", "recover_hsdp.cli.launch",
         *_train_args(out, 2, 2, ["replica=1,step=3,phase=grad_sync,rank=1"])],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not (
                (out / "events.jsonl").exists() and (out / "metrics.jsonl").exists()
                and len(read_jsonl(out / "metrics.jsonl")) >= 4):
            time.sleep(0.5)
        join = run_cli(["join", "--out", str(out), "--timeout", "300"], timeout=320)
        stdout, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    assert join.returncode == 0, join.stdout + join.stderr
    assert "joined before step" in join.stdout
    assert job.returncode == 0, stdout[-4000:]
    steps, joins, summary = _check(out, reference, 2, 2)
    _assert_rejoined(steps, joins, summary, 2, [1])
    assert not list((out / "join" / "requests").glob("*.json"))
