"""End to end: TorchTitan training through real process deaths (SIGKILL / hang), 4 x 1 on CPU.

Every test launches the real job (mpirun --with-ft ulfm) and checks what the survivors wrote.
Replica consistency (bitwise-identical parameter shards across survivors) is checked by the
trainer after every step; a divergence would stop the run, so finishing is part of the check.
"""

import json

import pytest


from conftest import DEBUG_CONFIG, read_jsonl, run_cli
from recover_hsdp.workload.ledger import ledger_records

STEPS = 10
B = 4  # 4 replicas x G = 1


def _train(out, *extra_args, faults=(), replicas=4, hang_timeout=10):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas), "--out", str(out)]
    for fault in faults:
        args += ["--fault", fault]
    result = run_cli(args + ["--", "--recover.timeouts.hang_s", str(hang_timeout), *extra_args],
                     timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return result, read_jsonl(out / "metrics.jsonl")


def _assert_b_every_step(steps, final_alive):
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["reduced_microbatches"] == B for s in steps)
    assert steps[-1]["alive_replicas"] == final_alive


TWO_KILLS = ["replica=1,step=3,phase=grad_sync", "replica=2,step=6,phase=backward"]


# torch: slow (default suite time: on torch the 2 x 2 oracle kill (test_recovery_oracle) and the
# frozen 2 x 2 rank (test_real_failures) run in the default suite)
# CI time: the torch plane's kills are test_recovery_oracle's 2 x 2 (slow) and the frozen 2 x 2 rank
@pytest.mark.parametrize("data_plane", ["mpi", pytest.param("torch", marks=pytest.mark.soak)])
def test_exact_mode_two_deaths_stays_on_failure_free_trajectory(tmp_path, failure_free,
                                                                data_plane):
    """Real process: two replicas SIGKILLed mid-sync under mpirun; TorchTitan's loss stays the
    failure-free one (the MPI run's), on both data planes ([Note: control plane and data
    plane]: on ``torch`` the first kill lands inside a gloo all-reduce of the survivors)."""
    _, steps = _train(tmp_path, "--recover.debug.save_final_params", "--recover.reduce.plane",
                      data_plane, faults=TWO_KILLS)
    _assert_b_every_step(steps, final_alive=2)
    assert [s["alive_replicas"] for s in steps] == [4, 4, 3, 3, 3, 2, 2, 2, 2, 2]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, failure_free["exact"])]
    assert max(diffs) <= 1e-3, diffs
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["dead_replicas"] for e in events] == [[1], [2]]
    fired = read_jsonl(tmp_path / "faults_fired.jsonl")
    assert [(f["replica"], f["step"], f["phase"]) for f in fired] == [
        (1, 3, "grad_sync"), (2, 6, "backward")]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["failures"] == 2
    assert summary["alive_replicas"] == 2


@pytest.mark.slow  # default suite time (61 s): the policy's roles for fewer replicas than
# initial_replicas are in process (tests/workload/, tests/manager/), the relaunch's overrides in
# tests/cli/test_attempts.py; the cluster relaunch onto 2 of 3 runs in the slow part too
def test_a_run_launched_below_its_initial_replicas_keeps_b(tmp_path, failure_free):
    """[Note: the relaunch keeps B] (what a relaunch onto fewer replicas runs): 3 replicas
    launched with recover.initial_replicas = 4 commit B = 4 every step with the policy's roles for
    3 of 4 (two majors of G = 2, a spare), the failure-free 4-replica trajectory.
    Real process: the launcher's batch check, the ranks' policy and data under mpirun."""
    _, steps = _train(tmp_path, "--recover.initial_replicas", "4", replicas=3)
    _assert_b_every_step(steps, final_alive=3)
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, failure_free["exact"])]
    assert max(diffs) <= 1e-3, diffs
    for entry in ledger_records(tmp_path):
        roles = {r: (a["role"], len(a["committed"])) for r, a in entry["replicas"].items()}
        assert roles == {"0": ("major", 2), "1": ("major", 2), "2": ("spare", 0)}, entry

