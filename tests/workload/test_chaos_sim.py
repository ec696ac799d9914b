"""The chaos simulator (benchmarks/chaos_sim.py, issue 34) on one small, dense simulated week.

16 replicas of 8 GPUs for 168 h at 300 x the Llama 3 interruption rate (~140 interruptions:
deaths, hangs, silent data corruption, cut links, lost hosts, stragglers). Every event calls the
real ``WorkloadPolicy`` at this size; the test records every plan it returned and checks the
invariant on each, then the figures: effective time in (0, 1], this project keeping at least
what checkpoint-restart keeps on the same trace, and the same figures from the same seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import chaos_sim  # noqa: E402
from _chaos import probe  # noqa: E402

ARGV = ["--gpus", "128", "--rate-scale", "300", "--max-trials", "1", "--no-plot"]


@pytest.fixture
def planned(monkeypatch):
    """Every plan the real policy returned in the simulation, with its B."""
    seen: list[tuple[int, int, int]] = []
    original = probe.PolicyProbe.check

    def record(self, plan):
        seen.append((plan.step, plan.committed_total(), self.b))
        return original(self, plan)

    monkeypatch.setattr(probe.PolicyProbe, "check", record)
    return seen


def run_week():
    args = chaos_sim.parse(ARGV)
    inp, _ = chaos_sim.load_inputs(args)
    row, _ = chaos_sim.run_size(128, inp, args)
    return row


def figures(row: dict) -> dict:
    """The simulated figures (not the wall-clock timings of the run)."""
    out = {}
    for name, system in row["systems"].items():
        for trial in system["per_trial"]:
            out[name] = {k: v for k, v in trial.items() if k not in ("sim_wall_s",
                                                                     "policy_wall_s")}
    return out


def test_a_dense_week_keeps_b_and_beats_checkpoint_restart(planned):
    """Every plan the real policy returned commits B; the week used every kind of decision;
    the figures are fractions; this project keeps at least checkpoint-restart's."""
    row = run_week()
    assert row["replicas"] == 16 and sum(row["interruptions"].values()) > 60
    assert row["interruptions"]["host"] > 0 and row["interruptions"]["link"] > 0
    ours = row["systems"]["this project"]["per_trial"][0]
    policy = ours["policy"]
    assert policy["reused_events"] == 0 and policy["real_events"] > 40   # W = 16: every event
    assert policy["replans"] > 0 and policy["admits"] > 0 and policy["restarts_from_state"] > 0
    assert planned and all(committed == b for _, committed, b in planned), planned[:5]
    assert len(planned) >= policy["plans"]
    assert ours["relaunches"] > 0 and ours["in_job_recoveries"] > 0
    assert ours["split_brain"] == 0 and ours["majority_refused"] == 0   # 16 replicas: fits
    assert ours["arbiter_claims"] > 0
    assert ours["hang_bounds_s"] == [30.0] or row["interruptions"]["hang"] == 0   # the floor
    for name, system in row["systems"].items():
        assert 0 < system["effective_training_time"] <= 1, name
    for name in ("this project", "this project, PRRTE surviving lost daemons"):
        assert row["systems"][name]["effective_training_time"] \
            >= row["systems"]["checkpoint-restart"]["effective_training_time"], name
    check = row["projection_check"]["step_factor_after_one_loss"]
    assert check["real_policy"] == check["projection_formula"] == 1.25   # ceil(64/15) / 4


def test_the_same_seed_gives_the_same_figures():
    """Which events call the real code depends on the seed only, never on timing."""
    assert figures(run_week()) == figures(run_week())
