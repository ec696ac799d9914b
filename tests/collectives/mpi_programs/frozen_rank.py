"""What the detector programs share (``detector_timeout.py``, ``detector_gaps.py``): waiting for
a request that a frozen rank may fail, and the end of a job whose last rank is frozen."""

import json
import os
import signal
import time

from recover_hsdp.collectives.mpi import MPI


def seconds_until_failed(request, limit_s: float) -> float | None:
    """Seconds until ``request`` failed, or None (completed, or still waiting after limit)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            if request.Test():
                return None
        except MPI.Exception:
            return time.monotonic() - t0
        time.sleep(0.01)
    return None


def report_and_end(out: str, rank: int, report: dict, frozen_pid: int) -> None:
    """Write this rank's report; rank 0 then SIGKILLs the frozen rank so the job ends."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if rank == 0:
        time.sleep(0.5)  # the others write their reports
        os.kill(frozen_pid, signal.SIGKILL)
    os._exit(0)
