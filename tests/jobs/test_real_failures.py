"""Failures that do not close a socket, errors that kill nobody, a writer lost at the very end, and
output folders reused: real 4 x 1 / 2 x 2 jobs (mpirun --with-ft ulfm) on one host.

Each test asserts: the launcher exits 0 with no step that waited for a deadline, every step committed with B
microbatches, the right survivors, the loss within 1e-3 of the failure-free run (exact data
assignment), and no process of the job alive afterwards (by the pids the job registered).
Survivors' parameters are compared by the trainer every step (consistency_check_interval = 1 in
the debug config): a divergence would stop the run, so finishing is part of the check.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest

from conftest import DEBUG_CONFIG, no_step_waited_for_a_deadline, read_jsonl, run_cli
from recover_hsdp.collectives.processes import read_registry

STEPS = 10
B = 4


def _train(out, faults=(), replicas=4, ranks=1, extra=(), timeout=300, hang_timeout="20"):
    """``hang_timeout`` None: the default hang settings ([Note: a hang bound from progress])."""
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas),
            "--ranks-per-replica", str(ranks), "--out", str(out)]
    for fault in faults:
        args += ["--fault", fault]
    started = time.monotonic()
    hang = ["--recover.timeouts.hang_s", hang_timeout] if hang_timeout else []
    result = run_cli(args + ["--", *hang, *extra], timeout=timeout)
    wall = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return result, read_jsonl(out / "metrics.jsonl"), wall


def _check(out, steps, failure_free, alive_after, wall, hang_timeout_s=20.0):
    no_step_waited_for_a_deadline(steps, hang_timeout_s)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["reduced_microbatches"] == B for s in steps)
    assert steps[-1]["alive_replicas"] == alive_after
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, failure_free["exact"])]
    assert max(diffs) <= 1e-3, diffs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == STEPS
    procs = read_registry(out)
    assert procs, "the job registered no process"
    assert [p.pid for p in procs if p.state() is not None] == []  # nothing left behind
    ledger = read_jsonl(out / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(STEPS))
    return summary


def _check_2x2(out, steps, wall, alive: list[int]):
    """A 2 x 2 run in which replica 1 left: B every step, the alive counts, one event naming
    replica 1, nothing left alive. Returns the event."""
    no_step_waited_for_a_deadline(steps)
    assert [s["alive_replicas"] for s in steps] == alive
    assert all(s["reduced_microbatches"] == 2 for s in steps)
    (event,) = read_jsonl(out / "events.jsonl")
    assert event["dead_replicas"] == [1], event
    assert [p.pid for p in read_registry(out) if p.state() is not None] == []
    return event


@pytest.mark.slow  # default suite time: test_frozen_rank_of_a_2x2_replica covers it (and
# tests/groups/test_data_plane.py the torch plane's abandoned call)
@pytest.mark.parametrize("data_plane", [pytest.param("mpi", marks=pytest.mark.soak),
                                        pytest.param("torch", marks=pytest.mark.soak)])
def test_frozen_rank_is_declared_dead_and_nothing_is_left_behind(tmp_path, failure_free,
                                                                 data_plane):
    """Replica 2 SIGSTOPs itself (all threads frozen, sockets open: a hung node) in step 3's
    backward. The heartbeat detector declares it dead within detect_timeout_s, the others
    shrink and finish, the survivors end the stopped process, and the launcher returns.
    Real process: (slow: the 2 x 2 case below proves the same and more) SIGSTOP of a real process,
    found by the detector; on the torch data plane the others are blocked in a gloo all-reduce
    with it and abandon it when the detector's notice arrives."""
    result, steps, wall = _train(tmp_path, faults=["replica=2,step=3,phase=backward,mode=stop"],
                                 extra=["--recover.reduce.plane", data_plane])
    _check(tmp_path, steps, failure_free, alive_after=3, wall=wall)
    (event,) = read_jsonl(tmp_path / "events.jsonl")
    assert event["dead_replicas"] == [2] and event["step"] == 3
    assert event["detect_s"] < 15, event  # detect_timeout_s = 4 (+ a loaded 2-core host)


