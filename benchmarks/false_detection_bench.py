"""False deaths at start-up under CPU pressure, before and after [Note: detection margins by phase].

The run: 3 namespace nodes (tests/netns_cluster.py), 3 replicas x 3 ranks (``--map-by
ppr:3:node``), the debug model for ``--steps`` steps, a busy process per core beside it (``--hog``),
no injected fault: every death in it is a false one. Two settings, side by side, run after run:

* ``before``: lazy MPI connections (``preconnect_max_ranks = 0``) and no margin for the
  replica heartbeat (``slow_phase_s = detect_s``), i.e. the detectors as they were;
* ``after``: the defaults (every connection opened in MPI_Init, ``slow_phase_s`` 30 s).

Counted in each run's log (Open MPI's ``mpi_ft_verbose 1`` lines included): the detector thread's
missed send deadlines ("MISSED my SEND deadline", the cause), live ranks declared dead ("now
suspected dead", "reported dead by someone else"), replica-heartbeat leaves ("(replica
heartbeat)"), relaunches, and whether the run completed with every replica. Also the largest
send gap Open MPI reported (the margin it took), and the seconds from the launch to the first
committed step.

    sudo python benchmarks/false_detection_bench.py --runs 5 --hog 2    # ~20 min on 2 cores

``--cut-step 3 --steps 14 --checkpoint-interval 2 --settings after --hog 0``: issue 35's run (node
2's link cut after step 3, so the relaunch tier takes over from the emergency checkpoint); then
a run passes if it completed with every step once.

Results: benchmarks/results/false_detection.json. Nothing here is imported by the product.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests")]

from _common import CONFIG, REPO, RESULTS, machine  # noqa: E402
from netns_cluster import NetnsCluster, available  # noqa: E402

SETTINGS = {"before": ["--recover.timeouts.preconnect_max_ranks", "0",
                       "--recover.timeouts.slow_phase_s", "4"],
            "after": []}
MISSED = re.compile(r"MISSED my SEND \d+ deadline by ([0-9.e+-]+)")
COUNTS = {"missed_send": "MISSED my SEND", "suspected": "now suspected dead",
          "aborted_live": "reported dead by someone else", "heartbeat_leaves": "(replica heartbeat)",
          "relaunches": "recover-hsdp: relaunch ",
          "segfaults": "Signal: Segmentation fault", "null_jumps": "Failing at address: (nil)"}
SUSPECTED = re.compile(r"^\[([\w.-]+):\d+\].*proc (\d+) now suspected dead", re.M)
ABORTED = re.compile(r"^\[([\w.-]+):\d+\].*reported dead by someone else", re.M)
FALSE = ("false_suspected", "false_aborted", "false_heartbeat_leaves")
TAGGED = re.compile(r"^\[([\w.-]+):\d+\] \[\[\d+,\d+\],(\d+)\]", re.M)
CLOSED = "Process group destroyed"  # TorchTitan's close, after the last step
ENDING = "ending mpirun"  # the launcher ends an attempt to relaunch it
SUMMARY = re.compile(r"^recover-hsdp: \d+ steps, final loss", re.M)
# [Note: a steady timeout learned from beat gaps]: each rank whose steady bound widened says so
LEARNED = re.compile(r"(Open MPI's detector|the replica heartbeat): beats came up to ([0-9.]+) s "
                     r"apart, so a silence was allowed up to ([0-9.]+) s")


def learned_bounds(text: str) -> dict:
    """The widest steady bound each signal learned (the detection time it cost) and the
    largest gap behind it, over the run's ranks."""
    found = {}
    for signal, gap, bound in LEARNED.findall(text):
        key = "detector" if signal.startswith("Open") else "heartbeat"
        found[f"{key}_widest_bound_s"] = max(found.get(f"{key}_widest_bound_s", 0.0), float(bound))
        found[f"{key}_largest_gap_s"] = max(found.get(f"{key}_largest_gap_s", 0.0), float(gap))
        found[f"{key}_ranks_widened"] = found.get(f"{key}_ranks_widened", 0) + 1
    return found


