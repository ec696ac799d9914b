"""[Note: a bounded MPI_Init] (recover_hsdp/train.py): a rank stuck inside one C call at
start-up ends within ``recover.timeouts.hang_s``; one that returns in time is left alone."""

from __future__ import annotations

import signal
import subprocess
import sys

from conftest import DEBUG_CONFIG
from recover_hsdp.cli.arguments import parser as _parser
from recover_hsdp.cli.launch import build_command
from recover_hsdp.collectives.mpirun import INIT_DEADLINE_ENV


def _exported(tmp_path, *flags) -> dict[str, str]:
    args = _parser().parse_args(["train", "--config", str(DEBUG_CONFIG), "--replicas", "2",
                                 "--ranks-per-replica", "1", "--out", str(tmp_path / "out"),
                                 *flags, "--", "--recover.timeouts.hang_s", "90.5"])
    command = build_command(args)[0]
    return dict(command[i + 1].split("=", 1) for i, a in enumerate(command) if a == "-x")


def test_the_launcher_gives_every_rank_hang_s_for_mpi_init(tmp_path):
    assert _exported(tmp_path)[INIT_DEADLINE_ENV] == "91"


# The main thread inside one C call that holds the GIL (as MPI_Init does): libc's sleep.
_STUCK = """
import ctypes, sys, time
from recover_hsdp.train import _bounded_mpi_init
with _bounded_mpi_init({{"{env}": "{deadline}"}}):
    ctypes.CDLL(None).sleep({inside})
time.sleep({after})
print("alive", flush=True)
"""


def _run(deadline: int, inside: int, after: float):
    code = _STUCK.format(env=INIT_DEADLINE_ENV, deadline=deadline, inside=inside, after=after)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)


def test_a_rank_stuck_in_a_c_call_past_the_deadline_ends():
    done = _run(deadline=1, inside=30, after=0)
    assert done.returncode == -signal.SIGALRM, (done.returncode, done.stderr[-2000:])
    assert "alive" not in done.stdout


def test_a_call_that_returns_in_time_disarms_it():
    done = _run(deadline=2, inside=0, after=3.0)  # past the deadline, out of the call
    assert done.returncode == 0 and "alive" in done.stdout, done.stderr[-2000:]
