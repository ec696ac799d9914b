"""Probe (issue 22 item 5): ``recover-hsdp train`` inside a real Slurm allocation on the
namespace cluster (slurm_cluster.py's slurmctld + one slurmd per node), 3 replicas x 1 rank on
nodes 0-2 of a 4-node allocation (node 3 stands by), checkpoints every 2 steps; node 2 is
SIGKILLed whole (its slurmd, its prted, its rank) after step 3. Expected: PRRTE ends the job, the
launcher relaunches inside the allocation on the nodes left (0, 1, 3) from the newest complete
checkpoint, the run completes 12 steps. ``salloc --no-kill``: without it Slurm ends the whole
allocation when a node fails. Prints the summary's relaunch record and the steps.
Run under the heavy lock: python docs/probes/slurm22/slurm_relaunch.py"""

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slurm_cluster  # noqa: E402

REPO = slurm_cluster.REPO
OUT = slurm_cluster.ROOT / "run"


def kill_after_step(cluster, step: int, node: int) -> None:
    metrics = OUT / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if metrics.exists() and sum(1 for _ in metrics.open()) >= step:
            killed = cluster.kill_node(node)
            print(f"probe: node {node} SIGKILLed after step {step} at {time.time():.3f} "
                  f"({len(killed)} processes)", flush=True)
            return
        time.sleep(0.2)


def command(cluster) -> list[str]:
    cidr = cluster.cidr
    mpi = ["--mca", "btl_tcp_if_include", cidr, "--prtemca", "oob_tcp_if_include", cidr,
           "--map-by", "ppr:1:node", *os.environ.get("PROBE_MPI_ARGS", "").split()]
    log = slurm_cluster.ROOT / "launcher.log"
    return ["salloc", "--no-kill", "-N", str(len(cluster.names)), "--ntasks-per-node=1",
            "sh", "-c", f'exec "$@" > {log} 2>&1', "launcher",
            sys.executable, "-m", "recover_hsdp.cli.launch", "train",
            "--config", str(REPO / "torchtitan_configs" / "debug_cpu.toml"),
            "--replicas", "3", "--out", str(OUT), "--end-grace", "10",
            *[f"--mpi-arg={a}" for a in mpi], "--",
            "--training.steps", "12", "--recover.timeouts.hang_s", "30",
            "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.folder", str(slurm_cluster.ROOT / "ckpt")]


if __name__ == "__main__":
    os.environ.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
                      PATH=f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}")
    os.environ.setdefault("PROBE_TIMEOUT", "400")
    slurm_cluster.COMMAND_FOR = command
    slurm_cluster.BEFORE_COMMAND = lambda cluster: threading.Thread(
        target=kill_after_step, args=(cluster, 3, 2), daemon=True).start()
    rc = slurm_cluster.main()
    summary = OUT / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        print("summary:", json.dumps({k: s.get(k) for k in ("completed", "alive_replicas",
                                                             "relaunches")}, indent=1))
        steps = [json.loads(line) for line in (OUT / "metrics.jsonl").open()]
        print("steps:", [(r["step"], r.get("alive_replicas"), r.get("reduced_microbatches"))
                         for r in steps])
    sys.exit(rc)
