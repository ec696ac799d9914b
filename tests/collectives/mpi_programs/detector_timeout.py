"""A rank that freezes (SIGSTOP) under Open MPI's detector launched with a wide timeout; the
ranks named in ``tighten`` lower their own detector timeout to ``seconds`` first
(recover_hsdp.collectives.detector). Every survivor reports whether and when its Ibarrier
failed; rank 0 then SIGKILLs the frozen rank so the job ends.

    detector_timeout.py OUT_DIR SECONDS TIGHTEN(comma list of ranks) WATCH_S
"""

import os
import signal
import sys
import time

from frozen_rank import report_and_end, seconds_until_failed
from recover_hsdp.collectives import detector
from recover_hsdp.collectives.mpi import MPI

out, seconds, tighten, watch_s = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4])
comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank, size = comm.Get_rank(), comm.Get_size()
found, why = detector.locate(rank, size)
report = {"found": found is not None, "why": why, "launch_s": found and found.seconds}
if found is not None and str(rank) in tighten.split(","):
    found.set(seconds)
report["timeout_s"] = found and found.seconds
pids = comm.allgather(os.getpid())
frozen = size - 1
if rank == frozen:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP)
report["error_after_s"] = seconds_until_failed(comm.Ibarrier(), watch_s)
report_and_end(out, rank, report, pids[frozen])
