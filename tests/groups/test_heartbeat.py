"""The replica heartbeat ([Note: a replica leaves as a unit]) and the rendezvous address rule
([Note: rendezvous address]), without MPI: a fake clock for the logic, real UDP sockets on
loopback with short periods for the thread."""

from __future__ import annotations

import threading
import time

import pytest

from recover_hsdp.groups import rendezvous
from recover_hsdp.groups.timeouts import group_timeout_s, job_deadlines
from recover_hsdp.groups.heartbeat import ReplicaHeartbeat, open_socket

TOKEN = b"12345678"


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _pair_logic(clock, timeout=4.0):
    a, b = open_socket("127.0.0.1"), open_socket("127.0.0.1")
    lost = []
    beat_a = ReplicaHeartbeat(a, 0, {1: b.getsockname()}, TOKEN, period_s=1.0, timeout_s=timeout,
                              on_lost=lambda *x: lost.append(x), clock=clock)
    beat_b = ReplicaHeartbeat(b, 1, {0: a.getsockname()}, TOKEN, period_s=1.0, timeout_s=timeout,
                              on_lost=lambda *x: lost.append(x), clock=clock)
    return beat_a, beat_b


def test_a_silent_peer_is_lost_after_the_timeout_and_not_before():
    clock = _Clock()
    a, b = _pair_logic(clock)
    for _ in range(3):  # both beat every second for 3 s
        clock.now += 1.0
        a.received(b.message(), clock.now)
        assert a.overdue(clock.now) is None
    for _ in range(4):  # then b falls silent; a keeps checking every second
        clock.now += 1.0
        assert a.overdue(clock.now) is None  # silent 4 s: not yet (> timeout)
    clock.now += 0.5
    assert a.overdue(clock.now) == (1, pytest.approx(4.5))
    a.sock.close(), b.sock.close()


def _phase_pair(clock):
    a, b = open_socket("127.0.0.1"), open_socket("127.0.0.1")
    make = lambda sock, shard, peer: ReplicaHeartbeat(  # noqa: E731
        sock, shard, {1 - shard: peer.getsockname()}, TOKEN, period_s=1.0, timeout_s=4.0,
        slow_timeout_s=30.0, on_lost=print, clock=clock)
    return make(a, 0, b), make(b, 1, a)


def _silence(beat, clock, seconds):
    """``seconds`` of silence from the peer, checked every second; the first overdue or None."""
    for _ in range(int(seconds)):
        clock.now += 1.0
        found = beat.overdue(clock.now)
        if found:
            return found
    return None


def test_start_up_is_a_slow_phase_until_steady():
    """[Note: detection margins by phase]: at start-up a silent peer has slow_timeout_s; after
    both say steady, detect_s again."""
    clock = _Clock()
    a, b = _phase_pair(clock)
    assert a.slow and b.message() != a.message()  # start-up beats say "slow"
    a.received(b.message(), clock.now)
    assert _silence(a, clock, 29) is None          # 29 s of silence at start-up: no death
    assert _silence(a, clock, 2)[0] == 1           # past 30 s: lost
    a.lost = None
    a.steady(), b.steady()
    a.received(b.message(), clock.now)
    assert not a.slow and _silence(a, clock, 4) is None
    assert _silence(a, clock, 1) == (1, pytest.approx(5.0))
    a.sock.close(), b.sock.close()


def test_a_peer_in_a_slow_phase_gets_the_margin_and_loses_it_when_it_ends():
    clock = _Clock()
    a, b = _phase_pair(clock)
    a.steady(), b.steady()
    with b.slow_phase(), b.slow_phase():  # a checkpoint save inside a join: nests
        a.received(b.message(), clock.now)
        assert not a.slow and a.allowed_silence(1) == 30.0
    assert not b.slow
    a.received(b.message(), clock.now)    # b's first beat after the save: steady
    assert a.allowed_silence(1) == 4.0 and _silence(a, clock, 5)[0] == 1
    with a.slow_phase():                  # this rank slow itself: its peers get the margin
        assert a.allowed_silence(1) == 30.0
    a.sock.close(), b.sock.close()


