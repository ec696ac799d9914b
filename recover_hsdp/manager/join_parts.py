"""What a rejoin is made of besides its protocol ([Note: rejoin at a boundary] in rejoin.py): the
trainer's part (``JoinWork``), the collectives layer's primitives (``CollectiveJoins``; the
in-process tests pass tests/fake_join.py's), a started join as every survivor knows it
(``StartedJoin``), the operator's requests and the bound on attempts.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

JOIN_DIR = "join"


class JoinWork(Protocol):
    """What the trainer provides for a join (one rank)."""

    def join_meta(self) -> dict[str, Any]:
        """Picklable replica state besides tensors (step, schedulers, tokens seen, ...)."""

    def load_join_meta(self, meta: dict[str, Any]) -> None: ...

    def join_tensors(self) -> list[np.ndarray]:
        """This rank's state tensors (parameters, then optimizer state) as writable numpy
        views, in an order that is the same on every replica."""

    def spawn_command(self, replicas: list[int]) -> tuple[str, list[str]]:
        """The program and arguments that start one replacement rank of ``replicas``."""


def join_requests(out_dir: Path) -> list[Path]:
    """Pending operator requests (``recover-hsdp join``), oldest first."""
    folder = out_dir / JOIN_DIR / "requests"
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


JOIN_ATTEMPTS = 3
"""How many boundaries may try to complete one started join ([Note: rejoin at a boundary])."""


@dataclasses.dataclass
class StartedJoin:
    """A join whose newcomers were started, as every survivor knows it (agreed facts only)."""

    replicas: tuple[int, ...]
    spawner: int                  # the spawner's original world rank
    step_started: int
    pending: Any = None           # the spawner's PendingJoin (None on the other survivors)
    failed_here: bool = False     # the spawner: the spawn failed or the newcomers are lost
    attempts: int = 0
    requests: list[Path] = dataclasses.field(default_factory=list)
    record: dict[str, Any] = dataclasses.field(default_factory=dict)


class CollectiveJoins:
    """The join primitives of the collectives layer ([Note: rejoin] in collectives/join.py);
    in-process tests pass the fake world's instead."""

    @staticmethod
    def spawn(world, command: str, args: list[str], replicas: tuple[int, ...], host=None):
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
    def offer(*args, **kwargs):
        from recover_hsdp.collectives.join import JoinOffer

        return JoinOffer(*args, **kwargs)

    @staticmethod
    def exit_newcomer() -> None:
        """An aborted join ends the newcomer (exit 0: mpirun must not end the job for it)."""
        os._exit(0)