@pytest.mark.soak  # CI time: in-process + the 2 x 2 case (default suite)
def test_error_inside_a_replica_makes_only_that_replica_leave(tmp_path, failure_free):
    """A RuntimeError in replica 1's forward at step 3 (what a CUDA OOM raises), then one in
    replica 3's optimizer step at step 6: each replica leaves as a unit with its error text in
    events.jsonl and the survivors stay on the failure-free trajectory.
    Real process: (slow: test_manager proves forward and optimizer errors; the 2 x 2 case
    the real exit) a real process ending itself."""
    result, steps, wall = _train(tmp_path, faults=["replica=1,step=3,phase=forward,mode=raise",
                                                   "replica=3,step=6,phase=optimizer,mode=raise"])
    _check(tmp_path, steps, failure_free, alive_after=2, wall=wall)
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["dead_replicas"] for e in events] == [[1], [3]]
    assert "injected fault at step 3 forward" in events[0]["errors"]["1"][0]
    assert "injected fault at step 6 optimizer" in events[1]["errors"]["3"][0]
    assert events[1]["step"] == 7  # step 6 was committed; the others see it leave in step 7


# torch: slow (default suite time: the 4 x 1 SIGKILL run in test_end_to_end is on both planes)
@pytest.mark.parametrize("data_plane", ["mpi", pytest.param("torch", marks=pytest.mark.soak)])
def test_error_in_one_rank_of_a_2x2_replica_takes_the_replica_out(tmp_path, data_plane):
    """2 x 2: rank 1 of replica 1 raises in backward; it leaves, its peer's intra-replica
    collective fails at once, and the replica leaves as a unit; replica 0 is untouched.
    Real process: a rank SIGKILLs itself after an error, mpirun tolerates it, its peer's gloo call
    fails."""
    result, steps, wall = _train(tmp_path, replicas=2, ranks=2,
                                 faults=["replica=1,step=2,phase=backward,rank=1,mode=raise"],
                                 extra=["--training.steps", "4", "--recover.reduce.plane",
                                        data_plane])
    event = _check_2x2(tmp_path, steps, wall, [2, 1, 1, 1])
    assert "rank 3 step 2: RuntimeError: injected fault" in " ".join(event["errors"]["1"])


@pytest.mark.soak  # CI time: in-process (test_manager's writer deaths) + the 2 x 2 case
def test_writer_dies_while_writing_the_run_outputs(tmp_path, failure_free):
    """Rank 0 (the writer) is SIGKILLed after the last step's commit, while it writes the run's
    final outputs: the next writer writes the summary and the launcher reports success.
    Real process: (slow: the 2 x 2 case below and test_manager prove it) the writer
    SIGKILLed while it writes files."""
    result, steps, wall = _train(tmp_path, faults=[f"replica=0,step={STEPS},phase=finish"],
                                 extra=["--recover.debug.save_final_params"])
    summary = _check(tmp_path, steps, failure_free, alive_after=4, wall=wall)
    assert summary["alive_replicas"] == 3  # the writer's replica died after the last step
    assert (tmp_path / "final_params.pt").exists()
    (event,) = read_jsonl(tmp_path / "events.jsonl")
    assert event["phase"] == "end of run" and event["dead_replicas"] == [0]


@pytest.mark.soak  # CI time: the 2 x 2 start-up death (slow) covers it
def test_death_while_the_model_is_built_is_survived(tmp_path, failure_free):
    """Replica 2 is SIGKILLed at start-up, after its process group formed and before the model
    is built (the world is built first: a death from there on is found by step 1's
    collectives). The other 3 replicas run every step with B and the failure-free loss.
    Real process: (slow: the 2 x 2 case below proves it) a death while TorchTitan builds the model."""
    result, steps, wall = _train(tmp_path, faults=["replica=2,step=0,phase=startup"])
    _check(tmp_path, steps, failure_free, alive_after=3, wall=wall)
    assert all(s["alive_replicas"] == 3 for s in steps)
    (event,) = read_jsonl(tmp_path / "events.jsonl")
    assert event["dead_replicas"] == [2] and event["step"] == 1, event


