"""LivenessPhase: one phase for the replica heartbeat and Open MPI's detector timeout
([Note: detection margins by phase], [Note: Open MPI's detector timeout by phase])."""

import pytest

from recover_hsdp.groups.liveness import LivenessPhase


class FakeDetector:
    def __init__(self):
        self.writes: list[float] = []

    def set(self, seconds: float) -> None:
        self.writes.append(seconds)


class FakeBeat:
    def __init__(self):
        self.steadies, self.depth = 0, 0

    def steady(self):
        self.steadies += 1

    def slow_phase(self):
        beat = self

        class _Phase:
            def __enter__(self):
                beat.depth += 1

            def __exit__(self, *exc):
                beat.depth -= 1
        return _Phase()


def test_start_up_is_wide_until_the_first_commit_then_slow_phases_widen_again():
    detector, beat = FakeDetector(), FakeBeat()
    phase = LivenessPhase(beat, detector, detect_s=4, slow_phase_s=30)
    assert detector.writes == [30] and phase.slow
    phase.steady()
    phase.steady()  # every committed step says so; one write
    assert detector.writes == [30, 4] and beat.steadies == 2 and not phase.slow
    with phase.slow_phase():  # a checkpoint save
        assert beat.depth == 1 and detector.writes[-1] == 30
        with phase.slow_phase():  # nested: no extra write
            assert beat.depth == 2
        assert detector.writes == [30, 4, 30]
    assert detector.writes == [30, 4, 30, 4] and beat.depth == 0


def test_a_slow_phase_during_start_up_keeps_it_wide():
    detector = FakeDetector()
    phase = LivenessPhase(None, detector, detect_s=4, slow_phase_s=30)
    with phase.slow_phase():  # a checkpoint load before the first step
        pass
    assert detector.writes == [30]
    phase.steady()
    assert detector.writes == [30, 4]


def test_an_error_inside_a_slow_phase_still_ends_it():
    detector = FakeDetector()
    phase = LivenessPhase(None, detector, detect_s=4, slow_phase_s=30)
    phase.steady()
    with pytest.raises(RuntimeError), phase.slow_phase():
        raise RuntimeError("save failed")
    assert detector.writes[-1] == 4 and not phase.slow


def test_without_a_detector_or_a_heartbeat_nothing_is_written():
    phase = LivenessPhase(None, None, detect_s=4, slow_phase_s=30)
    phase.steady()
    with phase.slow_phase():
        pass
    detector = FakeDetector()
    LivenessPhase(None, detector, detect_s=0, slow_phase_s=30).steady()  # detection off
    assert detector.writes == []
