"""The torch data plane ([Note: control plane and data plane], groups/data_plane.py), in
process: real gloo groups between threads, the control plane faked (tests/fakes.py).

What is proven here: one group per world epoch, built at the first reduce of the epoch (a
member lost during its rendezvous fails only that epoch) and rebuilt after a shrink; the sums
are right; a reduce blocked on a peer that stopped (a thread
that never calls, its sockets open, as a frozen process) is abandoned as soon as the control
plane reports the failure and leaves the bucket untouched; an abandoned group is never used
again; bf16 on the wire halves the bytes and keeps replicas identical. The real-process
cases are tests/jobs/test_end_to_end.py (SIGKILL on both planes) and tests/jobs/test_real_failures.py
(a frozen rank on the torch plane, slow suite).
"""

from __future__ import annotations

import time

import pytest
import torch

from fakes import FakeHub, FakeUnit, run_ranks, values_of
from recover_hsdp.config import ConfigError, JobConfig, Reduce
from recover_hsdp.groups.data_plane import TorchDataPlane
from recover_hsdp.recovery import BucketSync

N = 1000


def _value(replica: int, step: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) * (replica + 1) + step


def test_one_group_per_epoch_rebuilt_after_a_shrink():
    """Two clean steps on one group; replica 1 dies; the survivors build a new group for
    epoch 1 and sum only their own contributions."""
    hub = FakeHub(3)

    def rank(world):
        plane = TorchDataPlane(world, "gloo", timeout_s=30)
        sums = []
        for step in range(2):
            t = _value(world.replica, step)
            assert plane.reduce(t)
            sums.append(t)
            assert world.consensus(True).clean
        if world.replica == 1:
            hub.kill(1)
        result = world.consensus(True)
        t = _value(world.replica, 2)
        assert plane.reduce(t)
        assert world.consensus(True).clean
        return sums, t, plane.builds, len(plane.abandoned), result.epoch

    out = values_of(run_ranks(hub, rank), killed=[(1, 0)])
    for sums, last, builds, abandoned, epoch in out.values():
        for step, total in enumerate(sums):
            assert torch.equal(total, sum(_value(r, step) for r in range(3)))
        assert torch.equal(last, _value(0, 2) + _value(2, 2))
        assert (builds, abandoned, epoch) == (2, 1, 1)


def test_blocked_reduce_is_abandoned_when_the_control_plane_reports_a_failure():
    """Replica 2 stops taking part (alive, sockets open: no gloo error ever comes) and fails
    the epoch over the control plane; the two blocked in the gloo all-reduce with it return
    False within the poll, their buckets untouched (the call reduced a private copy)."""
    hub = FakeHub(3)

    def rank(world):
        plane = TorchDataPlane(world, "gloo", timeout_s=60)
        assert plane.reduce(_value(world.replica, 0))  # the group exists
        assert world.consensus(True).clean
        if world.replica == 2:
            time.sleep(0.5)  # the others are blocked in the next all-reduce by now
            world.fail_epoch("replica 2 frozen (test)")
            return world.consensus(False).clean
        t = _value(world.replica, 1)
        started = time.monotonic()
        ok = plane.reduce(t)
        waited = time.monotonic() - started
        clean = world.consensus(not world.epoch_failed).clean
        return ok, waited, torch.equal(t, _value(world.replica, 1)), len(plane.abandoned), clean

    out = values_of(run_ranks(hub, rank))
    assert out[(2, 0)] is False
    for key in [(0, 0), (1, 0)]:
        ok, waited, untouched, abandoned, clean = out[key]
        assert not ok and untouched and abandoned == 1 and not clean
        assert 0.3 < waited < 5.0, waited


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in-hook"])
def test_bucket_sync_on_the_torch_plane_rereduces_after_a_death(overlap):
    """BucketSync with a torch plane: replica 1 dies after the first bucket; the survivors'
    stale buckets are restored and reduced on the new epoch's group (overlapped: the death
    is found in ``wait_sums``; in the hook: in the next bucket's reduce)."""
    hub = FakeHub(3)

    def rank(world):
        units = [FakeUnit(f"u{i}") for i in range(3)]
        plane = TorchDataPlane(world, "gloo", timeout_s=30, overlap=overlap)
        sync = BucketSync(units, world, plane=plane)
        sync.begin_step(contributes=True)
        for index, unit in enumerate(units):
            if world.replica == 1 and index == 1:
                hub.kill(1)
            unit.sync(_value(world.replica, index))
        sync.wait_sums()
        stale = [b.epoch is None for b in sync.buckets]
        world.consensus(not world.epoch_failed and sync.all_current())
        sync.rereduce(contributes=True)
        assert world.consensus(not world.epoch_failed and sync.all_current()).clean
        return [b.tensor.clone() for b in sync.buckets], plane.builds, stale

    out = values_of(run_ranks(hub, rank), killed=[(1, 0)])
    for buckets, builds, stale in out.values():
        assert builds == 2
        assert stale[1:] == [True, True]  # never summed by the dead replica
        for index, tensor in enumerate(buckets):
            assert torch.equal(tensor, _value(0, index) + _value(2, index))


