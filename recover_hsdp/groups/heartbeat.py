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

Standard library only; the logic (``received``, ``overdue``) takes the time as an argument, so
tests drive it with a fake clock.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from typing import Callable

_MAGIC = b"RHB1"
_FORMAT = "!4s8sHB"  # magic, replica token, sender's shard, kind
_BEAT, _BYE = 0, 1


class ReplicaHeartbeat:
    """Args:
        sock: a bound UDP socket of this rank (``open_socket``); closed by ``stand_down``.
        shard: this rank's shard index in the replica.
        peers: shard -> (address, port) of every other rank of the replica.
        token: 8 bytes shared by the replica's ranks (datagrams of other jobs are ignored).
        period_s, timeout_s: beat period; silence after which a peer is lost (> 2 periods).
        on_lost: ``on_lost(shard, silent_s)``, called once from the heartbeat thread.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, sock: socket.socket, shard: int, peers: dict[int, tuple[str, int]],
                 token: bytes, *, period_s: float, timeout_s: float,
                 on_lost: Callable[[int, float], None], clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 2 * period_s > 0:
            raise ValueError(f"heartbeat timeout_s={timeout_s} must exceed 2 x period_s={period_s}")
        if len(token) != 8:
            raise ValueError("the heartbeat token is 8 bytes")
        self.sock, self.shard, self.peers, self.token = sock, shard, dict(peers), token
        self.period_s, self.timeout_s, self.on_lost, self.clock = period_s, timeout_s, on_lost, clock
        now = clock()
        self.last_seen = {peer: now for peer in self.peers}
        self.departed: set[int] = set()
        self.lost: int | None = None
        self._last_check = now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- logic (no sockets, no threads) -----------------------------------------------------
    def message(self, kind: int = _BEAT) -> bytes:
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
        self.last_seen[shard] = now

    def overdue(self, now: float) -> tuple[int, float] | None:
        """(shard, silent seconds) of a watched peer silent for ``timeout_s``, else None."""
        if now - self._last_check > self.timeout_s / 2:  # this thread could not listen
            self.last_seen = dict.fromkeys(self.last_seen, now)
        self._last_check = now
        for peer, seen in sorted(self.last_seen.items()):
            if peer not in self.departed and now - seen > self.timeout_s:
                return peer, now - seen
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

    def _send(self, kind: int) -> None:
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
                self._send(_BEAT)
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
