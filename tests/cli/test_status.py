"""[Note: rank status] (recover_hsdp/status.py) in process: the status file a rank keeps current,
the record a hung rank leaves, and ``recover-hsdp status``. The real jobs:
tests/jobs/test_real_failures.py (a stuck main thread, a frozen rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types

from conftest import REPO
from recover_hsdp import status
from recover_hsdp.cli.status import report
from recover_hsdp.collectives.processes import ProcessInfo, write_registry
from recover_hsdp.manager.failures import FailureLog
from recover_hsdp.phases import Phase


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_the_file_holds_the_last_point_at_once_even_for_a_stopped_process(tmp_path):
    """The mapping is in the page cache: a reader sees a point as soon as it is copied, with no
    flush (the writer thread is far from its first flush); a SIGSTOPped process's last point
    stays readable (here a child stops itself right after its point)."""
    board = status.RankStatus(tmp_path, world_rank=3, replica=1, shard=1, interval_s=3600)
    assert status.read_all(tmp_path) == {}  # nothing before the first point
    board.point(4, Phase.FORWARD, {"microbatch": 7, "last_microbatch_s": 0.2})
    record = status.read_all(tmp_path)[3]
    assert (record["step"], record["phase"], record["microbatch"]) == (4, "forward", 7)
    assert (record["replica"], record["shard"], record["pid"]) == (1, 1, os.getpid())
    assert "last_microbatch_s" not in record
    board.point(4, Phase.BACKWARD, {})
    assert status.read_all(tmp_path)[3]["phase"] == "backward"
    board.close()
    assert status.describe(status.read_all(tmp_path)[3]).startswith("step 4 backward for ")
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, signal; from recover_hsdp import status; from recover_hsdp.phases import "
        f"Phase; b = status.RankStatus({str(tmp_path)!r}, 5, 2, 0, interval_s=3600); "
        "b.point(9, Phase.GRAD_SYNC, {'bucket': 3}); os.kill(os.getpid(), signal.SIGSTOP)")],
        cwd=REPO)
    try:
        assert _wait_for(lambda: 5 in status.read_all(tmp_path), timeout=60)
        record = status.read_all(tmp_path)[5]
        assert (record["step"], record["phase"], record["bucket"]) == (9, "grad_sync", 3)
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_hung_rank_records_where_its_main_thread_was(tmp_path):
    """What the watchdog thread writes just before it kills a hung rank: the phase, the step
    and the main thread's stack (here: stuck in ``time.sleep`` inside this test)."""
    world = types.SimpleNamespace(replica=2, shard=0, world_rank=2)
    log = FailureLog(world, outputs=None, out_dir=tmp_path)
    board = status.RankStatus(tmp_path, world_rank=2, replica=2, shard=0, interval_s=60)
    board.point(3, Phase.BACKWARD, {})
    release = threading.Event()

    def watchdog():
        time.sleep(0.3)  # the main thread is "stuck" in the wait below by now
        log.hung("no progress for 31 s", board.latest)
        release.set()

    thread = threading.Thread(target=watchdog)
    thread.start()
    assert release.wait(30)
    thread.join()
    record = json.loads((tmp_path / "errors" / "rank2.json").read_text())
    assert record["step"] == 3 and record["phase"] == "backward"
    assert record["reason"].startswith("hung at step 3 backward for ")
    assert record["reason"].endswith("no progress for 31 s")
    assert any("release.wait" in line for line in record["stack"]), record["stack"]
    assert log.reasons([2]) == {"2": [f"rank 2 step 3: {record['reason']}"]}
    board.close()


def test_status_command_reports_every_rank_and_the_run(tmp_path):
    """A "running" job: two ranks' status files (both this process), its metrics, procs.json;
    then the command itself as a user runs it; a folder of no job is refused in one line."""
    for rank, phase in ((0, Phase.CONSENSUS), (1, Phase.BACKWARD)):
        board = status.RankStatus(tmp_path, world_rank=rank, replica=rank, shard=0)
        board.point(5, phase, {"point": "consensus"} if rank == 0 else {"microbatch": 9})
        board.close()
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"step": 4, "loss": 7.25, "alive_replicas": 2}) + "\n")
    write_registry(tmp_path, [ProcessInfo.current()])
    lines = report(tmp_path)
    assert lines[0] == f"{tmp_path}: running; step 4 committed (loss 7.25000, 2 replica(s) alive)"
    assert lines[1].startswith(f"rank 0 (replica 0, shard 0, pid {os.getpid()} on ")
    assert "step 5 consensus (point consensus) for " in lines[1]
    assert "step 5 backward (microbatch 9) for " in lines[2]
    result = subprocess.run([sys.executable, "-m", "recover_hsdp.cli.launch", "status",
                             str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.splitlines()[0] == lines[0]
    refused = subprocess.run([sys.executable, "-m", "recover_hsdp.cli.launch", "status",
                              str(tmp_path / "nothing")], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "no recover-hsdp job has written there" in refused.stderr
