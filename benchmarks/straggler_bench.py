"""A straggler absorbed by the policy: step time with rebalancing vs without vs the ideal.

    python benchmarks/straggler_bench.py [--steps 14] [--g 4] [--analyse DIR]

Three real 4 x 1 jobs (debug model, exact data assignment, G microbatches per replica, B = 4 G):
  failure-free  the reference: its median step time T and per-microbatch compute time t;
  slow          replica 3 sleeps t extra before every forward from step 3 on (``mode=slow``:
                2x slower per microbatch), no rebalancing (``straggler_slow_ratio = 0``);
  rebalanced    the same with ``straggler_slow_ratio = 1.5``, ``straggler_patience = 2``
                ([Note: straggler quotas] in recover_hsdp/workload/rebalance.py).
The ideal step time is total work / total speed: T x 4 / 3.5 (three replicas at speed 1, one at
1/2). Because that assumes the speeds of a quiet machine, each slow run also gets its compute
critical path against its own ideal, both from its measured seconds per microbatch s_r and
committed quotas q_r (ledger): max_r q_r s_r vs B / sum_r 1 / s_r. Step times are the medians
over the steps after the rebalancing took effect (step
3 + patience + 1 on), the same steps in both slow runs. The loss of each slow run is compared
with the failure-free run at every step (exact mode: the same ids each step, so it must be the
same trajectory). Caveat on this machine (2 shared cores, 4 processes): a replica that sleeps
frees CPU for the others, so "2x slower" is measured, not assumed (per-replica seconds per
microbatch come from the step records, ``compute_s_per_microbatch``).

Writes benchmarks/results/straggler.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from _common import machine, read_jsonl, train_command, write_json
from recover_hsdp.workload.ledger import ledger_records

SLOW_REPLICA, SLOW_FROM, PATIENCE = 3, 3, 2


def run(out: Path, g: int, steps: int, faults=(), extra=()) -> list[dict]:
    overrides = ["--training.steps", str(steps), "--training.global_batch_size", str(8 * g),
                 "--recover.timeouts.hang_s", "60", *extra]
    command = train_command(out, 4, stock=False, overrides=overrides, faults=list(faults))
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{out.name}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return read_jsonl(out / "metrics.jsonl")


def per_replica(steps: list[dict], first: int) -> dict[str, float]:
    """Median seconds per microbatch of each replica over the steps from ``first`` on."""
    rows = [s["compute_s_per_microbatch"] for s in steps if s["step"] >= first]
    return {r: statistics.median(row[r] for row in rows) for r in rows[0]}


def critical_path(work: Path, name: str, first: int, speeds: dict[str, float]) -> dict:
    """Median over the steps from ``first`` on of max_r q_r s_r, and B / sum 1 / s_r."""
    ledger = [line for line in ledger_records(work / name)
              if line["step"] + 1 >= first]  # ledger steps are 0-based
    paths = [max(len(e["committed"]) * speeds[r] for r, e in line["replicas"].items())
             for line in ledger]
    b = ledger[0]["global_microbatches"]
    ideal = b / sum(1 / s for s in speeds.values())
    path = statistics.median(paths)
    return {"compute_path_s": path, "compute_ideal_s": ideal,
            "over_compute_ideal": path / ideal - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--g", type=int, default=4, help="microbatches per replica (G)")
    parser.add_argument("--analyse", type=Path, help="only read the runs of an earlier call")
    args = parser.parse_args()
    work = args.analyse or Path(tempfile.mkdtemp(prefix="straggler_bench_"))
    if args.analyse:
        ref, slow, rebalanced = (read_jsonl(work / n / "metrics.jsonl")
                                 for n in ("failure_free", "slow", "rebalanced"))
        args.g, args.steps = ref[0]["g"], len(ref)
    else:
        ref = run(work / "failure_free", args.g, args.steps)
    t = statistics.median(s["compute_s_per_microbatch"]["0"] for s in ref[1:])
    fault = f"replica={SLOW_REPLICA},step={SLOW_FROM},mode=slow,seconds={t:.3f}"
    if not args.analyse:
        slow = run(work / "slow", args.g, args.steps, [fault])
        rebalanced = run(work / "rebalanced", args.g, args.steps, [fault],
                         ["--recover.bad_replicas.slow_ratio", "1.5",
                          "--recover.bad_replicas.slow_patience", str(PATIENCE)])
    first = SLOW_FROM + PATIENCE + 1
    T = statistics.median(s["step_time_s"] for s in ref[1:])
    ideal = T * 4 / 3.5
    result = {"machine": machine(), "replicas": 4, "g": args.g, "b": 4 * args.g,
              "steps": args.steps, "slow_replica": SLOW_REPLICA, "slow_from_step": SLOW_FROM,
              "extra_seconds_per_microbatch": round(t, 4), "measured_from_step": first,
              "failure_free_step_s": T, "ideal_step_s": ideal}
    for name, steps in (("slow", slow), ("rebalanced", rebalanced)):
        median = statistics.median(s["step_time_s"] for s in steps if s["step"] >= first)
        speeds = per_replica(steps, first)
        result[name] = {**critical_path(work, name, first, speeds),
            "step_s": median, "over_ideal": median / ideal - 1,
            "max_loss_diff": max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, ref)),
            "b_every_step": all(s["reduced_microbatches"] == 4 * args.g for s in steps),
            "slow_replica_quota": [len(line["replicas"][str(SLOW_REPLICA)]["committed"])
                                   for line in ledger_records(work / name)],
            "seconds_per_microbatch": speeds}
    result["quotas_rebalanced"] = [
        e.get("weights") for e in read_jsonl(work / "rebalanced" / "events.jsonl")
        if e.get("phase") == "rebalance"]
    path = write_json("straggler.json", result)
    for name in ("slow", "rebalanced"):
        r = result[name]
        print(f"{name:10s} step {r['step_s']:.2f} s ({100 * r['over_ideal']:+.0f}% vs ideal "
              f"{ideal:.2f} s; failure-free {T:.2f} s), max |loss - failure-free| "
              f"{r['max_loss_diff']:.2e}, B every step: {r['b_every_step']}; compute path "
              f"{r['compute_path_s']:.2f} s vs its ideal {r['compute_ideal_s']:.2f} s "
              f"({100 * r['over_compute_ideal']:+.0f}%)")
    print(f"-> {path} (runs under {work})")


if __name__ == "__main__":
    main()
