"""The GPU check behind scripts/gpu_check.sh (one CUDA GPU, at most ~8 minutes).

1. the debug model, 2 replicas x 1 rank sharing the GPU (``--ranks-per-gpu 2``), bf16 params and
   fp32 reduce, through mpirun: a failure-free run, then the same with replica 1 SIGKILLed in
   the gradient sync of step 3 and respawned one step later (a respawn + rejoin on the GPU);
   prints B measured per step, the loss against the failure-free run, the stall at the fault;
2. the oracle on GPU tensors: fp32 params, replica 1 SIGKILLed after 1 of the buckets of step
   2 was reduced; the gradient the job committed (dumped from the GPU) against a one-process
   CPU recomputation (tests/oracle.py);
3. host-staging bandwidth per bucket size (benchmarks/staging_bench.py: D2H, MPI, H2D).

``--cpu`` dry-runs the same plan on CPU (no GPU flags): it checks the plumbing, not the GPU.
Exit code 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
CONFIG = REPO / "torchtitan_configs" / "debug_cpu.toml"
STEPS = 8        # the oracle run
REJOIN_STEPS = {False: 40, True: 400}
"""Steps of the failure + rejoin runs (CPU dry run, GPU): enough for the newcomer's start-up
(seconds) to end before the run does."""
STAGING_SIZES_MB = "1,4,16,64,125"  # the bench prints one line per size


def _train(out: Path, gpu: bool, faults=(), extra=(), steps: int = STEPS) -> list[dict]:
    placement = ["--gpus-per-node", "1", "--ranks-per-gpu", "2"] if gpu else \
        ["--gpus-per-node", "0"]
    args = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(CONFIG),
            "--replicas", "2", "--ranks-per-replica", "1", "--out", str(out), *placement]
    for fault in faults:
        args += ["--fault", fault]
    args += ["--", "--training.steps", str(steps), "--recover.timeouts.hang_s", "30", *extra]
    started = time.monotonic()
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    (out.parent / f"{out.name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"gpu_check: FAIL: {out.name} exited {result.returncode}: "
                         f"{(result.stdout + result.stderr)[-2000:]}")
    print(f"  {out.name}: {time.monotonic() - started:.0f}s wall", flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_failure_and_rejoin(work: Path, gpu: bool) -> bool:
    mixed = ["--training.mixed_precision_param", "bfloat16",
             "--training.mixed_precision_reduce", "float32"]
    steps = REJOIN_STEPS[gpu]
    reference = _train(work / "reference", gpu, extra=mixed, steps=steps)
    run = _train(work / "kill_respawn", gpu, ["replica=1,step=3,phase=grad_sync"],
                 [*mixed, "--recover.tiers.respawn_after_steps", "1"], steps=steps)
    b = [s["reduced_microbatches"] for s in run]
    diffs = [abs(a["loss"] - r["loss"]) for a, r in zip(run, reference)]
    usual = statistics.median(s["step_time_s"] for s in reference[1:])
    stall = max(s["step_time_s"] for s in run[1:])
    events = [json.loads(x) for x in (work / "kill_respawn" / "events.jsonl").read_text()
              .splitlines()]
    joins = [e for e in events if e.get("phase") == "join" and e.get("ok")]
    print(f"  B measured per step: {sorted(set(b))} over {len(b)} steps (expected 2 each)")
    alive = [s["alive_replicas"] for s in run]
    print(f"  alive replicas: {alive[:12]}{' ...' if len(alive) > 12 else ''} (last {alive[-1]})")
    print(f"  |loss - failure-free| per step: max {max(diffs):.2e} over {len(diffs)} steps")
    print(f"  stall: longest step {stall:.2f}s vs median failure-free step {usual:.2f}s")
    print(f"  rejoin: {[(j['step'], j['joined_replicas'], round(j['join_stall_s'], 2)) for j in joins]}"
          " (step, replicas, survivors' stall s)")
    return (len(run) == steps and all(x == 2 for x in b) and max(diffs) <= 1e-3
            and bool(joins) and run[-1]["alive_replicas"] == 2)


def check_oracle(work: Path, gpu: bool) -> bool:
    import torch

    from oracle import committed_refs, recompute_gradient
    from recover_hsdp.workload.ledger import read_ledger

    out = work / "oracle"
    _train(out, gpu, ["replica=1,step=2,phase=grad_sync,bucket=1"],
           ["--recover.debug.dump_step_gradients", "2"])
    entry = [e for e in read_ledger(out) if e.step == 1][0]
    dump = torch.load(out / "grads_step2.pt")
    oracle = recompute_gradient(dump["params"], committed_refs(entry), 1)
    worst = max(float(((dump["grads"][n] - oracle[n]).abs() / (oracle[n].abs() + 1e-6)).max())
                for n in oracle)
    ok = all(torch.allclose(dump["grads"][n], oracle[n], rtol=1e-3, atol=1e-5) for n in oracle)
    print(f"  oracle: failure step 2 (replica 1 killed after 1 bucket), gradient from the "
          f"{'GPU' if gpu else 'CPU'} vs one-process CPU recomputation: "
          f"{'match' if ok else 'MISMATCH'} (worst relative error {worst:.1e})")
    return ok


def check_staging(gpu: bool) -> bool:
    from recover_hsdp.cli.launch import resolve_mpirun
    from recover_hsdp.collectives.mpirun import mpirun_prefix

    command = [*mpirun_prefix(2, mpirun=resolve_mpirun()), sys.executable,
               str(REPO / "benchmarks" / "staging_bench.py"), "--device",
               "cuda" if gpu else "cpu", "--sizes-mb", STAGING_SIZES_MB]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    lines = [line for line in result.stdout.splitlines() if line.startswith("staging ")]
    print("\n".join("  " + line for line in lines))
    # read from the bench's own lines, not mpirun's exit code (0 under ULFM when ranks crash):
    # one line per size, on the device asked for
    device = "cuda" if gpu else "cpu"
    return (len(lines) == len(STAGING_SIZES_MB.split(","))
            and all(f"({device})" in line for line in lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="dry-run the plan on CPU")
    parser.add_argument("--work", default=str(REPO / "outputs" / "gpu_check"))
    args = parser.parse_args(argv)
    gpu = not args.cpu
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = {}
    for name, check in (("failure + rejoin", lambda: check_failure_and_rejoin(work, gpu)),
                        ("oracle", lambda: check_oracle(work, gpu)),
                        ("staging bandwidth", lambda: check_staging(gpu))):
        print(f"gpu_check: {name} ({'GPU' if gpu else 'CPU dry run'})", flush=True)
        results[name] = check()
    print(f"gpu_check: {'PASS' if all(results.values()) else 'FAIL'} {results} in "
          f"{time.monotonic() - started:.0f}s")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
