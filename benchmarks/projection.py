"""Projection to 512 and 100k GPUs from the measured component costs (a small event simulator).

    python benchmarks/projection.py [--gpus 64,512,100000] [--g-init 4,128] [--hours 24]
        [--trials 200] [--restart-s 600] [--save-s S] [--replica-gpus 8]

Reads benchmarks/results/failure_cost.json (per-failure components of both methods) and
benchmarks/results/overhead.json (failure-free ReCoVer / stock step-time ratio), simulates a
training job of ``--hours`` wall hours with Poisson failures and prints, per GPU count, the
fraction of GPU time kept (useful compute / GPUs x wall time, relative to failure-free stock
TorchTitan) and the effective throughput ratio ReCoVer / checkpoint-restart. Two scenarios:
``paper-scale`` (restart = --restart-s, 10 minutes per the paper's introduction; everything else
measured) and ``as-measured`` (every component as measured on this machine).

Assumptions (also written to the output):
  A1 failures: Poisson, MTBF = 18 min x 100,000 / GPUs (a failure every ~18 minutes at 100k GPUs,
     scaling inversely with the GPU count); one failure takes out one replica of --replica-gpus.
  A2 checkpoint-restart: DCP save every tau seconds of compute, tau = Young's optimum
     sqrt(2 x save x MTBF) (the baseline's best case); a save stalls training for the measured
     save time; on a failure the work since the last checkpoint is lost (rerun), and the job is
     down for detect+exit + restart + checkpoint load; the restart brings a replacement node, so
     the job resumes at full size. Failures during a restart are not counted (favours C/R).
  A3 ReCoVer: the failure-free step time is the measured ReCoVer/stock ratio times stock's
     (ratios below 1 measured on this noisy CPU machine are clamped to 1); a failure stalls
     the survivors for the measured detect + repair + extra compute + restore; the dead replica
     is not replaced (no re-join), so the job continues with W of W_init = GPUs / replica-gpus
     replicas, B = W_init x G_init fixed, and a step takes the largest quota, G(W) = ceil(B/W)
     microbatch times (the policy's g_raise = ceil): the useful rate is G_init / ceil(B/W) of
     the failure-free one (e.g. W = 7 of 8 at G_init = 4: quota 5, 80%, not 7/8). "Kept"
     counts the dead GPUs as lost until the end of the job (conservative); "kept of held"
     counts only the GPUs the job still holds. With --join-s J > 0 (replica rejoin, issue 13:
     ``respawn_after_steps``) a lost replica's replacement is back J seconds after the loss
     (spawn + start-up + state transfer, on a spare node of the allocation) and G returns to
     G_init; the survivors stall for --join-stall-s at the join (measured: rejoin.json).
  A4 throughput is per GPU, relative to failure-free stock TorchTitan at the same GPU count; the
     measured seconds come from a tiny model on CPU, so only the restart (A2) is taken at the
     paper's scale. Override any component with the flags below to project other settings.
Writes benchmarks/results/projection.json and projection.png.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics

from _common import RESULTS, median, plt, write_json

ASSUMPTIONS = [" ".join(item.split()) for item in re.split(
    r"\n  (?=A\d)", __doc__.split("Assumptions (also written to the output):")[1]
    .split("Writes benchmarks")[0].strip())]


def mtbf_s(gpus: int) -> float:
    return 18 * 60 * 100_000 / gpus


def simulate_checkpoint_restart(rng, hours, mtbf, save_s, down_s) -> dict:
    horizon = hours * 3600
    tau = math.sqrt(2 * save_s * mtbf) if save_s > 0 else mtbf / 10
    t, committed, since, failures, lost = 0.0, 0.0, 0.0, 0, 0.0
    next_fail = rng.expovariate(1 / mtbf)
    while t < horizon:
        need = tau - since
        end = min(t + need, horizon)
        if next_fail < end:
            since += next_fail - t
            lost += since
            since, failures = 0.0, failures + 1
            t = next_fail + down_s
            next_fail = t + rng.expovariate(1 / mtbf)
            continue
        since += end - t
        t = end
        if t >= horizon:
            committed += since  # the final stretch counts (a last save at the end)
            break
        if next_fail < t + save_s:  # failure during the save: the interval is lost
            lost += since
            since, failures = 0.0, failures + 1
            t = next_fail + down_s
            next_fail = t + rng.expovariate(1 / mtbf)
            continue
        t += save_s
        committed += since
        since = 0.0
    return {"kept": committed / horizon, "failures": failures, "tau_s": tau,
            "lost_compute_s": lost}


def step_time_factor(replicas: int, alive: int, g_init: int) -> float:
    """Step time with ``alive`` of ``replicas`` replicas, in failure-free step times: the largest
    quota ceil(B / W) over G_init (A3)."""
    return math.ceil(replicas * g_init / alive) / g_init


def simulate_recover(rng, hours, gpus, replica_gpus, recover_s, overhead, g_init,
                     join_s: float = 0.0, join_stall_s: float = 0.0) -> dict:
    """Failure rate scales with the GPUs still held (fewer GPUs, fewer failures); with
    ``join_s`` > 0 each lost replica comes back that long after its loss (A3)."""
    horizon = hours * 3600
    replicas = gpus // replica_gpus
    t, useful, held_time, alive, failures = 0.0, 0.0, 0.0, gpus, 0
    returns: list[float] = []  # when the replacements of lost replicas are back
    next_fail = t + rng.expovariate(1 / mtbf_s(alive))
    while t < horizon and alive > 0:
        back = min(returns) if returns else math.inf
        end = min(next_fail, back, horizon)
        factor = step_time_factor(replicas, alive // replica_gpus, g_init)
        useful += gpus * (end - t) / overhead / factor
        held_time += alive * (end - t)
        t = end
        if t >= horizon:
            break
        if back <= next_fail:  # a replacement joins: G back toward G_init
            returns.remove(back)
            stall = min(join_stall_s, horizon - t)
            held_time += alive * stall
            t += stall
            alive += replica_gpus
        else:
            stall = min(recover_s, horizon - t)
            alive -= replica_gpus
            held_time += alive * stall
            t += stall
            failures += 1
            if join_s > 0:
                returns.append(t - stall + join_s)
        next_fail = t + rng.expovariate(1 / mtbf_s(alive)) if alive > 0 else math.inf
    return {"kept": useful / (gpus * horizon), "kept_of_held": useful / held_time,
            "failures": failures, "gpus_at_end": alive}


def project(inputs: dict, gpus_list, hours, trials, seed, g_inits=(4,)) -> list[dict]:
    rows = []
    for gpus, g_init in [(g, gi) for g in gpus_list for gi in g_inits]:
        mtbf = mtbf_s(gpus)
        rng = random.Random(seed)
        down = inputs["detect_exit_s"] + inputs["restart_s"] + inputs["load_s"]
        cr = [simulate_checkpoint_restart(rng, hours, mtbf, inputs["save_s"], down)
              for _ in range(trials)]
        rng = random.Random(seed)
        rc = [simulate_recover(rng, hours, gpus, inputs["replica_gpus"], inputs["recover_s"],
                               inputs["overhead"], g_init, inputs.get("join_s", 0.0),
                               inputs.get("join_stall_s", 0.0)) for _ in range(trials)]
        replicas = gpus // inputs["replica_gpus"]
        row = {
            "gpus": gpus, "replicas": replicas, "g_init": g_init,
            "step_factor_after_1": step_time_factor(replicas, replicas - 1, g_init),
            "mtbf_min": mtbf / 60,
            "expected_failures": hours * 3600 / mtbf,
            "cr_checkpoint_interval_s": cr[0]["tau_s"],
            "cr_kept": statistics.fmean(x["kept"] for x in cr),
            "recover_kept": statistics.fmean(x["kept"] for x in rc),
            "recover_kept_of_held": statistics.fmean(x["kept_of_held"] for x in rc),
            "recover_gpus_at_end": statistics.fmean(x["gpus_at_end"] for x in rc),
        }
        row["throughput_ratio"] = row["recover_kept"] / row["cr_kept"]
        # the failure-free ReCoVer/stock step-time ratio at which both methods keep the same
        row["break_even_overhead"] = inputs["overhead"] * row["throughput_ratio"]
        rows.append(row)
    return rows


def measured_inputs(args) -> dict:
    cost = json.loads((RESULTS / "failure_cost.json").read_text())
    overhead = json.loads((RESULTS / "overhead.json").read_text())
    cr = [row["checkpoint_restart"] for row in cost["rows"]]
    ratios = [v["median_ratio"] for k, v in overhead.items() if isinstance(v, dict)
              and "median_ratio" in v]
    measured = {
        "detect_exit_s": median(c["detect_exit_s"] for c in cr),
        "restart_init_s": median(c["restart_init_s"] for c in cr),
        "load_s": median(c["load_s"] for c in cr),
        "save_s": median(c["save_s_each"] for c in cr),
        "recover_s": cost["recover_median"]["total_s"],
        "overhead_ratio_measured": median(ratios),
    }
    rejoin = RESULTS / "rejoin.json"
    joins = json.loads(rejoin.read_text()).get("debugmodel", {}) if rejoin.exists() else {}
    measured["join_s"] = joins.get("median_start_to_ready_s", 0.0) + 60.0 if joins else 0.0
    measured["join_stall_s"] = joins.get("median_join_stall_s", 0.0)
    return measured


def _model_overhead(plane: str) -> float:
    """ReCoVer / stock step time of ``plane`` for the 1B config (benchmarks/gpu_step_model.py)."""
    model = json.loads((RESULTS / "gpu_step_model.json").read_text())["step_s"]
    row = next(v for k, v in model.items() if k.startswith("1B"))
    stock = next(v for k, v in row.items() if k.startswith("stock"))
    matches = [v for k, v in row.items() if plane in k]
    if len(matches) != 1:
        raise SystemExit(f"--data-plane {plane!r}: name one row of {sorted(row)}")
    return max(1.0, matches[0] / stock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default="64,512,100000",
                        help="64: the 1B config (8 replicas x 8 GPUs); 512: 64 replicas")
    parser.add_argument("--g-init", default="4,128",
                        help="G_init, microbatches per replica per step (4: the 1B config; "
                             "128: the paper's 64 replicas x 128 microbatches)")
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replica-gpus", type=int, default=8)
    parser.add_argument("--restart-s", type=float, default=600.0,
                        help="paper-scale restart (default 10 minutes)")
    parser.add_argument("--save-s", type=float, default=None, help="override the measured save")
    parser.add_argument("--load-s", type=float, default=None, help="override the measured load")
    parser.add_argument("--recover-s", type=float, default=None,
                        help="override the measured ReCoVer per-failure cost")
    parser.add_argument("--overhead", type=float, default=None,
                        help="override the failure-free ReCoVer/stock step-time ratio")
    parser.add_argument("--data-plane", default=None,
                        help="take the failure-free overhead from gpu_step_model.json's 1B row "
                             "for this plane (a substring of its row name, e.g. 'mpi plane TCP', "
                             "'torch plane NCCL, overlapped') instead of the CPU ratio")
    parser.add_argument("--join-s", type=float, default=None,
                        help="replica rejoin: a lost replica is back after this many seconds "
                             "(default: the measured start-to-ready of rejoin.json + 60 s for a "
                             "GPU model's start-up; 0: never)")
    parser.add_argument("--join-stall-s", type=float, default=None,
                        help="survivors' stall at a join (default: measured, rejoin.json)")
    parser.add_argument("--quick", action="store_true", help="50 trials")
    args = parser.parse_args()
    if args.quick:
        args.trials = 50
    measured = measured_inputs(args)
    base = {
        "detect_exit_s": measured["detect_exit_s"],
        "load_s": args.load_s if args.load_s is not None else measured["load_s"],
        "save_s": args.save_s if args.save_s is not None else measured["save_s"],
        "recover_s": args.recover_s if args.recover_s is not None else measured["recover_s"],
        "overhead": args.overhead if args.overhead is not None
        else _model_overhead(args.data_plane) if args.data_plane
        else max(1.0, measured["overhead_ratio_measured"]),
        "replica_gpus": args.replica_gpus,
        "join_s": args.join_s if args.join_s is not None else measured["join_s"],
        "join_stall_s": (args.join_stall_s if args.join_stall_s is not None
                         else measured["join_stall_s"]),
    }
    scenarios = {
        "paper-scale": {**base, "restart_s": args.restart_s},
        "as-measured": {**base, "restart_s": measured["restart_init_s"]},
    }
    gpus_list = [int(x) for x in args.gpus.split(",")]
    result = {"assumptions": ASSUMPTIONS, "measured": measured, "args": vars(args),
              "scenarios": {}}
    for name, inputs in scenarios.items():
        result["scenarios"][name] = {"inputs": inputs, "rows": project(
            inputs, gpus_list, args.hours, args.trials, args.seed,
            [int(g) for g in args.g_init.split(",")])}
    path = write_json("projection.json", result)
    try:
        _plot(result, args, RESULTS / "projection.png")
    except ModuleNotFoundError as err:  # matplotlib is optional
        print(f"no plot ({err})")
    print("Assumptions:\n" + "\n".join(f"  {a}" for a in ASSUMPTIONS))
    print("Measured inputs: " + ", ".join(f"{k}={v:.3g}" for k, v in measured.items()))
    print(markdown(result, args))
    print(f"wrote {path} and {RESULTS / 'projection.png'}")


def markdown(result, args=None) -> str:
    args = args or argparse.Namespace(**result["args"])
    lines = []
    for name, scenario in result["scenarios"].items():
        i = scenario["inputs"]
        lines += ["", f"**{name}** (restart {i['restart_s']:.0f} s, detect+exit "
                      f"{i['detect_exit_s']:.1f} s, load {i['load_s']:.2f} s, save "
                      f"{i['save_s']:.2f} s, ReCoVer per failure {i['recover_s']:.2f} s, "
                      f"ReCoVer overhead x{i['overhead']:.3f}, rejoin after "
                      f"{i.get('join_s', 0):.0f} s (stall {i.get('join_stall_s', 0):.2f} s); "
                      f"{args.hours:g} h job, "
                      f"{args.trials} trials)", "",
                  "| GPUs | replicas x G_init | step time after 1 loss | MTBF (min) | failures | "
                  "C/R ckpt interval (s) | C/R GPU time kept | "
                  "ReCoVer kept | ReCoVer kept of held | effective throughput ReCoVer / C/R | "
                  "break-even ReCoVer overhead |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in scenario["rows"]:
            lines.append(f"| {r['gpus']} | {r.get('replicas', '?')} x {r.get('g_init', '?')} | "
                         f"x{r.get('step_factor_after_1', float('nan')):.3f} | "
                         f"{r['mtbf_min']:.1f} | {r['expected_failures']:.1f} | "
                         f"{r['cr_checkpoint_interval_s']:.0f} | {r['cr_kept']:.1%} | "
                         f"{r['recover_kept']:.1%} | {r['recover_kept_of_held']:.1%} | "
                         f"{r['throughput_ratio']:.2f} | x{r['break_even_overhead']:.3f} |")
    return "\n".join(lines)


def _plot(result, args, path) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6.5, 3.8))
    gpus = [int(g) for g in args.gpus.split(",")]
    many = sorted({*gpus, 512, 2048, 8192, 32768, 100_000})
    for index, (name, scenario) in enumerate(result["scenarios"].items()):
        rows = project(scenario["inputs"], many, args.hours, max(20, args.trials // 4),
                       args.seed, [int(args.g_init.split(",")[0])])
        ax.semilogx(many, [r["cr_kept"] for r in rows], "o--", color=f"C{index}",
                    label=f"checkpoint-restart ({name})")
        ax.semilogx(many, [r["recover_kept"] for r in rows], "s-", color=f"C{index}",
                    label=f"ReCoVer ({name})")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("fraction of GPU time kept")
    ax.set_title(f"Projection ({args.hours:g} h job, MTBF = 18 min x 100k / GPUs, "
                 f"G_init = {args.g_init.split(',')[0]})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
