"""The hang bound learned from a rank's own progress ([Note: a hang bound from progress] in
recover_hsdp/collectives/guard.py): in-process, no MPI. The real-job proofs are in
tests/jobs/test_real_failures.py (a stuck main thread with the default settings; a replica 20x
slower per microbatch that is never taken for a hang)."""

import time

import pytest

from recover_hsdp.collectives.guard import Deadlines, MpiGuard, ProgressBound


def _steps(bound: ProgressBound, gaps_per_step: list[list[float]]) -> None:
    for gaps in gaps_per_step:
        for gap in gaps:
            bound.gap(gap)
        bound.step_done()


def test_the_ceiling_holds_until_a_step_after_the_warm_up_is_measured():
    bound = ProgressBound(ceiling_s=300, floor_s=30, factor=40)
    assert bound.seconds == 300
    _steps(bound, [[90.0, 0.2]])          # step 1: compile / warm-up, not typical
    assert bound.seconds == 300 and not bound.learned
    _steps(bound, [[0.1, 0.2, 0.05]])     # step 2: 40 x 0.2 s < floor
    assert bound.learned and bound.seconds == 30


def test_the_bound_follows_the_longest_recent_gap_between_floor_and_ceiling():
    bound = ProgressBound(ceiling_s=300, floor_s=30, factor=40)
    _steps(bound, [[0.1], [2.0, 1.0]])
    assert bound.seconds == pytest.approx(80)          # 40 x 2 s
    _steps(bound, [[20.0]])                             # a gap 10x longer: raises it at once
    assert bound.seconds == 300                         # capped by the ceiling
    fixed = ProgressBound(ceiling_s=10, floor_s=30, factor=40)   # floor above the ceiling
    _steps(fixed, [[0.1], [0.1]])
    assert fixed.seconds == 10


def test_a_gap_20x_longer_than_usual_fits_but_a_stuck_rank_is_found_in_tens_of_seconds():
    bound = ProgressBound(ceiling_s=300, floor_s=30, factor=40)
    _steps(bound, [[5.0], [1.0, 1.5, 1.2]])
    assert 20 * 1.5 < bound.seconds == pytest.approx(60)    # every microbatch 20x slower: no kill
    _steps(bound, [[0.2] * 8 for _ in range(30)])           # a quota raised to 4 G: more gaps,
    assert bound.seconds == 30                              # none longer; old steps age out


def test_the_window_forgets_old_steps():
    bound = ProgressBound(ceiling_s=300, floor_s=1, factor=10, window_steps=3)
    _steps(bound, [[0.0], [5.0], [0.1], [0.1]])
    assert bound.seconds == pytest.approx(50)
    _steps(bound, [[0.1]])
    assert bound.seconds == pytest.approx(1)


def test_without_a_floor_the_bound_is_fixed():
    bound = ProgressBound(ceiling_s=12, floor_s=None, factor=40)
    _steps(bound, [[0.1], [0.1], [0.1]])
    assert bound.seconds == 12 and "hang_timeout_s=12" in bound.describe()


def _guard(**kw) -> MpiGuard:
    # poll_s: the watchdog thread never looks during the test (it would SIGKILL pytest); the
    # verdict is asked for directly
    return MpiGuard(Deadlines(call_s=400, repair_s=500, hang_timeout_s=300, poll_s=1000.0, **kw))


def test_guard_verdict_uses_the_learned_bound_and_ignores_pauses_and_mpi_waits():
    guard = _guard(hang_floor_s=30.0)
    try:
        for _ in range(3):
            guard.beat()
            guard.step_done()
        assert guard.progress.seconds == 30
        now = time.monotonic()
        assert guard.verdict(now + 29) is None
        reason = guard.verdict(now + 31)
        assert reason is not None and "hang bound 30.0 s" in reason
        with guard.paused():
            assert guard.verdict(time.monotonic() + 1000) is None      # paused: no hang check
        with guard.call("Allreduce", 100.0):
            assert guard.verdict(time.monotonic() + 99) is None        # inside MPI: the deadline
            assert "deadline" in guard.verdict(time.monotonic() + 101)
        assert guard.progress.longest_gap_s < 1.0   # neither the pause nor the wait was a gap
    finally:
        guard.close()


def test_guard_with_fixed_bound_keeps_the_old_behaviour():
    guard = _guard()
    try:
        for _ in range(3):
            guard.step_done()
        assert guard.verdict(time.monotonic() + 299) is None
        assert "hang_timeout_s=300" in guard.verdict(time.monotonic() + 301)
    finally:
        guard.close()


def test_deadlines_reject_a_bad_floor_or_factor():
    with pytest.raises(ValueError, match="hang_floor_s"):
        Deadlines(hang_floor_s=0)
    with pytest.raises(ValueError, match="hang_progress_factor"):
        Deadlines(hang_progress_factor=0.5)


def test_a_whole_microbatch_is_the_unit_so_a_slow_one_in_one_gap_fits():
    # fine beats (FSDP buckets) make the gaps short; a microbatch slowed down in one piece (one
    # long gap) must still fit: the unit of the bound is the whole microbatch
    bound = ProgressBound(ceiling_s=300, floor_s=1, factor=40)
    bound.step_done(0.5)
    for _ in range(3):
        for _ in range(10):
            bound.gap(0.04)
        bound.step_done(0.4)
    assert bound.seconds == pytest.approx(16)
    assert 20 * 0.4 < bound.seconds
