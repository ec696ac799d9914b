"""In-process fake of the rejoin primitives ([Note: rejoin] in recover_hsdp/collectives/join.py)
over a ``FakeHub`` (tests/fakes.py): ``FakeJoins`` is what ``Rejoin``
(recover_hsdp/manager/rejoin.py) takes as ``joins`` in place of ``CollectiveJoins``.

Faked, with the contract of the real primitives:
  spawn          collective over the survivors' global communicator (it fails like the world's
                 collectives); starts S rank threads per replica (``FakeHub.start_rank``), each
                 running the test's newcomer function on a newcomer ``FakeWorld``;
  PendingJoin    ``test()`` is ready once every newcomer reached ``parent_channel``, failed once
                 one died; ``merge()`` meets the newcomers waiting in ``parent_channel``;
                 ``abort()`` ends their wait (they get None);
  JoinChannel    the offer's broadcast and the rank table (``exchange``), point-to-point
                 ``send`` / ``recv`` (pickled) and ``send_bytes`` / ``recv_bytes`` (copied), the
                 fault-tolerant ``agree``, ``abort``, ``merged.Get_rank()``;
  grow           the agreement inside ``FakeWorld.grow``: once every live member said yes, the
                 hub takes the grown layout and epoch + 1.
A member killed (``FakeHub.kill`` from its own thread, e.g. a ``phase=join`` fault) or an abort
revokes the join: from then on every channel call of every member returns False / None and
members blocked in one wake up; the agreement is uniform over the members still alive and False
once one died (ULFM's ``Agree`` after an unacknowledged failure). A newcomer whose join is
aborted ends with ``fakes.Retired`` (``exit_newcomer``; the real one exits 0).

Deterministic like the rest of the fake: a survivor's ``test()`` waits (bounded) until every
newcomer reached ``parent_channel`` or died and says "ready" from its ``start_steps`` + 1-th
call on, so a join completes at the same step boundary whatever the threads' timing; a send
waits for its receive.

Not faked: the spawned command line (recorded in ``spawned``, never run), hosts, chunking,
deadlines (the hub's bounded waits stand for them), a spawn or merge that fails with every
member alive.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from fakes import FakeHub, FakeWorld, Retired
from recover_hsdp.collectives.membership import JoinOffer, ReplicaLayout


class FakeJoins:
    """The four join primitives of ``CollectiveJoins`` over ``hub``; one object for every rank.

    Args:
        hub: the fake world.
        newcomer: run on each spawned rank's thread with its newcomer ``FakeWorld`` (build a
            manager with ``joins=`` this object, ``join_as_newcomer``, then the steps).
        start_steps: how many of a survivor's ``test()`` calls see the newcomers still
            starting (the survivors train meanwhile).

    Attributes:
        spawned: (command, args, replicas) of every spawn.
        exited: (replica, shard) of every newcomer that ended through ``exit_newcomer``.
    """

    def __init__(self, hub: FakeHub, newcomer: Callable[[FakeWorld], Any], start_steps: int = 1):
        self.hub, self.newcomer, self.start_steps = hub, newcomer, start_steps
        self.spawned: list[tuple[str, list[str], tuple[int, ...]]] = []
        self.exited: list[tuple[int, int]] = []
        self._join_of: dict[FakeWorld, _Join] = {}  # newcomer world -> its join
        self._world_of: dict[threading.Thread, FakeWorld] = {}  # newcomer thread -> its world

    def spawn(self, world: FakeWorld, command: str, args: list[str], replicas: tuple[int, ...],
              host: str | None = None) -> FakePendingJoin | None:
        """Survivors, collective: start the newcomers of ``replicas``. None when the world's
        epoch failed (then, as the real one, the epoch is failed)."""
        assert world.hub is self.hub, "spawn on a world of another hub"
        layout = world.layout

        def launch(values: list) -> _Join:  # by the last survivor to arrive, the lock held
            return self._launch(layout, command, list(args), tuple(replicas))

        join = world._collective("spawn", "global", layout.alive_ranks(), None, launch)
        if join is None:
            world.fail_epoch("spawn failed")
            return None
        return FakePendingJoin(join, world)

    def parent_channel(self, world: FakeWorld) -> FakeChannel | None:
        """Newcomers, once built: ready, then wait for the survivors' merge. None when the
        survivors gave the join up."""
        join = self._join_of.get(world)
        if join is None:
            raise RuntimeError("this world was not spawned by a join")
        return join.merge(world)

    @staticmethod
    def offer(*args, **kwargs) -> JoinOffer:
        return JoinOffer(*args, **kwargs)

    def exit_newcomer(self) -> None:
        """An aborted join ends the newcomer (the real one: exit 0)."""
        world = self._world_of[threading.current_thread()]
        with self.hub._cond:
            self.exited.append((world.replica, world.shard))
        raise Retired(f"newcomer replica {world.replica} shard {world.shard}: join aborted")

    def _launch(self, layout: ReplicaLayout, command: str, args: list[str],
                replicas: tuple[int, ...]) -> _Join:
        hub, s = self.hub, layout.ranks_per_replica
        survivors = [hub.world(layout.replica_of(w), layout.shard_of(w))
                     for w in layout.alive_ranks()]
        newcomers = [FakeWorld(hub, r, k, newcomer=True) for r in replicas for k in range(s)]
        join = _Join(hub, len(self.spawned), replicas, survivors, newcomers, self.start_steps)
        self.spawned.append((command, args, replicas))
        for world in newcomers:
            self._join_of[world] = join
            hub.start_rank(world, self.newcomer)
            self._world_of[hub._threads[(world.replica, world.shard)]] = world
        return join


class _Join:
    """One join's shared state; its methods run with the hub's condition held (``merge`` takes
    it itself).

    Merged ranks: the survivors in world-rank order, then the newcomers in spawn order
    (replica by replica), as ``Merge(high=...)`` orders them in the real one."""

    def __init__(self, hub: FakeHub, number: int, replicas: tuple[int, ...],
                 survivors: list[FakeWorld], newcomers: list[FakeWorld], start_steps: int):
        self.hub, self.number, self.replicas = hub, number, replicas
        self.members = survivors + newcomers
        self.newcomers = newcomers
        self.start_steps = start_steps
        self.started = time.monotonic()
        self.ready: set[int] = set()       # merged ranks of newcomers in parent_channel
        self.revoked: str | None = None
        self._agreements: Counter[int] = Counter()  # merged rank -> agreements it entered

    def index_of(self, world: FakeWorld) -> int:
        return next(i for i, w in enumerate(self.members) if w is world)

    def dead(self, world: FakeWorld) -> bool:
        key = (world.replica, world.shard)
        hub = self.hub
        return hub._worlds.get(key) is not world or key in hub.killed or key in hub.retired

    def broken(self) -> bool:
        return self.revoked is not None or any(self.dead(w) for w in self.members)

    def revoke(self, reason: str) -> None:
        if self.revoked is None:
            self.revoked = reason
        self.hub._cond.notify_all()

    def settled(self) -> bool:
        """Every newcomer reached parent_channel or died (or the join was given up)."""
        first = len(self.members) - len(self.newcomers)
        return self.revoked is not None or all(
            first + i in self.ready or self.dead(w) for i, w in enumerate(self.newcomers))

    def merge(self, world: FakeWorld) -> FakeChannel | None:
        index = self.index_of(world)
        with self.hub._cond:
            if index >= len(self.members) - len(self.newcomers):
                self.ready.add(index)
                self.hub._cond.notify_all()
            box = self.meet(index, "merge", ("merge",), None, range(len(self.members)))
            if box is None:
                self.revoke(f"merge failed on merged rank {index}")
                return None
        return FakeChannel(self, index, world)

    def meet(self, index: int, kind: str, slot: tuple, value: Any, members) -> list | None:
        """One rendezvous of merged ranks ``members``: their values in order, or None when the
        join is revoked or a member died (before it completed)."""
        hub, members = self.hub, tuple(members)
        name = f"join {self.number}: {kind} {slot[1:]} of merged ranks {members}"
        if self.broken():
            return None
        rv = hub._table(("join", self.number) + slot, kind, name)
        rv.values[index] = value
        if not rv.done and set(rv.values) >= set(members):
            rv.result, rv.done = [rv.values[m] for m in members], True
            hub._cond.notify_all()
        hub._wait(name, lambda: rv.done or self.broken())
        return rv.result if rv.done else None

    def agree(self, index: int, flag: bool, kind: str = "agree",
              on_yes: Callable[[], None] | None = None) -> bool:
        """Uniform over the live members: all said yes and none died. ``on_yes`` runs once,
        by the member that decides yes."""
        hub = self.hub
        n = self._agreements[index]
        self._agreements[index] += 1
        name = f"join {self.number}: {kind} #{n}"
        rv = hub._table(("join", self.number, "agree", n), kind, name)
        rv.values[index] = flag

        def decided() -> bool:
            live = {i for i, w in enumerate(self.members) if not self.dead(w)}
            if not rv.done and set(rv.values) >= live:
                rv.result = all(rv.values[i] for i in live) and not self.broken()
                rv.done = True
                if rv.result and on_yes is not None:
                    on_yes()
                hub._cond.notify_all()
            return rv.done

        hub._wait(name, decided)
        return rv.result


class FakePendingJoin:
    """A survivor's ``PendingJoin``: ``test``, ``merge``, ``abort``, ``started``, ``ready_at``,
    ``replicas``."""

    def __init__(self, join: _Join, world: FakeWorld):
        self.join, self.world = join, world
        self.replicas = join.replicas
        self.started = join.started
        self.ready_at: float | None = None
        self._tests = 0

    def test(self) -> tuple[bool, bool]:
        join, hub = self.join, self.join.hub
        with hub._cond:
            hub._wait(f"join {join.number}: test (newcomers starting)", join.settled)
            self._tests += 1
            failed = join.broken()
            ready = not failed and self._tests > join.start_steps
        if ready and self.ready_at is None:
            self.ready_at = time.monotonic()
        return ready, failed

    def merge(self) -> FakeChannel | None:
        return self.join.merge(self.world)

    def abort(self) -> None:
        with self.join.hub._cond:
            self.join.revoke("the survivors gave the join up")


class _Merged:
    """The merged communicator as the callers see it."""

    def __init__(self, join: _Join, index: int):
        self._join, self._index = join, index

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self._index

    def Get_size(self) -> int:  # noqa: N802
        return len(self._join.members)

    def agree_grow(self, layout: ReplicaLayout, epoch: int) -> bool:
        """``FakeWorld.grow``'s agreement: yes moves the hub to ``layout`` at ``epoch``."""
        join = self._join
        hub = join.hub

        def grown() -> None:
            hub.layout, hub.epoch = layout, epoch

        with hub._cond:
            return join.agree(self._index, True, "grow", grown)


