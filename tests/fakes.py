"""In-process fake of ``recover_hsdp.collectives.FaultTolerantWorld``: R replicas x S ranks, one
thread per rank, for fast tests of the layers above it (``BucketSync``, the step protocol).

Faked: the world's duck interface and its ULFM contract. A collective is matched across the ranks
of its communicator by (epoch, per-rank call number) and SUMs in replica order, so results are
bit-for-bit deterministic. Any failure (``FakeHub.kill``, any rank's ``fail_epoch`` or
``consensus(False)``) revokes the epoch: from then on every collective of that epoch returns
False on every rank, ranks blocked in one wake up and return False, and a failed ``allreduce``
poisons its buffer with NaN ("garbage", as the real contract says). ``consensus`` is uniform over
the ranks of alive replicas that were not killed; a replica that lost any rank is dead as a unit
(its other ranks get ``retire=True``). The layout is a real ``ReplicaLayout`` and the outcome a
real ``ConsensusResult``.

A rejoin (tests/fake_join.py) adds ranks to a running world: ``FakeHub.start_rank`` starts a new
life of a (replica, shard) on its own thread, a newcomer ``FakeWorld`` has no replicas alive and
epoch -1 (its death revokes nothing of the world's) until ``adopt`` / ``grow``.

Not faked: MPI, processes, chunked reduces, deadlines (``FakeWorld.deadlines`` only holds the
hub's timeout for the callers that read it), the hang watchdog, repair rounds (a repair
is one round), and timing hazards: an outcome depends only on which rank called what, never on
thread scheduling. Every wait is bounded (``timeout``): a protocol bug (a rank skipping a
collective, two ranks calling different ones) fails the test with an AssertionError naming the
rendezvous, and releases every other waiting rank, instead of hanging it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from recover_hsdp.collectives.guard import Deadlines
from recover_hsdp.collectives.membership import ConsensusResult, ReplicaLayout


class Killed(BaseException):
    """Unwinds a rank's thread after ``FakeHub.kill`` (a SIGKILL in the real job)."""


class Retired(BaseException):
    """Unwinds a rank's thread after ``FakeWorld.retire`` (``os._exit(0)`` in the real job)."""


class HubBroken(AssertionError):
    """A rank was released because another rank hit a protocol bug or ended unexpectedly."""


@dataclasses.dataclass
class _Rendezvous:
    kind: str
    values: dict[int, Any] = dataclasses.field(default_factory=dict)
    done: bool = False
    result: Any = None


