"""The writer-launcher handshake of [Note: emergency checkpoint] (manager/manager.py), as files
in the run's output folder: the one place that knows their names and contents.

  the launcher   ``supervise()`` before mpirun: the ranks inherit ``SUPERVISED_ENV``, so the
                 writer waits for a verdict; ``clear()`` before each attempt;
  the writer     once an emergency checkpoint is agreed complete: ``write_request()`` (its
                 step, the hosts emptied since the last one), then, when ``supervised()``,
                 ``wait_for_verdict()`` (bounded: ``VERDICT_WAIT_S``);
  the launcher   polls ``read_request()``; every host answers: ``write_verdict()`` ("go on");
                 one does not: it ends mpirun and relaunches from that checkpoint instead
                 (cli/attempts.py, ``RelaunchRequest``).

Every file is renamed into place (``write_json_atomic``): a reader never sees half of one.
Standard library only, below every layer that writes or reads these files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: The writer's word to the launcher: an emergency checkpoint is complete.
REQUEST = "relaunch-request.json"
#: The launcher's answer: ``{"step": N, "go_on": true}`` (the job goes on).
VERDICT = "relaunch-verdict.json"
FILES = (REQUEST, VERDICT)
#: Set (exported to every rank) when ``recover-hsdp train`` supervises the job.
SUPERVISED_ENV = "RECOVER_HSDP_SUPERVISED"
#: How long the writer waits for the verdict (the launcher probes the job's hosts:
#: PROBE_TIMEOUT_S in cli/hosts.py, plus margin).
VERDICT_WAIT_S = 30.0


def write_json_atomic(path: str | Path, record: dict[str, Any]) -> None:
    """``record`` as JSON at ``path``, renamed into place: a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


# ---------------------------------------------------------------- the launcher

def supervise(environ=os.environ) -> None:
    """Mark the job supervised (the ranks inherit ``environ``): the writer waits for verdicts."""
    environ[SUPERVISED_ENV] = "1"


def clear(out_dir: str | Path) -> None:
    """Remove an earlier attempt's request and verdict."""
    for name in FILES:
        (Path(out_dir) / name).unlink(missing_ok=True)


def read_request(out_dir: str | Path, seen: float | None = None
                 ) -> tuple[float, dict[str, Any]] | None:
    """The writer's request, if one is there that is not the one stamped ``seen``: (its stamp,
    its contents); None otherwise (none, the same one, or one being replaced)."""
    path = Path(out_dir) / REQUEST
    try:
        stamp = path.stat().st_mtime
        if stamp == seen:
            return None
        return stamp, json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_verdict(out_dir: str | Path, step: int) -> None:
    """The verdict "go on" for ``step``'s request: every host answered."""
    write_json_atomic(Path(out_dir) / VERDICT, {"step": step, "go_on": True})


# ---------------------------------------------------------------- the writer

def supervised(environ=os.environ) -> bool:
    """Whether a launcher answers requests (``recover-hsdp train`` started the job)."""
    return bool(environ.get(SUPERVISED_ENV))


def write_request(out_dir: str | Path, step: int, hosts: list[str]) -> None:
    """Tell the launcher that ``step``'s emergency checkpoint is complete (``hosts``: the ones
    emptied since the last)."""
    write_json_atomic(Path(out_dir) / REQUEST, {"step": step, "hosts": hosts, "time": time.time()})


def wait_for_verdict(out_dir: str | Path, step: int, timeout_s: float = VERDICT_WAIT_S) -> bool:
    """Wait until the launcher's verdict for ``step`` is there (True) or ``timeout_s`` passed
    (False). A launcher that ends the job instead ends this wait with it."""
    verdict, deadline = Path(out_dir) / VERDICT, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(verdict.read_text()).get("step") == step:
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return False
