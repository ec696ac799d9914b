"""Process model: one MPI rank per device; a torch.distributed world per replica.

Replica ``r = world_rank // S`` and shard index ``s = world_rank % S``. The replica's ranks
exchange their host names and interfaces over MPI and each picks the address its peers reach it
at ([Note: rendezvous address] in groups/rendezvous.py); the shard-0 rank opens a TCPStore there
on a free port, its address travels to the other S-1 ranks over MPI, and the S ranks form the
replica's own torch.distributed world (gloo on CPU, NCCL on GPU); with S > 1 each also opens the
UDP socket of the replica's heartbeat ([Note: a replica leaves as a unit] in
groups/replica_group.py). TorchTitan only ever sees that world: FSDP2 shards the model over
the replica's S ranks. Everything that crosses replicas goes through MPI (see
:mod:`recover_hsdp.collectives`).

Call :func:`bootstrap_replica` once per process, before TorchTitan builds its Trainer. It
publishes this rank's placement in the environment (``RECOVER_HSDP_PLACEMENT``), beside the
``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` that torch.distributed and TorchTitan read the same
way: the TrainSpec's dataloader and metrics builders, which TorchTitan calls with its own
arguments only, read it with :func:`current_placement`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from recover_hsdp.collectives import MPI  # imports mpi4py with the ULFM settings
from recover_hsdp.collectives.processes import ProcessInfo
from recover_hsdp.config import ConfigError
from recover_hsdp.groups import rendezvous
from recover_hsdp.groups.heartbeat import open_socket

PLACEMENT_ENV = "RECOVER_HSDP_PLACEMENT"
"""``"world_rank/world_size/ranks_per_replica"`` of this process (set by the bootstrap)."""


@dataclass(frozen=True)
class ProcessPlacement:
    """Where this process sits at launch: world rank, replica id, shard index, and the sizes.
    (The live membership after failures is ``collectives.FaultTolerantWorld.layout``.)"""

    world_rank: int
    world_size: int
    ranks_per_replica: int

    @property
    def replicas(self) -> int:
        return self.world_size // self.ranks_per_replica

    @property
    def replica(self) -> int:
        return self.world_rank // self.ranks_per_replica

    @property
    def shard(self) -> int:
        return self.world_rank % self.ranks_per_replica

    def to_env(self) -> str:
        return f"{self.world_rank}/{self.world_size}/{self.ranks_per_replica}"

    @classmethod
    def from_env(cls, value: str) -> "ProcessPlacement":
        world_rank, world_size, ranks_per_replica = (int(v) for v in value.split("/"))
        return cls(world_rank, world_size, ranks_per_replica)


@dataclass
class ReplicaWorld:
    """The replica's torch.distributed bootstrap: its TCPStore (kept alive) and layout."""

    layout: ProcessPlacement
    store: dist.Store
    procs: list[ProcessInfo]  # world rank -> (host, pid, start): [Note: nothing left behind]
    beats: "HeartbeatWiring | None" = None  # S > 1: the replica heartbeat's socket and peers


@dataclass
class HeartbeatWiring:
    """This rank's heartbeat socket, its replica peers' addresses (shard -> (address, port))
    and the replica's token ([Note: a replica leaves as a unit])."""

    sock: socket.socket
    peers: dict[int, tuple[str, int]] = field(default_factory=dict)
    token: bytes = b""


def current_placement() -> ProcessPlacement:
    """This process's placement, as :func:`bootstrap_replica` published it."""
    value = os.environ.get(PLACEMENT_ENV)
    if not value:
        raise RuntimeError("recover_hsdp.groups.bootstrap.bootstrap_replica() has not run in "
                           "this process")
    return ProcessPlacement.from_env(value)


