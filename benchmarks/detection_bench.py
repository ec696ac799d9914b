"""Detection of failures that close no socket, repeated: how often the job survives, how fast.

    python benchmarks/detection_bench.py [--runs 10] [--scenarios frozen,netns_frozen,netns_link]
                                         [--nodes 3] [--ranks-per-node 1]
                                         [--numbering node|slot]

Scenarios (the real 4 x 1 / 3 x 1 debug job, 8 steps, exact data assignment, default
``detect_timeout_s = 4``):
  frozen        one host, 4 replicas; replica 2 SIGSTOPs itself in step 3's backward
  netns_frozen  --nodes (3 or 4) namespace "nodes" (tests/netns_cluster.py), one replica each;
                replica 2's process is SIGSTOPped from outside after step 3
  netns_link    same cluster; node 2's link is taken down after step 3 (no RST)
``--ranks-per-node S``: replicas of S ranks, one per node (``--map-by ppr:S:node``);
``--numbering``: MPI ranks numbered round-robin over the hosts (``node``, the default here:
[Note: host-interleaved ranks] in recover_hsdp/collectives/ranks.py) or host by host (``slot``:
mpirun's own default and the launcher's), for the same run side by side. The
namespace runs keep PRRTE's own daemon keepalive (``recover.tiers.daemon_keepalive_s 0``) so a
cut link stays the in-job tier's and the detection is measured alone.
Each run counts as survived when the launcher exits 0, every step committed B microbatches and
exactly replica 2 was lost. Detection time: from the fault (the victim's record in
faults_fired.jsonl, or the harness's clock when it stops the process / downs the link) to the
survivors' agreement that replica 2 is gone (``decided_at`` of the failure event).
Writes benchmarks/results/detection.json (the namespace scenarios keyed by node count when it is
not 3; scenarios not run keep their earlier entry).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "torchtitan_configs" / "debug_cpu.toml"
STEPS = 8
sys.path.insert(0, str(REPO / "tests"))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []


def _launch_args(out: Path, replicas: int, extra=(), train=()) -> list[str]:
    return [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(CONFIG),
            "--replicas", str(replicas), "--out", str(out), "--end-grace", "10", *extra,
            "--", "--training.steps", str(STEPS), "--recover.timeouts.hang_s", "30", *train]


def _verdict(out: Path, rc: int, replicas: int, fault_time: float) -> dict:
    steps, records = _read(out / "metrics.jsonl"), _read(out / "events.jsonl")
    events = [e for e in records if "dead_replicas" in e]  # the repairs (saves log events too)
    ok = (rc == 0 and [s["step"] for s in steps] == list(range(1, STEPS + 1))
          and all(s["reduced_microbatches"] == replicas for s in steps)
          and [e["dead_replicas"] for e in events] == [[2]])
    result = {"survived": ok, "rc": rc, "events": events,
              "other_events": [e for e in records if "dead_replicas" not in e]}
    if events and fault_time and events[0].get("decided_at"):
        result["detect_s"] = events[0]["decided_at"] - fault_time
    return result


def run_frozen(workdir: Path) -> dict:
    out = workdir / "frozen"
    started = time.time()
    proc = subprocess.run(_launch_args(out, 4, ["--fault",
                                                "replica=2,step=3,phase=backward,mode=stop"]),
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    fired = _read(out / "faults_fired.jsonl")
    result = _verdict(out, proc.returncode, 4, fired[0]["time"] if fired else 0.0)
    result["wall_s"] = time.time() - started
    return result


def run_netns(workdir: Path, fault: str, index: int, nodes: int, per_node: int = 1,
              numbering: str = "node") -> dict:
    from netns_cluster import NetnsCluster

    out = workdir / fault
    out.mkdir(parents=True)
    with NetnsCluster(nodes, prefix=f"rhdb{index % 100}{fault[6]}{nodes}",
                      subnet=f"10.231.{200 + index % 50}") as cluster:
        mpi = [*cluster.mpirun_args(), "--map-by", f"ppr:{per_node}:node",
               "--rank-by", numbering]
        args = _launch_args(out, nodes, [f"--mpi-arg={a}" for a in mpi]
                            + ["--ranks-per-replica", str(per_node)],
                            ["--recover.tiers.daemon_keepalive_s", "0"])
        log = open(workdir / f"{fault}.log", "w")
        started = time.time()
        proc = cluster.popen(0, args, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                             stdout=log, stderr=log, cwd=str(REPO))
        while not any(s["step"] >= 3 for s in _read(out / "metrics.jsonl")):
            if proc.poll() is not None or time.time() - started > 300:
                break
            time.sleep(0.2)
        fault_time = time.time()
        if fault == "netns_link":
            cluster.link_down(2)
        else:
            for proc_info in json.loads((out / "procs.json").read_text())[
                    2 * per_node:3 * per_node]:  # replica 2's ranks: the node frozen
                os.kill(proc_info["pid"], signal.SIGSTOP)
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
        log.close()
        result = _verdict(out, rc, nodes, fault_time)
        result["wall_s"] = time.time() - started
        procs = out / "procs.json"
        result["hosts_by_rank"] = ([p["host"] for p in json.loads(procs.read_text())]
                                   if procs.exists() else [])
        result["leftover"] = {n: p for n, p in cluster.leftover_pids().items()
                              if not n.endswith("n2")}
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--scenarios", default="frozen,netns_frozen,netns_link")
    parser.add_argument("--nodes", type=int, default=3, choices=(3, 4),
                        help="namespace nodes of the netns scenarios (one replica each)")
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="S: ranks per replica, one replica per node (netns scenarios)")
    parser.add_argument("--numbering", default="node", choices=("node", "slot"),
                        help="MPI rank numbering: round-robin over hosts or host by host "
                             "(mpirun's default)")
    parser.add_argument("--results", default="detection.json",
                        help="file under benchmarks/results (scenarios not run keep their entry)")
    args = parser.parse_args()
    path = REPO / "benchmarks" / "results" / args.results
    report = json.loads(path.read_text()) if path.exists() else {}
    for scenario in args.scenarios.split(","):
        runs = []
        for index in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                result = (run_frozen(Path(tmp)) if scenario == "frozen"
                          else run_netns(Path(tmp), scenario, index, args.nodes,
                                         args.ranks_per_node, args.numbering))
            runs.append(result)
            print(f"{scenario} run {index + 1}: survived={result['survived']} "
                  f"detect_s={result.get('detect_s')} wall={result['wall_s']:.1f}s", flush=True)
        detects = [r["detect_s"] for r in runs if r["survived"] and r.get("detect_s") is not None]
        key = scenario if scenario == "frozen" or args.nodes == 3 else f"{scenario}_{args.nodes}"
        if scenario != "frozen" and args.ranks_per_node > 1:
            key += f"_s{args.ranks_per_node}_{args.numbering}"
        report[key] = {
            "runs": len(runs), "survived": sum(r["survived"] for r in runs),
            "median_detect_s": statistics.median(detects) if detects else None,
            "min_detect_s": min(detects) if detects else None,
            "max_detect_s": max(detects) if detects else None,
            "details": runs}
        r = report[key]
        print(f"== {key}: survived {r['survived']}/{r['runs']}, detect median "
              f"{r['median_detect_s']} (min {r['min_detect_s']}, max {r['max_detect_s']})",
              flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