def false_deaths(text: str, hosts: list[list[str]], cut: bool, round_robin: bool = False) -> dict:
    """Live ranks taken for dead, from the log: Open MPI's suspicions and its aborts of an
    accused rank, and the replica heartbeat's leaves, until the last attempt's ranks close their
    groups after the last step (ranks that exit then are not failures). ``hosts``: each
    attempt's job rank -> host (the registry), corrected by what Open MPI's lines print (MPI
    rank -> host: they differ under ``--rank-by node``, where the first attempt's MPI rank r is
    on node r mod 3). With ``cut``: a suspicion of a rank on node 2 (the cut one), and an abort
    printed there, are the real failure, not false; so is what follows the launcher ending an
    attempt to relaunch it (its ranks are ended)."""
    end = SUMMARY.search(text)
    text = text[:end.start()] if end else text
    attempts = re.split(r"^\+ \S*mpirun ", text, flags=re.M)[1:] or [text]
    closed = attempts[-1].find(CLOSED)  # the run is over: its ranks exit from here
    if end and closed >= 0:
        attempts[-1] = attempts[-1][:closed]
    found = {"false_suspected": 0, "false_aborted": 0,
             "false_heartbeat_leaves": sum(a.count("(replica heartbeat)") for a in attempts)}
    for index, part in enumerate(attempts):
        ended = part.find(ENDING)
        part = part[:ended] if ended >= 0 else part
        ranks = dict(enumerate(hosts[index] if index < len(hosts) else []))
        if round_robin and index == 0:
            ranks = {r: f"n{r % 3}" for r in range(len(ranks))}
        ranks.update({int(r): h for h, r in TAGGED.findall(part)})  # MPI rank -> host, as printed
        for host, proc in SUSPECTED.findall(part):
            on_cut = ranks.get(int(proc), "").endswith("n2")
            found["false_suspected"] += not (cut and on_cut)
        for host in ABORTED.findall(part):
            found["false_aborted"] += not (cut and host.endswith("n2"))
    return found


