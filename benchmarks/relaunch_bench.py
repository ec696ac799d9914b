"""The relaunch tier vs a checkpoint-restart by hand, for the failures PRRTE 3.0 cannot survive.

    python benchmarks/relaunch_bench.py [--repeats 1] [--faults link_down,kill_node]
        [--modes memory,relaunch,by_hand] [--ranks-per-node 1,2,3] [--steps 16] [--interval 4]
        [--keepalive 30]
        [--overhead-pairs 3] [--overhead-steps 40] [--overhead-intervals 1,5]

On a 4-node namespace cluster (tests/netns_cluster.py; needs root) a 3 x S job (S =
``--ranks-per-node``, one replica per node: nodes 0-2,
node 3 standing by in the hostfile, exact mode, a DCP checkpoint every ``--interval`` steps)
loses node 2 after step 5: its link cut (``link_down``) or every process on it SIGKILLed with
its PRRTE daemon (``kill_node``). PRRTE ends the MPI job either way.

* ``memory``: ``recover-hsdp train`` with host-memory state every ``--interval`` steps and no
  DCP checkpoint ([Note: host-memory state]): it relaunches from the survivors' copies (an
  emergency generation after a cut link) on nodes 0, 1, 3 (node 3's rank from a peer's copy).
* ``relaunch``: ``recover-hsdp train`` with a DCP checkpoint every ``--interval`` steps and no
  host-memory state ([Note: the relaunch tier]): it relaunches from the newest complete
  checkpoint (an emergency one after a cut link, [Note: emergency checkpoint]) on nodes 0, 1, 3.
* ``by_hand``: the same job with ``--recover.tiers.max_relaunches 0`` and no emergency checkpoint
  (``--recover.tiers.no-emergency_checkpoint``: only the periodic ones); the moment the launcher
  returns, this script (an operator with zero reaction time: a lower bound) starts the same
  command on nodes 0, 1, 3 with ``--checkpoint.load_step`` = the newest complete checkpoint.
  Both use ``--keepalive`` seconds of PRRTE keepalive (at PRRTE's defaults a cut link ends the
  job ~488 s after the cut, measured: docs/ULFM_NOTES.md).

Figures: seconds from the fault (this script's clock) to the first step committed again (the
first metrics line of the new job), and steps redone; for the launcher's modes the timeline
(the survivors' first repair, mpirun ended, the relaunch started, training again).

The failure-free cost of host-memory state (``--overhead-pairs``): the same 2 x 1 job on this
host with ``memory_snapshot_interval`` 0 (off) and each of ``--overhead-intervals``, run in
interleaved rounds (the order rotated each round); per round the ratio with snapshots to
without of the job's wall time (summary ``wall_s``, start-up included) and of the sum of its
step times after the first (the steady state, where snapshots are taken), and their medians;
then the cost per GiB of a rank's state in process (the copy on the critical path, the write
in the background). Writes benchmarks/results/``--results`` (default relaunch.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import CONFIG, REPO, machine, write_json  # noqa: E402
from netns_cluster import NetnsCluster  # noqa: E402

from recover_hsdp.cli.relaunch import newest_restart_point  # noqa: E402


def _read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []


def _argv(cluster, out, ckpt, steps, interval, keepalive, hostfile, extra=(), memory=False,
          per_node=1):
    mpi = [*cluster.mpirun_args(), "--map-by", f"ppr:{per_node}:node"]
    index = mpi.index("--hostfile")
    mpi[index + 1] = str(hostfile)
    return [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(CONFIG),
            "--replicas", "3", "--ranks-per-replica", str(per_node), "--out", str(out),
            "--end-grace", "10",
            *[f"--mpi-arg={a}" for a in mpi], "--", "--training.steps", str(steps),
            "--recover.timeouts.hang_s", "30",
            *(["--recover.tiers.memory_snapshot_interval", str(interval)] if memory else
              ["--checkpoint.enable", "--checkpoint.interval", str(interval),
               "--recover.tiers.memory_snapshot_interval", "0"]),
            "--checkpoint.folder", str(ckpt),
            "--recover.tiers.daemon_keepalive_s", str(keepalive), *extra]


def _wait(predicate, timeout=300, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.time()
        if proc is not None and proc.poll() is not None and not predicate():
            raise RuntimeError("the job ended first")
        time.sleep(0.05)
    raise TimeoutError


def one_run(mode: str, fault: str, steps: int, interval: int, keepalive: float, salt: int,
            per_node: int = 1) -> dict:
    root = Path(tempfile.mkdtemp(prefix="rh-relaunch-"))
    out, ckpt = root / "run", root / "ckpt"
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with NetnsCluster(4, prefix=f"rh22bb{salt % 10}", subnet=f"10.231.{41 + salt % 5}") as c:
        extra = ["--recover.tiers.max_relaunches", "0", "--recover.tiers.no-emergency_checkpoint"] \
            if mode == "by_hand" else []
        log = open(root / "run.log", "w")
        proc = c.popen(0, _argv(c, out, ckpt, steps, interval, keepalive, c.hostfile, extra,
                                memory=mode == "memory", per_node=per_node),
                       env=env, stdout=log, stderr=log, cwd=str(REPO))
        _wait(lambda: any(r["step"] >= 5 for r in _read(out / "metrics.jsonl")), proc=proc)
        fault_at = time.time()
        if fault == "link_down":
            c.link_down(2)
        else:
            c.kill_node(2)
        last = lambda: max((r["step"] for r in _read(out / "metrics.jsonl")), default=0)  # noqa
        if mode == "by_hand":
            proc.wait(timeout=900)
            done = last()
            resume = newest_restart_point(ckpt) or 0
            survivors = root / "hostfile-survivors"
            survivors.write_text("".join(f"{a} slots=8\n" for i, a in enumerate(c.addrs) if i != 2))
            out2 = root / "run2"
            proc = c.popen(0, _argv(c, out2, ckpt, steps, interval, keepalive, survivors,
                                    ["--checkpoint.load_step", str(resume)],
                                    per_node=per_node),
                           env=env, stdout=log, stderr=log, cwd=str(REPO))
            again = _wait(lambda: bool(_read(out2 / "metrics.jsonl")), proc=proc)
            proc.wait(timeout=900)
            result = {"steps_lost": done - resume, "resume_step": resume}
        else:
            proc.wait(timeout=900)
            events = [e for e in _read(out / "events.jsonl") if e.get("phase") == "relaunch"]
            record = events[0]
            again = record["training_again_at"]
            result = {"steps_lost": record["steps_lost"], "resume_step": record["resume_step"],
                      "from_memory": record.get("from_memory", False),
                      "completed": bool(json.loads((out / "summary.json").read_text())
                                        .get("completed")) if (out / "summary.json").exists()
                      else False,
                      "launcher_failure_to_training_s": record["failure_to_training_s"]}
            repairs = [e for e in _read(out / "relaunch" / "attempt-0" / "events.jsonl")
                       if e.get("dead_replicas") and e.get("decided_at")]
            result["timeline_s"] = {  # seconds after the fault
                "detected": repairs[0]["decided_at"] - fault_at if repairs else None,
                "job_ended": record["ended_at"] - fault_at,
                "relaunched": record["relaunched_at"] - fault_at,
                "training_again": again - fault_at}
        log.close()
    return {"mode": mode, "fault": fault, "ranks_per_node": per_node,
            "fault_to_training_s": again - fault_at, **result}


def overhead(pairs: int, steps: int, intervals: list[int]) -> dict:
    """Failure-free training time with host-memory snapshots vs without, interleaved: the
    job's wall time (start-up included) and the sum of its step times after the first (the
    steady state, where the snapshots are taken)."""
    rounds = []
    for index in range(pairs):
        walls, trains = {}, {}
        order = [0, *intervals]
        order = order[index % len(order):] + order[:index % len(order)]  # no side always first
        for interval in order:
            out = Path(tempfile.mkdtemp(prefix="rh-snap-")) / "run"
            done = subprocess.run(
                [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(CONFIG),
                 "--replicas", "2", "--out", str(out), "--", "--training.steps", str(steps),
                 "--recover.tiers.memory_snapshot_interval", str(interval)],
                cwd=str(REPO), env={**os.environ, "OMP_NUM_THREADS": "1"},
                capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
            walls[interval] = json.loads((out / "summary.json").read_text())["wall_s"]
            trains[interval] = sum(r["step_time_s"] for r in _read(out / "metrics.jsonl")
                                   if r["step"] > 1)
        rounds.append({"round": index, "wall_s": walls, "steps_s": trains,
                       "ratio": {n: walls[n] / walls[0] for n in intervals},
                       "steps_ratio": {n: trains[n] / trains[0] for n in intervals}})
        print(json.dumps(rounds[-1]), flush=True)
    return {"steps": steps, "rounds": rounds,
            "ratio_median": {n: statistics.median(r["ratio"][n] for r in rounds)
                             for n in intervals},
            "steps_ratio_median": {n: statistics.median(r["steps_ratio"][n] for r in rounds)
                                   for n in intervals}}


def copy_cost(mib: int = 512, repeats: int = 3) -> dict:
    """Where a snapshot's time goes, per GiB of a rank's state, in process: the copy on the
    step's critical path (``Snapshotter.submit``'s clone) and the background write to
    ``/dev/shm`` (``torch.save``), best of ``repeats``."""
    import torch

    from recover_hsdp.recovery.host_state import HostStateStore, checksum

    tensors = [torch.randn(mib * 2**20 // 4 // 8) for _ in range(8)]
    folder = Path(tempfile.mkdtemp(prefix="rh-copy-", dir="/dev/shm"))
    store = HostStateStore(folder, 0, 0)
    copy_s, write_s = [], []
    for step in range(repeats):
        started = time.perf_counter()
        copies = [t.detach().to("cpu", copy=True) for t in tensors]
        copy_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        store.write(step, {"step": step, "tensors": copies, "meta": {},
                           "checksum": checksum(copies)})
        write_s.append(time.perf_counter() - started)
    shutil.rmtree(folder, ignore_errors=True)
    gib = mib / 1024
    return {"mib": mib, "copy_s_per_gib": min(copy_s) / gib,
            "write_s_per_gib": min(write_s) / gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--faults", default="link_down,kill_node")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--keepalive", type=float, default=30.0)
    parser.add_argument("--modes", default="memory,relaunch,by_hand")
    parser.add_argument("--results", default="relaunch.json")
    parser.add_argument("--ranks-per-node", default="1",
                        help="S values, comma-separated: replicas of S ranks, one per node")
    parser.add_argument("--overhead-pairs", type=int, default=3)
    parser.add_argument("--overhead-steps", type=int, default=40)
    parser.add_argument("--overhead-intervals", default="1,5")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    cost = overhead(args.overhead_pairs, args.overhead_steps,
                    [int(n) for n in args.overhead_intervals.split(",")]) \
        if args.overhead_pairs else None
    if cost:
        cost["per_gib"] = copy_cost()
        print(json.dumps(cost["per_gib"]), flush=True)
    runs = []
    salt = 0
    sizes = [int(n) for n in args.ranks_per_node.split(",")]
    for _ in range(args.repeats):
        for per_node in sizes:
            for fault in args.faults.split(","):
                for mode in modes:
                    salt += 1
                    run = one_run(mode, fault, args.steps, args.interval, args.keepalive, salt,
                                  per_node)
                    print(json.dumps(run), flush=True)
                    runs.append(run)
    table = {}
    for key in sorted({(r["ranks_per_node"], r["fault"], r["mode"]) for r in runs}):
        per_node, fault, mode = key
        mine = [r for r in runs if (r["ranks_per_node"], r["fault"], r["mode"]) == key]
        if mine:
            table[f"S={per_node}/{fault}/{mode}"] = {
                "fault_to_training_s_median": statistics.median(r["fault_to_training_s"]
                                                                for r in mine),
                "detected_s": [r.get("timeline_s", {}).get("detected") for r in mine],
                "steps_lost": [r["steps_lost"] for r in mine]}
    print(json.dumps(table, indent=2))
    if cost:
        print(json.dumps({"wall": cost["ratio_median"], "steps": cost["steps_ratio_median"]}))
    write_json(args.results, {"machine": machine(), "args": vars(args),
                                 "runs": runs, "table": table, "snapshot_overhead": cost})


if __name__ == "__main__":
    main()
