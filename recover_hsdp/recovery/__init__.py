"""Layer 2: in-step recovery of the cross-replica gradient reduce (torch; no torchtitan, no MPI).

  buckets.py        ``BucketSync``: the FSDP2 all-reduce hook; bucket snapshots tagged with the
                    world epoch they were reduced under; restore + re-reduce of stale buckets
  planes.py         ``DataPlane``, where a bucket's sum travels; ``MpiDataPlane``, the ``mpi`` one
  staging.py        reused host chunks: [Note: no device tensor reaches MPI]
  fsdp_contract.py  the FSDP2 behaviour the hook relies on, checked at run time
  fingerprint.py    exact fingerprints of a shard: [Note: exact fingerprints]

The world it reduces through is a ``World`` (collectives/interface.py), duck-typed here (this
layer imports no MPI): ``FaultTolerantWorld`` in a job, ``tests/fakes.FakeWorld`` in tests.
"""

from recover_hsdp.recovery.buckets import Bucket, BucketSync, fsdp_units
from recover_hsdp.recovery.fingerprint import (fingerprint, flip_bit, from_halves, halves,
                                               parameter_fingerprint, state_fingerprint)
from recover_hsdp.recovery.planes import DataPlane, MpiDataPlane

__all__ = ["Bucket", "BucketSync", "DataPlane", "MpiDataPlane", "fingerprint", "flip_bit",
           "from_halves", "fsdp_units", "halves", "parameter_fingerprint", "state_fingerprint"]