def test_the_margin_is_never_below_the_timeout():
    sock = open_socket("127.0.0.1")
    with pytest.raises(ValueError, match="slow_timeout_s"):
        ReplicaHeartbeat(sock, 0, {}, TOKEN, period_s=1.0, timeout_s=4.0, slow_timeout_s=2.0,
                         on_lost=print)
    sock.close()


def test_foreign_datagrams_and_goodbyes():
    clock = _Clock()
    a, b = _pair_logic(clock)
    other = ReplicaHeartbeat(open_socket("127.0.0.1"), 1, {0: a.sock.getsockname()}, b"abcdefgh",
                             period_s=1.0, timeout_s=4.0, on_lost=print, clock=clock)
    for _ in range(10):  # another job's beats (wrong token) and garbage keep nobody alive
        clock.now += 1.0
        a.received(other.message(), clock.now)
        a.received(b"garbage", clock.now)
        a.overdue(clock.now)
    assert a.overdue(clock.now)[0] == 1
    a.received(b.message(1), clock.now)  # a goodbye: b is never lost after it
    clock.now += 100.0
    assert a.overdue(clock.now) is None
    for beat in (a, b, other):
        beat.sock.close()


def test_a_thread_that_could_not_run_does_not_blame_its_peers():
    """This process was stopped (or starved) 10 s: the silence it could not hear is no
    evidence; its peer is lost only if it stays silent for a timeout afterwards."""
    clock = _Clock()
    a, b = _pair_logic(clock)
    a.overdue(clock.now)
    clock.now += 10.0
    assert a.overdue(clock.now) is None
    for _ in range(4):
        clock.now += 1.0
        assert a.overdue(clock.now) is None
    clock.now += 1.0
    assert a.overdue(clock.now)[0] == 1
    a.sock.close(), b.sock.close()


def _threads(n=2, period=0.1, timeout=1.0):
    socks = [open_socket("127.0.0.1") for _ in range(n)]
    lost: dict[int, list] = {i: [] for i in range(n)}
    beats = [ReplicaHeartbeat(socks[i], i, {j: socks[j].getsockname() for j in range(n) if j != i},
                              TOKEN, period_s=period, timeout_s=timeout,
                              on_lost=lambda s, t, i=i: lost[i].append((s, t)))
             for i in range(n)]
    return [b.start() for b in beats], lost


def test_real_sockets_a_frozen_peer_is_lost_a_busy_one_is_not_a_goodbye_ends_cleanly():
    beats, lost = _threads(3)
    deadline = time.monotonic() + 3.0  # 3 x timeout of pure-Python compute holding the GIL
    x = 0
    while time.monotonic() < deadline:
        x += 1
    assert lost == {0: [], 1: [], 2: []}
    beats[2].stand_down(say_goodbye=False)  # rank 2 freezes: silent, no goodbye
    time.sleep(2.5)
    assert [s for s, _ in lost[0]] == [2] and [s for s, _ in lost[1]] == [2], lost
    assert 1.0 < lost[0][0][1] < 2.0, lost
    beats[0].stand_down(), beats[1].stand_down()

    beats, lost = _threads(2)
    time.sleep(0.3)
    beats[0].stand_down()  # leaves normally: its peer must never fire
    time.sleep(2.0)
    assert lost == {0: [], 1: []}
    beats[1].stand_down()
    assert not any(t.name == "recover-hsdp-replica-heartbeat" and t.is_alive()
                   for t in threading.enumerate())


def test_timers_are_ordered():
    from recover_hsdp.config import JobConfig

    class Job:
        recover = JobConfig().recover  # [recover.timeouts]: 300 s hang, 4 s detect (defaults)

    deadlines = job_deadlines(Job())
    timeout = group_timeout_s(deadlines, 4.0)
    assert 4.0 < 300.0 < deadlines.call_s < deadlines.repair_s < timeout
    assert timeout > deadlines.call_s + deadlines.repair_s


def _host(name, *pairs):
    return rendezvous.HostAddresses(name, tuple(pairs))


