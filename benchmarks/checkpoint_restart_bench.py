"""ReCoVer vs checkpoint-restart under the same failure schedule (same config, data, global batch).

    python benchmarks/checkpoint_restart_bench.py [--quick] [--replicas 4] [--steps 16]
        [--fail-after 5,10] [--interval 4] [--repeats 1]

Checkpoint-restart (the baseline) = stock TorchTitan HSDP (``recover-hsdp train --stock``, i.e.
torchrun) with TorchTitan DCP checkpoints every ``--interval`` steps. This supervisor polls the
job's metrics.jsonl; when step k (from ``--fail-after``) is committed it SIGKILLs the torchrun
worker of replica 1 (the kill lands in step k+1), torchrun tears the job down, and the supervisor
relaunches the stock job on the R-1 surviving replicas with the SAME global batch
(--training.global_batch_size; G = B / (R-1) microbatches per replica), TorchTitan loads the
latest checkpoint from the (shared, absolute) checkpoint folder and reruns the lost steps.

ReCoVer: the same job through mpirun with ``--fault replica=i,step=k+1,phase=grad_sync`` (a real
SIGKILL of replica i's rank in step k+1); survivors repair and keep going, no checkpoints.

Every step is timestamped by this supervisor when it first appears in metrics.jsonl (the same
clock for both modes). Window k = steps (f_k, f_{k+1}] (f_0 = 1, the first step); its effective
throughput = committed tokens of those steps / wall seconds between the first commits of step
f_k and step f_{k+1} / ranks alive in the window. A checkpoint-restart window thus pays for the
teardown, the restart, the checkpoint load and the rerun of the steps lost since the last
checkpoint; a ReCoVer window pays for detection, repair, restore and extra compute. Tokens per
rank-hour = all committed tokens / (ranks held x wall time, from launch to the last step).

Batch sizes: local_batch_size 1, global_batch_size 12 with R=4 (G=3); after one failure R=3
(G=4), after two R=2 (G=6): B = 12 microbatches every step in both modes.
Writes benchmarks/results/checkpoint_restart.json and checkpoint_restart.png.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from _common import (checkpoint_times, machine, median, plt, read_jsonl, supervise,
                     train_command, write_json, RESULTS)


def overrides(steps: int, global_batch: int, local_batch: int, extra: list[str] = ()) -> list[str]:
    return ["--training.steps", str(steps), "--training.local_batch_size", str(local_batch),
            "--training.global_batch_size", str(global_batch), *extra]


def run_checkpoint_restart(work: Path, replicas: int, steps: int, fail_after: list[int],
                           interval: int, global_batch: int, local_batch: int) -> dict:
    """Stock HSDP + DCP every ``interval`` steps; SIGKILL rank 1 after each step in
    ``fail_after``; relaunch on the survivors until ``steps`` are committed."""
    ckpt = work / "ckpt"
    extra = ["--checkpoint.enable", "--checkpoint.interval", str(interval),
             "--checkpoint.folder", str(ckpt)]
    segments, alive, pending = [], replicas, list(fail_after)
    while True:
        out = work / f"segment{len(segments)}"
        kill_after = pending[0] if pending else None
        seg = supervise(train_command(out, alive, stock=True,
                                      overrides=overrides(steps, global_batch, local_batch, extra)),
                        out, kill_rank=1 if kill_after else None, kill_after_step=kill_after)
        segments.append((alive, seg))
        if kill_after is None:
            if seg.returncode != 0 or steps not in seg.step_seen:
                raise RuntimeError(f"last stock segment failed: see {seg.log}")
            break
        if seg.killed_at is None:
            raise RuntimeError(f"the kill after step {kill_after} never happened: see {seg.log}")
        pending.pop(0)
        alive -= 1
    return _timeline_checkpoint_restart(segments, steps, fail_after, replicas)


def _timeline_checkpoint_restart(segments, steps, fail_after, replicas) -> dict:
    first_seen: dict[int, float] = {}
    tokens: dict[int, int] = {}
    detail = []
    for alive, seg in segments:
        for step, stamp in seg.step_seen.items():
            first_seen.setdefault(step, stamp)
        rows = read_jsonl(seg.out / "metrics.jsonl")
        for row in rows:
            tokens.setdefault(row["step"], row["tokens"])
        ck = checkpoint_times(seg.log)
        detail.append({
            "replicas": alive, "launched": seg.launched, "ended": seg.ended,
            "first_step": min(seg.step_seen) if seg.step_seen else None,
            "last_step": max(seg.step_seen) if seg.step_seen else None,
            "killed_at": seg.killed_at, "killed_after_step": seg.killed_after_step,
            "step_seen": {str(k): v for k, v in sorted(seg.step_seen.items())},
            "step_time_s": {str(r["step"]): r["step_time_s"] for r in rows},
            "checkpoint_saves_s": ck["saves_s"], "checkpoint_loads_s": ck["loads_s"],
            "load_begin": ck["load_begin"], "out": str(seg.out),
        })
    t0 = segments[0][1].launched
    kills = [seg.killed_at for _, seg in segments if seg.killed_at]
    return {"t0": t0, "first_seen": first_seen, "tokens": tokens, "failure_times": kills,
            "segments": detail}


def run_recover(work: Path, replicas: int, steps: int, fail_after: list[int], global_batch: int,
                local_batch: int, hang_timeout: float = 10) -> dict:
    faults = [f"replica={i + 1},step={k + 1},phase=grad_sync" for i, k in enumerate(fail_after)]
    out = work / "recover"
    seg = supervise(train_command(out, replicas, stock=False, faults=faults, overrides=overrides(
        steps, global_batch, local_batch, ["--recover.timeouts.hang_s", str(hang_timeout)])), out)
    rows = read_jsonl(out / "metrics.jsonl")
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise RuntimeError(f"ReCoVer run did not commit steps 1..{steps}: see {seg.log}")
    fired = read_jsonl(out / "faults_fired.jsonl")
    return {"t0": seg.launched, "first_seen": dict(seg.step_seen),
            "tokens": {r["step"]: r["tokens"] for r in rows},
            "failure_times": [f["time"] for f in fired],
            "events": read_jsonl(out / "events.jsonl"), "metrics": rows,
            "log": str(seg.log)}


def windows(run: dict, fail_after: list[int], steps: int, replicas: int) -> dict:
    """Effective throughput per window between failures, overall and per rank-hour."""
    seen, tokens = run["first_seen"], run["tokens"]
    bounds = [1, *fail_after, steps]
    out = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        seconds = seen[hi] - seen[lo]
        committed = sum(tokens[s] for s in range(lo + 1, hi + 1))
        alive = replicas - k
        out.append({"after_failures": k, "steps": [lo + 1, hi], "alive_ranks": alive,
                    "wall_s": seconds, "tokens": committed,
                    "tokens_per_s_per_rank": committed / seconds / alive})
    end = seen[steps]
    held, last, alive = 0.0, run["t0"], replicas
    for stamp in sorted(run["failure_times"]):
        held += (stamp - last) * alive
        last, alive = stamp, alive - 1
    held += (end - last) * alive
    total_tokens = sum(tokens[s] for s in range(1, steps + 1))
    return {"windows": out, "wall_s": end - run["t0"], "tokens": total_tokens,
            "rank_hours": held / 3600, "tokens_per_rank_hour": total_tokens / (held / 3600)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--fail-after", default="5,10",
                        help="comma-separated steps after which a replica dies")
    parser.add_argument("--interval", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--local-batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved A/B pairs")
    parser.add_argument("--quick", action="store_true", help="10 steps, failures after 3,7, N=2")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.fail_after, args.interval = 10, "3,7", 2
    fail_after = [int(x) for x in args.fail_after.split(",") if x]
    if any(k % args.interval == 0 for k in fail_after):
        print("note: a failure right after a checkpoint step loses no work")
    pairs = []
    for repeat in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="recover_ckpt_bench_"))
        try:
            cr = run_checkpoint_restart(work / "cr", args.replicas, args.steps, fail_after,
                                        args.interval, args.global_batch, args.local_batch)
            rc = run_recover(work, args.replicas, args.steps, fail_after, args.global_batch,
                             args.local_batch)
            pair = {"checkpoint_restart": {**windows(cr, fail_after, args.steps, args.replicas),
                                           "segments": cr["segments"],
                                           "progress": _progress(cr)},
                    "recover": {**windows(rc, fail_after, args.steps, args.replicas),
                                "events": rc["events"], "progress": _progress(rc)}}
            last = len(fail_after)
            pair["ratio_last_window"] = (
                pair["recover"]["windows"][last]["tokens_per_s_per_rank"]
                / pair["checkpoint_restart"]["windows"][last]["tokens_per_s_per_rank"])
            pair["ratio_tokens_per_rank_hour"] = (
                pair["recover"]["tokens_per_rank_hour"]
                / pair["checkpoint_restart"]["tokens_per_rank_hour"])
            pairs.append(pair)
            print(f"pair {repeat + 1}: ratio after last failure {pair['ratio_last_window']:.2f}, "
                  f"tokens/rank-hour ratio {pair['ratio_tokens_per_rank_hour']:.2f}", flush=True)
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"kept {work}")
    table = _table(pairs, fail_after)
    result = {"machine": machine(), "args": vars(args), "fail_after": fail_after,
              "table": table, "pairs": pairs,
              "median_ratio_last_window": median(p["ratio_last_window"] for p in pairs),
              "median_ratio_tokens_per_rank_hour": median(p["ratio_tokens_per_rank_hour"]
                                                          for p in pairs)}
    path = write_json("checkpoint_restart.json", result)
    _plot(pairs[-1], fail_after, RESULTS / "checkpoint_restart.png")
    print(_markdown(result))
    print(f"wrote {path} and {RESULTS / 'checkpoint_restart.png'}")


def _progress(run: dict) -> list[list[float]]:
    return [[stamp - run["t0"], step] for step, stamp in sorted(run["first_seen"].items())]


def _table(pairs, fail_after) -> list[dict]:
    rows = []
    for k in range(len(fail_after) + 1):
        cr = median(p["checkpoint_restart"]["windows"][k]["tokens_per_s_per_rank"] for p in pairs)
        rc = median(p["recover"]["windows"][k]["tokens_per_s_per_rank"] for p in pairs)
        w = pairs[0]["recover"]["windows"][k]
        rows.append({"after_failures": k, "steps": w["steps"], "alive_ranks": w["alive_ranks"],
                     "checkpoint_restart_tok_s_rank": cr, "recover_tok_s_rank": rc,
                     "ratio": median(p["recover"]["windows"][k]["tokens_per_s_per_rank"]
                                     / p["checkpoint_restart"]["windows"][k][
                                         "tokens_per_s_per_rank"] for p in pairs)})
    return rows


def after_start(side: dict) -> float:
    """Tokens per rank-hour from the first committed step on (start-up excluded: on this tiny
    job the one-off launch, ~10-30 s, is as long as the training itself)."""
    windows_ = side["windows"]
    rank_s = sum(w["alive_ranks"] * w["wall_s"] for w in windows_)
    return sum(w["tokens"] for w in windows_) / (rank_s / 3600)


def _markdown(result) -> str:
    lines = ["| failures so far | steps | ranks alive | checkpoint-restart tok/s/rank | "
             "ReCoVer tok/s/rank | ratio | ratio / pre-failure ratio |",
             "|---|---|---|---|---|---|---|"]
    before = result["table"][0]["ratio"]  # both methods, no failure yet: the step-cost ratio
    for row in result["table"]:
        lines.append(f"| {row['after_failures']} | {row['steps'][0]}-{row['steps'][1]} | "
                     f"{row['alive_ranks']} | {row['checkpoint_restart_tok_s_rank']:.1f} | "
                     f"{row['recover_tok_s_rank']:.1f} | {row['ratio']:.2f} | "
                     f"{row['ratio'] / before:.2f} |")
    lines.append("\nThe last column divides each window's ratio by the one before any failure "
                 "(where the two methods differ only in their failure-free step: stock "
                 "TorchTitan reduce-scatters every microbatch of G, ReCoVer syncs once per "
                 "step), so it shows what the failure handling alone changes.")
    cr = median(p["checkpoint_restart"]["tokens_per_rank_hour"] for p in result["pairs"])
    rc = median(p["recover"]["tokens_per_rank_hour"] for p in result["pairs"])
    crw = median(p["checkpoint_restart"]["wall_s"] for p in result["pairs"])
    rcw = median(p["recover"]["wall_s"] for p in result["pairs"])
    lines += ["", "| | checkpoint-restart | ReCoVer | ratio |", "|---|---|---|---|",
              f"| wall time to the last step (s) | {crw:.1f} | {rcw:.1f} | {crw / rcw:.2f} |",
              f"| tokens per rank-hour, from launch | {cr:.0f} | {rc:.0f} | "
              f"{result['median_ratio_tokens_per_rank_hour']:.2f} |"]
    pairs = result["pairs"]
    cr_s = median(after_start(p["checkpoint_restart"]) for p in pairs)
    rc_s = median(after_start(p["recover"]) for p in pairs)
    ratio_s = median(after_start(p["recover"]) / after_start(p["checkpoint_restart"])
                     for p in pairs)
    lines.append(f"| tokens per rank-hour, from the first step | {cr_s:.0f} | {rc_s:.0f} | "
                 f"{ratio_s:.2f} |")
    lines.append(f"\nRatios are medians of the per-pair ratios; {len(pairs)} pair(s). Start-up "
                 "(launch to step 1) per pair, checkpoint-restart / ReCoVer: " + ", ".join(
                     f"{p['checkpoint_restart']['progress'][0][0]:.1f} s / "
                     f"{p['recover']['progress'][0][0]:.1f} s" for p in pairs) + ".")
    return "\n".join(lines)


def _plot(pair, fail_after, path: Path) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7, 4))
    t0 = pair["checkpoint_restart"]["segments"][0]["launched"]
    for index, seg in enumerate(pair["checkpoint_restart"]["segments"]):
        points = sorted((stamp - t0, int(step)) for step, stamp in seg["step_seen"].items())
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, "o-", ms=3, color="C0",
                    label="checkpoint-restart (stock HSDP + DCP)" if index == 0 else None)
        ax.axvline(seg["launched"] - t0, color="C0", lw=0.5, ls="--")
    xs, ys = zip(*pair["recover"]["progress"])
    ax.plot(xs, ys, "o-", ms=3, color="C1", label="ReCoVer")
    for k in fail_after:
        ax.axhline(k, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("committed step")
    ax.set_title(f"Same failure schedule (replica lost after steps {fail_after})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
