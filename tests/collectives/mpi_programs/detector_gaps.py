"""Open MPI's detector timeout learned from beat gaps ([Note: a steady timeout learned from beat
gaps] in recover_hsdp/groups/gap_bound.py), with real pauses. Every rank runs a steady
``LivenessPhase`` (``detect_s`` = SECONDS) over its own detector, launched wide. Rank 0 observes
rank 2 (Open MPI's ring: rank - 1) and holds it stopped (SIGSTOP ... SIGCONT) for
``PAUSES`` x 0.5 x SECONDS, each silence under SECONDS; then once for longer than SECONDS but
inside the bound rank 0 learned; then for good. Every rank reports whether the world survived
the long pause (a barrier after it) and when its wait for the frozen rank failed; rank 0 then
SIGKILLs rank 2 so the job ends.

    detector_gaps.py OUT_DIR SECONDS PAUSES WATCH_S
"""

import os
import signal
import sys
import time

from frozen_rank import report_and_end, seconds_until_failed
from recover_hsdp.collectives import detector
from recover_hsdp.collectives.mpi import MPI
from recover_hsdp.groups.liveness import LivenessPhase

out, seconds, pauses, watch_s = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank, size = comm.Get_rank(), comm.Get_size()
found, why = detector.locate(rank, size)
report = {"found": found is not None, "why": why}
phase = LivenessPhase(None, found, detect_s=seconds, slow_phase_s=watch_s).start()
phase.steady()
report["steady_s"] = found and found.seconds
pids = comm.allgather(os.getpid())
frozen = size - 1
if rank == 0:
    for _ in range(pauses):  # silences under ``seconds``: the bound learns from them
        time.sleep(seconds / 4)
        os.kill(pids[frozen], signal.SIGSTOP)
        time.sleep(seconds / 2)
        os.kill(pids[frozen], signal.SIGCONT)
    time.sleep(seconds / 2)
    learned = phase.gaps.bound.allowed(time.monotonic())
    report["learned_s"], report["applied_s"] = learned, found.seconds
    # longer than ``seconds`` (the silence adds up to a beat period), inside the bound
    report["long_pause_s"] = long = (seconds + learned) / 2 - seconds / 8
    os.kill(pids[frozen], signal.SIGSTOP)
    time.sleep(long)
    os.kill(pids[frozen], signal.SIGCONT)
report["after_long_pause_failed_s"] = seconds_until_failed(comm.Ibarrier(), watch_s)
time.sleep(seconds / 2)  # the long pause's gap ends with a beat; the poller reads it
report["bound_before_freeze_s"] = phase.gaps.bound.allowed(time.monotonic())
comm.Barrier()
if rank == frozen:
    os.kill(os.getpid(), signal.SIGSTOP)
report["error_after_s"] = seconds_until_failed(comm.Ibarrier(), watch_s)
report["gaps"] = phase.close()
report_and_end(out, rank, report, pids[frozen])
