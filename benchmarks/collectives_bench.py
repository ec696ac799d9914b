"""Benchmark of the fault-tolerant collectives layer (recover_hsdp.collectives).

1. All-reduce (SUM, fp32, in place), 4 ranks, 1-256 MB: the guarded all-reduce (chunked, deadline,
   heartbeat: the ``mpi`` data plane) vs a plain mpi4py Allreduce (one call, same ULFM launch) vs
   torch.distributed gloo vs the ``torch`` data plane (``TorchDataPlane.reduce``: private copy,
   gloo all-reduce, control-plane poll, copy back; fp32 and bf16 on the wire), beside a memcpy of
   the same bytes on one rank (this host's physical limit: on one host every byte a rank sends
   is copied at least twice by the kernel).
   Time of one iteration = slowest rank; median of --iters (>= 10) after 2 warm-ups.
2. Failure -> repaired communicators: a rank is SIGKILLed by a peer in the middle of a stream of 16 MB
   guarded all-reduces; time from the kill to the end of the consensus that rebuilt the communicators
   (median over --kill-runs separate jobs), split into detection (kill -> agreed "not clean") and repair
  (``ConsensusResult.repair_s``).

usage: python benchmarks/collectives_bench.py [--iters 10] [--kill-runs 7] [--readme benchmarks/README.md]
The table is printed and written under the "## Collectives" heading of the README (other sections kept).
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES_MB = (1, 4, 16, 64, 256)


# ------------------------------------------------------------------------------------------------
# inner programs (run under mpirun)
# ------------------------------------------------------------------------------------------------
def inner_allreduce(iters: int, out: str) -> None:
    from recover_hsdp.collectives import MPI, FaultTolerantWorld
    import numpy as np
    import torch
    import torch.distributed as dist

    world = FaultTolerantWorld(MPI.COMM_WORLD, 1)
    plain = MPI.COMM_WORLD.Dup()
    plain.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = plain.Get_rank(), plain.Get_size()
    torch.set_num_threads(1)
    port = int(os.environ["BENCH_PORT"])
    store = dist.TCPStore("127.0.0.1", port, size, is_master=(rank == 0))
    pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=300))
    from recover_hsdp.groups.data_plane import TorchDataPlane

    planes = {dtype: TorchDataPlane(world, "gloo", wire_dtype=dtype, timeout_s=300)
              for dtype in ("fp32", "bf16")}

    def bench(fn):
        times = []
        for i in range(2 + iters):
            plain.Barrier()
            t = time.perf_counter()
            fn()
            dt = plain.allreduce(time.perf_counter() - t, op=MPI.MAX)
            world.heartbeat()
            if i >= 2:
                times.append(dt)
        return statistics.median(times)

    rows = []
    for mb in SIZES_MB:
        n = mb * (1 << 20) // 4
        buf = np.ones(n, dtype=np.float32)
        t_guarded = bench(lambda: world.allreduce(buf) or sys.exit("guarded all-reduce failed"))
        t_plain = bench(lambda: plain.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))
        x = torch.ones(n)
        t_gloo = bench(lambda: pg.allreduce([x]).wait())
        t_plane = {dtype: bench(lambda p=p: p.reduce(x) or sys.exit("data plane reduce failed"))
                   for dtype, p in planes.items()}
        y = torch.empty_like(x)
        t_copy = bench(lambda: y.copy_(x))
        rows.append({"mb": mb, "guarded": t_guarded, "plain": t_plain, "gloo": t_gloo,
                     "torch_plane": t_plane["fp32"], "torch_plane_bf16": t_plane["bf16"],
                     "memcpy": t_copy})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    world.finish()


def inner_kill(out: str, mb: int) -> None:
    from recover_hsdp.collectives import MPI, FaultTolerantWorld
    import numpy as np

    world = FaultTolerantWorld(MPI.COMM_WORLD, 1)
    rank, size = world.world_rank, world.global_comm.Get_size()
    victim = size // 2
    pids = world.allgather_global(os.getpid())
    buf = np.ones(mb * (1 << 20) // 4, dtype=np.float32)
    for _ in range(2):  # warm-up (opens the connections)
        world.allreduce(buf)
    t_kill = world.allgather_global(time.time() + 0.5)[0]
    if rank == 0:
        threading.Timer(t_kill - time.time(), lambda: os.kill(pids[victim], signal.SIGKILL)).start()
    while True:
        ok = world.allreduce(buf)
        res = world.consensus(ok)
        if not res.clean:
            break
    t_done = time.time()
    times = world.allgather_global({"total": t_done - t_kill, "detect": res.detect_s,
                                    "repair": res.repair_s})
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    world.finish()


# ------------------------------------------------------------------------------------------------
# outer driver
# ------------------------------------------------------------------------------------------------
def mpirun(nprocs: int, args: list[str], timeout: float, env=None) -> None:
    from recover_hsdp.collectives.mpirun import check_ulfm_mpirun, mpirun_prefix

    check_ulfm_mpirun()
    env = {"PYTHONPATH": str(REPO), **(env or {})}
    cmd = mpirun_prefix(nprocs, env=env) + [sys.executable, __file__, *args]
    subprocess.run(cmd, check=True, timeout=timeout, cwd=REPO, env={**os.environ, **env})


def write_readme(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find("\n## Collectives")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + text[end:] if end >= 0 else text[:start]
    path.write_text(text.rstrip("\n") + "\n\n" + section)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--inner", choices=["allreduce", "kill"])
    p.add_argument("--out")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--kill-runs", type=int, default=7)
    p.add_argument("--kill-mb", type=int, default=16)
    p.add_argument("--readme", default=str(REPO / "benchmarks" / "README.md"))
    a = p.parse_args()
    if a.inner == "allreduce":
        return inner_allreduce(a.iters, a.out)
    if a.inner == "kill":
        return inner_kill(a.out, a.kill_mb)

    tmp = Path(tempfile.mkdtemp(prefix="collectives-bench-"))
    mpirun(4, ["--inner", "allreduce", "--iters", str(a.iters), "--out", str(tmp / "ar.json")], 1800,
           env={"BENCH_PORT": str(29500 + os.getpid() % 1000)})
    rows = json.loads((tmp / "ar.json").read_text())
    kills = []
    for i in range(a.kill_runs):
        mpirun(4, ["--inner", "kill", "--kill-mb", str(a.kill_mb), "--out", str(tmp / f"k{i}.json")], 300)
        kills.append(json.loads((tmp / f"k{i}.json").read_text()))
    # one value per run: the slowest survivor (the victim's slot in the allgather is absent)
    total = [max(t["total"] for t in k) for k in kills]
    detect = [max(t["total"] - t["repair"] for t in k) for k in kills]
    repair = [max(t["repair"] for t in k) for k in kills]

    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    lines = [
        "## Collectives",
        "",
        "`benchmarks/collectives_bench.py` (regenerate: `python benchmarks/collectives_bench.py`). "
        f"4 ranks on one {os.cpu_count()}-core host (oversubscribed, shared with other jobs: noisy), "
        "Open MPI 5.0.11 ULFM launch (`recover_hsdp.collectives.mpirun`, btl tcp no-put flags), "
        "fp32 SUM in place; "
        f"time of one all-reduce = slowest rank, median of {a.iters} after 2 warm-ups.",
        "",
        "| size | guarded = `mpi` data plane (chunked 4 MB, deadline) | plain MPI Allreduce "
        "| gloo all_reduce "
        "| `torch` data plane fp32 | `torch` data plane bf16 | memcpy of the bytes | guarded / plain "
        "| torch plane / guarded |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['mb']} MB | {ms(r['guarded'])} ms | {ms(r['plain'])} ms | {ms(r['gloo'])} ms "
                     f"| {ms(r['torch_plane'])} ms | {ms(r['torch_plane_bf16'])} ms "
                     f"| {r['memcpy'] * 1e3:.1f} ms | {r['guarded'] / r['plain']:.2f} "
                     f"| {r['torch_plane'] / r['guarded']:.2f} |")
    lines += [
        "",
        f"SIGKILL of 1 of 4 ranks (4x1) by a peer during a stream of {a.kill_mb} MB guarded all-reduces, "
        f"to repaired communicators (end of `consensus`, slowest survivor), {a.kill_runs} runs:",
        "",
        "| | median | min | max |",
        "|---|---:|---:|---:|",
    ]
    for name, vals in (("kill -> repaired communicators", total),
                       ("kill -> uniform 'not clean' decision (detect)", detect),
                       ("decision -> repaired (revoke, shrink, split, agree)", repair)):
        lines.append(f"| {name} | {ms(statistics.median(vals))} ms | {ms(min(vals))} ms "
                     f"| {ms(max(vals))} ms |")
    section = "\n".join(lines) + "\n"
    print(section)
    results = REPO / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "collectives.json").write_text(json.dumps(
        {"rows": rows, "kill_total_s": total, "kill_detect_s": detect, "kill_repair_s": repair},
        indent=2) + "\n")
    write_readme(Path(a.readme), section)


if __name__ == "__main__":
    main()
