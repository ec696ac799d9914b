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

[Note: the compact ledger] A line listing every replica's ids is O(W x G) bytes: ~10 MB per step
at W = 12,500 and G = 128. So (format 2) a line's id lists are runs, ``[[start, stop], ...]``
(half-open, in order: a block is one run), and a step planned from the same layout as the step
before it, with no failure and nothing excluded in either ([Note: a plan in O(1) per step] in
plan.py), is one short line, ``{"step": t, "epoch": e, "next_of": t - 1}``: the line of t - 1
advanced by one step (exact: every id + B; stream: each replica's positions and stream_start +
its committed count). Readers expand both (`ledger_records`, `read_ledger`); format 1 lines (id
lists) still read. A writer's first line, and the first after a change, is a full line, so a
relaunch's or a new writer's lines never refer to a line they did not write or back-fill.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from recover_hsdp.workload.plan import StepPlan

LEDGER_NAME = "ledger.jsonl"
FORMAT = 2
_ID_FIELDS = ("committed", "extra", "discarded")


def runs(ids: Iterable[int]) -> list[list[int]]:
    """``ids`` in order as half-open runs of consecutive ids: [4, 5, 6, 0] -> [[4, 7], [0, 1]]."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def unruns(runs_: Sequence) -> list[int]:
    """The ids of `runs` (format 2); a format 1 id list as it is."""
    if runs_ and not isinstance(runs_[0], list):
        return list(runs_)
    return [i for start, stop in runs_ for i in range(start, stop)]


def repeats(plan: StepPlan, previous: StepPlan | None) -> bool:
    """Whether ``plan`` is ``previous`` advanced by one step ([Note: the compact ledger])."""
    return previous is not None and plan.is_fresh and previous.is_fresh and \
        plan.layout is previous.layout and plan.step == previous.step + 1


def ledger_line(plan: StepPlan, epoch: int, previous: StepPlan | None = None) -> dict:
    """The line written for the committed ``plan`` ([Note: the compact ledger]): short when it
    `repeats` ``previous`` (the plan of the line before it), else the full line in runs."""
    if repeats(plan, previous):
        return {"step": plan.step, "epoch": epoch, "next_of": previous.step}
    record = plan_record(plan, epoch)
    for entry in record["replicas"].values():
        for name in _ID_FIELDS:
            entry[name] = runs(entry[name])
    record["lost"] = {r: runs(ids) for r, ids in record["lost"].items()}
    record["format"] = FORMAT
    return record


def expand(lines: Iterable[dict]) -> list[dict]:
    """Full records (id lists) of ledger lines in file order; ValueError if a short line does
    not follow the step it names."""
    out: list[dict] = []
    for line in lines:
        if "next_of" not in line:
            record = dict(line)
            record["replicas"] = {r: {**e, **{n: unruns(e[n]) for n in _ID_FIELDS}}
                                  for r, e in line["replicas"].items()}
            record["lost"] = {r: unruns(ids) for r, ids in line["lost"].items()}
            record.pop("format", None)
            out.append(record)
            continue
        before = out[-1] if out else None
        if before is None or before["step"] != line["next_of"] or \
                line["step"] != line["next_of"] + 1 or before["failures"] or before["replans"]:
            raise ValueError(f"ledger line of step {line['step']} follows "
                             f"{'nothing' if before is None else 'step %d' % before['step']}, "
                             f"not the failure-free step {line['next_of']} it advances")
        exact, b = before["mode"] == "exact", before["global_microbatches"]
        replicas = {}
        for r, e in before["replicas"].items():
            shift = b if exact else len(e["committed"])
            replicas[r] = {**e, **{n: [i + shift for i in e[n]] for n in _ID_FIELDS}}
            if "stream_start" in e:
                replicas[r]["stream_start"] = e["stream_start"] + shift
        out.append({**before, "step": line["step"], "epoch": line["epoch"],
                    "replicas": replicas})
    return out


def plan_record(plan: StepPlan, epoch: int) -> dict:
    """The full record (a JSON-ready dict, id lists) of a committed `plan` under world `epoch`:
    what a reader gets back for its line ([Note: the compact ledger])."""
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
    """Append-only JSONL writer; `append(plan, epoch)` after each committed step (or `write` of a
    line made by `ledger_line`)."""

    def __init__(self, output_dir: str | os.PathLike, fsync: bool = False) -> None:
        self.path = Path(output_dir) / LEDGER_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._file = open(self.path, "a", encoding="utf-8")
        self._previous: StepPlan | None = None

    def append(self, plan: StepPlan, epoch: int) -> dict:
        """Write one line for the committed `plan` (short if it repeats the one appended before
        it); return the line written."""
        line = ledger_line(plan, epoch, self._previous)
        self.write(line, plan)
        self._previous = plan
        return line

    def write(self, line: dict, plan: StepPlan) -> None:
        """Write ``line``, made by `ledger_line` for the committed ``plan``; refused (nothing
        written) if the plan does not commit B."""
        if plan.committed_total() != plan.global_microbatches:
            raise AssertionError(f"step {plan.step}: refusing to log {plan.committed_total()} "
                                 f"committed microbatches, B = {plan.global_microbatches}")
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())

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


def ledger_records(path: str | os.PathLike) -> list[dict]:
    """The full records (id lists, `plan_record`'s form) of a ledger file (or of
    `ledger.jsonl` in a directory), in write order ([Note: the compact ledger]).

    A torn final line (no newline, not valid JSON) is skipped; a bad line elsewhere raises
    ValueError."""
    path = Path(path)
    if path.is_dir():
        path = path / LEDGER_NAME
    pieces = path.read_text(encoding="utf-8").split("\n")
    lines = []
    for n, piece in enumerate(pieces, 1):
        if not piece.strip():
            continue
        try:
            lines.append(json.loads(piece))
        except json.JSONDecodeError as e:
            if n == len(pieces):        # last piece without a trailing newline: torn write
                break
            raise ValueError(f"{path}:{n}: malformed ledger line ({e})") from e
    try:
        return expand(lines)
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: malformed ledger line ({e!r})") from e


def read_ledger(path: str | os.PathLike) -> list[LedgerEntry]:
    """Entries of a ledger file (or of `ledger.jsonl` in a directory), in write order; see
    `ledger_records`."""
    records = ledger_records(path)
    try:
        return [_entry(record) for record in records]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: malformed ledger line ({e!r})") from e
