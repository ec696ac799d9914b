"""Ranks spawned together do not share a fate: ``spawned_siblings.py DIR`` on 2 ranks.

Rank 0 spawns two ranks in one ``MPI_Comm_spawn`` (two replicas replaced at once, as a rejoin
does); spawned rank 0 is SIGKILLed 1 s later; spawned rank 1 keeps working for 5 s more and then
writes DIR/spawned1.json. PRRTE ends every rank of a spawned job when one of them is killed
unless the job is recoverable: ``mpirun_prefix`` makes every job PRRTE starts recoverable
(``--prtemca state_base_recoverable 1``, collectives/mpirun.py's module docstring).
"""

from __future__ import annotations

import json
import os
import sys
import time

from recover_hsdp.collectives.guard import die
from recover_hsdp.collectives.mpi import MPI


def child(out: str) -> None:
    MPI.Comm.Get_parent().Set_errhandler(MPI.ERRORS_RETURN)
    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        time.sleep(1.0)
        die("spawned rank 0: failing")
    time.sleep(6.0)  # its sibling is dead by now
    with open(os.path.join(out, f"spawned{rank}.json"), "w") as handle:
        json.dump({"alive_after_sibling_died": True}, handle)
    die("spawned rank 1: done")


def main() -> None:
    out = sys.argv[1]
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:
        child(out)
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    if rank == 0:
        MPI.COMM_SELF.Spawn(sys.executable, [os.path.abspath(__file__), out], maxprocs=2)
    time.sleep(9.0)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"alive": True}, handle)
    sys.stdout.flush()
    os._exit(0)  # the end of the job: every rank at once


if __name__ == "__main__":
    main()
