"""Replica rejoin ([Note: rejoin at a boundary] in recover_hsdp/manager/rejoin.py), real jobs.

A replica is SIGKILLed at step 3; a replacement is spawned one step later (``respawn_after_steps
= 1``) or on ``recover-hsdp join`` and joins once it is ready. Every test asserts: the job exits
0, every step commits B microbatch gradients (measured), the loss stays within 1e-3 of the
failure-free run (exact mode: the same microbatch ids every step, whoever computes them), the
parameters of all replicas are equal every step (``consistency_check_interval = 1``; the join
itself checks the newcomer's checksum against the donor's), and no process of the job (the
newcomers included) outlives it. The newcomer and the donor are also SIGKILLed in the middle of
the state transfer (``phase=join``): the attempt fails, the job goes on; a dead donor's join is
retried with a new donor, a dead newcomer's is given up and a later one works. A survivor that
is not the spawner dies while a newcomer starts: the join is kept.
"""

import json
import subprocess
import sys
import time

import pytest

from conftest import DEBUG_CONFIG, REPO, read_jsonl, run_cli
from recover_hsdp.collectives.processes import read_registry

STEPS = 40
COMMON = ("--training.steps", str(STEPS), "--recover.timeouts.hang_s", "10",
          "--recover.bad_replicas.consistency_check_interval", "1")


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
# joins for real, test_rejoin_protocol proves the protocol
@pytest.mark.parametrize("data_plane", [pytest.param("mpi", marks=pytest.mark.soak),
                                        pytest.param("torch", marks=pytest.mark.soak)])
