"""ReCoVer vs TorchFT, side by side: the same model, data and config; one replica (group)
SIGKILLed from outside mid-run.

    pip install --target .torchft torchft        # once: kept out of the venv (see below)
    python benchmarks/torchft_bench.py --torchft-path .torchft [--groups 2,4] [--steps 16]
        [--kill-after 5] [--g 2]

TorchFT (``torchft`` 0.2.0 from PyPI, in a folder of its own: TorchTitan's checkpoint and
optimizer modules import ``torchft`` whenever it is importable, so installed in the venv it
would load in every job; TorchTitan 0.2.2's own ``FTTrainer`` and ``[fault_tolerance]``
section): a ``torchft_lighthouse`` and one torchrun per replica group (1 rank each here),
``--fault_tolerance.replica_id i --group_size W``, gloo.
ReCoVer: ``recover-hsdp train --replicas W``. Both: the debug config, local corpus, global batch
G x W x local batch (B = G x W microbatches per step), the same seed. In both, when step
``--kill-after`` is committed, the supervisor SIGKILLs replica (group) 1's process(es).

Per system and W: failure-free step time (median of steps 3..N, measured between two step
records on both), the stall at the failure (commit gap of the failure step minus the median
step), microbatches committed per step after the failure (ReCoVer: ``reduced_microbatches``,
measured in its buckets; TorchFT: the replica groups that committed the step x G, counted from
their own metrics files), tokens/s after it (tokens committed after the kill / wall time), and
|loss - the same system's failure-free loss| after the failure. What each system promises:
TorchFT keeps the survivors training on a smaller global batch (the lost group's microbatches
are dropped from each step until it rejoins); ReCoVer keeps B (the survivors compute the lost
microbatches) and, in exact mode, the failure-free trajectory.
Writes benchmarks/results/torchft.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import CONFIG, REPO, RESULTS, descendants, machine, plt, read_jsonl, write_json

LOCAL_BATCH = 2  # debug_cpu.toml
SEQ_LEN = 128    # debug_cpu.toml
ENTRY = """
from recover_hsdp.titan import cpu_runtime, model_spec
cpu_runtime.install()
model_spec.register()
from torchtitan.experiments.ft.train import FTTrainer
from torchtitan.train import main
main(FTTrainer)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else name


def _poll(files: dict[int, Path], seen: dict[int, dict[int, float]]) -> None:
    now = time.time()
    for key, path in files.items():
        for row in read_jsonl(path):
            seen.setdefault(key, {}).setdefault(int(row["step"]), now)


TORCHFT_PATH: Path | None = None  # --torchft-path