@pytest.mark.slow  # default suite time (CI runs it): tests/manager proves the start-up death
def test_death_of_one_rank_of_a_2x2_replica_at_start_up(tmp_path):
    """2 x 2: rank 1 of replica 1 SIGKILLed at start-up (phase ``startup``): its replica peer's
    first collective fails, the replica leaves as a unit at step 1, replica 0 goes on.
    Real process: a death after the replica's rendezvous, before TorchTitan built the model."""
    result, steps, wall = _train(tmp_path, replicas=2, ranks=2,
                                 faults=["replica=1,step=0,phase=startup,rank=1"],
                                 extra=["--training.steps", "4"])
    assert _check_2x2(tmp_path, steps, wall, [1, 1, 1, 1])["step"] == 1


@pytest.mark.soak  # test_manager proves the writer hand-over; the 4 x 1 case is slow
def test_writer_of_a_2x2_replica_dies_while_writing_the_run_outputs(tmp_path):
    """2 x 2: the writer (rank 0 = shard 0 of replica 0) is SIGKILLed after the last commit;
    its replica peer leaves with it (a replica dies as a unit) and replica 1's first rank writes
    the summary, the final parameters and every line; the launcher reports success.
    Real process: the writer SIGKILLed while it writes files; its peer leaves; the files on disk
    end complete."""
    result, steps, wall = _train(tmp_path, replicas=2, ranks=2,
                                 faults=["replica=0,step=4,phase=finish,rank=0"],
                                 extra=["--training.steps", "4", "--recover.debug.save_final_params"])
    no_step_waited_for_a_deadline(steps)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["reduced_microbatches"] == 2 and s["alive_replicas"] == 2 for s in steps)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 4
    assert summary["alive_replicas"] == 1  # alive at the end, not at the last step's commit
    assert (tmp_path / "final_params.pt").exists()
    assert [line["step"] for line in read_jsonl(tmp_path / "ledger.jsonl")] == [0, 1, 2, 3]
    (event,) = read_jsonl(tmp_path / "events.jsonl")
    assert event["phase"] == "end of run" and event["dead_replicas"] == [0], event
    assert [p.pid for p in read_registry(tmp_path) if p.state() is not None] == []


@pytest.mark.soak  # CI time: the launcher's clean-up is one function (outputs.start_afresh)
def test_a_second_run_into_the_same_folder_starts_afresh(tmp_path):
    """Outputs are never mixed: the earlier run's ledger, faults and metrics are removed.
    Real process: the launcher's clean-up of a real output folder."""
    _train(tmp_path, replicas=2, faults=["replica=1,step=2,phase=forward"],
           extra=["--training.steps", "3"])
    assert len(read_jsonl(tmp_path / "faults_fired.jsonl")) == 1
    result, steps, _ = _train(tmp_path, replicas=2, extra=["--training.steps", "2"])
    assert "removed the earlier run's" in result.stdout
    assert [s["step"] for s in steps] == [1, 2]
    assert [line["step"] for line in read_jsonl(tmp_path / "ledger.jsonl")] == [0, 1]
    assert not (tmp_path / "faults_fired.jsonl").exists()
    assert not (tmp_path / "events.jsonl").exists() or not (tmp_path / "events.jsonl").read_text()