def one_run(index: int, setting: str, steps: int, hog: int, root: Path, cut_step: int = 0,
            checkpoint_interval: int = 0, rank_by_node: bool = False) -> dict:
    run, cut_at = root / f"{setting}-{index}", cut_step
    subprocess.run(["rm", "-rf", str(run)], check=False)
    run.mkdir(parents=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hog)]
    started = time.time()
    try:
        with NetnsCluster(3, prefix=f"fdb{index % 10}{setting[0]}",
                          subnet=f"10.236.{index % 200 + (0 if setting == 'before' else 50)}") as c:
            mpi = [*c.mpirun_args(), "--map-by", "ppr:3:node", "--mca", "mpi_ft_verbose", "1",
                   "--rank-by", "node" if rank_by_node else "slot"]  # the launcher's: node
            argv = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config",
                    str(CONFIG), "--replicas", "3", "--ranks-per-replica", "3", "--out",
                    str(run / "out"), "--end-grace", "10", *[f"--mpi-arg={a}" for a in mpi], "--",
                    "--training.steps", str(steps), "--recover.timeouts.hang_s", "60",
                    *SETTINGS[setting]]
            if checkpoint_interval:
                argv += ["--checkpoint.enable", "--checkpoint.interval", str(checkpoint_interval),
                         "--checkpoint.folder", str(run / "ckpt")]
            with open(run / "run.log", "w") as log:
                proc = c.popen(0, argv, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                               stdout=log, stderr=log, cwd=str(REPO))
                metrics, first = run / "out" / "metrics.jsonl", None
                deadline = time.time() + 1200
                while proc.poll() is None and time.time() < deadline:
                    if first is None and metrics.exists() and metrics.stat().st_size > 0:
                        first = time.time()
                    if cut_step and metrics.exists() and \
                            len(metrics.read_text().splitlines()) >= cut_step:
                        c.link_down(2)
                        cut_step = 0
                    time.sleep(0.2)
                if proc.poll() is None:
                    proc.kill()
                returncode = proc.wait()
    finally:
        for h in hogs:
            h.kill()
    text = (run / "run.log").read_text(errors="replace")
    summary_path = run / "out" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    gaps = [float(g) for g in MISSED.findall(text)]
    records = []
    if (run / "out" / "metrics.jsonl").exists():
        records = [json.loads(line) for line in
                   (run / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_done = [r["step"] for r in records]
    hosts = attempt_hosts(run)
    return {"setting": setting, "run": index, "exit": returncode,
            "completed": bool(summary.get("completed")),
            "every_step_once": steps_done == list(range(1, steps + 1)),
            "b_every_step": bool(records) and all(r["reduced_microbatches"] == 3 for r in records),
            "replicas_per_step": [r["alive_replicas"] for r in records],
            "alive_replicas": summary.get("alive_replicas"),
            "attempts": summary.get("attempts", 1), "wall_s": round(time.time() - started, 1),
            "first_step_at_s": round(first - started, 1) if first else None,
            "largest_send_gap_s": max(gaps, default=0.0),
            **{name: text.count(mark) for name, mark in COUNTS.items()},
            **learned_bounds(text),
            **false_deaths(text, hosts, cut=bool(cut_at), round_robin=rank_by_node)}


def attempt_hosts(run: Path) -> list[list[str]]:
    """Each attempt's rank -> host (the job's registry; a relaunched run keeps each earlier
    attempt's under relaunch/attempt-K)."""
    earlier = sorted((run / "out" / "relaunch").glob("attempt-*"),
                     key=lambda p: int(p.name.split("-")[1]))
    found = []
    for procs in [*(p / "procs.json" for p in earlier), run / "out" / "procs.json"]:
        found.append([p["host"] for p in json.loads(procs.read_text())]
                     if procs.exists() else [])
    return found


def totals_of(rows: list[dict], settings: list[str]) -> dict:
    totals = {}
    for setting in settings:
        mine = [r for r in rows if r["setting"] == setting]
        totals[setting] = {
            "runs": len(mine),
            "runs_with_a_false_death": sum(1 for r in mine if r["false_suspected"]
                                           or r["false_aborted"] or r["false_heartbeat_leaves"]),
            "runs_completed_with_every_replica": sum(1 for r in mine if r["completed"]
                                                     and r["alive_replicas"] == 3
                                                     and r["attempts"] == 1),
            "runs_completed_every_step_once": sum(1 for r in mine if r["completed"]
                                                  and r["every_step_once"] and r["exit"] == 0),
            **{name: sum(r[name] for r in mine) for name in [*COUNTS, *FALSE]},
            "largest_send_gap_s": max((r["largest_send_gap_s"] for r in mine), default=0.0),
            **{key: max((r.get(key, 0.0) for r in mine), default=0.0)
               for key in ("detector_widest_bound_s", "heartbeat_widest_bound_s")}}
    return totals


def reanalyse(path: Path, root: Path) -> None:
    data = json.loads(path.read_text())
    for row in data["runs"]:
        run = root / f"{row['setting']}-{row['run']}"
        text = (run / "run.log").read_text(errors="replace")
        row.update({name: text.count(mark) for name, mark in COUNTS.items()})
        row.update(false_deaths(text, attempt_hosts(run), cut=bool(data["args"]["cut_step"]),
                                round_robin=data["args"].get("rank_by_node", False)))
    data["totals"] = totals_of(data["runs"], data["args"]["settings"].split(","))
    path.write_text(json.dumps(data, indent=1))
    print(json.dumps(data["totals"], indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hog", type=int, default=2, help="busy processes beside the job")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--settings", default="before,after")
    parser.add_argument("--root", default="/tmp/recover_hsdp_false_detection")
    parser.add_argument("--cut-step", type=int, default=0, help="cut node 2's link after it")
    parser.add_argument("--checkpoint-interval", type=int, default=0)
    parser.add_argument("--rank-by-node", action="store_true",
                        help="MPI ranks numbered round-robin over the nodes (the launcher's "
                             "default: [Note: host-interleaved ranks]); without it host by host "
                             "(--rank-by slot), as the results before it were measured")
    parser.add_argument("--results", default="false_detection.json")
    parser.add_argument("--reanalyse", action="store_true",
                        help="recount the false deaths of --results from the logs under --root")
    args = parser.parse_args()
    if args.reanalyse:
        return reanalyse(RESULTS / args.results, Path(args.root))
    ok, why = available()
    if not ok:
        raise SystemExit(f"needs network namespaces: {why}")
    rows = []
    for index in range(args.runs):
        for setting in args.settings.split(","):
            row = one_run(index, setting, args.steps, args.hog, Path(args.root), args.cut_step,
                          args.checkpoint_interval, args.rank_by_node)
            rows.append(row)
            print(json.dumps(row), flush=True)
    totals = totals_of(rows, args.settings.split(","))
    print(json.dumps(totals, indent=1))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.results).write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "totals": totals, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
