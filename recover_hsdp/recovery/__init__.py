"""Layer 2: in-step recovery of the cross-replica gradient reduce (torch; no torchtitan, no MPI).

  buckets.py        ``BucketSync``: the FSDP2 all-reduce hook; bucket snapshots tagged with the
                    world epoch they were reduced under; restore + re-reduce of stale buckets
  fsdp_contract.py  the FSDP2 behaviour the hook relies on, checked at run time

The world it reduces through is duck-typed (``allreduce``, ``epoch``, ``epoch_failed``,
``fail_epoch``): ``recover_hsdp.collectives.FaultTolerantWorld`` in a job, a fake in tests.
"""

from recover_hsdp.recovery.buckets import Bucket, BucketSync, fsdp_units, local_parameter_checksum

__all__ = ["Bucket", "BucketSync", "fsdp_units", "local_parameter_checksum"]