def test_rendezvous_address_rule(monkeypatch):
    here = _host("a", ("eth0", "10.0.0.1"), ("docker0", "172.17.0.1"))
    peer = _host("b", ("docker0", "172.17.0.1"), ("eth0", "10.0.0.2"))
    assert rendezvous.local_address([here, _host("a")], 0) == ("127.0.0.1", None)  # one host
    routes = {"10.0.0.2": "10.0.0.1", "172.17.0.1": "172.17.0.1"}
    monkeypatch.setattr(rendezvous, "route_source", routes.get)
    # docker0 is on both hosts: skipped; eth0 routes to the peer
    assert rendezvous.local_address([here, peer], 0) == ("10.0.0.1", "eth0")
    assert rendezvous.store_address([here, peer], 0, env={}) == "10.0.0.1"
    assert rendezvous.store_address([here, peer], 0,
                                    env={rendezvous.STORE_HOST_ENV: "10.9.9.9"}) == "10.9.9.9"
    with pytest.raises(ValueError, match="loopback"):
        rendezvous.store_address([here, peer], 0, env={rendezvous.STORE_HOST_ENV: "127.0.1.1"})
    lonely = _host("a", ("eth0", "192.168.5.5"))
    monkeypatch.setattr(rendezvous, "route_source", lambda address: "127.0.0.1")
    with pytest.raises(ValueError, match="no address of host a .* routes to its replica peers"):
        rendezvous.local_address([lonely, peer], 0)


def test_mpi_interface_filter():
    env = {"OMPI_MCA_btl_tcp_if_include": "10.231.21.0/24,ib0"}
    assert rendezvous.mpi_uses("eth0", "10.231.21.3", env)
    assert rendezvous.mpi_uses("ib0", "192.168.0.1", env)
    assert not rendezvous.mpi_uses("eth1", "192.168.0.1", env)
    assert not rendezvous.mpi_uses("docker0", "172.17.0.1",
                                   {"OMPI_MCA_btl_tcp_if_exclude": "docker0,lo"})
    assert rendezvous.mpi_uses("eth0", "10.0.0.1", {})
    assert all(not a.startswith("127.") for a in rendezvous.this_host().addresses)


# [Note: silence the host can explain] ---------------------------------------------------------

def _witnessed_pair(clock, seen):
    a, b = open_socket("127.0.0.1"), open_socket("127.0.0.1")
    beat = ReplicaHeartbeat(a, 0, {1: b.getsockname()}, TOKEN, period_s=1.0, timeout_s=4.0,
                            slow_timeout_s=30.0, on_lost=print, clock=clock,
                            witness=lambda shard: seen.get(shard))
    peer = ReplicaHeartbeat(b, 1, {0: a.getsockname()}, TOKEN, period_s=1.0, timeout_s=4.0,
                            on_lost=print, clock=clock)
    beat.steady(), peer.steady()
    return beat, peer


@pytest.mark.parametrize("after, lost_after", [
    (("R", 150), 30),    # used CPU since its last beat: working, starved -> the slow margin
    (("S", 150), 30),    # sleeping between bursts of work is still work done
    (("R", 100), 4),     # no CPU since its last beat: silence is evidence
    (("T", 150), 4),     # stopped (SIGSTOP): never moves by itself
    (("Z", 150), 4),     # a zombie: dead
    (None, 4),           # gone, another host's, or a reused pid
])
def test_a_silent_peer_the_host_sees_working_gets_the_slow_margin(after, lost_after):
    clock, seen = _Clock(), {1: ("S", 100)}
    beat, peer = _witnessed_pair(clock, seen)
    clock.now += 1.0
    beat.received(peer.message(), clock.now)    # its last beat: 100 CPU ticks so far
    seen[1] = after
    found = _silence(beat, clock, 40)
    assert found is not None and found[0] == 1
    assert lost_after < found[1] <= lost_after + 1, found
    assert (1 in beat.working) == (lost_after == 30)
    beat.sock.close(), peer.sock.close()


