"""[Note: bounded teardown] (groups/teardown.py) in process: an NCCL abort that hangs costs the
step at most its bound; a group given up while it is still being built is aborted, whether the
helper thread had it already or finishes it later. (CPU: the groups are fakes with an
``abort``; torch's NCCL class needs a GPU.)"""

from __future__ import annotations

import threading
import time

from recover_hsdp.groups import data_plane, teardown
from recover_hsdp.groups.teardown import PendingBuild, abort_bounded


class FakeNcclGroup:
    """``abort`` blocks until ``release`` (a hung NCCL abort) unless ``quick``; a connect
    blocks until the group is aborted (a member lost during the rendezvous)."""

    def __init__(self, quick: bool = True):
        self.quick = quick
        self.release = threading.Event()
        self.aborted = threading.Event()

    def abort(self):
        self.aborted.set()
        if not self.quick:
            self.release.wait(30)

    def eager_connect_single_device(self, device):
        self.aborted.wait(30)


def test_an_abort_that_hangs_costs_at_most_its_bound():
    group = FakeNcclGroup(quick=False)
    started = time.monotonic()
    assert abort_bounded(group, 0.2) is False
    assert time.monotonic() - started < 2.0 and group.aborted.is_set()
    group.release.set()
    assert abort_bounded(FakeNcclGroup(), 5.0) is True


def test_an_abort_that_raises_is_reported_not_raised():
    class Broken:
        def abort(self):
            raise RuntimeError("communicator already gone")

    assert abort_bounded(Broken(), 5.0) is True


def test_the_data_plane_gives_a_hung_group_up_within_the_bound(monkeypatch):
    monkeypatch.setattr(data_plane, "ABORT_WAIT_S", 0.2)
    plane = data_plane.TorchDataPlane(world=None, backend="nccl")
    group = FakeNcclGroup(quick=False)
    plane._group, plane._key = group, (3, (0, 1))
    started = time.monotonic()
    plane._abandon()
    assert time.monotonic() - started < 2.0
    assert group.aborted.is_set() and plane._group is None and plane.abandoned == [group]
    assert group in teardown.NEVER_DESTROYED
    group.release.set()


def test_a_build_given_up_while_connecting_aborts_the_communicator():
    """The helper has the group and is stuck in its connect: giving the build up aborts it, so
    the helper's connect returns."""
    plane = data_plane.TorchDataPlane(world=None, backend="nccl")
    built = PendingBuild(nccl=True)
    group = FakeNcclGroup()
    assert built.offer(group)
    helper = threading.Thread(target=group.eager_connect_single_device, args=(0,))
    helper.start()
    plane._give_up_build(built)
    helper.join(5)
    assert not helper.is_alive() and group.aborted.is_set()


def test_a_group_finished_after_the_build_was_given_up_is_aborted_not_used():
    built = PendingBuild(nccl=True)
    assert built.abandon() is None  # nothing built yet
    late = FakeNcclGroup()
    assert built.offer(late) is False  # the helper must not connect it
    assert late.aborted.is_set() and late in teardown.NEVER_DESTROYED
    gloo = PendingBuild(nccl=False)
    gloo.abandon()
    kept = FakeNcclGroup()
    assert gloo.offer(kept) is False and not kept.aborted.is_set()  # gloo: nothing to abort
