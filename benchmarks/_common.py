"""Shared helpers of the benchmark scripts: run a job under a supervisor that timestamps every
committed step, kill a stock TorchTitan rank from outside, parse TorchTitan's checkpoint logs.

Nothing here is imported by the product or the tests.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "torchtitan_configs" / "debug_cpu.toml"
RESULTS = REPO / "benchmarks" / "results"
POLL_S = 0.05


def machine() -> dict:
    """nproc, memory and CPU model of this machine (for the results files)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "mem_gib": mem_gib, "cpu_model": model,
            "python": platform.python_version(), "revision": revision()}


def revision() -> str:
    """The commit the runs used, plus '+dirty (files)' when the product code had local edits."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "recover_hsdp"], cwd=REPO,
                               text=True, capture_output=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    files = [line[3:] for line in dirty if line.strip()]
    return head + (f"+dirty ({', '.join(files)})" if files else "")


def train_command(out: Path, replicas: int, *, stock: bool, overrides: list[str],
                  faults: list[str] = (), ranks_per_replica: int = 1) -> list[str]:
    command = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(CONFIG),
               "--replicas", str(replicas), "--ranks-per-replica", str(ranks_per_replica),
               "--out", str(out)]
    command += ["--stock"] if stock else []
    for fault in faults:
        command += ["--fault", fault]
    return command + ["--", *overrides]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return rows


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def torchrun_worker(launcher_pid: int, rank: int) -> int | None:
    """PID of the torchrun worker with global RANK ``rank`` under the launcher process."""
    for pid in descendants(launcher_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"TORCHELASTIC_RUN_ID=" in b"\0".join(env):
            if b"recover_hsdp.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


@dataclass
class Segment:
    """One launch of a job, supervised: when each step was first seen committed."""

    out: Path
    launched: float
    ended: float = 0.0
    returncode: int | None = None
    step_seen: dict[int, float] = field(default_factory=dict)
    killed_at: float | None = None
    killed_after_step: int | None = None
    log: Path | None = None


def supervise(command: list[str], out: Path, *, kill_rank: int | None = None,
              kill_after_step: int | None = None, timeout: float = 900) -> Segment:
    """Run ``command``, poll ``out/metrics.jsonl`` and timestamp each step when it appears.

    With ``kill_rank``/``kill_after_step``: SIGKILL that torchrun worker as soon as step
    ``kill_after_step`` is committed (the kill lands in the next step), then wait for the job to
    be torn down (torchrun stops the other workers).
    """
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / (out.name + ".log")
    with open(log, "wb") as handle:
        seg = Segment(out=out, launched=time.time(), log=log)
        proc = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"},
                                start_new_session=True)
        deadline = seg.launched + timeout
        try:
            while True:
                done = proc.poll() is not None
                now = time.time()
                for row in read_jsonl(out / "metrics.jsonl"):
                    seg.step_seen.setdefault(int(row["step"]), now)
                if (kill_rank is not None and seg.killed_at is None
                        and kill_after_step in seg.step_seen):
                    pid = torchrun_worker(proc.pid, kill_rank)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        seg.killed_at = time.time()
                        seg.killed_after_step = kill_after_step
                if done:
                    break
                if now > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    raise TimeoutError(f"{command} ran over {timeout}s (log {log})")
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seg.returncode, seg.ended = proc.returncode, time.time()
    return seg


_STAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - root - INFO - (.*)")


def titan_log_events(log: Path) -> list[tuple[float, str]]:
    """(epoch seconds, message) of every TorchTitan INFO line (all ranks)."""
    events = []
    for line in log.read_bytes().decode("utf-8", "replace").splitlines():
        match = _STAMP.search(line)
        if match:
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            events.append((stamp, match.group(2)))
    return events


def checkpoint_times(log: Path) -> dict:
    """Checkpoint save/load durations TorchTitan logged (slowest rank per event) and when the
    first load began."""
    events = titan_log_events(log)
    saves, loads, load_begin = [], [], None
    save_re = re.compile(r"Finished saving the checkpoint.*in ([\d.]+) seconds")
    load_re = re.compile(r"Finished loading the checkpoint in ([\d.]+) seconds")
    for stamp, message in events:
        if message.startswith("Loading the checkpoint from") and load_begin is None:
            load_begin = stamp
        for regex, bucket in ((save_re, saves), (load_re, loads)):
            match = regex.search(message)
            if match:
                bucket.append((stamp, float(match.group(1))))
    return {"saves_s": _per_event(saves), "loads_s": _per_event(loads), "load_begin": load_begin}


def _per_event(items: list[tuple[float, float]], gap: float = 1.0) -> list[float]:
    """Group per-rank log lines of one event (within ``gap`` s) and keep the slowest rank."""
    groups: list[list[tuple[float, float]]] = []
    for stamp, value in sorted(items):
        if groups and stamp - groups[-1][-1][0] < gap:
            groups[-1].append((stamp, value))
        else:
            groups.append([(stamp, value)])
    return [max(v for _, v in group) for group in groups]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot
