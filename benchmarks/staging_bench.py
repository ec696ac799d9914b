"""Host-staging bandwidth per bucket size ([Note: no device tensor reaches MPI]): D2H into a
reused pinned host buffer, the guarded MPI all-reduce of that buffer, H2D back; median of 5.

    mpirun -np 2 python benchmarks/staging_bench.py [--sizes-mb 1,4,16,64,125] [--device cuda]

The all-reduce goes in 4 MB pieces, as the product's does. Run by scripts/gpu_check.sh on a GPU
(``--device cuda``); ``--device cpu`` dry-runs the same code on CPU (the copies are then host
memcpys). Rank 0 prints one line per size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recover_hsdp.collectives.mpi import MPI  # noqa: E402  (MPI_Init before torch)


def _time(fn, sync) -> float:
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - started


def _allreduce(comm, array) -> None:
    """In 4 MB pieces, as the world's guarded all-reduce does (docs/ULFM_NOTES.md)."""
    from recover_hsdp.recovery.staging import CHUNK_BYTES

    step = CHUNK_BYTES // array.itemsize
    for lo in range(0, array.size, step):
        comm.Allreduce(MPI.IN_PLACE, array[lo:lo + step], op=MPI.SUM)


def main(argv=None) -> int:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", default="1,4,16,64,125")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    device = torch.device(args.device)
    pin = device.type == "cuda"
    sync = torch.cuda.synchronize if pin else (lambda: None)
    for mb in (float(s) for s in args.sizes_mb.split(",")):
        n = int(mb * (1 << 20)) // 4
        tensor = torch.ones(n, dtype=torch.float32, device=device)
        host = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        runs = {"d2h": [], "mpi": [], "h2d": []}
        for _ in range(5):
            runs["d2h"].append(_time(lambda: host.copy_(tensor), sync))
            comm.Barrier()
            runs["mpi"].append(_time(lambda: _allreduce(comm, host.numpy()), sync))
            runs["h2d"].append(_time(lambda: tensor.copy_(host), sync))
        if comm.Get_rank() == 0:
            med = {k: statistics.median(v) for k, v in runs.items()}
            print(f"staging {mb:g} MB ({device.type}): " + ", ".join(
                f"{k.upper()} {mb / 1024 / v:.2f} GB/s ({v * 1e3:.2f} ms)"
                for k, v in med.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