class FakeHub:
    """Shared state of the fake world, guarded by one condition variable.

    Attributes:
        layout: The current ``ReplicaLayout`` (alive replicas shrink at each non-clean consensus).
        epoch: The current world epoch.
        revoked: Epochs in which a failure happened.
        killed / retired: (replica, shard) of ranks that were killed / that retired (in their
            current life: ``start_rank`` starts a new one; the old kill stays in ``failures``).
        failures: (world rank, epoch, reason) of every failure, in order.
        calls: How many times each world method was called, over all ranks.
    """

    def __init__(self, replicas: int, ranks_per_replica: int = 1, timeout: float = 20.0):
        self.layout = ReplicaLayout(ranks_per_replica, replicas, tuple(range(replicas)))
        self.epoch = 0
        self.revoked: set[int] = set()
        self.killed: set[tuple[int, int]] = set()
        self.retired: set[tuple[int, int]] = set()
        self.failures: list[tuple[int, int, str]] = []
        self.calls: Counter[str] = Counter()
        self.timeout = timeout
        self._cond = threading.Condition()
        self._tables: dict[tuple, _Rendezvous] = {}
        self._broken: str | None = None
        self._waiting: Counter[str] = Counter()  # rendezvous name -> ranks blocked in it now
        self._threads: dict[tuple[int, int], threading.Thread] = {}  # (replica, shard) -> its
        # current life's thread
        self._lives: Counter[tuple[int, int]] = Counter()  # lives started by start_rank
        self._all_threads: dict[tuple, threading.Thread] = {}  # result key -> thread
        self._results: dict[tuple, Any] = {}
        self._worlds = {(r, s): FakeWorld(self, r, s)
                        for r in range(replicas) for s in range(ranks_per_replica)}

    def world(self, replica: int, shard: int = 0) -> FakeWorld:
        return self._worlds[(replica, shard)]

    def kill(self, replica: int, shard: int = 0) -> None:
        """Kill a rank from its own thread: revoke the epoch, then raise ``Killed``."""
        key = (replica, shard)
        with self._cond:
            thread = self._threads.get(key)
            if thread is not None and thread is not threading.current_thread():
                raise AssertionError(f"kill{key} must be called from that rank's own thread")
            self.killed.add(key)
            world = self._worlds[key]
            self._revoke(world, f"replica {replica} shard {shard} killed")
        raise Killed(f"replica {replica} shard {shard} killed at epoch {world.epoch}")

    def start_rank(self, world: FakeWorld, fn: Callable[[FakeWorld], Any]) -> tuple[int, int, int]:
        """Start a new life of ``world``'s (replica, shard) running ``fn(world)`` on its own thread
        (a rejoin's newcomer, tests/fake_join.py): from now on its kills and its thread are this
        life's. Returns the key its result has in what ``run_ranks`` returns: (replica, shard,
        life), life 1, 2, ..."""
        key = (world.replica, world.shard)
        with self._cond:
            self._lives[key] += 1
            result_key = (*key, self._lives[key])
            self.killed.discard(key)
            self.retired.discard(key)
            self._worlds[key] = world
            self._threads[key] = self._thread(result_key, world, fn)
            self._threads[key].start()
        return result_key

    def await_blocked(self, name: str, count: int) -> None:
        """Wait until ``count`` ranks are blocked in rendezvous ``name`` (to kill "during" it)."""
        with self._cond:
            self._wait(f"await_blocked({name!r}, {count})", lambda: self._waiting[name] >= count,
                       counted=False)

    # -- internals (called with self._cond held) --------------------------------------------------
    def _thread(self, result_key: tuple, world: FakeWorld, fn: Callable) -> threading.Thread:
        """One rank's thread (not started): its return value or the BaseException it ended with
        goes to ``_results[result_key]``; an unexpected exception releases the other ranks."""

        def body() -> None:
            try:
                self._results[result_key] = fn(world)
            except BaseException as err:  # noqa: BLE001 - handed back to the test
                self._results[result_key] = err
                if not isinstance(err, (Killed, Retired)):
                    with self._cond:
                        self._break(f"rank {result_key} raised {err!r}")

        thread = threading.Thread(target=body, daemon=True,
                                  name="fake-rank-r{}s{}".format(*result_key[:2])
                                  + (f"-life{result_key[2]}" if len(result_key) > 2 else ""))
        self._all_threads[result_key] = thread
        return thread

    def _revoke(self, world: FakeWorld, reason: str) -> None:
        self.revoked.add(world.epoch)
        self.failures.append((world.world_rank, world.epoch, reason))
        self._cond.notify_all()

    def _break(self, message: str) -> None:
        if self._broken is None:
            self._broken = message
        self._cond.notify_all()

    def _wait(self, name: str, predicate: Callable[[], bool], counted: bool = True) -> None:
        self._waiting[name] += counted
        self._cond.notify_all()
        try:
            ok = self._cond.wait_for(lambda: self._broken is not None or predicate(), self.timeout)
        finally:
            self._waiting[name] -= counted
        if self._broken is not None:
            raise HubBroken(f"released from {name}: {self._broken}")
        if not ok:
            self._break(f"a rank waited {self.timeout}s in {name}")
            raise AssertionError(f"waited {self.timeout}s in {name}: a peer never arrived "
                                 "(a rank skipped or reordered a collective?)")

    def _table(self, key: tuple, kind: str, name: str) -> _Rendezvous:
        rv = self._tables.setdefault(key, _Rendezvous(kind))
        if rv.kind != kind:
            self._break(f"{name}: peers called {rv.kind} here")
            raise AssertionError(f"{name}: peers called {rv.kind} here (collectives out of order)")
        return rv

    def _participants(self) -> set[int]:
        """Ranks that take part in an agreement: every rank of an alive replica not killed."""
        lay = self.layout
        return {w for w in lay.alive_ranks()
                if (lay.replica_of(w), lay.shard_of(w)) not in self.killed}

    def _decide(self, values: dict[int, bool]) -> tuple:
        """Consensus outcome, computed once by the last participant to arrive."""
        if all(values.values()) and self.epoch not in self.revoked:
            return (True, self.epoch, frozenset(), self.layout.alive_replicas, time.monotonic())
        old = self.layout.alive_replicas
        dead = frozenset(r for r in old if any((r, s) in self.killed
                                               for s in range(self.layout.ranks_per_replica)))
        self.layout = dataclasses.replace(self.layout,
                                          alive_replicas=tuple(r for r in old if r not in dead))
        self.epoch += 1
        return (False, self.epoch, dead, self.layout.alive_replicas, time.monotonic())


