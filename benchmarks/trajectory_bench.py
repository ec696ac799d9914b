"""Loss trajectory: failure-free vs ReCoVer losing half of its replicas (4 -> 2).

    python benchmarks/trajectory_bench.py [--quick] [--steps 30] [--replicas 4]

For each data assignment (``exact``: every step commits the failure-free microbatch ids;
``stream``: each replica draws from its own shard of the stream, as in the paper) it runs the
failure-free job and the same job with R/2 replicas really SIGKILLed (one at a time, spread over
the run, alternating the grad_sync and backward phases), and reports mean and max |dloss| per
step. In stream mode the steps after a failure see other microbatches, so the figure to compare
with is the noise floor: a failure-free run with another order of the same data (the exact
mode's shuffled windows of the same corpus; the stream itself is read in dataset order).
Writes benchmarks/results/trajectory.json and trajectory.png.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from _common import RESULTS, machine, plt, read_jsonl, supervise, train_command, write_json


def run(work: Path, name: str, replicas: int, steps: int, extra: list[str],
        faults: list[str] = ()) -> list[dict]:
    out = work / name
    seg = supervise(train_command(out, replicas, stock=False, faults=faults, overrides=[
        "--training.steps", str(steps), "--recover.timeouts.hang_s", "10", *extra]), out)
    rows = read_jsonl(out / "metrics.jsonl")
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise RuntimeError(f"{name}: did not commit steps 1..{steps}: see {seg.log}")
    return rows


def dloss(a: list[dict], b: list[dict]) -> dict:
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
    return {"mean": statistics.fmean(diffs), "max": max(diffs), "per_step": diffs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", default="exact,stream")
    parser.add_argument("--no-noise-floor", action="store_true")
    parser.add_argument("--quick", action="store_true", help="12 steps")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps = 12
    lost = args.replicas // 2
    fail_steps = [round(args.steps * (i + 1) / (lost + 1)) for i in range(lost)]
    faults = [f"replica={i + 1},step={s},phase={'grad_sync' if i % 2 == 0 else 'backward'}"
              for i, s in enumerate(fail_steps)]
    work = Path(tempfile.mkdtemp(prefix="recover_traj_"))
    result = {"machine": machine(), "args": vars(args), "faults": faults, "modes": {}}
    references: dict[str, list[dict]] = {}
    try:
        for mode in args.modes.split(","):
            extra = ["--recover.workload.data_assignment", mode]
            ref = run(work, f"{mode}_ref", args.replicas, args.steps, extra)
            failed = run(work, f"{mode}_failures", args.replicas, args.steps, extra, faults)
            entry = {"reference": [r["loss"] for r in ref],
                     "with_failures": [r["loss"] for r in failed],
                     "alive_replicas": [r["alive_replicas"] for r in failed],
                     "committed_microbatches": [r["committed_microbatches"] for r in failed],
                     "reduced_microbatches": [r["reduced_microbatches"] for r in failed],
                     "dloss": dloss(failed, ref)}
            if mode == "stream" and not args.no_noise_floor:
                other = references.get("exact") or run(
                    work, "exact_ref", args.replicas, args.steps,
                    ["--recover.workload.data_assignment", "exact"])
                entry["other_data_order"] = [r["loss"] for r in other]
                entry["noise_floor"] = dloss(other, ref)
            result["modes"][mode] = entry
            references[mode] = ref
            line = (f"{mode}: mean |dloss| {entry['dloss']['mean']:.2e}, max "
                    f"{entry['dloss']['max']:.2e}")
            if "noise_floor" in entry:
                line += (f" (noise floor, other data order: mean "
                         f"{entry['noise_floor']['mean']:.2e}, max {entry['noise_floor']['max']:.2e})")
            print(line, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    path = write_json("trajectory.json", result)
    _plot(result, RESULTS / "trajectory.png")
    print(markdown(result))
    print(f"wrote {path} and {RESULTS / 'trajectory.png'}")


def markdown(result) -> str:
    lines = ["| data assignment | replicas | mean abs(dloss) | max abs(dloss) | noise floor "
             "(other data order) mean / max |", "|---|---|---|---|---|"]
    for mode, entry in result["modes"].items():
        alive = entry["alive_replicas"]
        floor = entry.get("noise_floor")
        floor_text = f"{floor['mean']:.2e} / {floor['max']:.2e}" if floor else "-"
        lines.append(f"| {mode} | {alive[0]} -> {alive[-1]} | {entry['dloss']['mean']:.2e} | "
                     f"{entry['dloss']['max']:.2e} | {floor_text} |")
    return "\n".join(lines)


def _plot(result, path: Path) -> None:
    pyplot = plt()
    modes = list(result["modes"])
    fig, axes = pyplot.subplots(2, len(modes), figsize=(5 * len(modes), 6), sharex=True,
                                gridspec_kw={"height_ratios": [3, 1.3]}, squeeze=False)
    for col, mode in enumerate(modes):
        entry = result["modes"][mode]
        steps = list(range(1, len(entry["reference"]) + 1))
        ax = axes[0][col]
        ax.plot(steps, entry["reference"], label="failure-free", lw=2)
        ax.plot(steps, entry["with_failures"], "--", label="ReCoVer, replicas 4 -> 2")
        if "other_data_order" in entry:
            ax.plot(steps, entry["other_data_order"], ":", label="failure-free, other data order")
        for step, (a, b) in enumerate(zip(entry["alive_replicas"], entry["alive_replicas"][1:]),
                                      start=2):
            if b < a:
                ax.axvline(step, color="red", lw=0.6)
        ax.set_title(f"{mode} data assignment")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
        low = axes[1][col]
        low.semilogy(steps, [max(d, 1e-9) for d in entry["dloss"]["per_step"]],
                     label="|dloss| vs failure-free")
        if "noise_floor" in entry:
            low.semilogy(steps, [max(d, 1e-9) for d in entry["noise_floor"]["per_step"]], ":",
                         label="noise floor")
        low.set_xlabel("step")
        low.set_ylabel("|dloss|")
        low.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
