"""Which process is which rank, and ending the processes the world has excluded.

[Note: nothing left behind] A rank excluded from the world is not always dead: a frozen process
(SIGSTOP, a kernel stall) or a partitioned one keeps its sockets, its device memory and mpirun's
attention (mpirun waits for it forever). So every rank records (host, pid, process start time)
at start-up; after every repair and at the end of the run each survivor SIGKILLs the excluded
ranks that run on its own host, and the launcher, once the run is over, ends mpirun and any
registered process left on its host. The start time (``/proc/<pid>/stat`` field 22) guards
against killing an unrelated process that reused the pid.

Standard library only (the collectives layer).
"""

from __future__ import annotations

import json
import os
import signal
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

PROCS_FILE = "procs.json"


@dataclass(frozen=True)
class ProcessInfo:
    """Identity of one rank's process: host name, pid, start time in clock ticks since boot."""

    host: str
    pid: int
    start: int

    @classmethod
    def current(cls) -> "ProcessInfo":
        return cls(socket.gethostname(), os.getpid(), start_time(os.getpid()) or 0)

    def is_local(self) -> bool:
        return self.host == socket.gethostname()

    def state(self) -> str | None:
        """The process's state letter (R, S, T for stopped, Z, ...) if it is still this process
        on this host, else None (gone, reused pid, or another host)."""
        if not self.is_local() or start_time(self.pid) != self.start:
            return None
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return None
        return stat.rsplit(")", 1)[1].split()[0]

    def is_frozen(self) -> bool:
        """Stopped (SIGSTOP, or traced) on this host: it will never move by itself."""
        return self.state() in ("T", "t")

    def kill(self) -> bool:
        """SIGKILL the process if it is still this process on this host. True if signalled."""
        if self.pid == os.getpid() or self.state() in (None, "Z"):
            return False
        try:
            os.kill(self.pid, signal.SIGKILL)
            return True
        except OSError:
            return False


def start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def write_registry(out_dir: str | Path, procs: list[ProcessInfo]) -> Path:
    """``procs.json`` in ``out_dir``: world rank -> process (written once by rank 0)."""
    path = Path(out_dir) / PROCS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(p) for p in procs]))
    tmp.replace(path)
    return path


def read_registry(out_dir: str | Path) -> list[ProcessInfo]:
    path = Path(out_dir) / PROCS_FILE
    try:
        return [ProcessInfo(**p) for p in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return []


def kill_local(procs: list[ProcessInfo]) -> list[int]:
    """SIGKILL those of ``procs`` that still run on this host; returns the pids signalled."""
    return [p.pid for p in procs if p.kill()]


# ---------------------------------------------------------------- start-up records

START_DIR = "start"
"""[Note: start-up records] ``procs.json`` exists only once the bootstrap all-gather is done;
a rank that dies before (MPI_Init, the bootstrap, the replica's rendezvous: the deaths the
in-job tier cannot repair) would leave no trace of where it ran. So every rank writes
``start/rank<N>.json`` (its :class:`ProcessInfo`) right after MPI_Init, and a rank that leaves
through an exception adds ``"exited"``: its reason. After a job that ended before its world was
built, a rank with a record and no ``exited`` died hard (SIGKILL, a crash): the relaunch tier
(``recover_hsdp.cli.relaunch``) treats its host as lost."""


def write_start_record(out_dir: str | Path, rank: int, exited: str | None = None) -> None:
    """``start/rank<rank>.json`` in ``out_dir`` (this process), with ``exited`` when given."""
    folder = Path(out_dir) / START_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = {**asdict(ProcessInfo.current()), "rank": rank}
    if exited is not None:
        record["exited"] = exited
    tmp = folder / f".rank{rank}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(folder / f"rank{rank}.json")


def read_start_records(out_dir: str | Path) -> dict[int, dict]:
    """rank -> start record (``ProcessInfo`` fields, ``rank``, maybe ``exited``)."""
    records = {}
    for path in sorted((Path(out_dir) / START_DIR).glob("rank*.json")):
        try:
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records