def run_torchft(work: Path, groups: int, steps: int, g: int, kill_after: int | None) -> dict:
    entry = work / "ft_entry.py"
    entry.write_text(ENTRY)
    port = _free_port()
    extra = [str(TORCHFT_PATH)] if TORCHFT_PATH else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}",
           "PYTHONPATH": os.pathsep.join([str(REPO), *extra, os.environ.get("PYTHONPATH", "")])}
    lighthouse_bin = (TORCHFT_PATH / "bin" / "torchft_lighthouse") if TORCHFT_PATH else None
    lighthouse = subprocess.Popen(
        [str(lighthouse_bin) if lighthouse_bin else _tool("torchft_lighthouse"),
         "--min_replicas", "1", "--quorum_tick_ms", "100",
         "--join_timeout_ms", "10000", "--bind", f"[::]:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs, files, seen = {}, {}, {}
    started = time.time()
    killed_at = None
    try:
        for gid in range(groups):
            out = work / f"ft_g{gid}"
            files[gid] = out / "metrics.jsonl"
            command = [_tool("torchrun"), "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", "localhost:0", "--master-port", str(_free_port()),
                       str(entry), "--job.config_file", str(CONFIG),
                       "--job.dump_folder", str(out), "--recover.no-enable",
                       "--training.steps", str(steps), "--training.global_batch_size",
                       str(g * groups * LOCAL_BATCH), "--parallelism.data_parallel_shard_degree",
                       "1", "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(gid),
                       "--fault_tolerance.group_size", str(groups)]
            log = open(work / f"ft_g{gid}.log", "wb")
            procs[gid] = subprocess.Popen(command, cwd=REPO, env={**env, "REPLICA_GROUP_ID":
                                                                  str(gid)},
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        deadline = started + 600
        while any(p.poll() is None for gid, p in procs.items() if gid != 1 or not killed_at):
            _poll(files, seen)
            if kill_after is not None and killed_at is None and kill_after in seen.get(1, {}):
                for pid in [*descendants(procs[1].pid), procs[1].pid]:  # the group: worker(s)
                    try:                                                 # and its torchrun
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                killed_at = time.time()
            if time.time() > deadline:
                raise TimeoutError(f"torchft run over 600 s: see {work}")
            time.sleep(0.05)
        _poll(files, seen)
    finally:
        for p in [*procs.values(), lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    records = {gid: read_jsonl(path) for gid, path in files.items()}
    return {"seen": seen, "records": records, "killed_at": killed_at, "started": started}


def run_recover(work: Path, replicas: int, steps: int, g: int, kill_after: int | None) -> dict:
    out = work / f"recover_{replicas}_{kill_after}"
    command = [sys.executable, "-m", "recover_hsdp.cli.launch", "train", "--config", str(CONFIG),
               "--replicas", str(replicas), "--out", str(out), "--", "--training.steps",
               str(steps), "--training.global_batch_size", str(g * replicas * LOCAL_BATCH),
               "--recover.timeouts.hang_s", "30"]
    seen, started, killed_at = {}, time.time(), None
    log = open(work / f"recover_{replicas}_{kill_after}.log", "wb")
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None:
            _poll({0: out / "metrics.jsonl"}, seen)
            if kill_after is not None and killed_at is None and kill_after in seen.get(0, {}):
                procs = json.loads((out / "procs.json").read_text())
                pid = procs[1]["pid"]  # world rank 1 = replica 1 (S = 1)
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
            if time.time() > started + 600:
                raise TimeoutError(f"recover run over 600 s: see {work}")
            time.sleep(0.05)
        _poll({0: out / "metrics.jsonl"}, seen)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return {"seen": seen, "records": {0: read_jsonl(out / "metrics.jsonl")},
            "killed_at": killed_at, "started": started}


def summarise(system: str, free: dict, failed: dict, kill_after: int, g: int) -> dict:
    """The figures of one system at one W (see the module docstring)."""
    steps_free = free["records"][0]
    median_step = statistics.median(r["step_time_s"] for r in steps_free[2:])
    times = failed["seen"][0]
    last = max(times)
    # the longest commit gap after the kill, less a normal step (the survivor may have been a
    # step ahead of the victim, so the stall can land one step later)
    stall = max(times[t] - times[t - 1] for t in range(kill_after + 1, max(times) + 1)) \
        - median_step
    after = range(kill_after + 1, last + 1)
    if system == "recover":
        rows = {r["step"]: r for r in failed["records"][0]}
        per_step = [rows[t]["reduced_microbatches"] for t in after]
        tokens = sum(rows[t]["tokens"] for t in after)
    else:
        committed = {t: sum(1 for recs in failed["records"].values()
                            if any(r["step"] == t for r in recs)) for t in after}
        per_step = [committed[t] * g for t in after]
        # each group commits G microbatches of local_batch x seq_len tokens (its own stock
        # record assumes its one-rank world holds the whole global batch)
        tokens = sum(per_step) * LOCAL_BATCH * SEQ_LEN
    loss_free = {r["step"]: r["loss"] for r in steps_free}
    diffs = [abs(r["loss"] - loss_free[r["step"]]) for r in failed["records"][0]
             if r["step"] in after and r["step"] in loss_free]
    return {"killed_after_s": failed["killed_at"] - failed["started"],
            "per_step_after": per_step,
            "failure_free_step_s": median_step, "stall_s": stall,
            "microbatches_per_step_after": statistics.median(per_step),
            "tokens_per_s_after": tokens / (times[last] - times[kill_after]),
            "dloss_after_mean": statistics.fmean(diffs), "dloss_after_max": max(diffs),
            "steps_committed": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", default="2,4")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kill-after", type=int, default=5)
    parser.add_argument("--g", type=int, default=2, help="microbatches per replica per step")
    parser.add_argument("--keep", default=None, help="work in this folder and keep it")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw torchft.png from torchft.json")
    parser.add_argument("--torchft-path", default=None,
                        help="a folder torchft was installed into (pip install --target)")
    args = parser.parse_args()
    global TORCHFT_PATH
    TORCHFT_PATH = Path(args.torchft_path).resolve() if args.torchft_path else None
    if args.plot_only:
        return plot(json.loads((RESULTS / "torchft.json").read_text()))
    result = {"machine": machine(), "args": vars(args), "rows": []}
    with tempfile.TemporaryDirectory(prefix="recover_torchft_") as tmp:
        work = Path(args.keep or tmp)
        for groups in [int(x) for x in args.groups.split(",")]:
            row = {"groups": groups, "B": args.g * groups}
            for system, runner in (("torchft", run_torchft), ("recover", run_recover)):
                sub = work / f"{system}_{groups}"
                (sub / "free").mkdir(parents=True)
                (sub / "kill").mkdir(parents=True)
                free = runner(sub / "free", groups, args.steps, args.g, None)
                failed = runner(sub / "kill", groups, args.steps, args.g, args.kill_after)
                row[system] = summarise(system, free, failed, args.kill_after, args.g)
                print(f"W={groups} {system}: {row[system]}", flush=True)
            row["step_time_ratio_recover_torchft"] = (row["recover"]["failure_free_step_s"]
                                                      / row["torchft"]["failure_free_step_s"])
            result["rows"].append(row)
    write_json("torchft.json", result)
    plot(result)
    print(markdown(result))


def plot(result: dict) -> None:
    """torchft.png: tokens/s and microbatches per step after the failure, per system and W."""
    pyplot = plt()
    fig, axes = pyplot.subplots(1, 3, figsize=(10, 3.4))
    rows = result["rows"]
    xs = range(len(rows))
    for offset, system, label in ((-0.2, "torchft", "TorchFT"), (0.2, "recover", "ReCoVer")):
        for ax, key in zip(axes, ("tokens_per_s_after", "microbatches_per_step_after",
                                  "stall_s")):
            ax.bar([x + offset for x in xs], [r[system][key] for r in rows], 0.4, label=label)
    for ax, title in zip(axes, ("tokens/s after the failure", "microbatches per step after "
                                "(B = 2W)", "stall at the failure (s)")):
        ax.set_xticks(list(xs), [f"W = {r['groups']}" for r in rows])
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "torchft.png", dpi=120)


def markdown(result: dict) -> str:
    lines = ["| W | system | failure-free step (s) | step ratio ReCoVer/TorchFT | stall at the "
             "failure (s) | microbatches per step after (B before) | tokens/s after | "
             "abs(dloss) after vs own failure-free: mean / max |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for system in ("torchft", "recover"):
            r = row[system]
            ratio = f"{row['step_time_ratio_recover_torchft']:.3f}" if system == "recover" else ""
            lines.append(f"| {row['groups']} | {'TorchFT' if system == 'torchft' else 'ReCoVer'}"
                         f" | {r['failure_free_step_s']:.3f} | {ratio} | {r['stall_s']:.2f} | "
                         f"{r['microbatches_per_step_after']:g} ({row['B']}) | "
                         f"{r['tokens_per_s_after']:.0f} | {r['dloss_after_mean']:.2e} / "
                         f"{r['dloss_after_max']:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