def test_a_stuck_main_thread_costs_tens_of_seconds_with_the_default_settings(
        tmp_path, failure_free):
    """4 x 1, default hang settings (hang_timeout_s 300, hang_floor_s 30): replica 3's main
    thread sleeps forever inside step 3's backward. Its hang bound, learned from its own
    progress, is the 30 s floor: it kills itself, the others repair, step 3 commits B. Before the
    learned bound this run took 324 s (the fixed 300 s).
    Real process: a live process whose main thread is stuck (its watchdog thread runs)."""
    seen: list[str] = []
    watcher = threading.Thread(target=_watch_status, args=(tmp_path, seen), daemon=True)
    watcher.start()
    result, steps, wall = _train(tmp_path, hang_timeout=None,
                                 faults=["replica=3,step=3,phase=backward,mode=hang"])
    watcher.join(timeout=60)
    summary = _check(tmp_path, steps, failure_free, alive_after=3, wall=wall,
                     hang_timeout_s=300.0)
    assert [s["alive_replicas"] for s in steps] == [4, 4] + [3] * 8
    # the bound the stuck rank died by, as its watchdog wrote it: the defaults' formula over the
    # gap it measured (30 s, the floor, unless the host was loaded enough for a 0.75 s gap)
    found = re.search(r"hang bound ([\d.]+) s = min\(hang_timeout_s ([\d.]+), max\(hang_floor_s "
                      r"([\d.]+), ([\d.]+) x longest recent microbatch or gap ([\d.]+) s\)\)",
                      result.stderr)
    assert found, result.stderr[-3000:]
    bound, ceiling, floor, factor, gap = map(float, found.groups())
    assert (ceiling, floor, factor) == (300.0, 30.0, 40.0)             # the default settings
    assert abs(bound - min(ceiling, max(floor, factor * gap))) <= 0.05 + factor * 0.005
    assert bound < ceiling                                # learned, not the fixed 300 s
    assert bound <= steps[2]["step_time_s"] < bound + 20, (bound, steps[2]["step_time_s"])
    assert summary["wall_s"] < ceiling, summary["wall_s"]   # the whole run < the old bound
    (event,) = read_jsonl(tmp_path / "events.jsonl")
    assert event["dead_replicas"] == [3] and event["step"] == 3
    # [Note: rank status]: where it hung, recorded by its watchdog thread before the kill, and
    # `recover-hsdp status` run on the live job while it hung
    (reason,) = event["errors"]["3"]
    assert reason.startswith("rank 3 step 3: hung at step 3 backward for "), reason
    stack = json.loads((tmp_path / "errors" / "rank3.json").read_text())["stack"]
    assert any("time.sleep(3600)" in line for line in stack), stack
    assert any(line.startswith("rank 3 (replica 3, shard 0") and "step 3 backward" in line
               for line in seen), seen


def _watch_status(out, seen: list[str]) -> None:
    """Run ``recover-hsdp status`` on the running job until rank 3 has been seen stuck in
    step 3's backward for over 5 s (or the run's summary exists); the lines go to ``seen``."""
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and not (out / "summary.json").exists():
        result = subprocess.run([sys.executable, "-m", "recover_hsdp.cli.launch", "status",
                                 str(out)], capture_output=True, text=True, timeout=60)
        stuck = [line for line in result.stdout.splitlines()
                 if line.startswith("rank 3 ") and "step 3 backward" in line]
        if stuck and float(re.search(r"for ([\d.]+) s", stuck[0]).group(1)) > 5:
            seen.extend(stuck)
            return
        time.sleep(1.0)


