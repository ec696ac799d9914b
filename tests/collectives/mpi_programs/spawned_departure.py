"""[Note: exiting without Finalize] (collectives/world.py): a process that leaves a running job.

Run as ``spawned_departure.py DIR HOW`` on 3 ranks. Rank 2 spawns replica A, which dies by
SIGKILL (a replacement that joined, then failed); rank 1 spawns B, then SIGKILLs itself while B
starts (B's spawner lost: B gives up its join, as ``parent_link`` does). B then leaves ``HOW``:
``die`` (the project's way, ``guard.die``: SIGKILL) or ``exit`` (``os._exit(0)`` without
Finalize). Ranks 0 and 2 keep working for 6 s after that and write DIR/rank<w>.json: the job
must outlive B's departure.
"""

from __future__ import annotations

import json
import os
import sys
import time

from recover_hsdp.collectives.guard import die
from recover_hsdp.collectives.mpi import MPI


def child(how: str) -> None:
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    if how == "A":
        time.sleep(1.0)
        die("spawned A: failing")
    time.sleep(2.5)  # its spawner dies meanwhile
    request = parent.Ibarrier()
    try:
        while not request.Test():
            time.sleep(0.05)
    except MPI.Exception:
        pass  # the join given up
    if how == "exit":
        os._exit(0)
    die("spawned B: join given up, leaving")


def main() -> None:
    out, how = sys.argv[1], sys.argv[2]
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:
        child(how)
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank = comm.Get_rank()
    me = [sys.executable, os.path.abspath(__file__), out]
    if rank == 2:
        MPI.COMM_SELF.Spawn(me[0], me[1:] + ["A"], maxprocs=1)
    time.sleep(3.0)
    if rank == 1:
        MPI.COMM_SELF.Spawn(me[0], me[1:] + [how], maxprocs=1)
        time.sleep(1.0)
        die("rank 1: B's spawner fails while B starts")
    time.sleep(9.0)  # B has left by now; the job must still be here
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"alive_after_departure": True}, handle)
    sys.stdout.flush()
    os._exit(0)  # the end of the job: every rank at once


if __name__ == "__main__":
    main()