def test_the_epochs_group_is_built_at_the_step_start_not_in_the_first_hook():
    """``DataPlane.prepare`` (recovery/planes.py): ``begin_step`` builds the epoch's group on
    the calling thread, so no hook (on a GPU: autograd's device thread, inside the backward)
    builds one; a step of the same epoch builds nothing."""
    import threading

    hub = FakeHub(2)

    def rank(world):
        units = [FakeUnit(f"u{i}") for i in range(2)]
        plane = TorchDataPlane(world, "gloo", timeout_s=30)
        sync = BucketSync(units, world, plane=plane)
        built_in = []
        build = plane._build
        plane._build = lambda key: built_in.append(threading.current_thread().name) or build(key)
        results = []
        for step in range(2):
            sync.begin_step(contributes=True)
            before = plane.builds
            for index, unit in enumerate(units):
                unit.sync(_value(world.replica, index + step))
            sync.wait_sums()
            assert world.consensus(not world.epoch_failed and sync.all_current()).clean
            results.append(before)
        return results, built_in, threading.current_thread().name

    for results, built_in, thread in values_of(run_ranks(hub, rank)).values():
        assert results == [1, 1] and built_in == [thread]


def test_overlapped_sums_let_the_backward_go_on():
    """[Note: overlapped bucket sums]: replica 1 is 0.6 s late to every bucket (a slow
    backward); replica 0's hooks return at once (its sums are enqueued, not waited for), and
    the waiting happens in ``wait_sums``, after which every bucket holds the sum, tagged with
    the epoch. The same without overlap: replica 0 waits in every hook."""
    def timed(overlap):
        hub = FakeHub(2)

        def rank(world):
            units = [FakeUnit(f"u{i}") for i in range(3)]
            plane = TorchDataPlane(world, "gloo", timeout_s=30, overlap=overlap)
            plane.reduce(torch.zeros(1))  # build the group first
            sync = BucketSync(units, world, plane=plane)
            sync.begin_step(contributes=True)
            hooks = 0.0
            for index, unit in enumerate(units):
                if world.replica == 1:
                    time.sleep(0.6)
                started = time.monotonic()
                unit.sync(_value(world.replica, index))
                hooks += time.monotonic() - started
            sync.wait_sums()
            assert sync.all_current()
            return hooks, [b.tensor.clone() for b in sync.buckets]

        return values_of(run_ranks(hub, rank))

    overlapped, waited = timed(True), timed(False)
    for out in (overlapped, waited):
        for hooks, buckets in out.values():
            for index, tensor in enumerate(buckets):
                assert torch.equal(tensor, _value(0, index) + _value(1, index))
    assert overlapped[(0, 0)][0] < 0.3, overlapped[(0, 0)][0]
    assert waited[(0, 0)][0] > 1.2, waited[(0, 0)][0]


def test_overlapped_sum_blocked_on_a_frozen_peer_is_abandoned_in_the_wait():
    """A replica that stops taking part after its first bucket (alive, sockets open): the
    others' ``wait_sums`` gives up when the control plane reports the failure; their buckets
    hold their own contributions (restorable), none tagged."""
    hub = FakeHub(3)

    def rank(world):
        units = [FakeUnit(f"u{i}") for i in range(2)]
        plane = TorchDataPlane(world, "gloo", timeout_s=60)
        sync = BucketSync(units, world, plane=plane)
        sync.begin_step(contributes=True)
        units[0].sync(_value(world.replica, 0))
        if world.replica == 2:
            time.sleep(0.5)
            world.fail_epoch("replica 2 frozen (test)")
            return world.consensus(False).clean
        units[1].sync(_value(world.replica, 1))
        sync.wait_sums()
        mine = torch.equal(sync.buckets[1].tensor, _value(world.replica, 1))
        return [b.epoch for b in sync.buckets], mine, world.consensus(sync.all_current()).clean

    out = values_of(run_ranks(hub, rank))
    assert out[(2, 0)] is False
    for key in [(0, 0), (1, 0)]:
        epochs, mine, clean = out[key]
        assert epochs[1] is None and mine and not clean


def test_a_member_lost_during_the_group_rendezvous_fails_only_that_epoch():
    """Replica 2 takes part in the address exchange and dies before it joins the gloo
    rendezvous (its group never connects): the others, blocked in the rendezvous, give it up
    when the control plane reports the death; after the shrink the two survivors build the next
    epoch's group and sum."""
    from recover_hsdp.groups import rendezvous

    hub = FakeHub(3)

    def rank(world):
        plane = TorchDataPlane(world, "gloo", timeout_s=30)
        if world.replica == 2:
            world.allgather((rendezvous.this_host(), None))  # as _build, then gone
            time.sleep(0.5)  # the others are in the rendezvous by now
            hub.kill(2)
        started = time.monotonic()
        ok = plane.reduce(_value(world.replica, 0))
        waited = time.monotonic() - started
        assert not world.consensus(not world.epoch_failed).clean
        t = _value(world.replica, 1)
        assert plane.reduce(t)
        assert world.consensus(True).clean
        return ok, waited, t, plane.builds

    out = values_of(run_ranks(hub, rank), killed=[(2, 0)])
    for ok, waited, t, builds in out.values():
        assert not ok and 0.3 < waited < 5.0, waited
        assert torch.equal(t, _value(0, 1) + _value(1, 1)) and builds == 1


