"""Where a join stands, as every survivor knows it ([Note: rejoin at a boundary] in rejoin.py):
``JoinState`` and the moves between its states, ``StartedJoin`` (a join whose newcomers were
started, with the operator's requests it answers) and the bound on its attempts.

Every state but JOINING is decided by agreed facts only (the committed step's totals, the
alive set), so it is the same on every survivor; JOINING lasts for one attempt inside
``Rejoin.maybe_admit``. ``Rejoin`` changes its state in one place (``Rejoin._move``), which
asserts the move is one of ``JoinState.may_become``'s.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from pathlib import Path
from typing import Any

JOIN_DIR = "join"

JOIN_ATTEMPTS = 3
"""How many boundaries may try to complete one started join ([Note: rejoin at a boundary])."""


class JoinState(enum.Enum):
    """A survivor's join, from the last committed step's totals."""

    IDLE = "idle"          # no join started (one may start at the next boundary)
    STARTING = "starting"  # newcomers started, not seen ready (yet, or again after an attempt)
    READY = "ready"        # the spawner saw them ready: the next boundary attempts the join
    LOST = "lost"          # the spawner saw them die or time out: the next boundary gives up
    JOINING = "joining"    # an attempt is under way (stages 2-4)

    def may_become(self, other: JoinState) -> bool:
        return other in _MOVES[self]


_AGREED = {JoinState.STARTING, JoinState.READY, JoinState.LOST}  # what a step's totals say
_MOVES = {
    JoinState.IDLE: {JoinState.STARTING},                        # the spawn (stage 1)
    # totals; IDLE: given up (the spawner died, the newcomers were lost, the run ended)
    JoinState.STARTING: _AGREED | {JoinState.IDLE},
    JoinState.READY: _AGREED | {JoinState.JOINING, JoinState.IDLE},
    JoinState.LOST: _AGREED | {JoinState.IDLE},
    # IDLE: joined, or the last attempt failed; STARTING: back to the link for the next one
    JoinState.JOINING: {JoinState.IDLE, JoinState.STARTING},
}


@dataclasses.dataclass
class StartedJoin:
    """A join whose newcomers were started, as every survivor knows it (agreed facts only)."""

    replicas: tuple[int, ...]
    spawner: int                  # the spawner's original world rank
    step_started: int
    pending: Any = None           # the spawner's PendingJoin (None on the other survivors)
    failed_here: bool = False     # the spawner: the spawn failed or the newcomers are lost
    attempts: int = 0
    requests: list[Path] = dataclasses.field(default_factory=list)  # the spawner's: answered
    record: dict[str, Any] = dataclasses.field(default_factory=dict)  # its events.jsonl record

    def spawner_sees(self, repair_s: float) -> tuple[bool, bool]:
        """(newcomers ready, newcomers lost) as this rank sees them: the spawner tests them
        (lost too when not ready ``repair_s`` after the spawn); the other survivors see
        neither."""
        if self.failed_here:
            return False, True
        if self.pending is None:
            return False, False
        ready, failed = self.pending.test()
        if not ready and time.monotonic() - self.pending.started > repair_s:
            failed = True  # newcomers that never get ready
        return ready, failed


def join_requests(out_dir: Path) -> list[Path]:
    """Pending operator requests (``recover-hsdp join``), oldest first."""
    folder = out_dir / JOIN_DIR / "requests"
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def finish_requests(requests: list[Path], ok: bool) -> None:
    """Answer the operator's requests: moved to ``join/done`` or ``join/failed``."""
    for path in requests:
        done = path.parent.parent / ("done" if ok else "failed")
        done.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(path, done / path.name)
        except OSError:
            pass