@pytest.mark.soak  # tests/collectives/test_hang_bound.py proves the bound's logic
def test_a_replica_20x_slower_is_not_a_hang_but_a_stuck_one_is_found_fast(tmp_path, failure_free):
    """The learned hang bound with a 1 s floor, so that only the progress factor (40) protects a
    slow replica: every microbatch of replica 1 takes 20x its own last one (``times=20``, the
    whole extra in one sleep: one gap) in steps 3-5 and it is never taken for a hung one; replica
    3's main thread sticks at step 7 and is found after ~40 x its own microbatch: seconds, not
    the 120 s ceiling.
    Real process: a sleeping (slow) main thread that progresses, and one that never returns."""
    result, steps, wall = _train(tmp_path, extra=["--recover.timeouts.hang_floor_s", "1"], faults=[
        "replica=1,step=3,phase=forward,mode=slow,times=20,steps=3",
        "replica=3,step=7,phase=backward,mode=hang"], timeout=400, hang_timeout="120")
    _check(tmp_path, steps, failure_free, alive_after=3, wall=wall)
    assert [s["alive_replicas"] for s in steps] == [4] * 6 + [3] * 4     # replica 1 stayed
    per_microbatch = [s["compute_s_per_microbatch"]["1"] for s in steps[1:5]]
    assert per_microbatch[1] > 15 * per_microbatch[0], per_microbatch     # measured: ~20x
    (bound,) = re.findall(r"> hang bound ([0-9.]+) s = .*max\(hang_floor_s 1.0", result.stderr)
    assert float(bound) < 60                   # learned from progress, far below the ceiling
    assert steps[6]["step_time_s"] < float(bound) + 20, (bound, steps[6]["step_time_s"])
    (event,) = read_jsonl(tmp_path / "events.jsonl")
    assert event["dead_replicas"] == [3] and event["step"] == 7


@pytest.mark.soak  # 60 s of compute; detection_bench measures the same 10/10 times
def test_a_long_step_is_not_a_death(tmp_path):
    """Replica 1 computes 20 s (pure Python, GIL held, no MPI call: 5 x detect_timeout_s) in
    step 2: the heartbeat detector's own thread keeps it alive, nobody is declared dead.
    Real process: a real process holding the GIL for 20 s is not declared dead by the detector."""
    result, steps, wall = _train(tmp_path, replicas=2,
                                 faults=["replica=1,step=2,phase=forward,mode=busy,seconds=20"],
                                 extra=["--training.steps", "3", "--recover.timeouts.hang_s", "60"])
    assert [s["alive_replicas"] for s in steps] == [2, 2, 2]
    assert steps[1]["step_time_s"] >= 20
    assert not (tmp_path / "events.jsonl").exists() or not (tmp_path / "events.jsonl").read_text()
    assert len(read_jsonl(tmp_path / "faults_fired.jsonl")) == 1


# mpi: slow (default suite time: a frozen peer is the control plane's to find, the same code on
# both planes: test_collectives_faults[*-hang] and the stuck main thread above run it on MPI;
# torch adds the abandoned blocked gloo call, in the default suite here)
@pytest.mark.parametrize("data_plane", [pytest.param("mpi", marks=pytest.mark.soak), "torch"])
def test_frozen_rank_of_a_2x2_replica(tmp_path, data_plane):
    """2 x 2: rank 1 of replica 1 SIGSTOPs itself. Its replica peer is blocked in gloo with it
    (a frozen process keeps its sockets): the survivor that the detector tells ends the frozen
    process at once (same host), which frees the peer, and the replica leaves as a unit in about
    detect_timeout_s, not at the hang watchdog (20 s here).
    Real process: SIGSTOP (sockets open) of one rank; its gloo-blocked peer is freed when a
    survivor ends it."""
    result, steps, wall = _train(tmp_path, replicas=2, ranks=2,
                                 faults=["replica=1,step=2,phase=backward,rank=1,mode=stop"],
                                 extra=["--training.steps", "4", "--recover.reduce.plane",
                                        data_plane])
    event = _check_2x2(tmp_path, steps, wall, [2, 1, 1, 1])
    assert event["detect_s"] < 15
    # [Note: rank status]: what the frozen rank was doing, from its status file (its last
    # point, in the page cache of this host when SIGSTOP froze every thread)
    frozen = event["last_seen"]["3"]
    assert (frozen["replica"], frozen["shard"], frozen["step"]) == (1, 1, 2), frozen
    assert frozen["phase"] in ("forward", "backward"), frozen
