"""``GapBound``: the silence a liveness signal allows in steady state, learned from beat gaps.

[Note: a steady timeout learned from beat gaps] [Note: detection margins by phase]
(groups/heartbeat.py) widens both liveness signals where a burst of slowness is known to come
(start-up, a checkpoint, a rejoin). Left over (benchmarks/README.md "False deaths"): a host
that stays loaded in steady state. At 5.5 busy threads per core a live rank's heartbeats
reached its observer 4.09 s apart, past ``detect_s`` = 4, with no missed send deadline on the
sender: the delay was in delivery (the observer's progress of the TCP transport), which no
phase marks. Such a host shows it before it costs a death: the gaps between the beats an
observer receives grow (a healthy one's stay at the period, ``detect_s / 4``).

So each observer keeps the gaps it received in the last ``window_s`` (60 s) and allows a
silence of ``factor`` (3) x the largest, never less than ``detect_s`` and never more than
``slow_phase_s``. Why these: on a healthy host the gaps stay near the period, and 3 x a period
(3 s at the default 4 s) is below ``detect_s``, so the steady detection time of a cut link or a
frozen rank is unchanged; a host whose beats came 2 s apart has shown that 4 s of silence is
within its noise, and 6 s is not twice its worst. The window lets a burst widen the next minute
only (start-up's gaps count: the steps right after the first commit are the ones a loaded host
loses, run 9 of the hog benchmark died at step 3). A silence in progress never counts, only a
gap that ended with a beat, so a frozen or cut-off rank never widens its own timeout; only the
observer's own view is used, so nothing has to be agreed (the observed rank's timeout is its
observer's alone, as in Open MPI's ring).

The cost, said in one line at the end of a run whose bound ever widened (:meth:`report`): a
silent host on a loaded cluster is found after up to ``factor`` x its recent largest gap
instead of ``detect_s`` (at most ``slow_phase_s``); a dead process is still found at once (its
sockets close). ``slow_phase_s = detect_s`` turns the widening off.

Open MPI's detector (``DetectorGaps`` in groups/liveness.py reads the time of the last beat
its observer received from Open MPI's own state) and the replica heartbeat (``received`` in
groups/heartbeat.py) each keep one. Standard library only; times are arguments (fake clocks).
"""

from __future__ import annotations

from collections import deque

FACTOR = 3.0
WINDOW_S = 60.0


class GapBound:
    """Args:
        floor_s: the steady timeout (``detect_s``); the bound never goes below it.
        cap_s: the widest it may go (``slow_phase_s``).
        factor, window_s: the allowed silence is ``factor`` x the largest gap of the last
            ``window_s`` seconds.
    """

    def __init__(self, floor_s: float, cap_s: float, *, factor: float = FACTOR,
                 window_s: float = WINDOW_S):
        if not 0 < floor_s <= cap_s:
            raise ValueError(f"gap bound floor_s={floor_s} must be > 0 and <= cap_s={cap_s}")
        self.floor_s, self.cap_s, self.factor, self.window_s = floor_s, cap_s, factor, window_s
        self._gaps: deque[tuple[float, float]] = deque()  # (when it ended, seconds)
        self.largest_s = 0.0  # the largest gap ever seen (for the report)
        self.widest_s = floor_s  # the widest bound ever returned
        self.count = 0

    def gap(self, seconds: float, now: float) -> None:
        """A gap between two beats, ended by a beat received at ``now``."""
        if seconds <= 0:
            return
        self._gaps.append((now, seconds))
        self.largest_s = max(self.largest_s, seconds)
        self.count += 1

    def allowed(self, now: float) -> float:
        """The silence allowed at ``now``: ``factor`` x the largest gap of the window, within
        [floor_s, cap_s]."""
        while self._gaps and self._gaps[0][0] < now - self.window_s:
            self._gaps.popleft()
        largest = max((g for _, g in self._gaps), default=0.0)
        bound = min(self.cap_s, max(self.floor_s, self.factor * largest))
        self.widest_s = max(self.widest_s, bound)
        return bound

    def report(self, what: str) -> str:
        """One line when the bound ever widened, else empty."""
        if self.widest_s <= self.floor_s:
            return ""
        return (f"{what}: beats came up to {self.largest_s:.1f} s apart, so a silence was allowed "
                f"up to {self.widest_s:.1f} s (detect_s={self.floor_s:g}; [Note: a steady "
                "timeout learned from beat gaps])")
