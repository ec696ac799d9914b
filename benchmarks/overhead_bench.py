"""Failure-free overhead: ReCoVer (MPI path) vs stock TorchTitan HSDP, interleaved A/B runs.

    python benchmarks/overhead_bench.py [--layouts 2x1,2x2,4x1] [--g 1,4] [--pairs 3] [--steps 12]
    python benchmarks/overhead_bench.py --detector     # detector on vs off, same A/B scheme
    python benchmarks/overhead_bench.py --tp 2 --layouts 2x2,2x4 --g 2   # FSDP x TP replicas
    python benchmarks/overhead_bench.py --pp 2 --layouts 2x2 --g 1,4     # pipeline replicas
    python benchmarks/overhead_bench.py --planes --layouts 4x1 --g 1,4   # mpi vs torch data plane

Each pair runs the two modes back to back on the same machine with the same config, data and
seed; the per-run figure is the median step time over steps 3..N (steps 1-2 warm up) and the
tokens/s derived from it (tokens per step / median step time). Both paths measure a step the
same way: the time between two consecutive step records (the whole loop iteration, with each
side's own loss reporting). ``--g``: gradient-accumulation steps per replica (global batch =
G x R x S x local batch): G = 1, and G = 4 as in the 1B config. Prints the per-layout median of
the per-pair ratios (recover / stock) and writes benchmarks/results/overhead.json and
overhead.png. ``--quick``: layouts 2x1,2x2, 2 pairs, 8 steps. ``--tp T``: S ranks per replica
are FSDP S/T x TP T (stock: HSDP + TP with the same degrees); global batch G x R x S/T x local
batch; results in overhead_tp.json / overhead_tp.png. ``--pp P``: each replica a pipeline of P
stages (1F1B, TorchTitan's split; stock: HSDP + PP, which runs its schedule and its FSDP sync
once per microbatch, ReCoVer once per microbatch with the sync held to the last: [Note: pipeline
stages in a replica]); results in overhead_pp.json / overhead_pp.png. ``--planes``: each round
runs stock, ReCoVer on the ``mpi`` data plane and on the ``torch`` one back to back (same
work), then one run per plane with a replica SIGKILLed in step 6's gradient sync: its stall is
that step's time less the median step; results in overhead_planes.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine, plt

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "torchtitan_configs" / "debug_cpu.toml"
LOCAL_BATCH = 2  # debug_cpu.toml's training.local_batch_size


def run(replicas: int, ranks: int, stock: bool, steps: int,
        extra: tuple[str, ...] = (), faults: tuple[str, ...] = (), rows_out=None
        ) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(CONFIG),
                   "--replicas", str(replicas), "--ranks-per-replica", str(ranks), "--out", out]
        command += ["--stock"] if stock else []
        for fault in faults:
            command += ["--fault", fault]
        command += ["--", "--training.steps", str(steps), *extra]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=900)
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines][2:]
        if rows_out is not None:
            rows_out.extend(rows)
    step_s = statistics.median(row["step_time_s"] for row in rows)
    return step_s, statistics.median(row["tokens"] for row in rows) / step_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="2x1,2x2,4x1")
    parser.add_argument("--g", default="1,4", help="microbatches per replica per step")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree in a replica")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages in a replica")
    parser.add_argument("--planes", action="store_true",
                        help="stock vs ReCoVer on data_plane mpi vs torch, + the stall per death")
    parser.add_argument("--detector", action="store_true",
                        help="A/B of ReCoVer with the heartbeat detector (default, "
                             "detect_timeout_s = 4) vs without it (detect_timeout_s = 0)")
    args = parser.parse_args()
    if args.quick:
        args.layouts, args.pairs, args.steps = "2x1,2x2", 2, 8
    if args.detector:
        return detector_ab(args)
    if args.planes:
        return planes_ab(args)
    results = {}
    for layout, g in [(lay, int(g)) for g in args.g.split(",") for lay in args.layouts.split(",")]:
        replicas, ranks = map(int, layout.split("x"))
        batch = ("--training.global_batch_size",
                 str(g * replicas * ranks // (args.tp * args.pp) * LOCAL_BATCH))
        if args.tp > 1:
            batch += ("--parallelism.tensor_parallel_degree", str(args.tp))
        if args.pp > 1:
            batch += ("--parallelism.pipeline_parallel_degree", str(args.pp))
        pairs = []
        inner = "".join(f" {k}={v}" for k, v in (("PP", args.pp), ("TP", args.tp)) if v > 1)
        layout = f"{layout}{inner} G={g}"
        for _ in range(args.pairs):
            recover, recover_tps = run(replicas, ranks, False, args.steps, batch)
            stock, stock_tps = run(replicas, ranks, True, args.steps, batch)
            pairs.append({"recover_s": recover, "stock_s": stock, "ratio": recover / stock,
                          "recover_tokens_per_s": recover_tps, "stock_tokens_per_s": stock_tps,
                          "tokens_per_s_ratio": recover_tps / stock_tps})
        results[layout] = {
            "pairs": pairs,
            "median_recover_step_s": statistics.median(p["recover_s"] for p in pairs),
            "median_stock_step_s": statistics.median(p["stock_s"] for p in pairs),
            "median_ratio": statistics.median(p["ratio"] for p in pairs),
            "median_recover_tokens_per_s": statistics.median(p["recover_tokens_per_s"]
                                                             for p in pairs),
            "median_stock_tokens_per_s": statistics.median(p["stock_tokens_per_s"]
                                                           for p in pairs),
            "median_tokens_per_s_ratio": statistics.median(p["tokens_per_s_ratio"]
                                                           for p in pairs),
        }
        r = results[layout]
        print(f"{layout}: recover {r['median_recover_step_s']:.3f}s  stock "
              f"{r['median_stock_step_s']:.3f}s  ratio recover/stock {r['median_ratio']:.3f}  "
              f"tokens/s {r['median_recover_tokens_per_s']:.0f} vs "
              f"{r['median_stock_tokens_per_s']:.0f} (ratio {r['median_tokens_per_s_ratio']:.3f})",
              flush=True)
    name = "overhead_pp" if args.pp > 1 else "overhead_tp" if args.tp > 1 else "overhead"
    out = _save(f"{name}.json", results, args)
    _plot(results, out / f"{name}.png")
    print(markdown(results))


def detector_ab(args) -> None:
    """Failure-free step time with the detector on vs off, interleaved pairs (same work)."""
    results = {}
    for layout in args.layouts.split(","):
        replicas, ranks = map(int, layout.split("x"))
        pairs = []
        for _ in range(args.pairs):
            on, _ = run(replicas, ranks, False, args.steps)
            off, _ = run(replicas, ranks, False, args.steps, ("--recover.timeouts.detect_s", "0"))
            pairs.append({"detector_on_s": on, "detector_off_s": off, "ratio": on / off})
        results[layout] = {"pairs": pairs,
                           "median_on_s": statistics.median(p["detector_on_s"] for p in pairs),
                           "median_off_s": statistics.median(p["detector_off_s"] for p in pairs),
                           "median_ratio": statistics.median(p["ratio"] for p in pairs)}
        r = results[layout]
        print(f"{layout}: detector on {r['median_on_s']:.3f}s off {r['median_off_s']:.3f}s "
              f"ratio on/off {r['median_ratio']:.3f} (pairs: "
              f"{', '.join(format(p['ratio'], '.3f') for p in pairs)})",
              flush=True)
    _save("detector_overhead.json", results, args)


#: The data planes compared by ``--planes`` and the settings that select each.
PLANES = {"mpi": ("--recover.reduce.plane", "mpi"),
          "torch": ("--recover.reduce.plane", "torch"),
          "torch-hook": ("--recover.reduce.plane", "torch", "--recover.reduce.no-overlap")}


def planes_ab(args) -> None:
    """Stock vs ReCoVer on each data plane, interleaved (same work); then the stall of one
    death per plane. ``torch-hook`` is the torch plane with each sum waited for in its hook
    (``overlap_reduce = false``), beside the overlapped default: [Note: overlapped bucket sums]
    in recovery/buckets.py. [Note: control plane and data plane] in groups/data_plane.py."""
    planes = PLANES
    results = {}
    for layout, g in [(lay, int(g)) for g in args.g.split(",") for lay in args.layouts.split(",")]:
        replicas, ranks = map(int, layout.split("x"))
        batch = ("--training.global_batch_size", str(g * replicas * ranks * LOCAL_BATCH))
        rounds = []
        for _ in range(args.pairs):
            stock, _ = run(replicas, ranks, True, args.steps, batch)
            row = {"stock_s": stock}
            for plane in planes:
                row[f"{plane}_s"], _ = run(replicas, ranks, False, args.steps,
                                           batch + PLANES[plane])
                row[f"{plane}_ratio"] = row[f"{plane}_s"] / stock
            rounds.append(row)
            print(f"{layout} G={g}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()),
                  flush=True)
        result = {"rounds": rounds, **{
            f"median_{key}": statistics.median(r[key] for r in rounds) for key in rounds[0]}}
        for plane in planes:  # the stall of one death (replica 1, step 6, mid-sync)
            rows: list = []
            run(replicas, ranks, False, args.steps, batch + PLANES[plane],
                faults=("replica=1,step=6,phase=grad_sync",), rows_out=rows)
            by_step = {r["step"]: r["step_time_s"] for r in rows}
            calm = statistics.median(t for s, t in by_step.items() if s not in (6, 7))
            result[f"{plane}_death_step_s"] = by_step[6]
            result[f"{plane}_stall_s"] = by_step[6] - calm
        results[f"{layout} G={g}"] = result
        print(f"{layout} G={g}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()
                                              if k != "rounds"), flush=True)
    _save("overhead_planes.json", results, args)
    print(planes_markdown(results))


def planes_markdown(results: dict) -> str:
    names = [p for p in PLANES if any(f"median_{p}_s" in r for r in results.values()
                                       if isinstance(r, dict))]
    lines = ["| layout, G | rounds | stock step (s) | " + " | ".join(
        f"{p} step (s)" for p in names) + " | " + " | ".join(f"{p}/stock" for p in names)
        + " | " + " | ".join(f"stall per death {p} (s)" for p in names) + " |",
        "|---|---|---|" + "---|" * (3 * len(names))]
    for layout, r in results.items():
        if not isinstance(r, dict) or "rounds" not in r:
            continue
        lines.append(
            f"| {layout} | {len(r['rounds'])} | {r['median_stock_s']:.3f} | "
            + " | ".join(f"{r[f'median_{p}_s']:.3f}" for p in names) + " | "
            + " | ".join(f"{r[f'median_{p}_ratio']:.3f}" for p in names) + " | "
            + " | ".join(f"{r[f'{p}_stall_s']:.2f}" for p in names) + " |")
    return "\n".join(lines)


def _save(name: str, results: dict, args) -> Path:
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(
        {**results, "machine": machine(), "args": vars(args)}, indent=2) + "\n")
    return out


def markdown(results: dict) -> str:
    lines = ["| layout (R x S) | pairs | ReCoVer step (s) | stock step (s) | step-time ratio "
             "ReCoVer/stock | ReCoVer tok/s | stock tok/s | tok/s ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for layout, r in results.items():
        if not isinstance(r, dict) or "median_ratio" not in r:
            continue
        lines.append(
            f"| {layout} | {len(r['pairs'])} | {r['median_recover_step_s']:.3f} | "
            f"{r['median_stock_step_s']:.3f} | {r['median_ratio']:.3f} | "
            f"{r.get('median_recover_tokens_per_s', float('nan')):.0f} | "
            f"{r.get('median_stock_tokens_per_s', float('nan')):.0f} | "
            f"{r.get('median_tokens_per_s_ratio', float('nan')):.3f} |")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 3.5))
    layouts = list(results)
    xs = range(len(layouts))
    for offset, key, label in ((-0.2, "median_stock_tokens_per_s", "stock TorchTitan HSDP"),
                               (0.2, "median_recover_tokens_per_s", "ReCoVer")):
        ax.bar([x + offset for x in xs], [results[name][key] for name in layouts], 0.4, label=label)
    for x, layout in zip(xs, layouts):
        ax.annotate(f"x{results[layout]['median_tokens_per_s_ratio']:.2f}", (x + 0.2, 0),
                    xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(list(xs), layouts, fontsize=7)
    ax.set_xlabel("layout (replicas x ranks per replica)")
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("Failure-free throughput, interleaved A/B")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
