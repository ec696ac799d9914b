"""``ReplicaHeartbeat``: a UDP heartbeat among the S ranks of one replica, on its own thread.

Why it exists and what acts on it: [Note: a replica leaves as a unit] (groups/replica_group.py).
Each rank sends a datagram to every peer of its replica every ``period_s`` and calls
``on_lost(shard, silent_s)`` once, from the heartbeat thread, when a peer has been silent for
``timeout_s``. The thread never waits for the main thread: a main thread that computes, saves a
checkpoint or builds the model (holding the GIL in pure Python still lets this thread run every
5 ms switch interval) beats on; a frozen process (SIGSTOP: every thread stops), a dead one and
one whose link is cut stop beating. A peer that leaves normally says so (``stand_down`` sends a
goodbye) and is no longer watched.

Invariant: ``on_lost`` is called at most once, and never for a peer that said goodbye. If this
thread itself could not run for more than ``timeout_s / 2`` (its process was stopped, the host
stalled), silence it could not hear is not evidence: every peer's clock restarts.

[Note: detection margins by phase] A liveness signal that is silent for ``detect_s`` is a death
only if the silent rank could have beaten. What was measured (2-core host, 3 namespace nodes x 3
ranks, ``benchmarks/false_detection_bench.py``, docs/failures.md "False deaths"):

* Open MPI's detector thread is started early in MPI_Init but beats only once MPI_Init is over;
  a rank whose MPI_Init ends seconds after its observer's (the fence and the wire-up are CPU work,
  and 9 ranks on 2 cores finish them seconds apart), or whose first heartbeat waits on a lazy TCP
  handshake, or whose detector thread is held by heavy imports right after MPI_Init, misses its
  deadline ("MISSED my SEND deadline by 5.9 s"): the observer declares a live rank dead, Open MPI
  aborts it ("reported dead by someone else"). Done against it: MPI_Init comes before any heavy
  import (``recover_hsdp/train.py``), connections open inside MPI_Init for jobs up to
  ``recover.timeouts.preconnect_max_ranks``, the repair spreads its claim by agreement (a bcast
  there crashed survivors while an accused rank was aborted), and an attempt that still ends
  before its first step through such a detection keeps its hosts and is relaunched with twice
  ``slow_phase_s`` ([Note: the relaunch tier] in cli/relaunch.py; a crash inside MPI_Init,
  Open MPI's start-up race, is relaunched as it was). And its timeout follows the
  phase: Open MPI is launched with ``slow_phase_s`` and each rank writes ``detect_s`` into its
  own detector once steady, ``slow_phase_s`` again for a slow phase ([Note: Open MPI's detector
  timeout by phase] in collectives/detector.py; ``LivenessPhase`` in groups/liveness.py tells
  both signals). Open MPI adds its own start-up slack (its first deadline is timeout + 1 +
  log(ranks) s away), so a rank that has not beaten at all is suspected no sooner than ~2 x
  ``slow_phase_s`` after its observer started. Measured with both (benchmarks/README.md "False
  deaths"): no attempt of 26 on 3 loaded namespace nodes had a false detection before its first
  commit; in steady state a host 5x oversubscribed still had one (``detect_s`` is the user's
  trade).
* This heartbeat's thread needs the GIL; a main thread that holds it in one long C call (a model
  build, a checkpoint load, the first step's allocations on a loaded host) silences it. So it
  knows the phase: a rank in a phase allowed to be slow (start-up until its first committed
  step, a checkpoint save or load, a rejoin's transfer: ``slow_phase``/``steady``) says so in
  every beat, and a peer is given ``slow_timeout_s`` (``recover.timeouts.slow_phase_s``) while
  its last beat said so or while this rank is slow itself; ``timeout_s`` otherwise.

Why a phase first, and a timeout learned from beat gaps only in steady state: the gaps that
cost deaths at start-up come in bursts that no history predicts (a start-up's imports and
wire-up, a checkpoint's write), and the phase is known exactly where they happen. A host that
stays loaded in steady state has no phase to mark but shows it in its gaps: there each
observer widens its own bound ([Note: a steady timeout learned from beat gaps] in
groups/gap_bound.py; nothing to agree: the timeout is the observer's). The cost: a frozen rank
or a silent host in a slow phase is found after ``slow_phase_s`` (plus Open MPI's start-up
slack before the first step), on a loaded host after the learned bound, else ``detect_s``; a
dead process at once (its sockets close), in every phase.

[Note: silence the host can explain] The replica's ranks usually share a host, and there
silence is not the only evidence: ``/proc/<pid>/stat`` says whether the silent peer's process
is still that process, whether it is stopped (T) or a zombie, and how much CPU it has used. A
peer silent past ``timeout_s`` in steady state whose process on this host has used CPU since
its last beat is working, not dead: its heartbeat thread is starved (the main thread holds the
GIL in one long C call, the host is oversubscribed: the steady-state false deaths measured in
benchmarks/README.md "False deaths" were silences of 4.0-4.1 s under load), so it is given
``slow_timeout_s`` like a peer in a slow phase. A peer that is gone, stopped, a zombie, or has
used no CPU since its last beat is judged by its silence alone as before (``timeout_s``, or
the bound learned from its gaps), and a peer on another host (no witness) too. Cost: a frozen
rank's detection is unchanged (SIGSTOP stops its CPU clock and shows T), a dead one's too
(its pid is gone); a live rank that spins without beating (a busy deadlock holding the GIL)
is found after ``slow_timeout_s`` instead of ``timeout_s`` (the hang watchdog's bound is
usually longer still). One read of the peer's stat per beat received and per check of a
silent peer.

Standard library only; the logic (``received``, ``overdue``) takes the time as an argument, so
tests drive it with a fake clock.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from typing import Callable, Iterator

from recover_hsdp.groups.gap_bound import GapBound

_MAGIC = b"RHB1"
_FORMAT = "!4s8sHB"  # magic, replica token, sender's shard, kind
_BEAT, _BYE, _BEAT_SLOW = 0, 1, 2


class ReplicaHeartbeat:
    """Args:
        sock: a bound UDP socket of this rank (``open_socket``); closed by ``stand_down``.
        shard: this rank's shard index in the replica.
        peers: shard -> (address, port) of every other rank of the replica.
        token: 8 bytes shared by the replica's ranks (datagrams of other jobs are ignored).
        period_s, timeout_s: beat period; silence after which a peer is lost (> 2 periods).
        slow_timeout_s: the silence allowed while this rank or the peer is in a slow phase
            ([Note: detection margins by phase]); default ``timeout_s``. A rank starts slow
            (its start-up) until :meth:`steady`.
        on_lost: ``on_lost(shard, silent_s)``, called once from the heartbeat thread.
        clock: monotonic seconds (tests pass a fake one).
        witness: ``witness(shard)`` -> (state letter, CPU ticks) of the peer's process read on
            this host, or None (another host, gone): [Note: silence the host can explain].
    """

    def __init__(self, sock: socket.socket, shard: int, peers: dict[int, tuple[str, int]],
                 token: bytes, *, period_s: float, timeout_s: float,
                 on_lost: Callable[[int, float], None], clock: Callable[[], float] = time.monotonic,
                 slow_timeout_s: float | None = None,
                 witness: Callable[[int], tuple[str, int] | None] | None = None):
        if not timeout_s > 2 * period_s > 0:
            raise ValueError(f"heartbeat timeout_s={timeout_s} must exceed 2 x period_s={period_s}")
        slow_timeout_s = timeout_s if slow_timeout_s is None else slow_timeout_s
        if slow_timeout_s < timeout_s:
            raise ValueError(f"heartbeat slow_timeout_s={slow_timeout_s} < timeout_s={timeout_s}")
        self.slow_timeout_s = slow_timeout_s
        self._starting, self._slow_phases = True, 0  # start-up is a slow phase
        self.peer_slow = dict.fromkeys(peers, True)  # what each peer's last beat said
        if len(token) != 8:
            raise ValueError("the heartbeat token is 8 bytes")
        self.sock, self.shard, self.peers, self.token = sock, shard, dict(peers), token
        self.period_s, self.timeout_s, self.on_lost, self.clock = period_s, timeout_s, on_lost, clock
        now = clock()
        self.last_seen = {peer: now for peer in self.peers}
        self.departed: set[int] = set()
        self.lost: int | None = None
        self.witness = witness
        self.cpu_at_beat: dict[int, int] = {}  # the peer's CPU ticks when its last beat came
        self.working: set[int] = set()  # silent peers the host saw working: [Note: silence ...]
        self.explained = 0  # silences past timeout_s the host explained so far
        # steady gaps between a peer's beats: [Note: a steady timeout learned from beat gaps]
        self.gaps = GapBound(timeout_s, slow_timeout_s)
        self._last_check = now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- phases ([Note: detection margins by phase]) ----------------------------------------
    @property
    def slow(self) -> bool:
        """Whether this rank is in a phase allowed to be slow (its beats say so)."""
        return self._starting or self._slow_phases > 0

    def steady(self) -> None:
        """Start-up is over (the first committed step): ``timeout_s`` from now on, outside
        :meth:`slow_phase`."""
        self._starting = False

    @contextlib.contextmanager
    def slow_phase(self) -> Iterator[None]:
        """A phase allowed to be slow (a checkpoint save or load, a rejoin's transfer); nests."""
        self._slow_phases += 1
        try:
            yield
        finally:
            self._slow_phases -= 1

    def allowed_silence(self, peer: int, now: float | None = None) -> float:
        if self.slow or self.peer_slow[peer] or self._working(peer):
            return self.slow_timeout_s
        # [Note: a steady timeout learned from beat gaps] (groups/gap_bound.py)
        return self.gaps.allowed(self.clock() if now is None else now)

    def _working(self, peer: int) -> bool:
        """[Note: silence the host can explain]: the peer's process on this host has used CPU
        since its last beat and is neither stopped nor a zombie."""
        seen = self.witness(peer) if self.witness is not None else None
        before = self.cpu_at_beat.get(peer)
        working = (seen is not None and before is not None and seen[0] not in "TtZXx"
                   and seen[1] > before)
        if working and peer not in self.working:
            self.working.add(peer)
            self.explained += 1
        return working

    # -- logic (no sockets, no threads) -----------------------------------------------------
    def message(self, kind: int | None = None) -> bytes:
        if kind is None:
            kind = _BEAT_SLOW if self.slow else _BEAT
        return struct.pack(_FORMAT, _MAGIC, self.token, self.shard, kind)

    def received(self, data: bytes, now: float) -> None:
        """One datagram: a beat or a goodbye of a peer (anything else is ignored)."""
        if len(data) != struct.calcsize(_FORMAT):
            return
        magic, token, shard, kind = struct.unpack(_FORMAT, data)
        if magic != _MAGIC or token != self.token or shard not in self.peers:
            return
        if kind == _BYE:
            self.departed.add(shard)
        else:
            if not (self.slow or self.peer_slow[shard] or kind == _BEAT_SLOW
                    or shard in self.working):  # a steady gap the host did not explain
                self.gaps.gap(now - self.last_seen[shard], now)
            self.peer_slow[shard] = kind == _BEAT_SLOW
            seen = self.witness(shard) if self.witness is not None else None
            if seen is not None:
                self.cpu_at_beat[shard] = seen[1]
        self.last_seen[shard] = now
        self.working.discard(shard)

    def overdue(self, now: float) -> tuple[int, float] | None:
        """(shard, silent seconds) of a watched peer silent for longer than it is allowed
        (:meth:`allowed_silence`), else None."""
        if now - self._last_check > self.timeout_s / 2:  # this thread could not listen
            self.last_seen = dict.fromkeys(self.last_seen, now)
        self._last_check = now
        for peer, seen in sorted(self.last_seen.items()):
            silent = now - seen
            if peer not in self.departed and silent > self.timeout_s \
                    and silent > self.allowed_silence(peer, now):
                return peer, silent
        return None

    # -- thread ---------------------------------------------------------------------------
    def start(self) -> "ReplicaHeartbeat":
        now = self.clock()
        self.last_seen = dict.fromkeys(self.last_seen, now)
        self._last_check = now
        self._thread = threading.Thread(target=self._run, name="recover-hsdp-replica-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def stand_down(self, say_goodbye: bool = True) -> None:
        """Stop watching and beating (this rank leaves normally); the peers are told (three
        goodbyes: UDP may drop one). ``say_goodbye=False``: fall silent (tests: a frozen peer)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period_s + 1.0)
        if say_goodbye:
            for _ in range(3):
                self._send(_BYE)
        self.sock.close()

    def _send(self, kind: int | None = None) -> None:
        data = self.message(kind)
        for peer, address in self.peers.items():
            if peer in self.departed:
                continue
            try:
                self.sock.sendto(data, address)
            except OSError:
                pass  # unreachable now: silence decides

    def _run(self) -> None:
        next_beat = self.clock()
        while not self._stop.is_set():
            now = self.clock()
            if now >= next_beat:
                self._send()
                next_beat = now + self.period_s
            try:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, next_beat - now))
                while ready:
                    self.received(self.sock.recv(64), self.clock())
                    ready, _, _ = select.select([self.sock], [], [], 0)
            except (OSError, ValueError):
                if self._stop.is_set():
                    return  # closed while standing down
                raise
            if self._stop.is_set():
                return
            found = self.overdue(self.clock())
            if found is not None:
                self.lost = found[0]
                self._stop.set()
                self.on_lost(*found)
                return


def open_socket(address: str) -> socket.socket:
    """A UDP socket on ``address`` (the rank's address in [Note: rendezvous address]), any port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, 0))
    return sock