class FakeWorld:
    """One rank's view: a ``World`` (collectives/interface.py; tests/package/test_interfaces.py checks
    the members), with ``FaultTolerantWorld``'s contract (see its docstrings)."""

    def __init__(self, hub: FakeHub, replica: int, shard: int, newcomer: bool = False):
        self.hub = hub
        self.replica, self.shard = replica, shard
        s = hub.layout.ranks_per_replica
        self.world_rank = replica * s + shard
        self.layout = ReplicaLayout(s, 0, ()) if newcomer else hub.layout  # a newcomer's: adopt
        self.deadlines = Deadlines(call_s=hub.timeout, repair_s=hub.timeout, hang_timeout_s=None)
        self.arbiter_dir: str | None = None
        self.retired = False
        self.on_phase = None  # as FaultTolerantWorld.on_phase: called with "consensus"
        self.on_failed = None  # as FaultTolerantWorld.on_failed (no frozen processes here)
        self.on_leave = None  # as FaultTolerantWorld.on_leave: called once when it leaves normally
        self.on_hung = None  # as FaultTolerantWorld.on_hung (the fake has no hang watchdog)
        self.on_blocked = None  # as FaultTolerantWorld.on_blocked (nor a waiting call)
        self.closed = False
        self.calls: Counter[str] = Counter()
        self._epoch = -1 if newcomer else 0
        self._failed_at: float | None = None
        self._seq: Counter[str] = Counter()   # per-communicator call number in this epoch
        self._agreements = 0                  # consensus / finish calls in this epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def epoch_failed(self) -> bool:
        """This rank saw a failure in the current epoch."""
        return self._failed_at is not None

    @property
    def alive_replicas(self) -> tuple[int, ...]:
        return self.layout.alive_replicas

    def shard_members(self) -> tuple[int, ...]:
        return self.layout.shard_ranks(self.shard)

    def heartbeat(self) -> None:
        with self.hub._cond:
            self._count("heartbeat")

    def step_done(self, longest_unit_s: float = 0.0) -> None:
        pass

    def peers_failed(self) -> bool:
        """As ``FaultTolerantWorld.peers_failed``: this epoch failed here or was revoked."""
        with self.hub._cond:
            self._count("peers_failed")
            self._check_usable()
            if self._failed_at is None and self._epoch in self.hub.revoked:
                self._failed_at = time.monotonic()
            return self._failed_at is not None

    def watchdog_paused(self):
        return contextlib.nullcontext()

    # -- guarded collectives ----------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray) -> bool:
        """In-place SUM over my shard communicator, in replica order; NaN-poisoned when False."""
        return self._allreduce("allreduce", f"shard{self.shard}",
                               self.layout.shard_ranks(self.shard), buf)

    def allreduce_global(self, buf: np.ndarray) -> bool:
        return self._allreduce("allreduce_global", "global", self.layout.alive_ranks(), buf)

    def allgather(self, obj: Any) -> list[Any] | None:
        return self._collective("allgather", f"shard{self.shard}",
                                self.layout.shard_ranks(self.shard), obj, list)

    def allgather_global(self, obj: Any) -> list[Any] | None:
        return self._collective("allgather_global", "global", self.layout.alive_ranks(), obj, list)

    def send_bytes(self, data: np.ndarray, to_replicas: list[int]) -> bool:
        """As ``FaultTolerantWorld.send_bytes``: a rendezvous of the two ranks per receiver
        (one kind, "bytes", for both sides: the rendezvous checks they match)."""
        for replica in to_replicas:
            dest = self.layout.ranks_of(replica)[self.shard]
            if self._collective("bytes", self._p2p(self.world_rank, dest),
                                (self.world_rank, dest), data.copy(), lambda v: v[0]) is None:
                return False
        return True

    def recv_bytes(self, from_replica: int) -> np.ndarray | None:
        source = self.layout.ranks_of(from_replica)[self.shard]
        return self._collective("bytes", self._p2p(source, self.world_rank),
                                (source, self.world_rank), None, lambda v: v[0])

    @staticmethod
    def _p2p(source: int, dest: int) -> str:
        return f"p2p{source}->{dest}"

    def barrier(self) -> bool:
        return self._collective("barrier", "global", self.layout.alive_ranks(), None,
                                lambda values: True) is not None

    def fail_epoch(self, reason: str) -> None:
        with self.hub._cond:
            self._count("fail_epoch")
            self._check_usable()
            if self._failed_at is None:
                self._failed_at = time.monotonic()
            self.hub._revoke(self, reason)

    def _allreduce(self, kind: str, comm: str, members: tuple[int, ...], buf: np.ndarray) -> bool:
        if not isinstance(buf, np.ndarray) or not (buf.flags.c_contiguous and buf.flags.writeable):
            raise TypeError(f"{kind} needs a C-contiguous writeable numpy buffer, got {type(buf)}")

        def total(values: list[np.ndarray]) -> np.ndarray:
            if any(v.shape != buf.shape or v.dtype != buf.dtype for v in values):
                raise AssertionError(f"{kind}: shapes/dtypes differ across ranks: "
                                     f"{[(v.shape, str(v.dtype)) for v in values]}")
            out = values[0].copy()
            for v in values[1:]:
                out += v
            return out

        result = self._collective(kind, comm, members, buf.copy(), total)
        if result is None:
            if buf.dtype.kind == "f":
                buf.fill(np.nan)
            return False
        buf[...] = result
        return True

    def _collective(self, kind: str, comm: str, members: tuple[int, ...], value: Any,
                    combine: Callable[[list[Any]], Any]) -> Any:
        """One rendezvous of ``members``; None when this epoch saw (or sees meanwhile) a failure."""
        hub = self.hub
        with hub._cond:
            self._count(kind)
            self._check_usable()
            if self._failed_at is not None:
                return None
            if self._epoch in hub.revoked:
                self._failed_at = time.monotonic()
                return None
            seq = self._seq[comm]
            self._seq[comm] += 1
            name = f"{kind} #{seq} on the {comm} communicator in epoch {self._epoch}"
            rv = hub._table((self._epoch, comm, seq), kind, name)
            rv.values[self.world_rank] = value
            if set(rv.values) == set(members):
                try:
                    rv.result = combine([rv.values[m] for m in members])
                except AssertionError as err:
                    hub._break(f"{name}: {err}")
                    raise
                rv.done = True
                hub._cond.notify_all()
            hub._wait(name, lambda: rv.done or self._epoch in hub.revoked)
            if rv.done:
                return rv.result
            self._failed_at = time.monotonic()
            return None

    # -- agreement --------------------------------------------------------------------------------
    def _agree(self, kind: str, flag: Any) -> Any:
        hub = self.hub
        with hub._cond:
            self._count(kind)
            self._check_usable()
            name = f"{kind} #{self._agreements} in epoch {self._epoch}"
            rv = hub._table(("agree", self._epoch, self._agreements), kind, name)
            self._agreements += 1
            rv.values[self.world_rank] = flag

            def decided() -> bool:
                if not rv.done and set(rv.values) >= hub._participants():
                    votes = {w: v for w, v in rv.values.items() if w in hub._participants()}
                    rv.result = hub._decide(votes) if kind == "consensus" else (
                        all(votes.values()) and self._epoch not in hub.revoked)
                    rv.done = True
                    hub._cond.notify_all()
                return rv.done

            hub._wait(name, decided)
            return rv.result

    def consensus(self, ok: bool) -> ConsensusResult:
        """Uniform over the ranks of alive replicas not killed; not clean: epoch + 1, shrink."""
        started = time.monotonic()
        if not ok:
            self.fail_epoch("caller reported a failed epoch")
        if self.on_phase is not None:
            self.on_phase("consensus")
        clean, epoch, dead, alive, decided = self._agree("consensus", self._failed_at is None)
        if clean:
            return ConsensusResult(True, epoch, frozenset(), alive, False)
        detect_s = decided - (self._failed_at if self._failed_at is not None else started)
        self._epoch, self.layout = epoch, dataclasses.replace(self.layout, alive_replicas=alive)
        self._failed_at, self._agreements = None, 0
        self._seq.clear()
        self.retired = self.replica in dead
        return ConsensusResult(False, epoch, dead, alive, self.retired, max(detect_s, 0.0),
                               time.monotonic() - decided, 1)

    def retire(self, message: str = "") -> None:
        if not self.retired:
            raise RuntimeError("retire() called but consensus did not ask this rank to retire")
        with self.hub._cond:
            self.hub.retired.add((self.replica, self.shard))
        self._left()
        raise Retired(f"replica {self.replica} shard {self.shard} retired at epoch "
                      f"{self._epoch}" + (f": {message}" if message else ""))

    def finish(self) -> bool:
        clean = self._agree("finish", self._failed_at is None)
        self.close()
        return clean

    def close(self) -> None:
        self.closed = True
        self._left()

    def _left(self) -> None:
        if self.on_leave is not None:
            on_leave, self.on_leave = self.on_leave, None
            on_leave()

    # -- rejoin (tests/fake_join.py) --------------------------------------------------------------
    def adopt(self, offer) -> None:
        """As ``FaultTolerantWorld.adopt``: a newcomer takes the layout and arbiter folder from
        the join offer."""
        self.layout = ReplicaLayout(offer.ranks_per_replica, offer.num_replicas,
                                    tuple(offer.alive_replicas))
        self.arbiter_dir = offer.payload.get("arbiter")

    def grow(self, merged, ranks: list[int], alive_replicas: tuple[int, ...], num_replicas: int,
             epoch: int) -> bool:
        """As ``FaultTolerantWorld.grow``: one more agreement on the join's merged communicator
        (``merged.agree_grow``, which moves the hub to the grown layout), then this rank's view:
        epoch ``epoch`` + 1, ``alive_replicas`` alive. False: nothing changed."""
        layout = ReplicaLayout(self.layout.ranks_per_replica, num_replicas,
                               tuple(sorted(alive_replicas)))
        with self.hub._cond:
            self._count("grow")
            self._check_usable()
        if not merged.agree_grow(layout, epoch + 1):
            return False
        with self.hub._cond:
            self.layout, self._epoch = layout, epoch + 1
            self._failed_at, self._agreements = None, 0
            self._seq.clear()
        return True

    def _count(self, kind: str) -> None:
        self.calls[kind] += 1
        self.hub.calls[kind] += 1

    def _check_usable(self) -> None:
        if (self.replica, self.shard) in self.hub.killed:
            raise AssertionError(f"rank {self.world_rank} was killed: its thread must not go on")
        if self.retired:
            raise RuntimeError(f"rank {self.world_rank} has retired (its replica is dead)")


