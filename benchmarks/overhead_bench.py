"""Failure-free overhead: ReCoVer (MPI path) vs stock TorchTitan HSDP, interleaved A/B runs.

    python benchmarks/overhead_bench.py [--layouts 2x1,2x2,4x1] [--pairs 3] [--steps 12]

Each pair runs the two modes back to back on the same machine with the same config, data and
seed; the per-run figure is the median step time over steps 3..N (steps 1-2 warm up). Prints the
per-layout median of the per-pair ratios (recover / stock) and writes benchmarks/results/.
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


def run(replicas: int, ranks: int, stock: bool, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "recover_hsdp.launch", "train", "--config", str(CONFIG),
                   "--replicas", str(replicas), "--ranks-per-replica", str(ranks), "--out", out]
        command += ["--stock"] if stock else []
        command += ["--", "--training.steps", str(steps)]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=900)
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        times = [json.loads(line)["step_time_s"] for line in lines][2:]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="2x1,2x2,4x1")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    results = {}
    for layout in args.layouts.split(","):
        replicas, ranks = map(int, layout.split("x"))
        pairs = []
        for _ in range(args.pairs):
            recover = run(replicas, ranks, False, args.steps)
            stock = run(replicas, ranks, True, args.steps)
            pairs.append({"recover_s": recover, "stock_s": stock, "ratio": recover / stock})
        results[layout] = {
            "pairs": pairs,
            "median_recover_step_s": statistics.median(p["recover_s"] for p in pairs),
            "median_stock_step_s": statistics.median(p["stock_s"] for p in pairs),
            "median_ratio": statistics.median(p["ratio"] for p in pairs),
        }
        r = results[layout]
        print(f"{layout}: recover {r['median_recover_step_s']:.3f}s  stock "
              f"{r['median_stock_step_s']:.3f}s  ratio recover/stock {r['median_ratio']:.3f}",
              flush=True)
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
