"""Cost of one failure: checkpoint-restart with DCP every N steps vs ReCoVer, component by component.

    python benchmarks/failure_cost_bench.py [--quick] [--intervals 2,4,8,16] [--replicas 4]

For each checkpoint interval N the failure lands mid-interval, after step k = N + N/2 (so N/2
steps are lost, the expected loss of a failure at a uniformly random step), and the run has
k + 2 steps. Side by side, in the same loop iteration:

checkpoint-restart (stock TorchTitan HSDP via torchrun + DCP every N steps; rank 1 SIGKILLed by
this supervisor right after step k committed; relaunched on R-1 replicas, same global batch):
  detect + exit   kill -> the launcher has exited (torchrun saw the death and stopped the job)
  restart init    relaunch -> TorchTitan starts loading the checkpoint, plus load end -> first
                  step starts (process start, rendezvous, model build, FSDP, dataloader)
  checkpoint load TorchTitan's "Finished loading the checkpoint in X seconds" (slowest rank)
  rerun           wall time of re-running the lost steps (last checkpoint + 1 .. k)
  save            TorchTitan's "Finished saving the checkpoint ... in X seconds" per save (slowest
                  rank); saves per failure = the saves the run made before the failure
ReCoVer (same job via mpirun, ``--fault replica=1,step=k+1,phase=grad_sync``: a real SIGKILL
during the gradient sync of step k+1), from events.jsonl:
  detect, repair (shrink + agree), extra compute (re-planned microbatches), restore (+ re-reduce)
  failure-step excess = step time of step k+1 - median step time of the later steps (same G)

Writes benchmarks/results/failure_cost.json and failure_cost.png.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from _common import RESULTS, machine, median, plt, write_json
from checkpoint_restart_bench import run_checkpoint_restart, run_recover

CR_PARTS = ("detect_exit_s", "restart_init_s", "load_s", "rerun_s")
RC_PARTS = ("detect_s", "repair_s", "extra_compute_s", "restore_s")


def checkpoint_restart_cost(run: dict, k: int, interval: int) -> dict:
    before, after = run["segments"][0], run["segments"][1]
    step_time = {int(s): t for s, t in after["step_time_s"].items()}
    seen = {int(s): t for s, t in after["step_seen"].items()}
    first = min(seen)
    first_start = seen[first] - step_time[first]
    load = max(after["checkpoint_loads_s"]) if after["checkpoint_loads_s"] else 0.0
    load_begin = after["load_begin"]
    init = (load_begin - after["launched"]) + (first_start - (load_begin + load))
    saves = before["checkpoint_saves_s"]
    cost = {
        "failure_after_step": k, "last_checkpoint": first - 1,
        "lost_steps": k - (first - 1),
        "detect_exit_s": before["ended"] - before["killed_at"],
        "restart_init_s": init, "load_s": load,
        "rerun_s": seen[k] - first_start,
        "save_s_each": median(saves), "saves_before_failure": len(saves),
        "save_s_total": sum(saves),
        "step_time_s_before": median([t for s, t in before["step_time_s"].items()
                                      if int(s) > 1]),
    }
    cost["total_s"] = sum(cost[p] for p in CR_PARTS)
    cost["total_with_saves_s"] = cost["total_s"] + cost["save_s_total"]
    return cost


def recover_cost(run: dict, k: int) -> dict:
    event = run["events"][0]
    times = {r["step"]: r["step_time_s"] for r in run["metrics"]}
    steady = median([times[s] for s in times if s > k + 1])
    cost = {p: event[p] for p in RC_PARTS}
    cost["total_s"] = sum(cost.values())
    cost["failure_step_s"] = times[k + 1]
    cost["steady_step_s"] = steady
    cost["failure_step_excess_s"] = times[k + 1] - steady
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--intervals", default="2,4,8,16")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--local-batch", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="intervals 2,4 only")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.intervals = "2,4"
    rows = []
    for interval in [int(x) for x in args.intervals.split(",")]:
        k = interval + max(1, interval // 2)
        steps = k + 2
        work = Path(tempfile.mkdtemp(prefix=f"recover_cost_N{interval}_"))
        try:
            cr = run_checkpoint_restart(work / "cr", args.replicas, steps, [k], interval,
                                        args.global_batch, args.local_batch)
            rc = run_recover(work, args.replicas, steps, [k], args.global_batch,
                             args.local_batch)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        row = {"interval": interval, "checkpoint_restart": checkpoint_restart_cost(cr, k, interval),
               "recover": recover_cost(rc, k)}
        row["ratio_total"] = row["checkpoint_restart"]["total_s"] / row["recover"]["total_s"]
        rows.append(row)
        c, r = row["checkpoint_restart"], row["recover"]
        print(f"N={interval}: checkpoint-restart {c['total_s']:.1f}s (lost {c['lost_steps']} "
              f"steps) vs ReCoVer {r['total_s']:.2f}s", flush=True)
    result = {"machine": machine(), "args": vars(args), "rows": rows,
              "recover_median": {p: median(r["recover"][p] for r in rows)
                                 for p in (*RC_PARTS, "total_s", "failure_step_excess_s")}}
    path = write_json("failure_cost.json", result)
    _plot(rows, RESULTS / "failure_cost.png")
    print(markdown(result))
    print(f"wrote {path} and {RESULTS / 'failure_cost.png'}")


def markdown(result) -> str:
    lines = ["| N | lost steps | detect+exit | restart init | ckpt load | rerun | "
             "**C/R total** | save (each x count) | ReCoVer detect | repair | extra compute | "
             "restore | **ReCoVer total** | ReCoVer failure-step excess | C/R / ReCoVer |",
             "|" + "---|" * 15]
    for row in result["rows"]:
        c, r = row["checkpoint_restart"], row["recover"]
        lines.append(
            f"| {row['interval']} | {c['lost_steps']} | {c['detect_exit_s']:.2f} | "
            f"{c['restart_init_s']:.2f} | {c['load_s']:.2f} | {c['rerun_s']:.2f} | "
            f"**{c['total_s']:.2f}** | {c['save_s_each']:.2f} x {c['saves_before_failure']} | "
            f"{r['detect_s']:.3f} | {r['repair_s']:.3f} | {r['extra_compute_s']:.3f} | "
            f"{r['restore_s']:.3f} | **{r['total_s']:.2f}** | {r['failure_step_excess_s']:.2f} | "
            f"{row['ratio_total']:.1f} |")
    lines.append("\nAll times in seconds.")
    return "\n".join(lines)


def _plot(rows, path: Path) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8, 4))
    cr_parts = [("detect_exit_s", "detect + exit"), ("restart_init_s", "restart init"),
                ("load_s", "checkpoint load"), ("rerun_s", "rerun lost steps"),
                ("save_s_total", "saves before the failure")]
    rc_parts = [("detect_s", "ReCoVer detect"), ("repair_s", "ReCoVer repair"),
                ("extra_compute_s", "ReCoVer extra compute"), ("restore_s", "ReCoVer restore")]
    xs = list(range(len(rows)))
    width = 0.38
    bottom = [0.0] * len(rows)
    for index, (key, label) in enumerate(cr_parts):
        values = [row["checkpoint_restart"][key] for row in rows]
        ax.bar([x - width / 2 for x in xs], values, width, bottom=bottom, label=label,
               color=f"C{index}", hatch="//" if key == "save_s_total" else None)
        bottom = [b + v for b, v in zip(bottom, values)]
    bottom = [0.0] * len(rows)
    for index, (key, label) in enumerate(rc_parts):
        values = [row["recover"][key] for row in rows]
        ax.bar([x + width / 2 for x in xs], values, width, bottom=bottom, label=label,
               color=f"C{index + 5}")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(xs, [f"N={row['interval']}\nC/R | ReCoVer" for row in rows])
    ax.set_ylabel("seconds per failure")
    ax.set_title("Cost of one failure (tiny CPU model, 4 replicas)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
