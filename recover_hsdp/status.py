"""What each rank is doing, kept current in a file: where a hang was, and ``recover-hsdp status``.

[Note: rank status] A rank that is declared hung or silent cannot always say so itself (a
SIGSTOPped process runs no thread), so every rank keeps its last phase point in a file:
``status/rank<N>.json`` (step, phase, the point's detail such as the microbatch or the bucket,
when the phase began and when the point was, pid, host). The file is memory-mapped: the main
thread copies the point's few hundred bytes into the mapping at every phase point of [Note:
phases as data] (recover_hsdp/phases.py), no system call, and the page cache holds them at
once, so a reader on the same host (the survivor that ends a frozen process, a launcher on a
one-host job) sees the very point a rank stopped at, even after SIGSTOP; a daemon thread
flushes the mapping to the file system once per ``interval_s`` (1 s) when it changed, so
readers elsewhere (a shared folder) see it at most that late. A reader that meets a point half
copied reads again. Then:

* a rank whose own watchdog finds it hung records, before it ends itself, its phase and the
  main thread's Python stack (taken from the watchdog thread) in ``errors/rank<N>.json``, which
  the survivors' repair event carries (``events.jsonl`` ``errors``);
* the survivors' repair event also carries the last status of every rank it lost
  (``last_seen``): what a SIGSTOPped or cut-off rank was doing;
* ``recover-hsdp status DIR`` prints every rank's live phase, step and the age of its record,
  with the run's progress, from these files and ``metrics.jsonl`` (no message to the job).

Standard library only.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

FOLDER = "status"
_DETAIL = ("bucket", "buckets_total", "point", "microbatch")


def status_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / FOLDER / f"rank{rank}.json"


class RankStatus:
    """This rank's live status file ([Note: rank status]); ``point`` is a ``PhaseHooks``
    subscriber."""

    SIZE = 1024  # bytes of the mapping: one record, padded

    def __init__(self, out_dir: str | Path, world_rank: int, replica: int, shard: int,
                 interval_s: float = 1.0) -> None:
        self.path = status_path(out_dir, world_rank)
        self.identity = {"rank": world_rank, "replica": replica, "shard": shard,
                         "pid": os.getpid(), "host": socket.gethostname()}
        self.interval_s = interval_s
        self._latest: dict[str, Any] | None = None
        self._dirty = False
        self._map: mmap.mmap | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, self.SIZE)
                self._map = mmap.mmap(fd, self.SIZE)
            finally:
                os.close(fd)
        except OSError:
            pass  # best effort: the status is a report, never a reason to fail
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recover-hsdp-status",
                                        daemon=True)
        self._thread.start()

    def point(self, step: int, phase, detail: dict[str, Any]) -> None:
        """The last phase point, copied into the mapping (main thread, no system call)."""
        name = getattr(phase, "value", str(phase))
        now = time.time()
        latest = self._latest
        since = latest["since"] if latest and (latest["step"], latest["phase"]) == (step, name) \
            else now
        self._latest = {"step": step, "phase": name, "since": since, "at": now,
                        **{k: _plain(detail[k]) for k in _DETAIL if detail.get(k) is not None}}
        if self._map is not None:
            data = json.dumps({**self.identity, **self._latest}).encode()[:self.SIZE - 1]
            self._map[:] = (data + b"\n").ljust(self.SIZE, b" ")
            self._dirty = True

    @property
    def latest(self) -> dict[str, Any] | None:
        return None if self._latest is None else {**self.identity, **self._latest}

    def flush(self) -> None:
        if self._map is not None and self._dirty:
            self._dirty = False
            try:
                self._map.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        self._stop.set()
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()


def main_thread_stack(limit: int = 12) -> list[str]:
    """The main thread's Python stack, innermost last (from any thread; [] if unavailable)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [line.rstrip() for line in traceback.format_stack(frame, limit=limit)]


def read_all(out_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Every rank's last status record, by world rank (unreadable ones skipped; a record met
    half copied is read again)."""
    found = {}
    for path in sorted((Path(out_dir) / FOLDER).glob("rank*.json")):
        for _ in range(5):
            try:
                text = path.read_bytes().strip()
                if not text:
                    break  # a rank before its first point
                record = json.loads(text)
                found[int(record["rank"])] = record
                break
            except (OSError, ValueError, KeyError):
                time.sleep(0.01)
    return found


def describe(record: dict[str, Any], now: float | None = None) -> str:
    """One rank's status in words: ``step 3 backward (microbatch 7) for 2.1 s``."""
    now = time.time() if now is None else now
    extra = ", ".join(f"{k} {record[k]}" for k in ("microbatch", "bucket", "point") if k in record)
    return (f"step {record['step']} {record['phase']}" + (f" ({extra})" if extra else "")
            + f" for {max(0.0, now - record['since']):.1f} s")


def _plain(value: Any) -> Any:
    return getattr(value, "value", value) if not isinstance(value, (int, float, str)) else value
