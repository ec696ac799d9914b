"""Commit ledger: one JSON line per committed step, append-only (`ledger.jsonl` in the dump dir).

Each line records what the step summed, so an oracle can recompute the step's gradient on one
process: the step, the world epoch it was committed under, G, the alive replicas, the failures seen
during the step, and per replica its role, committed microbatch ids, extras and discarded ids (an
unpromoted spare's compute), plus the work of replicas that died during the step (discarded too).
In stream mode the ids are positions in the stream `slot` the replica reads and `stream_start` is
that slot's cursor at the start of the step; in exact mode they are global microbatch ids.

Invariant kept by the writer (it refuses the line otherwise): the committed ids of a line sum to B.
One rank writes (the trainer picks the lowest surviving rank); each line is flushed before the next
step starts, and a torn last line (the writer died mid-write) is ignored by the reader.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from recover_hsdp.workload.plan import StepPlan

LEDGER_NAME = "ledger.jsonl"


def plan_record(plan: StepPlan, epoch: int) -> dict:
    """The ledger line (a JSON-ready dict) for a committed `plan` under world `epoch`."""
    replicas = {}
    for a in plan.assignments:
        entry = {"role": a.role.value, "committed": list(a.committed_ids),
                 "extra": list(a.extra_ids), "discarded": list(a.discarded_ids),
                 "promoted": a.promoted}
        if a.excluded:  # a culprit of this step ([Note: bad replicas] in manager/culprits.py)
            entry["excluded"] = True
        if a.stream_start is not None:
            entry["stream_start"] = a.stream_start
            entry["slot"] = a.slot
        replicas[str(a.replica)] = entry
    return {"step": plan.step, "epoch": epoch, "mode": plan.data_assignment.value,
            "global_microbatches": plan.global_microbatches, "g": plan.g,
            "alive": list(plan.alive), "failures": list(plan.dead), "replans": plan.round,
            "committed_total": plan.committed_total(), "replicas": replicas,
            "lost": {str(r): list(ids) for r, ids in plan.lost_work}}


class LedgerWriter:
    """Append-only JSONL writer; `append(plan, epoch)` after each committed step."""

    def __init__(self, output_dir: str | os.PathLike, fsync: bool = False) -> None:
        self.path = Path(output_dir) / LEDGER_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, plan: StepPlan, epoch: int) -> dict:
        """Write one line for the committed `plan`; return the record written."""
        record = plan_record(plan, epoch)
        if record["committed_total"] != plan.global_microbatches:
            raise AssertionError(f"step {plan.step}: refusing to log {record['committed_total']} "
                                 f"committed microbatches, B = {plan.global_microbatches}")
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        return record

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "LedgerWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class LedgerEntry:
    """One committed step as read back; replica keys are ints."""

    step: int
    epoch: int
    mode: str
    global_microbatches: int
    g: int
    alive: tuple[int, ...]
    failures: tuple[int, ...]
    replans: int
    roles: dict[int, str]
    committed: dict[int, tuple[int, ...]]
    extra: dict[int, tuple[int, ...]]
    discarded: dict[int, tuple[int, ...]]
    stream_start: dict[int, int]
    lost: dict[int, tuple[int, ...]]
    slots: dict[int, int]

    @property
    def committed_total(self) -> int:
        """Number of committed microbatches (== global_microbatches)."""
        return sum(len(ids) for ids in self.committed.values())

    def committed_keys(self) -> set[tuple[int, int]]:
        """Committed microbatches as unique keys: (-1, id) exact, (slot, position) stream."""
        exact = self.mode == "exact"
        return {(-1 if exact else self.slots.get(r, r), i)
                for r, ids in self.committed.items() for i in ids}


def _entry(rec: dict) -> LedgerEntry:
    """Parse one decoded line."""
    reps = {int(r): e for r, e in rec["replicas"].items()}
    return LedgerEntry(
        step=rec["step"], epoch=rec["epoch"], mode=rec["mode"],
        global_microbatches=rec["global_microbatches"], g=rec["g"], alive=tuple(rec["alive"]),
        failures=tuple(rec["failures"]), replans=rec["replans"],
        roles={r: e["role"] for r, e in reps.items()},
        committed={r: tuple(e["committed"]) for r, e in reps.items()},
        extra={r: tuple(e["extra"]) for r, e in reps.items()},
        discarded={r: tuple(e["discarded"]) for r, e in reps.items()},
        stream_start={r: e["stream_start"] for r, e in reps.items() if "stream_start" in e},
        lost={int(r): tuple(ids) for r, ids in rec["lost"].items()},
        slots={r: e["slot"] for r, e in reps.items() if e.get("slot") is not None})


def read_ledger(path: str | os.PathLike) -> list[LedgerEntry]:
    """Entries of a ledger file (or of `ledger.jsonl` in a directory), in write order.

    A torn final line (no newline, not valid JSON) is skipped; a bad line elsewhere raises
    ValueError.
    """
    path = Path(path)
    if path.is_dir():
        path = path / LEDGER_NAME
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    entries = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entries.append(_entry(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            if n == len(lines):        # last piece without a trailing newline: torn write
                break
            raise ValueError(f"{path}:{n}: malformed ledger line ({e})") from e
    return entries
