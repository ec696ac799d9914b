"""The relaunch tier vs a checkpoint-restart by hand, for the failures PRRTE 3.0 cannot survive.

    python benchmarks/relaunch_bench.py [--repeats 1] [--faults link_down,kill_node]
        [--steps 16] [--interval 4] [--keepalive 30]

On a 4-node namespace cluster (tests/netns_cluster.py; needs root) a 3 x 1 job (nodes 0-2,
node 3 standing by in the hostfile, exact mode, a DCP checkpoint every ``--interval`` steps)
loses node 2 after step 5: its link cut (``link_down``) or every process on it SIGKILLed with
its PRRTE daemon (``kill_node``). PRRTE ends the MPI job either way.

* ``relaunch``: ``recover-hsdp train`` as shipped ([Note: the relaunch tier]): it relaunches
  from the newest complete checkpoint (an emergency one after a cut link, [Note: emergency
  checkpoint]) on nodes 0, 1, 3.
* ``by_hand``: the same job with ``--recover.tiers.max_relaunches 0`` and no emergency checkpoint
  (``--recover.tiers.no-emergency_checkpoint``: only the periodic ones); the moment the launcher
  returns, this script (an operator with zero reaction time: a lower bound) starts the same
  command on nodes 0, 1, 3 with ``--checkpoint.load_step`` = the newest complete checkpoint.
  Both use ``--keepalive`` seconds of PRRTE keepalive (at PRRTE's defaults a cut link ends the
  job ~488 s after the cut, measured: docs/ULFM_NOTES.md).

Figures: seconds from the fault (this script's clock) to the first step committed again (the
first metrics line of the new job), and steps redone. Writes benchmarks/results/relaunch.json.
"""

from __future__ import annotations

import argparse
import json
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


def _argv(cluster, out, ckpt, steps, interval, keepalive, hostfile, extra=()):
    mpi = [*cluster.mpirun_args(), "--map-by", "ppr:1:node"]
    index = mpi.index("--hostfile")
    mpi[index + 1] = str(hostfile)
    return [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(CONFIG),
            "--replicas", "3", "--out", str(out), "--end-grace", "10",
            *[f"--mpi-arg={a}" for a in mpi], "--", "--training.steps", str(steps),
            "--recover.timeouts.hang_s", "30", "--checkpoint.enable", "--checkpoint.interval",
            str(interval), "--checkpoint.folder", str(ckpt),
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


def one_run(mode: str, fault: str, steps: int, interval: int, keepalive: float, salt: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="rh-relaunch-"))
    out, ckpt = root / "run", root / "ckpt"
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with NetnsCluster(4, prefix=f"rh22bb{salt % 10}", subnet=f"10.231.{41 + salt % 5}") as c:
        extra = ["--recover.tiers.max_relaunches", "0", "--recover.tiers.no-emergency_checkpoint"] \
            if mode == "by_hand" else []
        log = open(root / "run.log", "w")
        proc = c.popen(0, _argv(c, out, ckpt, steps, interval, keepalive, c.hostfile, extra),
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
                                    ["--checkpoint.load_step", str(resume)]),
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
                      "launcher_failure_to_training_s": record["failure_to_training_s"]}
        log.close()
    return {"mode": mode, "fault": fault, "fault_to_training_s": again - fault_at, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--faults", default="link_down,kill_node")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--keepalive", type=float, default=30.0)
    args = parser.parse_args()
    runs = []
    salt = 0
    for _ in range(args.repeats):
        for fault in args.faults.split(","):
            for mode in ("relaunch", "by_hand"):
                salt += 1
                run = one_run(mode, fault, args.steps, args.interval, args.keepalive, salt)
                print(json.dumps(run), flush=True)
                runs.append(run)
    table = {}
    for fault in args.faults.split(","):
        for mode in ("relaunch", "by_hand"):
            mine = [r for r in runs if r["fault"] == fault and r["mode"] == mode]
            table[f"{fault}/{mode}"] = {
                "fault_to_training_s_median": statistics.median(r["fault_to_training_s"]
                                                                for r in mine),
                "steps_lost": [r["steps_lost"] for r in mine]}
    print(json.dumps(table, indent=2))
    write_json("relaunch.json", {"machine": machine(), "args": vars(args),
                                           "runs": runs, "table": table})


if __name__ == "__main__":
    main()
