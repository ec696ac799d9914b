"""[Note: stopped peers outside the detector] (collectives/processes.py), in process, on real
processes: a peer stopped by SIGSTOP for ``after_s`` while a guarded call waits is SIGKILLed
by the waiting rank's watchdog thread; one stopped for a moment (a profiler), one seen stopped
only in sweeps that are not contiguous, one running, and this process are left alone. The
respawned replica frozen in a real job is tests/jobs/test_rejoin.py's
``test_a_frozen_replacement_is_ended_by_a_peer_on_its_host``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from recover_hsdp.collectives.guard import Deadlines, MpiGuard
from recover_hsdp.collectives.processes import ProcessInfo, StoppedPeers, start_time
from recover_hsdp.manager.local_processes import LocalProcesses


@pytest.fixture
def peers():
    """Two real processes of 'the job' on this host: (Popen, ProcessInfo) each."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for _ in range(2)]
    infos = []
    for proc in procs:
        deadline = time.monotonic() + 10
        while start_time(proc.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        infos.append(ProcessInfo(ProcessInfo.current().host, proc.pid, start_time(proc.pid)))
    yield list(zip(procs, infos))
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _stopped(info: ProcessInfo) -> None:
    deadline = time.monotonic() + 10
    while not info.is_frozen() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert info.is_frozen()


def test_a_peer_stopped_in_every_sweep_for_after_s_is_due_and_no_other(peers):
    (stopped, stopped_info), (_, running_info) = peers
    stopped.send_signal(signal.SIGSTOP)
    _stopped(stopped_info)
    table = [ProcessInfo.current(), stopped_info, running_info]
    watch = StoppedPeers(after_s=3.0)
    assert watch.sweep(table, now=100.0, contiguous_s=2.0) == []
    assert watch.sweep(table, now=101.5, contiguous_s=2.0) == []
    assert watch.sweep(table, now=103.0, contiguous_s=2.0) == [stopped_info]
    # a gap longer than contiguous_s: the process may have moved meanwhile, it starts over
    assert watch.sweep(table, now=110.0, contiguous_s=2.0) == []


def test_a_peer_that_moves_between_sweeps_starts_over(peers):
    (proc, info), _ = peers
    watch = StoppedPeers(after_s=2.0)
    proc.send_signal(signal.SIGSTOP)
    _stopped(info)
    assert watch.sweep([info], now=10.0, contiguous_s=5.0) == []
    proc.send_signal(signal.SIGCONT)  # a profiler let it go
    deadline = time.monotonic() + 10
    while info.is_frozen() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.sweep([info], now=11.0, contiguous_s=5.0) == []
    proc.send_signal(signal.SIGSTOP)
    _stopped(info)
    assert watch.sweep([info], now=12.0, contiguous_s=5.0) == []  # since 12, not 10
    assert watch.sweep([info], now=14.0, contiguous_s=5.0) == [info]


class _World:
    """What ``LocalProcesses.watch_stopped`` needs of a world: its guard's hook and deadlines."""

    def __init__(self, deadlines: Deadlines):
        self.deadlines, self.world_rank = deadlines, 0
        self.guard = MpiGuard(deadlines, name="test")
        self.on_blocked = None
        self.guard.on_blocked = lambda now: self.on_blocked and self.on_blocked(now)


def test_a_waiting_call_ends_a_stopped_peer_and_leaves_a_running_one(peers):
    """The whole path: ``MpiGuard``'s watchdog thread calls the manager's sweep while a guarded
    call waits; the stopped peer is SIGKILLed within after_s plus a few polls."""
    (stopped, stopped_info), (running, running_info) = peers
    world = _World(Deadlines(call_s=60, repair_s=70, hang_timeout_s=30, poll_s=0.2))
    try:
        LocalProcesses(world, [ProcessInfo.current(), stopped_info, running_info]
                       ).watch_stopped(after_s=1.0)
        stopped.send_signal(signal.SIGSTOP)
        _stopped(stopped_info)
        started = time.monotonic()
        with world.guard.call("Allreduce(shard)", 60):  # a wait on the stopped peer
            while stopped.poll() is None and time.monotonic() - started < 20:
                time.sleep(0.05)
        assert stopped.returncode == -signal.SIGKILL
        assert running.poll() is None
    finally:
        world.guard.close()


def test_no_sweep_outside_a_call_nor_when_off(peers):
    (stopped, stopped_info), _ = peers
    world = _World(Deadlines(call_s=60, repair_s=70, hang_timeout_s=30, poll_s=0.1))
    try:
        LocalProcesses(world, [stopped_info]).watch_stopped(after_s=0)  # detect_s = 0: off
        assert world.on_blocked is None
        LocalProcesses(world, [stopped_info]).watch_stopped(after_s=0.3)
        stopped.send_signal(signal.SIGSTOP)
        _stopped(stopped_info)
        time.sleep(1.5)  # no call waits: nothing is swept
        assert stopped.poll() is None
    finally:
        world.guard.close()
