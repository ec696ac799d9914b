"""Run outputs: ``metrics.jsonl`` (one object per step), ``events.jsonl``, ``summary.json``.

Only the writer rank writes (rank 0; after failures, the lowest surviving rank). Files are
appended and flushed line by line so a run that dies keeps every step it finished. Every rank
keeps the records in memory, so a writer that takes over after the old one died first appends
what the old writer did not get to write (:func:`backfill_jsonl`): nothing is lost.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from recover_hsdp import handshake

#: Files a run writes into its output folder (checkpoints live in their own subfolder).
RUN_FILES = ("metrics.jsonl", "events.jsonl", "ledger.jsonl", "faults_fired.jsonl", "summary.json",
             "final_params.pt", "procs.json", *handshake.FILES)


def clear_run_files(out_dir: str | Path, keep: tuple[str, ...] = ()) -> list[str]:
    """Remove an earlier run's files from ``out_dir`` so a new run never mixes with them
    (checkpoints are kept: a restart loads them; so are the folders in ``keep``). Returns the
    names removed."""
    out_dir = Path(out_dir)
    removed = []
    for path in [*(out_dir / n for n in RUN_FILES), *out_dir.glob("grads_step*.pt")]:
        if path.exists():
            path.unlink()
            removed.append(path.name)
    for folder in ("membership", "errors", "samples", "join", "start", "status"):  # claims,
        # errors, data log, joins, start-up records, rank status
        if folder not in keep and (out_dir / folder).is_dir():
            shutil.rmtree(out_dir / folder)
            removed.append(f"{folder}/")
    return removed


def start_afresh(out_dir: str | Path, folders: tuple[str, ...] = ()) -> list[str]:
    """Create ``out_dir`` if needed and remove an earlier run's files from it
    (:func:`clear_run_files`, plus the sub-``folders`` named), saying so in one line: a new run's
    outputs never mix with an old one's. Returns the names removed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    removed = clear_run_files(out_dir)
    for folder in folders:
        if (out_dir / folder).is_dir():
            shutil.rmtree(out_dir / folder)
            removed.append(f"{folder}/")
    if removed:
        print(f"recover-hsdp: {out_dir}: removed the earlier run's {', '.join(removed)}",
              flush=True)
    return removed


def backfill_jsonl(path: Path, records: list[dict[str, Any]], key) -> None:
    """Append to ``path`` the ``records`` whose ``key(record)`` is not in the file yet.

    A torn last line (its writer died mid-write) is cut off first."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text)
    present = {key(json.loads(line)) for line in text.splitlines() if line.strip()}
    with open(path, "a") as handle:
        for record in records:
            if key(record) not in present:
                handle.write(json.dumps(record) + "\n")


class RunMetrics:
    """Per-step metrics, failure events and the end-of-run summary for one job."""

    def __init__(self, out_dir: str | Path, *, is_writer: bool, mode: str):
        self.out_dir = Path(out_dir)
        self.is_writer = is_writer
        self.mode = mode
        self.started = time.perf_counter()
        self.steps: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        if is_writer:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "events.jsonl"):
                (self.out_dir / name).unlink(missing_ok=True)

    def set_writer(self, is_writer: bool) -> None:
        """Hand the writer duty to this rank (the old writer died): write what it could not."""
        if is_writer and not self.is_writer:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            backfill_jsonl(self.out_dir / "metrics.jsonl", self.steps, lambda r: r["step"])
            backfill_jsonl(self.out_dir / "events.jsonl", self.events,
                           lambda r: (r["step"], r["epoch"], r.get("phase")))
        self.is_writer = is_writer

    def _append(self, name: str, record: dict[str, Any]) -> None:
        if self.is_writer:
            with open(self.out_dir / name, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def log_step(self, record: dict[str, Any]) -> None:
        self.steps.append(record)
        self._append("metrics.jsonl", record)
        if self.is_writer:
            print(
                f"[recover-hsdp {self.mode}] step {record['step']:>4}  loss {record['loss']:.5f}  "
                f"step_time {record['step_time_s']:.3f}s  alive_replicas {record['alive_replicas']}"
                f"  committed_microbatches {record['committed_microbatches']}"
                + (f" (measured {record['reduced_microbatches']})"
                   if "reduced_microbatches" in record else ""), flush=True)

    def log_event(self, record: dict[str, Any]) -> None:
        self.events.append(record)
        self._append("events.jsonl", record)

    def summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        wall = time.perf_counter() - self.started
        times = [s["step_time_s"] for s in self.steps]
        tokens = sum(s["tokens"] for s in self.steps)
        train_time = sum(times)
        return {
            "mode": self.mode,
            "steps": len(self.steps),
            "final_loss": self.steps[-1]["loss"] if self.steps else None,
            "tokens": tokens,
            "tokens_per_s": tokens / train_time if train_time else 0.0,
            "median_step_time_s": statistics.median(times) if times else None,
            "wall_s": wall,
            "failures": sum(1 for e in self.events if e.get("dead_replicas")),
            "joins": sum(1 for e in self.events if e.get("phase") == "join" and e.get("ok")),
            **(extra or {}),
        }

    def write_summary(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        summary = self.summary(extra)
        if self.is_writer:
            path = self.out_dir / "summary.json"
            path.write_text(json.dumps(summary, indent=2) + "\n")
        return summary


# -- errors/: why a rank left ([Note: replica-local errors] in manager/failures.py) -----------

def _reason_path(out_dir: str | Path, world_rank: int) -> Path:
    return Path(out_dir) / "errors" / f"rank{world_rank}.json"


def write_reason(out_dir: str | Path, record: dict[str, Any]) -> None:
    """``errors/rank<N>.json`` in ``out_dir``: why rank N left (safe from any thread)."""
    try:
        path = _reason_path(out_dir, record["rank"])
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        pass  # the reason is on stderr


def forget_reasons(out_dir: str | Path, world_ranks) -> None:
    """Joined newcomers: an earlier life's reason for leaving is not theirs."""
    for world_rank in world_ranks:
        _reason_path(out_dir, world_rank).unlink(missing_ok=True)
