"""Replica rejoin: join time, the survivors' stall and the state transfer vs model size.

    python benchmarks/rejoin_bench.py [--flavors debugmodel,cpu_large] [--runs 3] [--steps 40]

Each run: 4 replicas x 1 rank (exact data assignment), replica 1 SIGKILLed in the gradient sync
of step 6, ``respawn_after_steps = 1`` (the replacement is spawned before step 8, joins once it
is ready). Read from the run's own outputs (events.jsonl, metrics.jsonl): the survivors' stall
at the spawn and at the join, the newcomer's start-to-ready time, bytes per donor rank and
MB/s of the transfer, and tokens/s before the failure (steps 2..5), between the failure and the
join (steps 7 ..), and after the join (steps are timed as in every benchmark here: between step records).
On this 2-core box the newcomer's start-up competes with the training for the cores, so the
"between" window is slower than with fewer replicas alone; on a cluster it runs on its own host.
Writes benchmarks/results/rejoin.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import CONFIG, REPO, machine, read_jsonl, write_json


def one_run(flavor: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config",
                   str(CONFIG), "--replicas", "4", "--out", out, "--fault",
                   "replica=1,step=6,phase=grad_sync", "--", "--training.steps", str(steps),
                   "--model.flavor", flavor, "--recover.tiers.respawn_after_steps", "1"]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=1800)
        rows = read_jsonl(Path(out) / "metrics.jsonl")
        events = read_jsonl(Path(out) / "events.jsonl")
    join = next(e for e in events if e.get("phase") == "join" and e["ok"])
    joined = join["step"]

    def tokens_per_s(lo: int, hi: int) -> float:
        window = [r for r in rows if lo <= r["step"] < hi]
        return sum(r["tokens"] for r in window) / sum(r["step_time_s"] for r in window)

    return {"flavor": flavor, "join_step": joined, "bytes_per_donor_rank": join["bytes_per_donor_rank"],
            "transfer_s": join["transfer_s"], "transfer_mb_per_s": join["transfer_mb_per_s"],
            "spawn_stall_s": join["spawn_stall_s"], "join_stall_s": join["join_stall_s"],
            "start_to_ready_s": join["start_to_ready_s"],
            "tokens_per_s_before": tokens_per_s(2, 6), "tokens_per_s_between": tokens_per_s(7, joined),
            "tokens_per_s_after": tokens_per_s(joined + 1, steps + 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavors", default="debugmodel,cpu_large")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results = {}
    for flavor in args.flavors.split(","):
        runs = [one_run(flavor, args.steps) for _ in range(args.runs)]
        keys = [k for k in runs[0] if k not in ("flavor",)]
        results[flavor] = {"runs": runs, **{f"median_{k}": statistics.median(r[k] for r in runs)
                                            for k in keys}}
        r = results[flavor]
        print(f"{flavor}: {r['median_bytes_per_donor_rank'] / 1e6:.0f} MB/donor rank, transfer "
              f"{r['median_transfer_s']:.2f}s ({r['median_transfer_mb_per_s']:.0f} MB/s), stall "
              f"spawn {r['median_spawn_stall_s']:.2f}s + join {r['median_join_stall_s']:.2f}s, "
              f"newcomer ready after {r['median_start_to_ready_s']:.1f}s; tokens/s before "
              f"{r['median_tokens_per_s_before']:.0f}, between {r['median_tokens_per_s_between']:.0f}"
              f", after {r['median_tokens_per_s_after']:.0f}", flush=True)
    write_json("rejoin.json", {**results, "machine": machine(), "args": vars(args)})


if __name__ == "__main__":
    main()
