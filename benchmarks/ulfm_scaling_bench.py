"""The fault-tolerant collectives alone (no torch) at the largest rank count this box holds:
16 ... 256 MPI processes on a namespace cluster (issue 34 item 2).

    python benchmarks/ulfm_scaling_bench.py [--ranks 16 32 64 128 256] [--nodes 4]
                                            [--iters 20] [--detect-s 60] [--results F]

``--detect-s 0`` runs without Open MPI's heartbeat detector (``mpi_ft_detector false``): every
death here is a SIGKILL, which PRRTE reports on its own (the daemon sees its child exit), so
the collectives' costs can be measured past the sizes where the detector's start-up breaks
(below); a frozen rank or a cut link would then go unseen.

Each size is one ULFM job (``recover_hsdp.collectives.mpirun`` flags, Open MPI's heartbeat
detector on its thread with a ``--detect-s`` timeout: slowed, so 256 Python processes on 2 cores
raise no false alarm) spread evenly over ``--nodes`` network-namespace "nodes"
(tests/netns_cluster.py; one replica = one rank). Every rank runs, over ``FaultTolerantWorld``:

  reduce   ``allreduce_global`` of 8 int64 (the step's totals are this kind of call), checked
  agree    ``consensus(True)``: the fault-tolerant agreement every step makes (MPI_Comm_agree)
  1 death  one rank SIGKILLs itself right before a reduce; the survivors' reduce fails, their
           consensus revokes, shrinks, agrees on the dead and rebuilds the communicators
  4 deaths four ranks, spread evenly over the ranks, the same way at once

Times: one call = the slowest rank's, median over ``--iters``; a death: from the victims' kill
(their wall clock, written just before) to the survivors' decision that the epoch was not clean
(detect) and to the rebuilt communicators (repair = ``ConsensusResult.repair_s``), the slowest
survivor; the phases of the repair (revoke + shrink, rebuild, the agreement on the membership)
from the world's ``on_phase`` marks. After each death the survivors reduce again and check the
sum. Writes benchmarks/results/ulfm_scaling.json and prints the table with the fit in log P.
Needs root (namespaces). ~10 min with the defaults on this box.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


# ----------------------------------------------------------------------------- inner (each rank)
def inner(out: str, iters: int, deaths: list[list[int]]) -> None:
    import numpy as np

    from recover_hsdp.collectives import MPI, Deadlines, FaultTolerantWorld

    comm = MPI.COMM_WORLD
    me, size = comm.Get_rank(), comm.Get_size()
    marks: list[tuple[str, float]] = []
    world = FaultTolerantWorld(comm, 1, Deadlines(call_s=900.0, repair_s=1200.0,
                                                  hang_timeout_s=None),
                               on_phase=lambda name: marks.append((name, time.time())))
    log: dict = {"rank": me, "size": size, "host": os.uname().nodename, "reduce": [],
                 "agree": [], "deaths": [], "errors": 0, "ok_but_partial": 0}

    def reduce_checked(count: bool = True) -> bool:
        """The reduce, its sum checked (``count``: a wrong sum is an error; False in the
        call a death breaks: a rank may return success there without every contribution,
        ULFM's errors are not uniform, and the consensus declares the epoch failed)."""
        values = np.full(8, me + 1, np.int64)
        ok = world.allreduce_global(values)
        want = sum(r + 1 for r in world.layout.alive_ranks())
        if ok and not (values == want).all():
            log["errors" if count else "ok_but_partial"] += 1
            if count:
                log.setdefault("wrong", []).append({"got": values.tolist(), "want": want,
                                                    "epoch": world.epoch,
                                                    "done": [len(log["reduce"]),
                                                             len(log["agree"]),
                                                             len(log["deaths"])]})
        return ok

    world.consensus(reduce_checked())  # warm: connections made
    for _ in range(iters):
        started = time.perf_counter()
        assert reduce_checked()
        log["reduce"].append(time.perf_counter() - started)
    for _ in range(iters):
        started = time.perf_counter()
        assert world.consensus(True).clean
        log["agree"].append(time.perf_counter() - started)
    for victims in deaths:
        if me in victims:
            Path(out, f"kill{me}.json").write_text(json.dumps({"t": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        marks.clear()
        entered = time.time()
        ok = reduce_checked(count=False)
        result = world.consensus(ok)
        decided = time.time() - result.repair_s
        log["deaths"].append({
            "victims": victims, "reduce_ok": ok, "clean": result.clean,
            "dead": sorted(result.dead_replicas), "alive": len(result.alive_replicas),
            "entered": entered, "decided": decided, "repaired": time.time(),
            "detect_s": result.detect_s, "repair_s": result.repair_s, "rounds": result.rounds,
            "marks": list(marks)})
        # the survivors reduce again and agree the epoch was clean before the next victims go:
        # (a victim that leaves right after its own part of a reduce can break a peer's)
        log["deaths"][-1]["after_ok"] = world.consensus(reduce_checked()).clean
    world.finish()
    Path(out, f"rank{me}.json").write_text(json.dumps(log))


# ----------------------------------------------------------------------------- driver
def spread(count: int, size: int, taken: set[int]) -> list[int]:
    """``count`` ranks spread evenly over 1 .. size - 1, none of ``taken`` (rank 0 stays)."""
    out = []
    for k in range(count):
        r = max(1, (size * (2 * k + 1)) // (2 * count))
        while r in taken or r in out:
            r = r % (size - 1) + 1
        out.append(r)
    return sorted(out)


def run_size(size: int, nodes: int, iters: int, detect_s: float, timeout_s: float) -> dict:
    from netns_cluster import NetnsCluster

    from recover_hsdp.collectives.mpirun import heartbeat_detector_args, mpirun_prefix

    one = spread(1, size, set())
    four = spread(4, size, set(one))
    deaths = [one, four]
    per_node = math.ceil(size / nodes)
    with tempfile.TemporaryDirectory(prefix="ulfm_scale_") as out, \
            NetnsCluster(nodes, prefix=f"rhus{size}", subnet="10.231.77",
                         slots=per_node) as cluster:
        env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        detector = heartbeat_detector_args(detect_s, preconnect=False) if detect_s > 0 else \
            ["--mca", "mpi_ft_detector", "false"]
        cmd = mpirun_prefix(size, env=env, extra=[
            *detector, *cluster.mpirun_args(),
            "--map-by", f"ppr:{per_node}:node"]) + [
            sys.executable, str(Path(__file__).resolve()), "--inner", out, "--iters", str(iters),
            "--deaths", json.dumps(deaths)]
        started = time.time()
        proc = cluster.popen(0, cmd, env=dict(os.environ, **env), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
        try:
            text, _ = proc.communicate(timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            text, rc = proc.communicate()[0], None
        wall = time.time() - started
        logs = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        kills = {int(p.stem[4:]): json.loads(p.read_text())["t"]
                 for p in Path(out).glob("kill*.json")}
    return summarize(size, nodes, deaths, logs, kills, rc, wall, text.decode(errors="replace")
                     if isinstance(text, bytes) else (text or ""))


def summarize(size, nodes, deaths, logs, kills, rc, wall, text) -> dict:
    row = {"ranks": size, "nodes": nodes, "rc": rc, "wall_s": round(wall, 1),
           "finished": len(logs), "expected_finished": size - sum(len(v) for v in deaths),
           "errors": sum(g["errors"] for g in logs), "deaths": [],
           "ok_but_partial": sum(g["ok_but_partial"] for g in logs),
           "wrong": [dict(w, rank=g["rank"]) for g in logs for w in g.get("wrong", [])][:8]}
    if not logs:
        row["log_head"], row["log_tail"] = text[:3000], text[-3000:]
        return row
    for name in ("reduce", "agree"):
        per_iter = [max(g[name][i] for g in logs) for i in range(len(logs[0][name]))]
        row[f"{name}_ms"] = round(1e3 * statistics.median(per_iter), 3)
    for index, victims in enumerate(deaths):
        events = [g["deaths"][index] for g in logs]
        killed = min(kills[v] for v in victims if v in kills)
        phases: dict[str, float] = {}
        for event in events:  # the slowest survivor's time to each phase mark
            for name, t in event["marks"]:
                phases[name] = max(phases.get(name, 0.0), t - killed)
        row["deaths"].append({
            "victims": victims,
            "all_saw_them_dead": all(sorted(e["dead"]) == sorted(victims) for e in events),
            "alive_after": events[0]["alive"], "after_reduce_ok": all(e["after_ok"]
                                                                      for e in events),
            "detect_s": round(max(e["decided"] for e in events) - killed, 3),
            "repaired_s": round(max(e["repaired"] for e in events) - killed, 3),
            "repair_s": round(max(e["repair_s"] for e in events), 3),
            "rounds": max(e["rounds"] for e in events),
            "phase_marks_s": {k: round(v, 3) for k, v in sorted(phases.items(),
                                                                  key=lambda kv: kv[1])}})
    return row


def fit_log(rows: list[dict], key) -> dict | None:
    """Least squares ``a + b log2 P`` over the rows that have ``key``; None if fewer than 2."""
    points = [(math.log2(r["ranks"]), key(r)) for r in rows if key(r) is not None]
    if len(points) < 2:
        return None
    mx = statistics.mean(x for x, _ in points)
    my = statistics.mean(y for _, y in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    a = my - b * mx
    return {"a": a, "b_per_doubling": b, "at_100k_ranks": a + b * math.log2(100_000)}


def combine(paths: list[str], cores: int) -> dict:
    """[Note: extrapolating from an oversubscribed box] The result files of several runs as one
    table (a size measured twice: the run that held, else the first), its plot
    (``results/ulfm_scaling.png``: wall time vs ranks on log axes) and the extrapolation to 100k
    ranks. On this box every rank of a call busy-polls its share of ``cores`` cores, so a call's
    wall time is ~ its ranks' total CPU / ``cores``: the time one rank would take on a core of its
    own is wall x ``cores`` / P (assumption 1). ULFM's agreement and shrink (and the guarded
    reduce's tree) have log P depth, so that per-rank time is fitted as a + b log2 P
    (assumption 2) and read at 100k. Not in it: the network (per hop, microseconds on a real
    fabric, below these CPU times), a detector's timeout before the first notice, stragglers."""
    rows: dict[int, dict] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            held = row.get("finished") == row.get("expected_finished") and row.get("deaths")
            if row["ranks"] not in rows or (held and not rows[row["ranks"]].get("deaths")):
                rows[row["ranks"]] = row
    ordered = [rows[p] for p in sorted(rows)]

    def own_core(value, row):
        return None if value is None else value * cores / row["ranks"]

    keys = {
        "reduce_ms": lambda r: r.get("reduce_ms"),
        "agree_ms": lambda r: r.get("agree_ms"),
        "one_death_repaired_s": lambda r: r["deaths"][0]["repaired_s"] if r.get("deaths")
        else None}
    fits = {name: fit_log(ordered, lambda r, k=key: own_core(k(r), r))
            for name, key in keys.items()}
    try:
        _plot(ordered, keys, cores)
    except ModuleNotFoundError as err:   # matplotlib is optional (pip install -e ".[bench]")
        print(f"no plot ({err})")
    return {"cores": cores, "rows": ordered, "own_core_fits": fits}


def _plot(rows: list[dict], keys: dict, cores: int) -> None:
    from _common import RESULTS, plt

    pyplot = plt()
    figure, axis = pyplot.subplots(figsize=(7, 4.5))
    for name, key in keys.items():
        points = [(r["ranks"], key(r)) for r in rows if key(r) is not None]
        scale = 1e-3 if name.endswith("_ms") else 1.0
        label = name.replace("_ms", "").replace("_s", "")
        line, = axis.plot([p for p, _ in points], [v * scale for _, v in points], "o-",
                          label=f"{label}: wall")
        axis.plot([p for p, _ in points], [v * scale * cores / p for p, v in points], "x--",
                  color=line.get_color(), label=f"{label}: x cores / P (one core per rank)")
    broke = [r["ranks"] for r in rows if not r.get("deaths")]
    for ranks in broke:
        axis.axvline(ranks, color="red", linestyle=":", label=f"{ranks}: broke at start-up")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("MPI ranks (4 namespace nodes, 2 cores)")
    axis.set_ylabel("seconds (slowest rank)")
    axis.set_title("recover_hsdp.collectives alone: time vs ranks")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(RESULTS / "ulfm_scaling.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--deaths", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--detect-s", type=float, default=60.0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--results", default="ulfm_scaling.json")
    parser.add_argument("--combine", nargs="+", metavar="JSON",
                        help="no run: merge these result files, plot, extrapolate ([Note: "
                             "extrapolating from an oversubscribed box])")
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if args.inner:
        inner(args.inner, args.iters, json.loads(args.deaths))
        return
    if args.combine:
        from _common import machine, write_json

        result = combine(args.combine, args.cores)
        path = write_json(args.results, {"machine": machine(), "sources": args.combine,
                                         **result})
        print(json.dumps(result["own_core_fits"], indent=1))
        print(f"wrote {path}")
        return
    rows = []
    for size in args.ranks:
        row = run_size(size, args.nodes, args.iters, args.detect_s, args.timeout_s)
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(args, rows)


def write(args, rows: list[dict]) -> None:
    """The results so far (after every size: a later size may take the box down)."""
    from _common import machine, write_json

    fits = {
        "reduce_ms": fit_log(rows, lambda r: r.get("reduce_ms")),
        "agree_ms": fit_log(rows, lambda r: r.get("agree_ms")),
        "one_death_repaired_s": fit_log(rows, lambda r: r["deaths"][0]["repaired_s"]
                                        if r.get("deaths") else None)}
    path = write_json(args.results, {"machine": machine(), "detect_s": args.detect_s,
                                            "iters": args.iters, "rows": rows, "fits": fits})
    print(json.dumps(fits, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
