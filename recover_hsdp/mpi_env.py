"""Import mpi4py's MPI with the settings this project relies on (see ULFM_NOTES.md).

[Note: mpi4py settings] ``thread_level = "serialized"``: both btl/tcp self-deadlocks seen after a
rank death need MPI_THREAD_MULTIPLE (mpi4py's default); with "serialized" only one thread may
call MPI, which is how this project uses it. ``finalize = False``: MPI_Finalize after a failure
can hang in its PMIx fence; the job's survivors exit without it. Every module that needs MPI
imports it from here so these settings are applied before the first ``from mpi4py import MPI``.
"""

import mpi4py

mpi4py.rc.thread_level = "serialized"
mpi4py.rc.finalize = False

from mpi4py import MPI  # noqa: E402

__all__ = ["MPI"]
