"""The loss effect of bf16 on the wire: the debug model, exact mode, 4 x 1, 100 steps, the
torch data plane with ``wire_dtype = fp32`` and ``bf16`` (and the mpi plane as the reference),
run back to back on the same machine with the same data and seed.

    python benchmarks/wire_dtype_bench.py [--steps 100] [--replicas 4]

Prints per-run final loss, the largest and the mean |loss difference| to the mpi run over all
steps and over the last 10, the median step time; writes benchmarks/results/wire_dtype.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "torchtitan_configs" / "debug_cpu.toml"
RUNS = {"mpi fp32": ("mpi", "fp32"), "torch fp32": ("torch", "fp32"),
        "torch bf16": ("torch", "bf16")}


def run(replicas: int, steps: int, plane: str, dtype: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config",
                   str(CONFIG), "--replicas", str(replicas), "--out", out, "--",
                   "--training.steps", str(steps), "--recover.reduce.plane", plane,
                   "--recover.reduce.wire_dtype", dtype,
                   "--recover.bad_replicas.consistency_check_interval", "10"]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=1800)
        return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args()
    runs = {name: run(args.replicas, args.steps, *spec) for name, spec in RUNS.items()}
    reference = [row["loss"] for row in runs["mpi fp32"]]
    result = {"args": vars(args), "runs": {}}
    for name, rows in runs.items():
        losses = [row["loss"] for row in rows]
        diffs = [abs(a - b) for a, b in zip(losses, reference)]
        result["runs"][name] = {
            "losses": losses, "final_loss": losses[-1], "max_abs_diff": max(diffs),
            "mean_abs_diff": statistics.fmean(diffs),
            "mean_abs_diff_last10": statistics.fmean(diffs[-10:]),
            "median_step_s": statistics.median(row["step_time_s"] for row in rows[2:])}
        r = result["runs"][name]
        print(f"{name}: final loss {r['final_loss']:.4f}, |diff to mpi fp32| max "
              f"{r['max_abs_diff']:.2e} mean {r['mean_abs_diff']:.2e} (last 10: "
              f"{r['mean_abs_diff_last10']:.2e}), median step {r['median_step_s']:.3f} s",
              flush=True)
    out = REPO / "benchmarks" / "results" / "wire_dtype.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