def run_ranks(hub: FakeHub, fn: Callable[[FakeWorld], Any], timeout: float = 30.0) -> dict:
    """Run ``fn(world)`` on one thread per rank; {(replica, shard): return value or the
    BaseException the thread ended with}, and the same for ranks started meanwhile by
    ``FakeHub.start_rank`` under (replica, shard, life). An unexpected exception releases the
    other ranks (``HubBroken``); a thread still running after ``timeout`` fails with
    AssertionError."""
    with hub._cond:
        hub._results = {}
        hub._threads = {key: hub._thread(key, hub.world(*key), fn) for key in hub._worlds}
        first = list(hub._threads.values())
    for thread in first:
        thread.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with hub._cond:  # start_rank registers a thread before its starter can end
            running = [t for t in hub._all_threads.values() if t.is_alive()]
        if not running:
            break
        running[0].join(max(0.0, deadline - time.monotonic()))
    with hub._cond:
        stuck = sorted(key for key, thread in hub._all_threads.items() if thread.is_alive())
    if stuck:
        with hub._cond:
            hub._break(f"run_ranks timed out after {timeout}s")
        raise AssertionError(f"ranks {stuck} still running after {timeout}s")
    return dict(hub._results)


def values_of(results: dict, killed=(), retired=()) -> dict:
    """Return values of the ranks that ended normally; raise if any rank ended otherwise than
    expected (``killed`` / ``retired``: (replica, shard) keys expected to end so)."""
    expected = {**{k: Killed for k in killed}, **{k: Retired for k in retired}}
    wrong = {k: v for k, v in results.items()
             if isinstance(v, BaseException) != (k in expected)
             or (k in expected and not isinstance(v, expected[k]))}
    if wrong:
        root = sorted(wrong.items(), key=lambda kv: isinstance(kv[1], HubBroken))[0]
        raise AssertionError(f"ranks ended unexpectedly: {wrong}") from (
            root[1] if isinstance(root[1], BaseException) else None)
    return {k: v for k, v in results.items() if k not in expected}


class FakeUnit:
    """Stands in for an FSDP2 unit: records what ``BucketSync`` sets; ``sync(t)`` calls the
    installed all-reduce hook with ``t``, as FSDP does after a unit's reduce-scatter."""

    def __init__(self, name: str = "unit"):
        self.name = name
        self.hook: Callable | None = None
        self.stream = None
        self.force_sum: bool | None = None
        self.divide_factor: float | None = None
        self.synced = 0

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        self.hook, self.stream = hook, stream

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        self.force_sum = enable

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.divide_factor = factor

    def sync(self, tensor):
        assert self.hook is not None, f"{self.name}: no all-reduce hook installed"
        self.synced += 1
        self.hook(tensor)
        return tensor