def test_bf16_on_the_wire_keeps_replicas_identical():
    hub = FakeHub(2)

    def rank(world):
        plane = TorchDataPlane(world, "gloo", wire_dtype="bf16", timeout_s=30)
        t = torch.randn(N, generator=torch.Generator().manual_seed(world.replica))
        exact = (torch.randn(N, generator=torch.Generator().manual_seed(0))
                 + torch.randn(N, generator=torch.Generator().manual_seed(1)))
        assert plane.reduce(t)
        return t, exact

    out = values_of(run_ranks(hub, rank))
    (a, exact), (b, _) = out[(0, 0)], out[(1, 0)]
    assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, exact)
    assert torch.allclose(a, exact, rtol=2e-2, atol=2e-2)


def test_auto_is_torch_on_gpus_and_mpi_on_cpu():
    from recover_hsdp.groups.data_plane import resolve_data_plane

    assert resolve_data_plane("auto", None) == "mpi"
    assert resolve_data_plane("auto", torch.device("cpu")) == "mpi"
    assert resolve_data_plane("auto", torch.device("cuda", 3)) == "torch"
    assert resolve_data_plane("mpi", torch.device("cuda", 0)) == "mpi"
    assert resolve_data_plane("torch", None) == "torch"
    assert resolve_data_plane("auto", torch.device("cuda", 0), ranks_per_gpu=2) == "mpi"
    with pytest.raises(ConfigError) as err:  # NCCL: one rank per GPU in a communicator
        resolve_data_plane("torch", torch.device("cuda", 0), ranks_per_gpu=2)
    assert "plane=torch with 2 ranks per GPU" in str(err.value)
    assert "\n" not in str(err.value)
    assert JobConfig().recover.reduce.plane == "auto" and JobConfig().recover.reduce.overlap


@pytest.mark.parametrize("changes,words", [
    ({"wire_dtype": "bf16"}, "needs recover.reduce.plane=torch"),
    ({"plane": "nccl"}, "recover.reduce.plane='nccl'"),
    ({"transport": "ib"}, "recover.reduce.transport='ib'"),
    ({"overlap": "yes"}, "recover.reduce.overlap='yes'"),
])
def test_data_plane_fields_are_refused_in_one_line(changes, words):
    """(bf16 with the [recover.debug] outputs: tests/test_config_sections.py.)"""
    section = Reduce()
    for name, value in changes.items():
        setattr(section, name, value)
    with pytest.raises(ConfigError) as err:
        section.check()
    assert words in str(err.value) and "\n" not in str(err.value)


def test_transport_is_checked_at_launch_in_one_line():
    """[Note: transports]: tcp needs nothing; uct/ofi need their btl and host libraries (this
    wheel has the components, this host has no RDMA libraries)."""
    from recover_hsdp.collectives.mpirun import check_transport, mpirun_prefix

    check_transport("tcp")
    with pytest.raises(ValueError) as err:
        check_transport("uct", find_library=lambda name: None)
    assert "recover.reduce.transport='uct'" in str(err.value) and "libibverbs" in str(err.value)
    check_transport("ofi", find_library=lambda name: f"lib{name}.so")  # libraries found: ok
    line = mpirun_prefix(2, transport="uct")
    assert line[line.index("btl") + 1] == "uct,self" and "tcp,self" not in line


def test_nccl_data_plane_groups_are_built_with_the_watchdogs_teardown_off(monkeypatch):
    """[Note: no watchdog decides on the data plane]: the NCCL group's constructor sees
    TORCH_NCCL_ASYNC_ERROR_HANDLING=0 whatever the process has (the replica group's 3), and the
    process's value is back afterwards. (CPU: the constructor is a recorder; torch's NCCL
    class needs a GPU.)"""
    import os

    import torch.distributed as dist

    from recover_hsdp.groups import data_plane

    seen = {}

    class Recorder:
        Options = dist.ProcessGroupNCCL.Options if hasattr(dist, "ProcessGroupNCCL") else \
            type("Options", (), {})

        def __init__(self, store, rank, size, options):
            seen["handling"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")

    monkeypatch.setattr(dist, "ProcessGroupNCCL", Recorder, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    plane = data_plane.TorchDataPlane(world=None, backend="nccl")
    plane._new_group(store=None, rank=0, size=2, address="127.0.0.1")
    assert seen == {"handling": "0"}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
