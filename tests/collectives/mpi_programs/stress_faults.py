"""Repeat the fault scenarios of tests/collectives/test_collectives_faults.py many times and
tabulate the outcomes.

Flakiness is a product bug: run this before trusting a change to the collectives layer.
usage: python tests/collectives/mpi_programs/stress_faults.py [REPEATS] [SCENARIO_KEY_SUBSTRING ...]
Keeps the logs of failed runs under ./stress_logs/. Exit code 1 if any run failed.
"""

import collections
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/collectives/
from mpi_programs.mpijob import run_mpi  # noqa: E402
from test_collectives_faults import SCENARIOS, check  # noqa: E402


def stress(repeats: int, keys: list[str]) -> dict[str, collections.Counter]:
    outcomes: dict[str, collections.Counter] = {}
    walls: dict[str, list[float]] = collections.defaultdict(list)
    for key in keys:
        sc = SCENARIOS[key]
        outcomes[key] = collections.Counter()
        for i in range(repeats):
            out = Path(tempfile.mkdtemp(prefix=f"stress-{key}-"))
            job = run_mpi(sc.nprocs, "collectives_worker.py", sc.args(out), out, timeout_s=120)
            try:
                check(sc, job)
                outcomes[key]["pass"] += 1
                shutil.rmtree(out)
            except AssertionError as e:
                reason = "hang" if job.rc is None else str(e).splitlines()[0][:60]
                outcomes[key][f"FAIL {reason}"] += 1
                keep = Path("stress_logs") / f"{key}-{i}"
                keep.parent.mkdir(exist_ok=True)
                shutil.move(str(out), keep)
                print(f"  {key} run {i}: FAILED ({reason}); logs in {keep}", flush=True)
            walls[key].append(job.wall_s)
        w = sorted(walls[key])
        print(f"{key:32s} {dict(outcomes[key])}  wall median {w[len(w) // 2]:.1f}s max {w[-1]:.1f}s",
              flush=True)
    return outcomes


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    pats = sys.argv[2:]
    keys = [k for k in SCENARIOS if not pats or any(p in k for p in pats)]
    t0 = time.time()
    outcomes = stress(repeats, keys)
    bad = sum(n for c in outcomes.values() for o, n in c.items() if o != "pass")
    print(f"{len(keys)} scenarios x {repeats} runs in {time.time() - t0:.0f}s: {bad} failed runs")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
