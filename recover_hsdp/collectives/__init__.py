"""Layer 1: fault-tolerant collectives across replicas (mpi4py + Open MPI 5 ULFM).

Imports mpi4py, numpy and the standard library only (no torch, no torchtitan: the layers contract
in pyproject.toml). Modules:

  interface.py   ``World``: the Protocol the layers above (and the tests' fake) hold a world to
  world.py       ``FaultTolerantWorld``: communicators, layout, epoch, consensus, retire, finish
  guarded.py     its guarded collectives and how a failure is noted ([Note: guarded calls])
  repair.py      the repair after a failed consensus: shrink, claim, rebuild, agree, commit
  arbiter.py     ``SplitBrainArbiter``: which side of a partition goes on (a file; stdlib only)
  growth.py      the world's growth at a rejoin (stage 4 of [Note: rejoin])
  join.py        the rejoin's spawn, merge, offer and state channel ([Note: rejoin])
  mpi.py         the one ``mpi4py.MPI`` import, after [Note: serialized, no finalize]
  guard.py       per-call deadlines and the hang watchdog (``Deadlines``, ``MpiGuard``)
  membership.py  ``ReplicaLayout``, ``ConsensusResult``, ``JoinOffer`` (plain data, no MPI)
  ranks.py       the job's replica-major order, whatever mpirun's numbering
                 ([Note: host-interleaved ranks])
  mpirun.py      the measured-safe ``mpirun --with-ft ulfm`` line and the ULFM check
  processes.py   which process is which rank; ending the ones the world excluded

Importing this package does not initialise MPI: ``mpi`` (``mpi4py.MPI``, after the ``mpi4py.rc``
settings of [Note: serialized, no finalize]) is imported on first use of ``MPI`` or
``FaultTolerantWorld`` from here, so the launcher can use ``mpirun`` without becoming an MPI
process.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"MPI": "mpi", "FaultTolerantWorld": "world", "CHUNK_BYTES": "guarded",
         "Deadlines": "guard", "MpiGuard": "guard",
         "ConsensusResult": "membership", "ReplicaLayout": "membership"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
