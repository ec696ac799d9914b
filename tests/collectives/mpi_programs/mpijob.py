"""Launch a real ULFM mpirun job from a test, with a hard timeout that never leaves processes behind."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from recover_hsdp.collectives.mpirun import mpirun_prefix

REPO = Path(__file__).resolve().parents[3]
PROGRAMS = Path(__file__).resolve().parent


@dataclasses.dataclass
class Job:
    rc: int | None  # None: timed out (and killed)
    wall_s: float
    output: str
    out_dir: Path

    def results(self) -> dict[int, dict]:
        """rank -> the JSON that rank wrote as ``rank<w>.json`` (ranks that died wrote none)."""
        found = {}
        for p in self.out_dir.glob("rank*.json"):
            found[int(p.stem[4:])] = json.loads(p.read_text())
        return found


def run_mpi(nprocs: int, program: str, args: list[str], out_dir: Path, timeout_s: float,
            extra: list[str] = ()) -> Job:
    """Run ``python tests/collectives/mpi_programs/<program> args...`` on ``nprocs`` ULFM ranks
    (``extra``: more mpirun arguments)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = mpirun_prefix(nprocs, env={"PYTHONPATH": env["PYTHONPATH"]}, extra=list(extra)) + [
        sys.executable, str(PROGRAMS / program), *args]
    log = out_dir / "mpirun.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                             start_new_session=True)
        try:
            rc: int | None = p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            _kill_tree(p)
    return Job(rc, time.monotonic() - t0, log.read_text(errors="replace"), out_dir)


def _kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL mpirun and every descendant of it, by PID (ranks may sit in other process groups)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    victims, frontier = [], [p.pid]
    while frontier:
        pid = frontier.pop()
        victims.append(pid)
        frontier += [c for c, pp in parent.items() if pp == pid]
    for pid in reversed(victims):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
