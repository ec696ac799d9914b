"""Failure-free tests of recover_hsdp.collectives, communicator-agnostic in the style of mpi4py's own
test suite: every test of ``BaseTestWorld`` runs against several (communicator, S) pairs, each world on
its own ``Dup()`` of the communicator (FaultTolerantWorld Dups it, with MPI.ERRORS_RETURN).

Run under mpirun at any size (tests/collectives/test_collectives_layer.py runs it at 1, 2 and 4 ranks):
    python layer_suite.py OUT_DIR
Each rank writes OUT_DIR/rank<w>.json: {"ran": n, "failures": [...]}; exit code 0 iff all passed.
"""

import json
import os
import sys
import time
import unittest

from recover_hsdp.collectives import CHUNK_BYTES, MPI, Deadlines, FaultTolerantWorld
import numpy as np

DEADLINES = Deadlines.for_tests(hang_timeout_s=10.0)


class BaseTestWorld:
    COMM = MPI.COMM_NULL
    S = 1

    def setUp(self):
        self.world = FaultTolerantWorld(self.COMM, self.S, DEADLINES)
        self.size = self.COMM.Get_size()
        self.rank = self.COMM.Get_rank()
        self.replicas = self.size // self.S

    def tearDown(self):
        self.world.close()

    # -- layout -----------------------------------------------------------------------------------
    def testLayout(self):
        w = self.world
        self.assertEqual((w.replica, w.shard), divmod(self.rank, self.S))
        self.assertEqual(w.epoch, 0)
        self.assertEqual(w.alive_replicas, tuple(range(self.replicas)))
        self.assertEqual(w.shard_members(), tuple(r * self.S + w.shard for r in range(self.replicas)))
        self.assertEqual(w.shard_comm.Get_size(), self.replicas)
        self.assertEqual(w.shard_comm.Get_rank(), w.replica)  # ordered by replica
        self.assertEqual(w.global_comm.Get_size(), self.size)
        self.assertIsNot(w.global_comm, self.COMM)
        self.assertNotEqual(w.global_comm, self.COMM)  # a Dup, not the base communicator
        self.assertEqual(w.global_comm.Get_errhandler(), MPI.ERRORS_RETURN)
        self.assertEqual(w.shard_comm.Get_errhandler(), MPI.ERRORS_RETURN)
        for rank in range(self.size):
            self.assertEqual(w.layout.replica_of(rank), rank // self.S)
            self.assertEqual(w.layout.shard_of(rank), rank % self.S)

    # -- all-reduce -------------------------------------------------------------------------------
    def _check_sum(self, dtype, n, shape=None):
        members = self.world.shard_members()
        buf = (np.arange(n) % 11 + 1000 * (self.rank + 1)).astype(dtype)
        if shape is not None:
            buf = buf.reshape(shape)
        self.assertTrue(self.world.allreduce(buf))
        want = (np.arange(n) % 11 * len(members) + 1000 * sum(r + 1 for r in members)).astype(dtype)
        np.testing.assert_array_equal(buf.reshape(-1), want)

    def testAllreduceDtypes(self):
        for dtype in (np.float32, np.float64, np.int32, np.int64):
            self._check_sum(dtype, 1001)

    def testAllreduceChunked(self):
        # crosses the 4 MB chunk boundary twice, with a short tail; 2-D buffer
        n = 2 * (CHUNK_BYTES // 8) + 3
        self._check_sum(np.float64, n)
        self._check_sum(np.float32, 4 * 1024 * 1024 + 8, shape=(8, -1))

    def testAllreduceEmpty(self):
        buf = np.zeros(0, dtype=np.float32)
        self.assertTrue(self.world.allreduce(buf))

    def testAllreduceGlobal(self):
        buf = np.array([self.rank + 1, 7], dtype=np.int64)
        self.assertTrue(self.world.allreduce_global(buf))
        self.assertEqual(buf.tolist(), [self.size * (self.size + 1) // 2, 7 * self.size])

    def testBufferValidation(self):
        with self.assertRaises(ValueError):
            self.world.allreduce(np.zeros((4, 4), dtype=np.float32)[:, 1])  # not contiguous
        with self.assertRaises(TypeError):
            self.world.allreduce(np.zeros(4, dtype=np.float16))
        with self.assertRaises(TypeError):
            self.world.allreduce([1.0, 2.0])
        ro = np.zeros(4)
        ro.flags.writeable = False
        with self.assertRaises(ValueError):
            self.world.allreduce(ro)
        self.assertFalse(self.world.epoch_failed)

    # -- allgather / barrier ----------------------------------------------------------------------
    def testAllgather(self):
        got = self.world.allgather(("checksum", self.world.replica))
        self.assertEqual(got, [("checksum", r) for r in range(self.replicas)])
        arr = self.world.allgather(np.full(3, self.rank, dtype=np.float64))
        self.assertEqual([a.tolist() for a in arr], [[float(r)] * 3 for r in self.world.shard_members()])
        self.assertEqual(self.world.allgather_global(self.rank), list(range(self.size)))
        self.assertTrue(self.world.barrier())

    # -- consensus --------------------------------------------------------------------------------
    def testSendBytesReachesOnlyTheTargets(self):
        w = self.world
        if self.replicas < 2:
            return
        data = (np.arange(CHUNK_BYTES + 3) % 251).astype(np.uint8)   # two chunks
        targets = list(range(1, self.replicas, 2))   # replicas 1, 3, ...
        if w.replica == 0:
            self.assertTrue(w.send_bytes(data, targets))
        elif w.replica in targets:
            got = w.recv_bytes(0)
            self.assertIsNotNone(got)
            np.testing.assert_array_equal(got, data)
        self.assertTrue(w.barrier())   # the others took no part and nothing is left pending
        self.assertTrue(w.consensus(True).clean)

    def testConsensusClean(self):
        res = self.world.consensus(True)
        self.assertTrue(res.clean)
        self.assertEqual((res.epoch, res.dead_replicas, res.retire), (0, frozenset(), False))
        self.assertEqual(res.alive_replicas, tuple(range(self.replicas)))
        self.assertEqual(self.world.epoch, 0)

    def testConsensusFlaggedRebuilds(self):
        # one rank reports a bad epoch: no one died, but everyone repairs and moves to epoch 1
        old_global, old_shard = self.world.global_comm, self.world.shard_comm
        res = self.world.consensus(self.rank != self.size - 1)
        self.assertFalse(res.clean)
        self.assertEqual((res.epoch, res.dead_replicas, res.retire), (1, frozenset(), False))
        self.assertEqual(res.alive_replicas, tuple(range(self.replicas)))
        self.assertEqual(res.rounds, 1)
        self.assertIsNot(self.world.global_comm, old_global)
        self.assertIsNot(self.world.shard_comm, old_shard)
        self.assertEqual(self.world.shard_comm.Get_rank(), self.world.replica)
        self._check_sum(np.int64, 99)  # the rebuilt communicators work
        self.assertTrue(self.world.consensus(True).clean)
        self.assertEqual(self.world.epoch, 1)

    def testFailEpochRevokesEveryone(self):
        if self.rank == self.size - 1:
            self.world.fail_epoch("test: failure seen outside MPI")
            self.assertTrue(self.world.epoch_failed)
        ok = self.world.allreduce_global(np.ones(2, dtype=np.float64))
        self.assertFalse(ok)  # the global communicator was revoked by the last rank
        self.assertFalse(self.world.allreduce(np.ones(2)))  # later calls of the epoch: False at once
        self.assertIsNone(self.world.allgather(1))
        res = self.world.consensus(ok)
        self.assertEqual((res.clean, res.epoch, res.dead_replicas), (False, 1, frozenset()))
        self.assertFalse(self.world.epoch_failed)
        self._check_sum(np.float64, 10)

    def testRepeatedConsensus(self):
        for i in range(5):
            flag = i % 2 == 0
            if flag:
                self._check_sum(np.float32, 64)
            else:
                # consensus(False) revokes (the caller may have skipped collectives): a peer that is
                # still finishing this all-reduce may see it fail. The epoch is not clean either way.
                self.world.allreduce(np.ones(64, dtype=np.float32))
            res = self.world.consensus(flag)
            self.assertEqual(res.clean, flag)
        self.assertEqual(self.world.epoch, 2)

    def testRetireOnlyWhenTold(self):
        with self.assertRaises(RuntimeError):
            self.world.retire()


def _classes(size):
    """(communicator, S) pairs for this world size; every pair gets its own TestCase class."""
    pairs = [("World", MPI.COMM_WORLD, 1), ("Self", MPI.COMM_SELF, 1)]
    if size > 1:
        pairs.append(("WorldOneReplica", MPI.COMM_WORLD, size))
    if size % 2 == 0 and size > 2:
        pairs.append(("WorldS2", MPI.COMM_WORLD, 2))
    for name, comm, s in pairs:
        yield type(f"TestWorld_{name}_S{s}", (BaseTestWorld, unittest.TestCase), {"COMM": comm, "S": s})


class TestWatchdog(unittest.TestCase):
    """Run once (not per communicator): costs ~2.5 s of sleeping."""

    def testHeartbeatAndPauseKeepARankAlive(self):
        world = FaultTolerantWorld(MPI.COMM_WORLD, 1, Deadlines(call_s=30, repair_s=30,
                                                                hang_timeout_s=0.6, poll_s=0.05))
        try:
            for _ in range(10):  # 1.5 s of "compute" with heartbeats
                time.sleep(0.15)
                world.heartbeat()
            with world.watchdog_paused():  # 1 s of "compute" without heartbeats
                time.sleep(1.0)
            self.assertTrue(world.barrier())  # still alive
        finally:
            world.close()


class TestValidation(unittest.TestCase):
    def testRanksPerReplicaMustDivide(self):
        size = MPI.COMM_WORLD.Get_size()
        for bad in (0, size + 1, -1):
            with self.assertRaisesRegex(ValueError, "ranks_per_replica"):
                FaultTolerantWorld(MPI.COMM_WORLD, bad, DEADLINES)


def main():
    out = sys.argv[1]
    rank = MPI.COMM_WORLD.Get_rank()
    suite = unittest.TestSuite()
    loader = unittest.defaultTestLoader
    for cls in [*_classes(MPI.COMM_WORLD.Get_size()), TestValidation, TestWatchdog]:
        suite.addTests(loader.loadTestsFromTestCase(cls))
    stream = open(os.path.join(out, f"unittest{rank}.log"), "w")
    result = unittest.TextTestRunner(stream=stream, verbosity=2).run(suite)
    stream.close()
    # nobody exits while a slower rank is still inside the last test's collectives
    FaultTolerantWorld(MPI.COMM_WORLD, 1, DEADLINES).finish()
    failures = [f"{t.id()}: {tb.splitlines()[-1]}" for t, tb in result.failures + result.errors]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"ran": result.testsRun, "failures": failures}, f)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
