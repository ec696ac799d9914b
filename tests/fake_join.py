"""In-process fake of the rejoin primitives ([Note: rejoin] in recover_hsdp/collectives/join.py)
over a ``FakeHub`` (tests/fakes.py): ``FakeJoins`` is what ``Rejoin``
(recover_hsdp/manager/rejoin.py) takes as ``joins`` in place of ``CollectiveJoins``: the
``Joins`` protocol of recover_hsdp/manager/joins.py (tests/manager/test_join_interface.py checks the
method names and signatures).

Faked, with the contract of the real primitives:
  spawn          the spawner alone starts S rank threads per replica (``FakeHub.start_rank``),
                 each running the test's newcomer function on a newcomer ``FakeWorld``;
  PendingJoin    the spawner's: ``test()`` is ready once every newcomer reached ``parent_link``,
                 failed once one died; ``offer_port()`` opens the next attempt (False once a
                 newcomer died); ``check()`` the link's agreement after a failed attempt;
                 ``abort()`` ends the newcomers' wait (they get None);
  agree          the survivors' agreement on the world as it is (false in a revoked epoch);
  accept         collective over the survivors' world: the attempt's channel of (survivors of
                 now + newcomers), which the newcomers' ``next_channel`` meets;
  JoinChannel    the offer's broadcast and the rank table (``exchange``), point-to-point
                 ``send`` / ``recv`` (pickled) and ``send_bytes`` / ``recv_bytes`` (copied), the
                 fault-tolerant ``agree``, ``abort``, ``merged.Get_rank()``;
  grow           the agreement inside ``FakeWorld.grow``: once every live member said yes, the
                 hub takes the grown layout and epoch + 1.
The link (spawner + newcomers) breaks when one of them dies; an attempt's channel when one of
its members dies or it is aborted: from then on every call of every member returns False /
None and members blocked in one wake up; an agreement is uniform over the members still alive
and False once one died (ULFM's ``Agree`` after an unacknowledged failure). A survivor's death
that is not the spawner's leaves the link intact: the join is kept. A newcomer whose join is
given up ends with ``fakes.Retired`` (``exit_newcomer``; the real one exits 0).

Deterministic like the rest of the fake: the spawner's ``test()`` waits (bounded) until every
newcomer reached ``parent_link`` or died and says "ready" from its ``start_steps`` + 1-th call
on, so a join completes at the same step boundary whatever the threads' timing; a send waits
for its receive.

Not faked: the spawned command line (recorded in ``spawned``, never run), hosts, ports,
chunking, deadlines (the hub's bounded waits stand for them; a newcomer connecting to a port
nobody accepts any more is told to exit instead of waiting for its ``Connect`` deadline), a
spawn, accept or merge that fails with every member alive.
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
    """``Joins`` (the join's collective operations) over ``hub``; one object for every rank.

    Args:
        hub: the fake world.
        newcomer: run on each spawned rank's thread with its newcomer ``FakeWorld`` (build a
            manager with ``joins=`` this object, ``join_as_newcomer``, then the steps).
        start_steps: how many of the spawner's ``test()`` calls see the newcomers still
            starting (the survivors train meanwhile).

    Attributes:
        spawned: (command, args, replicas, spawner's world rank) of every spawn.
        exited: (replica, shard) of every newcomer that ended through ``exit_newcomer``.
    """

    def __init__(self, hub: FakeHub, newcomer: Callable[[FakeWorld], Any], start_steps: int = 1):
        self.hub, self.newcomer, self.start_steps = hub, newcomer, start_steps
        self.spawned: list[tuple[str, list[str], tuple[int, ...], int]] = []
        self.exited: list[tuple[int, int]] = []
        self._join_of: dict[FakeWorld, _Join] = {}  # newcomer world -> its join
        self._world_of: dict[threading.Thread, FakeWorld] = {}  # newcomer thread -> its world

    def spawn(self, world: FakeWorld, command: str, args: list[str], replicas: tuple[int, ...],
              host: str | None = None) -> FakePendingJoin:
        """The spawner alone: start the newcomers of ``replicas``."""
        assert world.hub is self.hub, "spawn on a world of another hub"
        with self.hub._cond:
            join = self._launch(world, command, list(args), tuple(replicas))
        return FakePendingJoin(join, world)

    @staticmethod
    def agree(world: FakeWorld, flag: bool) -> bool:
        """Survivors: the AND of ``flag`` over the world as it is (False in a failed epoch)."""
        return bool(world._agree("join-go", bool(flag) and not world.epoch_failed))

    @staticmethod
    def accept(world: FakeWorld, pending: FakePendingJoin | None, spawner: int
               ) -> FakeChannel | None:
        """Survivors, collective: the current attempt's channel (survivors first)."""
        hub = world.hub
        joins_of = [j for j in _Join.live(hub) if j.spawner.world_rank == spawner]
        assert len(joins_of) == 1, f"accept: no join of spawner {spawner}"
        join = joins_of[0]
        layout = world.layout

        def open_attempt(values: list) -> _Attempt | None:  # the last survivor, lock held
            attempt = join.outstanding
            assert attempt is not None, "accept without a port sent"
            survivors = [hub.world(layout.replica_of(w), layout.shard_of(w))
                         for w in layout.alive_ranks()]
            attempt.members = survivors + join.newcomers
            join.outstanding = None
            hub._cond.notify_all()
            if join.link_broken():  # a newcomer died: the live ones fail this attempt too
                attempt.revoke("a newcomer died before the accept")
                return None
            return attempt

        attempt = world._collective("accept", "global", layout.alive_ranks(), None, open_attempt)
        if attempt is None:
            return None
        return FakeChannel(attempt, attempt.index_of(world), world)

    def parent_link(self, world: FakeWorld) -> FakeLink | None:
        """Newcomers, once built: ready; their link to the spawner."""
        join = self._join_of.get(world)
        if join is None:
            raise RuntimeError("this world was not spawned by a join")
        with self.hub._cond:
            join.ready.add(join.newcomers.index(world))
            self.hub._cond.notify_all()
            if join.given_up or join.link_broken():
                return None
        return FakeLink(join, world)

    @staticmethod
    def offer(epoch: int, alive_replicas: tuple[int, ...], new_replicas: tuple[int, ...],
              ranks_per_replica: int, num_replicas: int, donor: int, payload: dict[str, Any]
              ) -> JoinOffer:
        return JoinOffer(epoch, alive_replicas, new_replicas, ranks_per_replica, num_replicas,
                         donor, payload)

    def exit_newcomer(self) -> None:
        """A given-up join ends the newcomer (the real one: exit 0)."""
        world = self._world_of[threading.current_thread()]
        with self.hub._cond:
            self.exited.append((world.replica, world.shard))
        raise Retired(f"newcomer replica {world.replica} shard {world.shard}: join aborted")

    def _launch(self, spawner: FakeWorld, command: str, args: list[str],
                replicas: tuple[int, ...]) -> _Join:
        hub, s = self.hub, spawner.layout.ranks_per_replica
        newcomers = [FakeWorld(hub, r, k, newcomer=True) for r in replicas for k in range(s)]
        join = _Join(hub, len(self.spawned), replicas, spawner, newcomers, self.start_steps)
        self.spawned.append((command, args, replicas, spawner.world_rank))
        for world in newcomers:
            self._join_of[world] = join
            hub.start_rank(world, self.newcomer)
            self._world_of[hub._threads[(world.replica, world.shard)]] = world
        return join


def _dead(hub: FakeHub, world: FakeWorld) -> bool:
    key = (world.replica, world.shard)
    return hub._worlds.get(key) is not world or key in hub.killed or key in hub.retired


class _Session:
    """Rendezvous and agreements of a fixed list of members (the link, or one attempt's
    channel); its methods run with the hub's condition held."""

    def __init__(self, hub: FakeHub, name: str, members: list[FakeWorld]):
        self.hub, self.name, self.members = hub, name, members
        self.revoked: str | None = None
        self._agreements: Counter[int] = Counter()  # member index -> agreements it entered

    def index_of(self, world: FakeWorld) -> int:
        return next(i for i, w in enumerate(self.members) if w is world)

    def broken(self) -> bool:
        return self.revoked is not None or any(_dead(self.hub, w) for w in self.members)

    def revoke(self, reason: str) -> None:
        if self.revoked is None:
            self.revoked = reason
        self.hub._cond.notify_all()

    def meet(self, index: int, kind: str, slot: tuple, value: Any, members) -> list | None:
        """One rendezvous of member indices ``members``: their values in order, or None when
        the session is revoked or a member died (before it completed)."""
        hub, members = self.hub, tuple(members)
        name = f"{self.name}: {kind} {slot[1:]} of members {members}"
        if self.broken():
            return None
        rv = hub._table((self.name,) + slot, kind, name)
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
        name = f"{self.name}: {kind} #{n}"
        rv = hub._table((self.name, "agree", n), kind, name)
        rv.values[index] = flag

        def decided() -> bool:
            live = {i for i, w in enumerate(self.members) if not _dead(hub, w)}
            if not rv.done and set(rv.values) >= live:
                rv.result = all(rv.values[i] for i in live) and not self.broken()
                rv.done = True
                if rv.result and on_yes is not None:
                    on_yes()
                hub._cond.notify_all()
            return rv.done

        hub._wait(name, decided)
        return rv.result


class _Attempt(_Session):
    """One attempt's channel: ``members`` (survivors of the accept + newcomers) are set when
    the survivors accept; before that the newcomers wait for it."""

    def __init__(self, hub: FakeHub, join: _Join, number: int):
        super().__init__(hub, f"join {join.number} attempt {number}", [])
        self.join = join


class _Join:
    """One started join's shared state (the link is spawner + newcomers)."""

    _all: list[_Join] = []

    def __init__(self, hub: FakeHub, number: int, replicas: tuple[int, ...], spawner: FakeWorld,
                 newcomers: list[FakeWorld], start_steps: int):
        self.hub, self.number, self.replicas = hub, number, replicas
        self.spawner, self.newcomers = spawner, newcomers
        self.link = _Session(hub, f"join {number} link", [spawner] + newcomers)
        self.start_steps = start_steps
        self.started = time.monotonic()
        self.ready: set[int] = set()       # newcomer indices in parent_link
        self.given_up = False
        self.attempts: list[_Attempt] = []
        self.outstanding: _Attempt | None = None  # a port sent, not accepted yet
        _Join._all.append(self)

    @classmethod
    def live(cls, hub: FakeHub) -> list[_Join]:
        return [j for j in cls._all if j.hub is hub and not j.given_up]

    def link_broken(self) -> bool:
        return self.link.broken()

    def settled(self) -> bool:
        """Every newcomer reached parent_link or died (or the join was given up)."""
        return self.given_up or all(i in self.ready or _dead(self.hub, w)
                                    for i, w in enumerate(self.newcomers))


class FakePendingJoin:
    """The spawner's ``PendingJoin``: ``test``, ``offer_port``, ``accepted``, ``check``,
    ``abort``, ``close``, ``started``, ``ready_at``, ``replicas``."""

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
            failed = any(_dead(hub, w) for w in join.newcomers)
            ready = not failed and self._tests > join.start_steps
        if ready and self.ready_at is None:
            self.ready_at = time.monotonic()
        return ready, failed

    def offer_port(self) -> bool:
        join, hub = self.join, self.join.hub
        with hub._cond:
            if join.link_broken():
                return False
            if join.outstanding is None:
                join.outstanding = _Attempt(hub, join, len(join.attempts))
                join.attempts.append(join.outstanding)
                hub._cond.notify_all()
            return True

    def accepted(self) -> None:
        pass  # the fake accept consumes the outstanding attempt itself

    def check(self) -> bool:
        join = self.join
        with join.hub._cond:
            return join.link.agree(0, True, "check")

    def abort(self, tell: bool = True) -> None:
        with self.join.hub._cond:
            self.join.given_up = True
            self.join.link.revoke("the survivors gave the join up")

    def close(self) -> None:
        with self.join.hub._cond:
            self.join.given_up = True


class FakeLink:
    """A newcomer's ``ParentLink``: ``next_channel``, ``check``."""

    def __init__(self, join: _Join, world: FakeWorld):
        self.join, self.world = join, world
        self._seen = 0  # attempts this newcomer took part in

    def next_channel(self) -> FakeChannel | None:
        join, hub = self.join, self.join.hub
        with hub._cond:
            def opened() -> bool:
                return join.given_up or _dead(hub, join.spawner) or (
                    len(join.attempts) > self._seen and bool(join.attempts[self._seen].members))
            hub._wait(f"join {join.number}: newcomer waits for attempt {self._seen}", opened)
            if join.given_up or _dead(hub, join.spawner):
                return None
            attempt = join.attempts[self._seen]
            self._seen += 1
            return FakeChannel(attempt, attempt.index_of(self.world), self.world)

    def check(self) -> bool:
        join = self.join
        with join.hub._cond:
            return join.link.agree(join.link.index_of(self.world), True, "check")


class _Merged:
    """The merged communicator as the callers see it."""

    def __init__(self, attempt: _Attempt, index: int):
        self._attempt, self._index = attempt, index

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self._index

    def Get_size(self) -> int:  # noqa: N802
        return len(self._attempt.members)

    def agree_grow(self, layout: ReplicaLayout, epoch: int) -> bool:
        """``FakeWorld.grow``'s agreement: yes moves the hub to ``layout`` at ``epoch``."""
        attempt = self._attempt
        hub = attempt.hub

        def grown() -> None:
            hub.layout, hub.epoch = layout, epoch
            attempt.join.given_up = True  # the join is over

        with hub._cond:
            return attempt.agree(self._index, True, "grow", grown)


class FakeChannel:
    """One member's ``JoinChannel`` of one attempt."""

    def __init__(self, attempt: _Attempt, index: int, world: FakeWorld):
        self.attempt, self.world = attempt, world
        self.merged = _Merged(attempt, index)
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
        everyone = range(len(self.attempt.members))
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
        with self.attempt.hub._cond:
            return self.attempt.agree(self._index, ok and self.ok)

    def abort(self) -> None:
        with self.attempt.hub._cond:
            self.attempt.revoke(f"merged rank {self._index} aborted the join")

    def _meet(self, kind: str, slot: tuple, value: Any, members) -> list | None:
        with self.attempt.hub._cond:
            box = self.attempt.meet(self._index, kind, slot, value, members)
        if box is None:
            self.ok = False
        return box