def test_respawn_4x1(tmp_path, reference, data_plane):
    """Real process: MPI_Comm_spawn through PRRTE and the transfer of TorchTitan's real state."""
    out = tmp_path / "run"
    result = run_cli(_train_args(out, 4, 1, ["replica=1,step=3,phase=grad_sync"],
                                 ("--recover.tiers.respawn_after_steps", "1", "--recover.reduce.plane",
                                  data_plane)), timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps, joins, summary = _check(out, reference, 4, 1)
    assert [s["alive_replicas"] for s in steps[2:4]] == [3, 3]
    _assert_rejoined(steps, joins, summary, 4, [1])
    assert joins[-1]["step_started"] == 5  # lost before step 4, respawned 1 step later
    assert summary["failures"] == 1 and summary["joins"] == 1


@pytest.mark.slow  # default suite time: tests/manager/test_rejoin_protocol.py kills both in-process
@pytest.mark.parametrize("victim", [pytest.param("newcomer", marks=pytest.mark.soak),  # CI time:
                                    pytest.param("donor", marks=pytest.mark.soak)])  # in process
def test_death_during_the_transfer(tmp_path, reference, victim):
    """SIGKILL mid-transfer of the join started before step 5: the newcomer (replica 1's
    replacement) or the donor (replica 2: the lowest alive replica that is not the spawner's).
    The attempt fails, the survivors go on (after the donor's death: without replica 2 too);
    a dead newcomer ends the join (a later respawn brings replica 1 back), a dead donor does
    not: the kept newcomer joins at the next boundary with a new donor (replica 3).
    Real process: (slow: test_rejoin_protocol proves both victims) a real SIGKILL mid-transfer."""
    out = tmp_path / "run"
    target = 1 if victim == "newcomer" else 2
    result = run_cli(_train_args(out, 4, 1, ["replica=1,step=3,phase=grad_sync",
                                             f"replica={target},step=5,phase=join"],
                                 ("--recover.tiers.respawn_after_steps", "1")), timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps, joins, summary = _check(out, reference, 4, 1)
    fired = read_jsonl(out / "faults_fired.jsonl")
    assert [(f["replica"], f["phase"]) for f in fired] == [(1, "grad_sync"), (target, "join")]
    assert joins[0]["step_started"] == 5 and not joins[0]["ok"] and joins[0]["donor"] == 2
    if victim == "newcomer":
        _assert_rejoined(steps, joins, summary, 4, [1])
        return
    retried = joins[1]
    assert retried["ok"] and retried["step_started"] == 5 and retried["attempt"] == 2, joins
    assert retried["donor"] == 3 and retried["joined_replicas"] == [1]
    assert retried["step"] == joins[0]["step"] + 1  # the next boundary
    later = [j for j in joins[2:] if j["ok"]]  # replica 2's respawn, if the run is long enough
    assert steps[-1]["alive_replicas"] == 3 + len(later) == summary["alive_replicas"]


@pytest.mark.soak  # CI time (196 s): test_rejoin_protocol::
# test_survivor_death_while_the_newcomer_starts_keeps_the_join proves the protocol; the default
# suite's standby-host join is a real one
def test_survivor_death_while_the_newcomer_starts(tmp_path, reference):
    """Issue 22's scenario: 4 x 1, ``respawn_after_steps = 2``, replica 3 SIGKILLed at step 2,
    its newcomer spawned before step 5; replica 2 (not the spawner) SIGKILLed in step 6 while
    the newcomer starts. The join is kept and completes after the death; replica 2 is
    respawned after it.
    Real process: MPI_Comm_spawn from the spawner's COMM_SELF, a real SIGKILL of a survivor
    while the newcomer builds its trainer, Accept/Connect on the repaired world."""
    out = tmp_path / "run"
    result = run_cli(_train_args(out, 4, 1, ["replica=3,step=2,phase=forward",
                                             "replica=2,step=6,phase=forward"],
                                 ("--recover.tiers.respawn_after_steps", "2")), timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps, joins, summary = _check(out, reference, 4, 1)
    first = joins[0]
    assert first["ok"] and first["joined_replicas"] == [3] and first["step_started"] == 5, joins
    assert first["step"] > 6 and first["alive_replicas"] == [0, 1, 3]  # after the death
    assert [s["alive_replicas"] for s in steps[5:first["step"] - 1]] == \
        [2] * (first["step"] - 6)  # 2 alive from step 6 until the join
    assert all(s["g"] == 1 for s in steps if s["alive_replicas"] == 4)
    later = [j for j in joins[1:] if j["ok"]]
    assert [j["joined_replicas"] for j in later] in ([], [[2]])
    assert steps[-1]["alive_replicas"] == 3 + len(later) == summary["alive_replicas"]
    print(f"measured: first join before step {first['step']} (stall {first['join_stall_s']:.2f}s, "
          f"start-to-ready {first.get('start_to_ready_s', 0):.1f}s); replica 2 back: "
          f"{[j['step'] for j in later]}; alive at the end {steps[-1]['alive_replicas']}")


@pytest.mark.soak  # CI time: the default suite's standby-host join runs `recover-hsdp join`
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


@pytest.mark.slow  # default suite time: test_stopped_peers proves the sweep in process on real
# stopped processes; this is the real respawned rank (the soak's third lost run)
def test_a_frozen_replacement_is_ended_by_a_peer_on_its_host(tmp_path):
    """A respawned replica is outside Open MPI's heartbeat detector (it watches the original
    world only); SIGSTOPped, it was never declared dead: the survivors waited in their
    all-reduce to the call deadline and the job relaunched from step 0. Now a survivor on its
    host ends it ([Note: stopped peers outside the detector] in collectives/processes.py): 3 x 1,
    replica 1 SIGKILLed at step 3, respawned, its replacement SIGSTOPped at step 30; the job
    finishes in its first attempt, B every step, and the stopped rank is found before any
    deadline. Real process: MPI_Comm_spawn through PRRTE, a real SIGSTOP of the spawned rank."""
    out = tmp_path / "run"
    result = run_cli(_train_args(out, 3, 1, ["replica=1,step=3,phase=grad_sync",
                                             "replica=1,step=30,mode=stop"],
                                 ("--recover.tiers.respawn_after_steps", "1")), timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert not list(out.glob("relaunch/attempt-*")), output[-5000:]  # no second attempt
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["reduced_microbatches"] == 3 for s in steps)  # B, measured
    events = read_jsonl(out / "events.jsonl")
    joins = [e for e in events if e.get("phase") == "join" and e["ok"]]
    assert joins and joins[0]["step"] < 30, f"the replacement joined after the stop: {joins}"
    fired = read_jsonl(out / "faults_fired.jsonl")
    stopped = fired[-1]
    assert (stopped["mode"], stopped["step"]) == ("stop", 30)
    assert stopped["pid"] != fired[0]["pid"]  # the replacement, not replica 1's first process
    lost = [e for e in events if e.get("dead_replicas") == [1] and e["step"] == 30]
    assert lost and lost[0]["detect_s"] < 2 * 10 + 30, lost  # before the call deadline (2H + 30)
    assert f"(pid {stopped['pid']}), stopped for 4 s on this host" in output
    assert steps[-1]["alive_replicas"] in (2, 3)  # respawned again if the run was long enough
    deadline = time.monotonic() + 20
    procs = read_registry(out)
    while any(p.state() not in (None, "Z") for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p.pid for p in procs if p.state() not in (None, "Z")] == []
    print(f"measured: joined before step {joins[0]['step']}, stopped replacement found in "
          f"{lost[0]['detect_s']:.1f} s, step 30 took {steps[29]['step_time_s']:.1f} s")