def test_a_beat_ends_the_explained_silence():
    clock, seen = _Clock(), {1: ("R", 100)}
    beat, peer = _witnessed_pair(clock, seen)
    beat.received(peer.message(), clock.now)
    seen[1] = ("R", 500)
    assert _silence(beat, clock, 10) is None and 1 in beat.working
    beat.received(peer.message(), clock.now)    # it beats again: CPU 500 is the new baseline
    assert 1 not in beat.working
    assert _silence(beat, clock, 6)[1] == pytest.approx(5.0)   # no CPU since: 4 s again
    beat.sock.close(), peer.sock.close()


_STARVED_PEER = r"""
import math, re, sys, time
sys.path.insert(0, sys.argv[1])
from recover_hsdp.groups.heartbeat import ReplicaHeartbeat, open_socket
sock = open_socket("127.0.0.1")
print(sock.getsockname()[1], flush=True)
ports = [int(p) for p in sys.stdin.readline().split()]
beat = ReplicaHeartbeat(sock, 1, {0: ("127.0.0.1", ports[0]), 2: ("127.0.0.1", ports[1])},
                        b"12345678", period_s=0.25, timeout_s=1.0,
                        on_lost=lambda *a: None).start()
beat.steady()
n, took = 16, 0.0
while took < 0.2:   # calibrated on this machine: each more "a" doubles the call
    n += 1
    started = time.monotonic()
    re.match(r"(a+)+$", "a" * n + "b")
    took = time.monotonic() - started
n += max(1, math.ceil(math.log2(float(sys.argv[2]) / took)))
time.sleep(1.0)
started = time.monotonic()
re.match(r"(a+)+$", "a" * n + "b")   # one C call holding the GIL ~argv[2] seconds
print("done", time.monotonic() - started, flush=True)
time.sleep(30)
"""


def test_real_process_a_peer_starved_by_its_own_gil_is_not_lost_a_stopped_one_is(tmp_path):
    """A real peer process whose main thread holds the GIL in one regex (its heartbeat thread
    cannot beat for seconds) is not declared lost by a same-host observer that reads its CPU
    clock (an observer without that witness loses it: the control); SIGSTOPped, it is lost
    after the steady-state timeout."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from recover_hsdp.collectives.processes import ProcessInfo, start_time

    repo = str(Path(__file__).resolve().parents[2])
    peer = subprocess.Popen([sys.executable, "-c", _STARVED_PEER, repo, "4"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(peer.stdout.readline())
        info = ProcessInfo(ProcessInfo.current().host, peer.pid, start_time(peer.pid))
        lost = []
        sock = open_socket("127.0.0.1")
        beat = ReplicaHeartbeat(sock, 0, {1: ("127.0.0.1", port)}, TOKEN, period_s=0.25,
                                timeout_s=1.0, slow_timeout_s=60.0,
                                on_lost=lambda *a: lost.append(a),
                                witness=lambda shard: info.cpu_ticks())
        control_lost = []
        control = ReplicaHeartbeat(open_socket("127.0.0.1"), 2, {1: ("127.0.0.1", port)}, TOKEN,
                                   period_s=0.25, timeout_s=1.0, slow_timeout_s=60.0,
                                   on_lost=lambda *a: control_lost.append(a))
        peer.stdin.write(f"{sock.getsockname()[1]} {control.sock.getsockname()[1]}\n")
        peer.stdin.flush()
        beat.start(), control.start()
        beat.steady(), control.steady()
        word, held = peer.stdout.readline().split()
        assert word == "done" and float(held) > 1.5, f"the GIL held {held} s only: not a test"
        assert lost == [] and beat.explained >= 1, (lost, beat.explained)
        assert control_lost and control_lost[0][0] == 1, control_lost   # silence alone: lost
        time.sleep(1.0)                         # beating again
        os.kill(peer.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and lost[0][0] == 1 and 1.0 < lost[0][1] < 2.5, lost
    finally:
        peer.kill()
        peer.wait()
        for b in (locals().get("beat"), locals().get("control")):
            if b is not None:
                b.stand_down(say_goodbye=False)