@pytest.mark.soak  # the writer hand-over is proven in-process and by the writer deaths (slow)
def test_global_rank_0_killed_outputs_move_to_lowest_survivor(tmp_path, local_corpus):
    """Rank 0 dies after step 3 was agreed but before it wrote step 3's records: the new
    writer writes them (from its own copy) and everything after.
    Real process: (slow:
    test_manager::test_writer_dies_and_the_next_one_writes_everything proves the hand-
    over) rank 0's process SIGKILLed mid-run."""
    _, steps = _train(tmp_path, faults=["replica=0,step=3,phase=optimizer"])
    _assert_b_every_step(steps, final_alive=3)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["failures"] == 1
    ledger = ledger_records(tmp_path)
    assert [e["step"] for e in ledger] == list(range(STEPS))      # nothing lost at the handover
    assert read_jsonl(tmp_path / "events.jsonl")[0]["dead_replicas"] == [0]


@pytest.mark.soak  # the watchdog is proven by test_collectives_faults[*-hang] and the stuck main thread
def test_hang_is_detected_within_bound_and_training_continues(tmp_path, local_corpus):
    """Real process: the hang watchdog's own thread kills a process whose main thread is stuck."""
    hang_timeout = 5
    _, steps = _train(tmp_path, faults=["replica=3,step=3,phase=backward,mode=hang"],
                      hang_timeout=hang_timeout)
    _assert_b_every_step(steps, final_alive=3)
    event = read_jsonl(tmp_path / "events.jsonl")[0]
    assert event["dead_replicas"] == [3]
    # the hung rank kills itself after hang_timeout; survivors wait in the reduce meanwhile
    failure_step = [s for s in steps if s["step"] == 3][0]
    assert failure_step["step_time_s"] < hang_timeout + 20


@pytest.mark.soak  # the schedule is unit-tested, the kills elsewhere
def test_paper_like_failure_schedule(tmp_path, local_corpus):
    """One failure every 3 steps at a seeded random step, 2 in all, each victim drawn among the
    replicas alive at its step. Real process: the seeded schedule's kills fire in real
    processes."""
    from recover_hsdp.faults import FaultSpec, Phase, failure_schedule

    alive, expected = [0, 1, 2, 3], []
    for fault in failure_schedule(3, 2, Phase.GRAD_SYNC, seed=7):
        expected.append(FaultSpec(replica=fault.victim(alive), step=fault.step,
                                  phase=fault.phase))
        alive.remove(expected[-1].replica)
    _, steps = _train(tmp_path, "--recover.faults.every", "3", "--recover.faults.max_failures",
                      "2", "--recover.faults.seed", "7")
    _assert_b_every_step(steps, final_alive=2)
    fired = read_jsonl(tmp_path / "faults_fired.jsonl")
    assert [(f["replica"], f["step"]) for f in fired] == [(s.replica, s.step) for s in expected]
    assert all(1 + 3 * i <= s.step <= 3 * (i + 1) for i, s in enumerate(expected))
    assert [e["dead_replicas"] for e in read_jsonl(tmp_path / "events.jsonl")] == [
        [s.replica] for s in expected]


@pytest.mark.soak  # test_recovery_oracle::test_promoted_spare (gradients, slow) covers it
def test_spare_promoted_when_its_shadowed_replica_dies(tmp_path, failure_free):
    """After replica 1 dies, G = 2: replicas 0 and 2 are majors and 3 is a spare shadowing
    replica 0's ids (exact mode). When replica 0 (global rank 0) dies at step 6, the spare is
    promoted: no extra microbatch, and the trajectory is still the failure-free one.
    Real process: (slow: the promotion is the policy's and the manager's, proven in-process) a
    spare promoted in a real job."""
    _, steps = _train(tmp_path, faults=["replica=1,step=3,phase=grad_sync",
                                        "replica=0,step=6,phase=grad_sync,bucket=3"])
    _assert_b_every_step(steps, final_alive=2)
    assert steps[5]["roles"]["spare"] == 1 and steps[6]["roles"]["spare"] == 0
    events = read_jsonl(tmp_path / "events.jsonl")
    assert events[1]["dead_replicas"] == [0] and events[1]["promoted"] == [3]
    assert events[1]["extra_microbatches"] == 0
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, failure_free["exact"])]
    assert max(diffs) <= 1e-3, diffs
