"""Failure-free GPU step time of stock HSDP and of each ReCoVer data plane, from per-byte costs.

    python benchmarks/gpu_step_model.py [--compute-mb-s 0.1] [--tcp-node-gb-s 5] ...

A model, not a measurement: no GPU cluster was available to this project. Every input is a
flag, printed with the table; the defaults are the figures of issue 23 (1B config on 8 x 8
H100: 618 MB fp32 gradient shard per rank, 17 buckets, ~0.4 s of compute per step at G = 4)
and public line rates, and where this CPU machine measured the same quantity
(benchmarks/results/collectives.json: the MPI and gloo per-byte cost over loopback) it is
printed beside them for scale, not used.

Per step on one rank (S ranks per replica, R replicas, G microbatches per replica):
  ring all-reduce bytes on the wire  w = 2 (R-1)/R x shard bytes (x 1/2 with bf16 on the wire)
  compute                            G x t_mb (forward + backward), backward = 2/3 of it
  stock HSDP (TorchTitan, NCCL)      FSDP syncs every microbatch: G reduces, each overlapped
                                     with that microbatch's backward (NCCL on its own stream):
                                     exposed = G x max(0, t_nccl - overlap x t_bwd) + t_bucket
  ReCoVer, data_plane = torch, NCCL  one reduce per step (sync on the last microbatch only),
                                     overlapped with the last backward: the hook enqueues
                                     it ([Note: overlapped bucket sums], overlap_reduce =
                                     true); with overlap_reduce = false the whole reduce is
                                     exposed
  ReCoVer, data_plane = mpi          staged D2H + MPI over TCP (IPoIB) or RDMA (btl uct) + H2D,
                                     synchronous in the hook (no overlap; the wheel has no CUDA)
  + per step: snapshots (a device copy of the shard, HBM bandwidth), the consensus (one agree,
    ~1 ms measured here), the totals reduce (a few floats).
Invariant the model keeps: every plane sums the same B microbatch gradients per step; only
the time of moving the bytes differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = {"1B on 8 x 8 (G = 4)": (8, 8, 4), "paper 64 x 128 (G = 128)": (64, 8, 128)}


def ring_bytes(shard_bytes: float, replicas: int) -> float:
    return 2 * (replicas - 1) / replicas * shard_bytes


def step_times(a, replicas: int, ranks: int, g: int) -> dict[str, float]:
    shard = a.shard_mb * 1e6
    wire = ring_bytes(shard, replicas)
    t_mb, t_bwd = a.compute_mb_s, a.compute_mb_s * 2 / 3
    compute = g * t_mb
    bucket = 1 / a.buckets
    per_rank_tcp = a.tcp_node_gb_s * 1e9 / ranks       # one NIC (IPoIB) shared by S ranks
    per_rank_rdma = a.rdma_gpu_gb_s * 1e9              # one NIC per GPU
    staging = 2 * shard / (a.staging_gb_s * 1e9)       # D2H + H2D, pinned
    snapshot = shard / (a.hbm_gb_s * 1e9) * 2          # read + write
    fixed = snapshot + a.consensus_s
    nccl = wire / (a.nccl_bus_gb_s * 1e9)
    nccl_bf16 = nccl / 2

    def exposed(t_reduce: float, overlapped: bool) -> float:
        if not overlapped:
            return t_reduce
        return max(0.0, t_reduce - a.overlap * t_bwd) + t_reduce * bucket

    return {
        "compute": compute,
        "stock HSDP (NCCL, reduce every microbatch, overlapped)":
            compute + g * exposed(nccl, True),
        "ReCoVer torch plane NCCL, overlap_reduce = false": compute + nccl + fixed,
        "ReCoVer torch plane NCCL, overlapped (default)": compute + exposed(nccl, True) + fixed,
        "ReCoVer torch plane NCCL bf16, overlapped": compute + exposed(nccl_bf16, True) + fixed,
        "ReCoVer mpi plane TCP/IPoIB (today)": compute + staging + wire / per_rank_tcp + fixed,
        "ReCoVer mpi plane RDMA (btl uct)": compute + staging + wire / per_rank_rdma + fixed,
    }


def measured_here() -> dict[str, float]:
    """Per-byte cost of the all-reduces measured on this CPU host (loopback), if present."""
    path = RESULTS / "collectives.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    big = max(rows, key=lambda r: r["mb"])
    return {f"{k} GB/s of buffer (4 ranks, {big['mb']} MB, this CPU host)":
            big["mb"] / 1e3 / big[k] for k in ("guarded", "gloo", "torch_plane", "memcpy")
            if k in big}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shard-mb", type=float, default=618.0, help="fp32 gradient shard per rank")
    p.add_argument("--buckets", type=int, default=17)
    p.add_argument("--compute-mb-s", type=float, default=0.1,
                   help="forward+backward of one microbatch (0.4 s per step at G = 4)")
    p.add_argument("--tcp-node-gb-s", type=float, default=5.0, help="TCP over IPoIB per node")
    p.add_argument("--rdma-gpu-gb-s", type=float, default=40.0,
                   help="btl uct per GPU NIC (400 Gb/s IB at ~80%%)")
    p.add_argument("--nccl-bus-gb-s", type=float, default=40.0,
                   help="NCCL inter-node ring bus bandwidth per GPU")
    p.add_argument("--staging-gb-s", type=float, default=20.0,
                   help="pinned D2H/H2D per GPU (PCIe 5 x16 ~ 50 theoretical)")
    p.add_argument("--hbm-gb-s", type=float, default=2000.0, help="snapshot copy (H100 HBM3)")
    p.add_argument("--overlap", type=float, default=0.9,
                   help="fraction of a backward a reduce on its own stream can hide behind")
    p.add_argument("--consensus-s", type=float, default=0.002)
    a = p.parse_args()
    table = {name: step_times(a, *layout) for name, layout in LAYOUTS.items()}
    print("Inputs (assumptions unless marked measured):")
    for key, value in vars(a).items():
        print(f"  {key} = {value}")
    for key, value in measured_here().items():
        print(f"  measured here: {key} = {value:.2f}")
    print(markdown(table))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_step_model.json").write_text(json.dumps(
        {"inputs": vars(a), "measured_here": measured_here(), "step_s": table}, indent=2) + "\n")


def markdown(table: dict[str, dict[str, float]]) -> str:
    names = list(next(iter(table.values())))
    lines = ["| step time (s) | " + " | ".join(table) + " |",
             "|---|" + "---:|" * len(table)]
    for name in names:
        cells = []
        for layout in table:
            stock = table[layout]["stock HSDP (NCCL, reduce every microbatch, overlapped)"]
            value = table[layout][name]
            cells.append(f"{value:.3f}" + ("" if name == "compute" else f" (x{value / stock:.2f})"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
