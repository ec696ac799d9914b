"""The join's collective operations ([Note: rejoin] in collectives/join.py) as ``Rejoin``
(rejoin.py) calls them: the ``Joins`` protocol and ``CollectiveJoins``, the collectives
layer's implementation. The in-process tests pass tests/fake_join.py's ``FakeJoins``;
tests/manager/test_join_interface.py checks that both keep the protocol's method names and signatures.
"""

from __future__ import annotations

from typing import Any, Protocol


class Joins(Protocol):
    """What a rejoin needs of the collectives layer, on survivors and newcomers.

    The objects it hands out: the spawner's ``PendingJoin`` (``test``, ``offer_port``,
    ``check``, ``abort``, ``close``, ``started``, ``ready_at``), an attempt's ``JoinChannel``
    (``exchange``, ``send`` / ``recv``, ``send_bytes`` / ``recv_bytes``, ``agree``, ``abort``,
    ``merged``, ``ranks``, ``processes``) and a newcomer's ``ParentLink`` (``next_channel``,
    ``check``); see recover_hsdp/collectives/join.py.
    """

    def spawn(self, world, command: str, args: list[str], replicas: tuple[int, ...],
              host: str | None = None) -> Any:
        """The spawner alone (stage 1): start the newcomers of ``replicas``; their
        ``PendingJoin``, or None when the spawn failed."""

    def agree(self, world, flag: bool) -> bool:
        """Survivors (stage 2): the AND of ``flag`` over the world as it is."""

    def accept(self, world, pending: Any, spawner: int) -> Any:
        """Survivors, collective (stage 2): the attempt's ``JoinChannel``, or None."""

    def parent_link(self, world) -> Any:
        """Newcomers, once built: ready; their ``ParentLink`` to the spawner, or None."""

    def offer(self, epoch: int, alive_replicas: tuple[int, ...], new_replicas: tuple[int, ...],
              ranks_per_replica: int, num_replicas: int, donor: int,
              payload: dict[str, Any]) -> Any:
        """The join offer the survivors' first rank broadcasts (``JoinOffer``)."""

    def exit_newcomer(self) -> None:
        """An aborted join ends the newcomer."""


class CollectiveJoins:
    """``Joins`` over MPI: recover_hsdp.collectives.join (imported when first used)."""

    @staticmethod
    def spawn(world, command: str, args: list[str], replicas: tuple[int, ...],
              host: str | None = None):
        from recover_hsdp.collectives.join import spawn

        return spawn(world, command, args, replicas, host=host)

    @staticmethod
    def agree(world, flag: bool) -> bool:
        from recover_hsdp.collectives.join import agree

        return agree(world, flag)

    @staticmethod
    def accept(world, pending, spawner: int):
        from recover_hsdp.collectives.join import accept

        return accept(world, pending, spawner)

    @staticmethod
    def parent_link(world):
        from recover_hsdp.collectives.join import parent_link

        return parent_link(world)

    @staticmethod
    def offer(epoch: int, alive_replicas: tuple[int, ...], new_replicas: tuple[int, ...],
              ranks_per_replica: int, num_replicas: int, donor: int, payload: dict[str, Any]):
        from recover_hsdp.collectives.join import JoinOffer

        return JoinOffer(epoch, alive_replicas, new_replicas, ranks_per_replica, num_replicas,
                         donor, payload)

    @staticmethod
    def exit_newcomer() -> None:
        """An aborted join ends the newcomer by SIGKILL, not by an exit: after another spawned
        rank was killed, an exit without Finalize ends the whole job ([Note: exiting without
        Finalize] in collectives/world.py)."""
        from recover_hsdp.collectives.guard import die

        die("newcomer: join aborted, leaving ([Note: exiting without Finalize])")
