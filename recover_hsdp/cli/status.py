"""``recover-hsdp status DIR``: what every rank of the job writing to DIR is doing, and how far
the run got, read from files the ranks keep current ([Note: rank status] in
recover_hsdp/status.py; ``metrics.jsonl``, ``summary.json``, ``procs.json``). It sends the job
nothing, so it works on a job that is stuck as well as on one that ended."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from recover_hsdp import status
from recover_hsdp.collectives.processes import read_registry

_STATES = {"T": "stopped", "t": "stopped", "Z": "exited", "D": "in the kernel"}


def _last_step(out: Path) -> dict | None:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def report(out: Path, now: float | None = None) -> list[str]:
    """The lines ``recover-hsdp status`` prints (empty: nothing of a job in ``out``)."""
    now = time.time() if now is None else now
    records, last = status.read_all(out), _last_step(out)
    if not records and last is None:
        return []
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    state = ("finished" if summary.get("completed") else "ended without completing") \
        if summary else "running"
    head = f"{out}: {state}"
    if last is not None:
        head += (f"; step {last['step']} committed (loss {last['loss']:.5f}, "
                 f"{last['alive_replicas']} replica(s) alive)")
    lines = [head]
    procs = {p.pid: p for p in read_registry(out)}
    for rank, record in sorted(records.items()):
        proc = procs.get(record.get("pid"))
        letter = proc.state() if proc is not None else None
        alive = "" if proc is None or not proc.is_local() else \
            " [gone]" if letter is None else f" [{_STATES[letter]}]" if letter in _STATES else ""
        lines.append(f"rank {rank} (replica {record['replica']}, shard {record['shard']}, pid "
                     f"{record['pid']} on {record['host']}): {status.describe(record, now)}; "
                     f"last point {max(0.0, now - record['at']):.1f} s ago{alive}")
    return lines


def run_status(args) -> int:
    out = Path(args.out).resolve()
    lines = report(out)
    if not lines:
        print(f"recover-hsdp: error: {out}: no recover-hsdp job has written there (no "
              f"{status.FOLDER}/ and no metrics.jsonl): pass the job's --out folder",
              file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    return 0
