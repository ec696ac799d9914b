"""A steady timeout learned from beat gaps ([Note: a steady timeout learned from beat gaps] in
recover_hsdp/groups/gap_bound.py): the bound, Open MPI's gaps read off its state, and both
liveness signals using it, on fake clocks."""

import socket

import pytest

from recover_hsdp.groups.gap_bound import GapBound
from recover_hsdp.groups.heartbeat import ReplicaHeartbeat
from recover_hsdp.groups.liveness import DetectorGaps, LivenessPhase


def test_a_healthy_hosts_gaps_keep_detect_s():
    bound = GapBound(4.0, 30.0)
    for t in range(1, 60):
        bound.gap(1.0 + 0.05 * (t % 3), float(t))  # beats at the period, a little jitter
    assert bound.allowed(60.0) == 4.0 and bound.report("x") == ""


def test_late_beats_widen_it_within_the_cap_and_it_narrows_after_the_window():
    bound = GapBound(4.0, 30.0, factor=3.0, window_s=60.0)
    bound.gap(2.2, 10.0)
    assert bound.allowed(10.0) == pytest.approx(6.6)
    bound.gap(15.0, 20.0)  # a burst
    assert bound.allowed(20.0) == 30.0  # capped at slow_phase_s
    assert bound.allowed(70.5) == 30.0  # 15 s gap ended at 20: still in the window
    assert bound.allowed(80.5) == 4.0  # both gaps out of the window
    assert "15.0 s apart" in bound.report("Open MPI's detector") and bound.widest_s == 30.0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        GapBound(4.0, 3.0)
    with pytest.raises(ValueError):
        GapBound(0.0, 3.0)


class FakeOpenMPI:
    """Open MPI's detector state as ``DetectorTimeout`` shows it."""

    def __init__(self):
        self.observing, self.stamp, self.writes = 1, 1000.0, []

    def last_beat(self):
        return self.observing, self.stamp

    def set(self, seconds):
        self.writes.append(seconds)


def test_gaps_are_read_off_open_mpis_stamp():
    mpi, bound = FakeOpenMPI(), GapBound(4.0, 30.0)
    gaps = DetectorGaps(mpi, bound, period_s=1.0)
    gaps.poll(0.0)  # Open MPI's start-up slack (a stamp in the future): no gap yet
    mpi.stamp = 3.0
    gaps.poll(0.25)  # the stamp went back: starts over
    for now in (0.5, 0.75, 1.0):  # the same beat, seen again
        gaps.poll(now)
    mpi.stamp = 5.5  # next beat 2.5 s later, seen 0.25 s after the last poll
    gaps.poll(1.25)
    assert bound.count == 1 and bound.largest_s == 2.5
    mpi.stamp = 9.0
    gaps.poll(3.0)  # this poller was held 1.75 s > the period: the gap may hide a beat
    assert bound.count == 1
    mpi.observing, mpi.stamp = 0, 9.5  # a ring re-link: a new rank observed
    gaps.poll(3.1)
    mpi.stamp = 10.5
    gaps.poll(3.2)
    assert bound.count == 2 and bound.largest_s == 2.5


def test_the_phase_writes_the_learned_bound_once_steady_only():
    mpi, clock = FakeOpenMPI(), [0.0]
    phase = LivenessPhase(None, mpi, detect_s=4, slow_phase_s=30, clock=lambda: clock[0])
    assert mpi.writes == [30]
    mpi.stamp = 1.0
    phase.poll()
    clock[0], mpi.stamp = 0.25, 4.0  # a 3 s gap during start-up
    phase.poll()
    assert mpi.writes == [30]  # start-up: slow_phase_s whatever the gaps
    phase.steady()
    assert mpi.writes == [30, 9.0]  # the gap is in the window: 3 x 3 s
    with phase.slow_phase():
        assert mpi.writes[-1] == 30
    assert mpi.writes[-1] == 9.0
    clock[0] = 61.0  # the window passed
    phase.poll()
    assert mpi.writes[-1] == 4
    assert phase.close() == [phase.gaps.bound.report("Open MPI's detector")]
    assert "3.0 s apart" in phase.close()[0]


def test_a_poll_holds_the_lock_the_main_threads_apply_takes():
    """The poller appends to the bound's window while the main thread's ``steady`` reads it."""
    held = []

    class Watched(FakeOpenMPI):
        def last_beat(self):
            held.append(phase._lock.locked())
            return super().last_beat()

    phase = LivenessPhase(None, Watched(), detect_s=4, slow_phase_s=30)
    phase.poll()
    assert held == [True]


def test_the_poller_thread_reads_and_stops():
    mpi = FakeOpenMPI()
    phase = LivenessPhase(None, mpi, detect_s=1.6, slow_phase_s=30).start()
    assert phase._thread is not None and phase._thread.is_alive()
    assert phase.close() == [] and not phase._thread.is_alive()


def _heartbeat(clock):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    beat = ReplicaHeartbeat(sock, 0, {1: ("127.0.0.1", 9)}, b"tokentok", period_s=1.0,
                            timeout_s=4.0, slow_timeout_s=30.0, on_lost=lambda *a: None,
                            clock=lambda: clock[0])
    return beat, sock


def test_the_replica_heartbeat_learns_from_its_steady_peers_gaps():
    clock = [0.0]
    beat, sock = _heartbeat(clock)
    peer = ReplicaHeartbeat(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), 1,
                            {0: ("127.0.0.1", 9)}, b"tokentok", period_s=1.0, timeout_s=4.0,
                            on_lost=lambda *a: None)
    try:
        beat.received(peer.message(), 0.0)  # start-up beats (slow): no gap counts
        beat.received(peer.message(), 12.0)
        beat.steady()
        peer.steady()
        beat.received(peer.message(), 13.0)  # the peer's first steady beat: the gap before
        assert beat.gaps.count == 0  # it was the peer's slow phase
        beat.received(peer.message(), 15.0)  # a steady gap of 2 s
        assert beat.gaps.count == 1
        beat.overdue(15.0)  # the thread checks every beat period or so
        for now in (16.0, 17.0, 18.0, 19.0, 20.0, 20.9):
            assert beat.overdue(now) is None  # up to 5.9 s silent: < 3 x 2 s
        assert beat.overdue(21.5) == (1, pytest.approx(6.5))
        clock[0] = 80.0  # the window passed: detect_s again
        assert beat.allowed_silence(1) == 4.0
    finally:
        sock.close()
        peer.sock.close()
