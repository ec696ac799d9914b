"""The job's order of ranks: replica-major, whatever order mpirun numbered the processes in.

[Note: host-interleaved ranks] Open MPI's heartbeat detector watches one ring over
MPI_COMM_WORLD: rank w observes rank w - 1, and when it declares that rank dead it starts
observing the next rank before it, from a fresh timeout. Numbered host by host (mpirun's
default), the S ranks of a lost host are neighbours in that ring and are found one after the
other, S x ``detect_s``: 20.8 s for S = 3 at 4 s (benchmarks/README.md), and a GPU host
holds 8. Numbered round-robin over the hosts (``--mpi-arg=--rank-by --mpi-arg=node``), every
rank of a host is observed from another host and a lost host's ranks are declared dead
together, one ``detect_s`` after the loss (measured: 4.2 and 5.1 s). That numbering is opt-in,
not the launcher's default: in 1 of its 3 measured runs an attempt ended at start-up (relaunched,
then completed; a second run ended in an event the bench did not expect, its kind not kept),
none in the one host-by-host run; too few runs to tell, and a start-up lost is what [Note:
detection margins by phase] fights, so the default stays mpirun's until it is. Measured again
once both detectors had their start-up margin (benchmarks/README.md "False deaths", issue 35's
cut run with ``--rank-by-node``, 5 runs): no attempt of 10 lost at start-up, the cut node found
in 4.1-4.8 s; still opt-in (a default that changes every multi-host launch wants more runs).

The project keeps its own order, replica-major ([Note: replica layout] in config/checks.py:
replica r's shard s is rank r x S + s): :func:`replica_major_keys` rebuilds it from where the
processes run: ranks grouped by host (hosts in the order of their lowest MPI rank), in MPI
rank order within a host, cut into replicas of S. Under mpirun's default numbering that is the
identity; under round-robin numbering it puts each host's ranks back together, so a replica
still lives on one host when S divides the ranks per host. :func:`job_communicator` is
MPI_COMM_WORLD re-ordered that way (a Split with those keys), the communicator every layer
above calls "the world" and its ranks "original world ranks". The detector keeps watching
MPI_COMM_WORLD's ring; a failure is a process's, so the job communicator sees it as
MPI_COMM_WORLD does. A newcomer's spawned world is replica-major by construction ([Note:
rejoin] in join.py).
"""

from __future__ import annotations

from typing import Hashable, Sequence


def replica_major_keys(hosts: Sequence[Hashable]) -> list[int]:
    """Each MPI rank's place in the job (index: MPI rank), given the host of every rank: ranks
    grouped by host, hosts in the order of their lowest rank, rank order within a host."""
    first: dict[Hashable, int] = {}
    for host in hosts:
        first.setdefault(host, len(first))
    order = sorted(range(len(hosts)), key=lambda rank: (first[hosts[rank]], rank))
    keys = [0] * len(hosts)
    for place, rank in enumerate(order):
        keys[rank] = place
    return keys


def job_communicator(comm=None):
    """``comm`` (default MPI_COMM_WORLD) in the job's order ([Note: host-interleaved ranks]):
    ``comm`` itself when its order already is, else a re-ordered copy. A collective over
    ``comm``, made once at start-up, before the bootstrap."""
    from recover_hsdp.collectives.mpi import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        leader = host.allreduce(rank, op=MPI.MIN)  # names this host: its lowest rank
    finally:
        host.Free()
    keys = replica_major_keys(comm.allgather(leader))
    if keys == list(range(len(keys))):
        return comm
    return comm.Split(color=0, key=keys[rank])
