"""``LivenessPhase``: this rank's phase, told to both liveness signals.

[Note: detection margins by phase] (groups/heartbeat.py) says which phases are allowed to be
slow and why; this object is the one place the trainer says where it is. The replica heartbeat
learns it through ``steady``/``slow_phase`` (its beats carry it to the peers); Open MPI's
detector through its timeout ([Note: Open MPI's detector timeout by phase] in
collectives/detector.py): ``slow_phase_s`` while this rank starts up or is in a slow phase,
once steady ``detect_s`` or, on a host whose beats have come late, the bound learned from the
gaps ([Note: a steady timeout learned from beat gaps] in groups/gap_bound.py; ``DetectorGaps``
reads them off Open MPI's state). Either signal may be absent (one rank per replica: no
heartbeat; Open MPI's struct not found or no detector: the launch timeout stays).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from recover_hsdp.groups.gap_bound import GapBound


class DetectorGaps:
    """The gaps between the beats Open MPI's detector received from the rank this rank
    observes, read off its state (``DetectorTimeout.last_beat``) at each :meth:`poll`
    (``LivenessPhase`` polls every ``detect_s / 16``), into ``bound``. A gap counts only if
    the poll that saw its new beat came at most ``period_s`` after the last poll that saw the
    old one (a poller held longer may have missed a beat between them and would see two gaps
    as one); a change of the rank observed (a ring re-link) starts over, and so does a stamp
    that went back (Open MPI's slack after a re-link is a time in the future)."""

    def __init__(self, detector, bound: GapBound, period_s: float):
        self.detector, self.bound, self.period_s = detector, bound, period_s
        self._last: tuple[int, float, float] | None = None  # observing, stamp, last seen at

    def poll(self, now: float) -> None:
        observing, stamp = self.detector.last_beat()
        last, self._last = self._last, (observing, stamp, now)
        if last is None or observing != last[0] or stamp <= last[1]:
            if last is not None and (observing, stamp) == last[:2]:
                self._last = last[:2] + (now,)  # the same beat, seen again now
            return
        if now - last[2] <= self.period_s:
            self.bound.gap(stamp - last[1], now)


class LivenessPhase:
    """Args:
        heartbeat: the replica heartbeat (``ReplicaHeartbeat``) or None.
        detector: this rank's ``DetectorTimeout`` or None.
        detect_s, slow_phase_s: the detector's timeout in steady state and in a slow phase.
    """

    def __init__(self, heartbeat=None, detector=None, *, detect_s: float = 0.0,
                 slow_phase_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.heartbeat, self.detector = heartbeat, detector
        self.detect_s, self.slow_phase_s = detect_s, max(slow_phase_s, detect_s)
        self.clock = clock
        self._starting, self._slow_phases = True, 0
        self._applied: float | None = None
        self._lock = threading.Lock()
        self.gaps: DetectorGaps | None = None
        if detector is not None and detect_s > 0:
            self.gaps = DetectorGaps(detector, GapBound(detect_s, self.slow_phase_s),
                                     period_s=detect_s / 4)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._apply()

    def start(self) -> "LivenessPhase":
        """Poll Open MPI's beat gaps on a thread (``detect_s / 16``): [Note: a steady timeout
        learned from beat gaps] in groups/gap_bound.py. Without a detector, nothing."""
        if self.gaps is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="recover-hsdp-detector-gaps")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.detect_s / 16):
            self.poll()

    def poll(self) -> None:
        """One read of Open MPI's last beat, and the timeout it implies written."""
        if self.gaps is not None:
            with self._lock:  # the bound's window is read by the main thread's _apply
                self.gaps.poll(self.clock())
            self._apply()

    def close(self) -> list[str]:
        """Stop polling; one line per liveness signal whose steady bound ever widened."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        lines = [self.gaps.bound.report("Open MPI's detector")] if self.gaps is not None else []
        beat = getattr(self.heartbeat, "gaps", None)
        if beat is not None:
            lines.append(beat.report("the replica heartbeat"))
        return [line for line in lines if line]

    @property
    def slow(self) -> bool:
        return self._starting or self._slow_phases > 0

    def steady(self) -> None:
        """A step was committed: start-up is over (idempotent)."""
        if self.heartbeat is not None:
            self.heartbeat.steady()
        if self._starting:
            self._starting = False
            self._apply()

    @contextlib.contextmanager
    def slow_phase(self) -> Iterator[None]:
        """A phase allowed to be slow (a checkpoint save or load, a rejoin's transfer); nests."""
        beat = self.heartbeat.slow_phase() if self.heartbeat is not None else contextlib.nullcontext()
        with beat:
            self._slow_phases += 1
            self._apply()
            try:
                yield
            finally:
                self._slow_phases -= 1
                self._apply()

    def _apply(self) -> None:
        if self.detector is None or self.detect_s <= 0:
            return
        with self._lock:  # the main thread (phases) and the poller
            if self.slow:
                seconds = self.slow_phase_s
            elif self.gaps is not None:
                seconds = self.gaps.bound.allowed(self.clock())
            else:
                seconds = self.detect_s
            if seconds != self._applied:
                self.detector.set(seconds)
                self._applied = seconds


def build_liveness(heartbeat, detect_s: float, slow_phase_s: float, *, rank: int, size: int,
                   log=None) -> LivenessPhase:
    """This rank's phase over its heartbeat and, where it can be found, Open MPI's detector
    (``rank``/``size``: MPI_COMM_WORLD's). A detector that is on but not found is one line
    (``log``): a silent host is then found after the launch timeout in every phase."""
    from recover_hsdp.collectives.detector import locate

    detector, why = locate(rank, size) if detect_s > 0 else (None, "")
    phase = LivenessPhase(heartbeat, detector, detect_s=detect_s,
                          slow_phase_s=slow_phase_s).start()
    if log is not None and rank == 0:
        if detector is not None:
            log(f"Open MPI's detector timeout: {phase.slow_phase_s:g} s while starting and in "
                f"slow phases, {detect_s:g} s once steady, wider where beats come late (up to "
                f"{phase.slow_phase_s:g} s; [Note: Open MPI's detector timeout by phase], [Note: "
                "a steady timeout learned from beat gaps])")
        elif why:
            log(f"Open MPI's detector timeout stays at its launch value: {why}; a silent host "
                f"is found after that, not recover.timeouts.detect_s={detect_s:g} ([Note: Open "
                "MPI's detector timeout by phase])")
    return phase
