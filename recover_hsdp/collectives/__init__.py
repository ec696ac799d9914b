"""Layer 1: fault-tolerant collectives across replicas (mpi4py + Open MPI 5 ULFM).

Imports mpi4py, numpy and the standard library only (no torch, no torchtitan: the layers contract
in pyproject.toml). Modules:

  world.py       ``FaultTolerantWorld``: guarded all-reduce, consensus (agree, revoke, shrink,
                 rebuild), world epoch, retire, finish
  guard.py       per-call deadlines and the hang watchdog (``Deadlines``, ``MpiGuard``)
  membership.py  ``ReplicaLayout`` and ``ConsensusResult`` (plain data, no MPI)
  mpirun.py      the measured-safe ``mpirun --with-ft ulfm`` line and the ULFM check

Importing this package does not initialise MPI: ``world`` (and with it ``mpi4py.MPI``, after the
``mpi4py.rc`` settings of [Note: serialized, no finalize]) is imported on first use of
``MPI``, ``FaultTolerantWorld`` or ``Deadlines`` from here, so the launcher can use ``mpirun``
without becoming an MPI process.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"MPI": "world", "FaultTolerantWorld": "world", "CHUNK_BYTES": "world",
         "Deadlines": "guard", "MpiGuard": "guard",
         "ConsensusResult": "membership", "ReplicaLayout": "membership"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
