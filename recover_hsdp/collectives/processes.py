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

    def cpu_ticks(self) -> tuple[str, int] | None:
        """(state letter, user + system CPU clock ticks) if it is still this process on this
        host, else None: what [Note: silence the host can explain] reads."""
        if not self.is_local() or start_time(self.pid) != self.start:
            return None
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return fields[0], int(fields[11]) + int(fields[12])

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


class StoppedPeers:
    """[Note: stopped peers outside the detector] Open MPI's heartbeat detector watches one ring
    over the job's original ``MPI_COMM_WORLD`` (``ompi_comm_start_detector`` is not implemented
    for any other communicator), so a rank that joined later (``MPI_Comm_spawn``: a respawned
    replica) is never declared dead while it is frozen: a SIGSTOPped replacement keeps its
    sockets open and its peers wait in their collective until their own call deadline ends
    them (measured: the whole job, 50 s after the stop, then a relaunch from step 0). A stopped
    process never moves by itself, and a peer on its host sees it: while a guarded call of a
    rank waits, its watchdog thread sweeps the job's processes on this host (a read of
    ``/proc/<pid>/stat`` each, only during a wait longer than one poll) and SIGKILLs one seen
    stopped (T, t) in every sweep for ``after_s`` (``[recover.timeouts] detect_s``, the
    detector's own bound); its peers then see an ordinary death. "Every sweep" keeps a process
    a profiler or debugger stops for a moment (py-spy, gdb) alive. Original ranks are swept too
    (the detector would declare them dead at the same bound anyway). Limit: a process frozen on
    a host where no other rank of the job runs, or a spawned rank behind a cut link, is not
    seen (nothing of the job runs there to look): its peers' call deadline still ends the
    wait, and the relaunch tier the job (docs/failures.md)."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._since: dict[ProcessInfo, float] = {}  # seen stopped, from
        self._last = float("-inf")

    def sweep(self, procs, now: float, contiguous_s: float) -> list[ProcessInfo]:
        """The processes of ``procs`` on this host (not this one) stopped in every sweep since
        ``after_s`` ago; a sweep more than ``contiguous_s`` after the previous one starts over
        (the process may have moved in the gap). Reads ``/proc`` only."""
        if now - self._last > contiguous_s:
            self._since = {}
        self._last = now
        me = os.getpid()
        stopped = [p for p in procs if p.pid != me and p.is_frozen()]
        self._since = {p: self._since.get(p, now) for p in stopped}
        return [p for p, since in self._since.items() if now - since >= self.after_s]


# ---------------------------------------------------------------- start-up records

START_DIR = "start"
"""[Note: start-up records] ``procs.json`` exists only once the bootstrap all-gather is done;
a rank that dies before (MPI_Init, the bootstrap, the replica's rendezvous: the deaths the
in-job tier cannot repair) would leave no trace of where it ran. So every rank writes
``start/rank<N>.json`` (its :class:`ProcessInfo`) right after MPI_Init, and a rank that leaves
through an exception adds ``"exited"``: its reason, and ``"saw_failed"``: the world ranks its MPI
knew to have failed then. After a job that ended before its world was built, a rank with a
record and no ``exited`` died hard (SIGKILL, a crash), or was ended with the job while it still
waited (e.g. in a rendezvous with the dead rank, ended by the launcher or PRRTE after the others
left). The ranks that left name the first kind: where any ``saw_failed`` is recorded, only the
ranks named there (and without ``exited``) make the relaunch tier (``recover_hsdp.cli.relaunch``)
treat their hosts as lost; a rank ended with the job is no evidence against its host. Without
any (no rank's MPI saw a failure), every rank without ``exited`` counts."""


def write_start_record(out_dir: str | Path, rank: int, exited: str | None = None,
                       saw_failed: list[int] | None = None) -> None:
    """``start/rank<rank>.json`` in ``out_dir`` (this process), with ``exited`` and
    ``saw_failed`` when given."""
    folder = Path(out_dir) / START_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = {**asdict(ProcessInfo.current()), "rank": rank}
    if exited is not None:
        record["exited"] = exited
    if saw_failed:
        record["saw_failed"] = sorted(saw_failed)
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
