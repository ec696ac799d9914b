"""The job's order of ranks: replica-major, whatever order mpirun numbered the processes in.

[Note: host-interleaved ranks] Open MPI's heartbeat detector watches one ring over
MPI_COMM_WORLD: rank w observes rank w - 1, and when it declares that rank dead it starts
observing the next rank before it, from a fresh timeout. Numbered host by host (mpirun's
default), the S ranks of a lost host are neighbours in that ring and are found one after the
other, S x ``detect_s``: 20.8 s for S = 3 at 4 s (benchmarks/README.md), and a GPU host
holds 8. So the launcher numbers the processes round-robin over the hosts when a job spans
several (``--rank-by node``, :func:`rank_by_node_args`; a ``--rank-by`` of the user's wins):
every rank of a host is observed from another host, and a lost host's ranks are declared dead
together, one ``detect_s`` after the loss. Measured (benchmarks/README.md "False deaths",
issue 35's cut run, 3 x 3 on 3 namespace nodes, 5 runs): the cut node found in 4.1-4.8 s
against ~20 s host by host, and, once both detectors had their start-up margin ([Note:
detection margins by phase]), no attempt of 10 lost at start-up. (It had been the default
once and was made opt-in when, before those margins, 1 of 3 runs lost an attempt at
start-up.) ``--mpi-arg=--rank-by --mpi-arg=slot`` keeps mpirun's host-by-host numbering.

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


def rank_by_node_args(hosts: Sequence[str], mpi_args: Sequence[str]) -> list[str]:
    """``--rank-by node`` for a job over several hosts ([Note: host-interleaved ranks]),
    unless the user chose a ranking (``--rank-by`` or a ``--map-by`` with ``rank-by`` in it)."""
    said = " ".join(mpi_args)
    if len(set(hosts)) < 2 or "rank-by" in said:
        return []
    return ["--rank-by", "node"]
