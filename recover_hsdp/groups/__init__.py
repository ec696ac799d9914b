"""The torch.distributed groups a rank builds, watches and abandons (every torch.distributed
import of the package lives here).

  bootstrap.py      process model: MPI rank -> (replica, shard), the replica's TCPStore over
                    MPI, this rank's placement (``ProcessPlacement``)
  rendezvous.py     [Note: rendezvous address]: the address replica peers reach a rank at, and
                    the one route choice between hosts (standard library only)
  replica_group.py  the replica's own process group (``ReplicaGroup``) and
                    [Note: a replica leaves as a unit]: the one way a rank leaves its replica
  heartbeat.py      ``ReplicaHeartbeat``: UDP heartbeat among a replica's ranks (stdlib)
  timeouts.py       [Note: the timer table]: every timer of a job, derived once and ordered
  data_plane.py     ``TorchDataPlane``: the per-epoch group of the same-shard ranks of the
                    alive replicas ([Note: control plane and data plane])
  teardown.py       [Note: bounded teardown]: a group given up (also mid-build) is aborted
                    within a bound and never destroyed

Below the step protocol (manager/ imports the leave path, never torch.distributed) and above
the three layers; the TorchTitan glue (titan/) builds these objects and hands them on.
"""