class FakeChannel:
    """One member's ``JoinChannel``."""

    def __init__(self, join: _Join, index: int, world: FakeWorld):
        self.join, self.world = join, world
        self.merged = _Merged(join, index)
        self.ranks: list[int] = []
        self.processes: list[Any] = []
        self.ok = True
        self._sent: Counter[int] = Counter()
        self._received: Counter[int] = Counter()

    @property
    def _index(self) -> int:
        return self.merged.Get_rank()

    def exchange(self, offer: JoinOffer | None, world_rank: int | None, process: Any
                 ) -> JoinOffer | None:
        everyone = range(len(self.join.members))
        box = self._meet("bcast(offer)", ("bcast",), offer if self._index == 0 else None,
                         everyone)
        if box is None:
            return None
        offer = pickle.loads(pickle.dumps(box[0]))
        if world_rank is None:  # as the real one: from the offer and the merged rank
            s = offer.ranks_per_replica
            index = self._index - len(offer.alive_replicas) * s
            world_rank = offer.new_replicas[index // s] * s + index % s
        table = self._meet("allgather(ranks)", ("allgather",), (world_rank, process), everyone)
        if table is None:
            return None
        self.ranks = [r for r, _ in table]
        self.processes = [p for _, p in table]
        return offer

    def merged_rank_of(self, world_rank: int) -> int:
        return self.ranks.index(world_rank)

    def send(self, obj: Any, to_world_rank: int) -> bool:
        data = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
        return self.send_bytes(data, to_world_rank)

    def recv(self, from_world_rank: int) -> Any:
        data = self.recv_bytes(from_world_rank)
        return None if data is None else pickle.loads(data.tobytes())

    def send_bytes(self, data: np.ndarray, to_world_rank: int) -> bool:
        dest = self.merged_rank_of(to_world_rank)
        n = self._sent[dest]
        self._sent[dest] += 1
        return self._meet("send", ("p2p", self._index, dest, n), data.copy(),
                          (self._index, dest)) is not None

    def recv_bytes(self, from_world_rank: int, out: np.ndarray | None = None
                   ) -> np.ndarray | None:
        source = self.merged_rank_of(from_world_rank)
        n = self._received[source]
        self._received[source] += 1
        box = self._meet("send", ("p2p", source, self._index, n), None, (source, self._index))
        if box is None:
            return None
        data = box[0]
        if out is not None and out.size == data.size:
            out[...] = data
            return out
        return data

    def agree(self, ok: bool) -> bool:
        with self.join.hub._cond:
            return self.join.agree(self._index, ok and self.ok)

    def abort(self) -> None:
        with self.join.hub._cond:
            self.join.revoke(f"merged rank {self._index} aborted the join")

    def _meet(self, kind: str, slot: tuple, value: Any, members) -> list | None:
        with self.join.hub._cond:
            box = self.join.meet(self._index, kind, slot, value, members)
        if box is None:
            self.ok = False
        return box
