"""The one import of ``mpi4py.MPI`` in recover-hsdp, with the rc settings ULFM needs here, and the
small translations to and from it (numpy buffer types, error names).

Every module of the collectives package that calls MPI takes ``MPI`` from here, so the settings below are in
place whichever of them is imported first (the package's ``__init__`` imports none of them:
the launcher uses ``mpirun`` without becoming an MPI process).
"""

from __future__ import annotations

import sys

import mpi4py

if "mpi4py.MPI" not in sys.modules:
    # [Note: serialized, no finalize] On this stack both btl/tcp self-deadlocks after a death need
    # THREAD_MULTIPLE (mpi4py's default); MPI_Finalize after a failure hangs in its PMIx fence. So:
    # one MPI thread, and processes exit without MPI_Finalize (mpirun still returns 0).
    mpi4py.rc.thread_level = "serialized"
    mpi4py.rc.finalize = False
# MPI_Init here, before numpy (1.4 s of CPU per rank): the ranks of a loaded host then reach it
# close together ([Note: detection margins by phase] in groups/heartbeat.py).
from mpi4py import MPI  # noqa: E402

import numpy as np  # noqa: E402

__all__ = ["MPI", "buffer_type", "errname", "finalize_disabled"]

_MPI_TYPES = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
              np.dtype(np.int32): MPI.INT32_T, np.dtype(np.int64): MPI.INT64_T}


def finalize_disabled() -> bool:
    """Whether the settings above took effect (False: ``mpi4py.MPI`` was imported before us)."""
    return mpi4py.rc.finalize is False


def errname(e: MPI.Exception) -> str:
    """A short name of a ULFM error class for log lines."""
    names = {MPI.ERR_PROC_FAILED: "ERR_PROC_FAILED", MPI.ERR_REVOKED: "ERR_REVOKED",
             MPI.ERR_PROC_FAILED_PENDING: "ERR_PROC_FAILED_PENDING"}
    return names.get(e.Get_error_class(), f"MPI error class {e.Get_error_class()}")


def buffer_type(buf: np.ndarray) -> MPI.Datatype:
    """The MPI datatype of a host buffer reduced in place; TypeError/ValueError say what is wrong."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"expected a numpy host buffer, got {type(buf).__name__} (stage GPU tensors "
                        "through host memory first)")
    if not (buf.flags.c_contiguous and buf.flags.writeable):
        raise ValueError("the buffer must be C-contiguous and writeable (it is reduced in place)")
    try:
        return _MPI_TYPES[buf.dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {buf.dtype}; use one of "
                        f"{sorted(str(d) for d in _MPI_TYPES)}") from None
