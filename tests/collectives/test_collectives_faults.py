"""recover_hsdp.collectives under real failures: ULFM mpirun jobs in which ranks are SIGKILLed (by a peer
or by themselves) or hang, at chosen moments (see mpi_programs/collectives_worker.py).

Each scenario asserts: the job ends within a bound; every survivor (and every retired rank) reports the
same epoch, dead replicas and alive replicas; ranks of dead replicas retire with their log line and exit
0 (mpirun's return code is non-zero if any rank exits with a non-zero code; SIGKILLed ranks do not
count); the steps redone after the failure reduce exactly the sum over the surviving replicas.
"""

import dataclasses
import os
import re

import pytest

from mpi_programs.mpijob import run_mpi


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    replicas: int
    S: int
    victims: tuple[int, ...]
    second: tuple[int, ...] = ()  # during_<repair phase>: ranks that die inside that repair phase
    mb: float = 1.0
    hang_timeout: float = 10.0
    bound_s: float = 60.0  # the whole job must end within this
    hook_thread: bool = False  # the reduce on a second thread, as CUDA autograd runs the hook

    @property
    def nprocs(self):
        return self.replicas * self.S

    @property
    def dead_replicas(self):
        return sorted({v // self.S for v in self.victims + self.second})

    @property
    def alive_replicas(self):
        return [r for r in range(self.replicas) if r not in self.dead_replicas]

    def args(self, out_dir):
        return ["--scenario", self.name, "--S", str(self.S), "--out", str(out_dir),
                "--victims", ",".join(map(str, self.victims)), "--second", ",".join(map(str, self.second)),
                "--mb", str(self.mb), "--hang-timeout", str(self.hang_timeout), "--steps", "3",
                "--fail-step", "1", *(["--hook-thread"] if self.hook_thread else [])]


SCENARIOS = {
    "2x1-before-allreduce": Scenario("before_allreduce", 2, 1, (1,)),
    "4x1-rank0-before-allreduce": Scenario("before_allreduce", 4, 1, (0,)),
    "2x2-one-rank-of-replica": Scenario("before_allreduce", 2, 2, (3,)),
    "4x1-mid-64MB-allreduce": Scenario("mid_allreduce", 4, 1, (2,), mb=64),
    "4x1-two-replicas-mid-64MB": Scenario("mid_allreduce", 4, 1, (1, 2), mb=64),
    "3x2-mid-allreduce": Scenario("mid_allreduce", 3, 2, (2,), mb=16),
    # [Note: MPI from autograd's thread]: the hook's MPI calls on a second thread
    "4x1-mid-16MB-allreduce-on-autograd-thread": Scenario("mid_allreduce", 4, 1, (2,), mb=16,
                                                          hook_thread=True),
    "2x2-one-rank-on-autograd-thread": Scenario("before_allreduce", 2, 2, (3,), hook_thread=True),
    "4x1-during-agree": Scenario("during_agree", 4, 1, (1,)),
    "3x2-rank0-during-agree": Scenario("during_agree", 3, 2, (0,)),
    "4x1-during-shrink": Scenario("during_shrink", 4, 1, (1,), second=(2,)),
    "3x2-during-shrink": Scenario("during_shrink", 3, 2, (5,), second=(1,)),
    "4x1-during-rebuild": Scenario("during_rebuild", 4, 1, (1,), second=(2,)),
    "4x1-during-membership-agree": Scenario("during_membership_agree", 4, 1, (3,), second=(0,)),
    "2x1-hang": Scenario("hang", 2, 1, (1,), hang_timeout=3.0),
    "2x2-hang": Scenario("hang", 2, 2, (1,), hang_timeout=3.0),
}


def check(sc: Scenario, job) -> dict:
    """All the assertions of one run; returns the survivors' results."""
    tail = job.output[-4000:]
    assert job.rc is not None, f"job hung (killed after {job.wall_s:.0f} s)\n{tail}"
    assert job.rc == 0, f"mpirun rc {job.rc}: some rank exited non-zero\n{tail}"
    assert job.wall_s < sc.bound_s, f"took {job.wall_s:.1f} s > {sc.bound_s} s"
    results = job.results()
    doomed = set(sc.victims) | set(sc.second)
    dead_ranks = {r * sc.S + s for r in sc.dead_replicas for s in range(sc.S)}
    assert set(results) == set(range(sc.nprocs)) - doomed, f"reports from {sorted(results)}\n{tail}"
    for rank, res in results.items():
        where = f"rank {rank}"
        assert res["value_errors"] == 0, where
        assert res["hook_threads"] == (["autograd-device-thread"] if sc.hook_thread else []), where
        assert res["epoch"] == 1, where
        assert res["alive_replicas"] == sc.alive_replicas, where
        failed = [e for e in res["events"] if not e["clean"]]
        assert len(failed) == 1, f"{where}: {failed}"
        assert failed[0]["dead"] == sc.dead_replicas and failed[0]["epoch"] == 1, where
        assert failed[0]["step"] == 1, where
        if rank in dead_ranks:
            assert res["status"] == "retired" and failed[0]["retire"], where
            assert re.search(rf"RETIRE rank {rank} \(replica {rank // sc.S}, .*SIGKILL", job.output), where
        else:
            assert res["status"] == "finished" and not failed[0]["retire"], where
            # every step committed once, and after the failure the reduce is exactly the sum over the
            # surviving replicas' ranks of this shard (contribution (rank+1)*100 + step at index 0)
            clean_steps = [e["step"] for e in res["events"] if e["clean"]]
            assert clean_steps == [0, 1, 2], where
            final = {s["step"]: s for s in res["sums"]}  # last reduce of each step = the committed one
            for step in (1, 2):
                members = [r * sc.S + rank % sc.S for r in sc.alive_replicas]
                assert final[step]["members"] == members, where
                assert final[step]["first"] == sum((m + 1) * 100 + step for m in members), where
                assert final[step]["epoch"] == 1, where
    return results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("key", list(SCENARIOS))
def test_fault_scenario(key, tmp_path):
    """Real process: a rank SIGKILLed or hung inside a real ULFM call (all-reduce, Agree, Shrink,
    rebuild)."""
    sc = SCENARIOS[key]
    job = run_mpi(sc.nprocs, "collectives_worker.py", sc.args(tmp_path), tmp_path, timeout_s=120)
    results = check(sc, job)
    survivors = {r: res for r, res in results.items() if res["status"] == "finished"}
    first_failure = {r: next(e for e in res["events"] if not e["clean"]) for r, res in survivors.items()}
    if sc.name == "mid_allreduce":
        # the kill landed inside the big all-reduce: some survivor saw its all-reduce fail
        assert any(not e["allreduce_ok"] for e in first_failure.values()), first_failure
    if sc.name == "during_agree":
        # nothing failed before the consensus: the death was seen inside the Agree
        assert all(e["allreduce_ok"] and e["global_ok"] for e in first_failure.values()), first_failure
    if sc.name in ("during_rebuild", "during_membership_agree"):
        # the second death broke the first repair round: the repair went round again
        assert all(e["rounds"] >= 2 for e in first_failure.values()), first_failure
    if sc.name == "hang":
        t_hang = float((tmp_path / f"hang{sc.victims[0]}.txt").read_text())
        for r, e in first_failure.items():
            # detected and repaired within the hang timeout plus a generous margin for a loaded box
            assert e["t"] - t_hang < sc.hang_timeout + 10.0, (r, e["t"] - t_hang)
        assert "no progress (heartbeat)" in job.output


@pytest.mark.soak  # a stress run of every scenario: run it before trusting a change here
@pytest.mark.timeout(7200)
def test_fault_scenarios_repeated():
    """Every scenario RECOVER_STRESS_REPEATS times (default 10): any flaky run is a product bug."""
    from mpi_programs.stress_faults import stress

    outcomes = stress(int(os.environ.get("RECOVER_STRESS_REPEATS", "10")), list(SCENARIOS))
    assert all(set(c) == {"pass"} for c in outcomes.values()), outcomes
