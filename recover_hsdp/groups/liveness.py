"""``LivenessPhase``: this rank's phase, told to both liveness signals.

[Note: detection margins by phase] (groups/heartbeat.py) says which phases are allowed to be
slow and why; this object is the one place the trainer says where it is. The replica heartbeat
learns it through ``steady``/``slow_phase`` (its beats carry it to the peers); Open MPI's
detector through its timeout ([Note: Open MPI's detector timeout by phase] in
collectives/detector.py): ``slow_phase_s`` while this rank starts up or is in a slow phase,
``detect_s`` once steady. Either signal may be absent (one rank per replica: no heartbeat;
Open MPI's struct not found or no detector: the launch timeout stays).
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class LivenessPhase:
    """Args:
        heartbeat: the replica heartbeat (``ReplicaHeartbeat``) or None.
        detector: this rank's ``DetectorTimeout`` or None.
        detect_s, slow_phase_s: the detector's timeout in steady state and in a slow phase.
    """

    def __init__(self, heartbeat=None, detector=None, *, detect_s: float = 0.0,
                 slow_phase_s: float = 0.0):
        self.heartbeat, self.detector = heartbeat, detector
        self.detect_s, self.slow_phase_s = detect_s, max(slow_phase_s, detect_s)
        self._starting, self._slow_phases = True, 0
        self._applied: float | None = None
        self._apply()

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
        seconds = self.slow_phase_s if self.slow else self.detect_s
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
    phase = LivenessPhase(heartbeat, detector, detect_s=detect_s, slow_phase_s=slow_phase_s)
    if log is not None and rank == 0:
        if detector is not None:
            log(f"Open MPI's detector timeout: {phase.slow_phase_s:g} s while starting and in "
                f"slow phases, {detect_s:g} s once steady ([Note: Open MPI's detector timeout "
                "by phase])")
        elif why:
            log(f"Open MPI's detector timeout stays at its launch value: {why}; a silent host "
                f"is found after that, not recover.timeouts.detect_s={detect_s:g} ([Note: Open "
                "MPI's detector timeout by phase])")
    return phase
