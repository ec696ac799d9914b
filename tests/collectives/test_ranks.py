"""[Note: host-interleaved ranks] in process: the job's replica-major order rebuilt from where
mpirun put the processes, under host-by-host and round-robin numbering, and the launcher's
round-robin numbering. The real numbering on namespace hosts (PRRTE's ``--rank-by node``) is
every launch of tests/cluster/."""

from recover_hsdp.collectives import MPI
from recover_hsdp.collectives.ranks import job_communicator, rank_by_node_args, replica_major_keys


def _replicas(hosts, keys, s):
    """replica -> the hosts of its ranks, under ``keys``."""
    out: dict[int, set] = {}
    for rank, key in enumerate(keys):
        out.setdefault(key // s, set()).add(hosts[rank])
    return out


def test_host_by_host_numbering_is_already_the_jobs_order():
    hosts = ["a", "a", "a", "b", "b", "b", "c", "c", "c"]
    assert replica_major_keys(hosts) == list(range(9))


def test_round_robin_numbering_puts_each_hosts_ranks_back_together():
    hosts = ["a", "b", "c"] * 3  # --map-by ppr:3:node --rank-by node
    keys = replica_major_keys(hosts)
    assert keys == [0, 3, 6, 1, 4, 7, 2, 5, 8]
    assert _replicas(hosts, keys, 3) == {0: {"a"}, 1: {"b"}, 2: {"c"}}
    # shard order within a replica is MPI rank order on the host (local rank order)
    assert [r for r in range(9) if keys[r] // 3 == 1] == [1, 4, 7]
    # and the ring of MPI ranks never has two ranks of one host next to each other
    assert all(hosts[w] != hosts[w - 1] for w in range(9))


def test_uneven_hosts_keep_host_by_host_replicas():
    hosts = ["a", "b", "c", "a"]  # slots 2, 1, 1 mapped by slot, numbered round-robin
    keys = replica_major_keys(hosts)
    assert keys == [0, 2, 3, 1]
    assert _replicas(hosts, keys, 2) == {0: {"a"}, 1: {"b", "c"}}  # as by-slot numbering has it
    assert replica_major_keys(["a", "a", "b", "c"]) == [0, 1, 2, 3]


def test_hosts_are_ordered_by_their_lowest_rank():
    assert replica_major_keys(["b", "a", "b", "a"]) == [0, 2, 1, 3]
    assert replica_major_keys([]) == []


class _FakeWorld:
    """Enough of an intracommunicator for job_communicator: every rank's host and this rank."""

    def __init__(self, hosts, rank):
        self.hosts, self.rank, self.split = hosts, rank, None

    def Get_rank(self):
        return self.rank

    def Split_type(self, kind, key):
        assert kind == MPI.COMM_TYPE_SHARED and key == self.rank
        return _FakeHost(self)

    def allgather(self, value):
        assert value == self._leader(self.rank)
        return [self._leader(r) for r in range(len(self.hosts))]

    def _leader(self, rank):
        return self.hosts.index(self.hosts[rank])

    def Split(self, color, key):
        self.split = (color, key)
        return self


class _FakeHost:
    def __init__(self, world):
        self.world, self.freed = world, False

    def allreduce(self, value, op):
        assert op == MPI.MIN
        return self.world._leader(self.world.rank)

    def Free(self):
        self.freed = True


def test_job_communicator_reorders_only_when_needed():
    by_slot = _FakeWorld(["a", "a", "b", "b"], rank=2)
    assert job_communicator(by_slot) is by_slot and by_slot.split is None
    round_robin = _FakeWorld(["a", "b", "a", "b"], rank=1)
    assert job_communicator(round_robin) is round_robin
    assert round_robin.split == (0, 2)  # MPI rank 1 is host b's first rank: job rank 2


def test_the_launcher_numbers_round_robin_across_hosts_only():
    assert rank_by_node_args(["10.0.0.1", "10.0.0.2"], []) == ["--rank-by", "node"]
    assert rank_by_node_args(["10.0.0.1", "10.0.0.1"], []) == []
    assert rank_by_node_args(["10.0.0.1"], ["--map-by", "ppr:3:node"]) == []
    assert rank_by_node_args(["h1", "h2"], ["--rank-by", "slot"]) == []  # the user's choice
    assert rank_by_node_args(["h1", "h2"], ["--map-by", "ppr:2:node:rank-by=slot"]) == []
