"""The split-brain arbiter: which side of a partition goes on after a repair (a file, no MPI).

[Note: split brain] A partition leaves two sides that each see the other as dead; both
would shrink and train on, and both would write the run's outputs. So after a repair
the first rank of each side claims the transition (old epoch, old alive replicas) in the
arbiter folder with an atomic create-if-absent (``os.link`` of a written file: the claim
appears whole or not at all). The side that created it goes on; a side that finds it
held by ranks it is not a part of stops (its ranks retire). A repair with one side
always wins; a later round of the same repair (a further death) finds its own side's
claim. A side holding fewer than half of the replicas alive before (or exactly half,
without the lowest one) claims ``claim_delay_s`` later, so the larger side wins the
race. Without a shared folder (``arbiter_dir`` None) every side goes on; with one that cannot
be reached, a majority side goes on and a minority side stops (so that two sides never both
go on for want of the folder). A claim's file name carries a digest of the alive replicas,
not their list (a list of 79 replicas or more passed the 255-byte limit of a file name: the
chaos simulation of issue 34 found every cut link past 632 GPUs answered "go on"); the list
itself is in the file.

Standard library only: the repair (``repair.py``) asks it on the first rank of each side and
broadcasts the answer over that side's shrunk communicator.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Collection


class SplitBrainArbiter:
    """Claims of membership transitions in a folder every rank of the job sees.

    Args:
        folder: The arbiter folder (on the job's shared file system); created on the first
            claim. ``None``: no arbiter, every side goes on.
        claim_delay_s: The head start a minority side gives a majority side (shorter than
            ``Deadlines.repair_s``: the other ranks of the side wait in a broadcast meanwhile).
        sleep: How the head start is waited (the world pauses its hang watchdog around it).
        log: Where the one line about an unreachable folder goes.
    """

    def __init__(self, folder: str | os.PathLike | None, claim_delay_s: float = 10.0, *,
                 sleep: Callable[[float], None] = time.sleep,
                 log: Callable[[str], None] | None = None) -> None:
        self.folder = None if folder is None else os.fspath(folder)
        self.claim_delay_s = claim_delay_s
        self.sleep = sleep
        self.log = log if log is not None else (lambda line: None)

    def head_start(self, side: Collection[int], old_alive: tuple[int, ...]) -> float:
        """Seconds the side holding replicas ``side`` waits before it claims: ``claim_delay_s``
        for fewer than half of ``old_alive`` or the half without the lowest replica, else 0."""
        if 2 * len(side) < len(old_alive) or (2 * len(side) == len(old_alive)
                                               and min(old_alive) not in side):
            return self.claim_delay_s
        return 0.0

    def claim(self, epoch: int, old_alive: tuple[int, ...], members: set[int],
              side: Collection[int], *, rank: int) -> bool:
        """Whether the side ``members`` (original world ranks; ``side``: the replicas they
        hold) goes on after the repair of ``epoch`` that started from ``old_alive``.
        ``rank`` is the claiming rank (log lines, a private temporary file name)."""
        if self.folder is None:
            return True
        delay = self.head_start(side, old_alive)
        if delay > 0:
            # A minority side (or the half without the lowest replica) lets a majority side,
            # which detects the partition at about the same time, claim first.
            self.sleep(delay)
        try:
            return self._take(epoch, old_alive, members, rank)
        except OSError as err:  # no arbiter reachable: a majority goes on, a minority stops
            goes_on = delay == 0
            self.log(f"rank {rank}: arbiter folder {self.folder}: {err}; "
                     + ("going on (a majority side)" if goes_on else "stopping (a minority side)"))
            return goes_on

    def claim_path(self, epoch: int, old_alive: tuple[int, ...]) -> str:
        """The file that claims the transition out of (``epoch``, ``old_alive``): a fixed-length
        name whatever the number of replicas."""
        digest = hashlib.sha256(",".join(map(str, old_alive)).encode()).hexdigest()[:24]
        return os.path.join(self.folder, f"epoch{epoch}-alive{len(old_alive)}-{digest}.json")

    def _take(self, epoch: int, old_alive: tuple[int, ...], members: set[int], rank: int) -> bool:
        os.makedirs(self.folder, exist_ok=True)
        path = self.claim_path(epoch, old_alive)
        tmp = f"{path}.{rank}.{os.getpid()}.tmp"
        with open(tmp, "w") as handle:
            handle.write(" ".join(map(str, sorted(members))))
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            with open(path) as handle:
                owner = {int(w) for w in handle.read().split()}
            return members <= owner
        finally:
            os.unlink(tmp)