def _addresses(replica_comm, shard: int, size: int):
    """[Note: rendezvous address] on every rank of the replica: (the store's address, this
    rank's heartbeat socket or None, every rank's heartbeat address). A rank without a routable
    address makes every rank of the replica stop with the same one line."""
    hosts = replica_comm.allgather(rendezvous.this_host())
    sock, error, address = None, None, rendezvous.LOCAL
    try:
        address, interface = rendezvous.local_address(hosts, shard)
        if interface and rendezvous.spans_hosts(hosts):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)  # gloo falls back to lo
        store_host = rendezvous.store_address(hosts, shard) if shard == 0 else None
        if size > 1:
            sock = open_socket(address)
    except (ValueError, OSError) as err:
        store_host, error = None, f"replica rank {shard}: {err}"
    beats = replica_comm.allgather((sock.getsockname() if sock else None, error))
    errors = [e for _, e in beats if e]
    if errors:
        if sock is not None:
            sock.close()
        raise ConfigError(errors[0])
    return store_host, sock, [b for b, _ in beats]


NEWCOMER_ENV = "RECOVER_HSDP_NEWCOMER"
"""Set on ranks spawned to replace lost replicas: ``"r1,r2,...:W_init"`` (the replica ids they
take, the job's initial replica count); [Note: rejoin] in recover_hsdp/collectives/join.py."""


def newcomer_placement(ranks_per_replica: int, comm=None) -> ProcessPlacement | None:
    """This rank's placement when it was spawned to replace a lost replica, else None. The
    spawned ranks' own MPI world holds S ranks per replica they replace, in order."""
    value = os.environ.get(NEWCOMER_ENV)
    if not value:
        return None
    replicas, initial = value.split(":")
    ids = [int(r) for r in replicas.split(",")]
    rank = (comm or MPI.COMM_WORLD).Get_rank()
    replica, shard = divmod(rank, ranks_per_replica)
    return ProcessPlacement(ids[replica] * ranks_per_replica + shard,
                            int(initial) * ranks_per_replica, ranks_per_replica)


def bootstrap_replica(ranks_per_replica: int, timeout_s: float = 300.0,
                      comm=None, placement: ProcessPlacement | None = None) -> ReplicaWorld:
    """Create this replica's TCPStore over MPI and set the env TorchTitan reads.

    Every rank of ``comm`` (default COMM_WORLD) must call it. Returns the store to pass to
    ``init_process_group``; the replica's shard-0 rank hosts it. ``placement``: a newcomer's
    (:func:`newcomer_placement`), whose place in the job is not its rank in ``comm``.
    """
    comm = comm or MPI.COMM_WORLD
    if ranks_per_replica < 1 or comm.Get_size() % ranks_per_replica:
        raise ValueError(f"ranks_per_replica={ranks_per_replica} does not divide the MPI world "
                         f"size {comm.Get_size()} (validate the config first)")
    layout = placement or ProcessPlacement(comm.Get_rank(), comm.Get_size(), ranks_per_replica)
    procs = comm.allgather(ProcessInfo.current())
    replica_comm = comm.Split(color=layout.replica, key=layout.shard)
    if placement is not None:
        procs = []  # a newcomer learns the job's processes when it joins
    try:
        store_host, sock, beat_addresses = _addresses(replica_comm, layout.shard,
                                                      ranks_per_replica)
        if layout.shard == 0:
            store = dist.TCPStore(store_host, 0, ranks_per_replica, is_master=True,
                                  timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
            address, token = replica_comm.bcast(((store_host, store.port), os.urandom(8)), root=0)
        else:
            address, token = replica_comm.bcast(None, root=0)
            store = dist.TCPStore(address[0], address[1], ranks_per_replica, is_master=False,
                                  timeout=timedelta(seconds=timeout_s))
    finally:
        replica_comm.Free()
    beats = None
    if sock is not None:
        peers = {shard: tuple(a) for shard, a in enumerate(beat_addresses) if shard != layout.shard}
        beats = HeartbeatWiring(sock, peers, token)
    os.environ.update(RANK=str(layout.shard), WORLD_SIZE=str(ranks_per_replica),
                      MASTER_ADDR=address[0], MASTER_PORT=str(address[1]),
                      **{PLACEMENT_ENV: layout.to_env()})
    return ReplicaWorld(layout, store, procs, beats)
