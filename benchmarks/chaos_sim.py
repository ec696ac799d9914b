"""Chaos simulation (issue 34): weeks of training at 1k-1M GPUs, decided by the project's own code.

    python benchmarks/chaos_sim.py [--gpus 1000,10000,100000,1000000] [--hours 168] [--seed 0]

A seeded discrete-event simulation of a training job of W replicas of 8 GPUs (the 1B config's
ranks_per_replica) over ``--hours`` of wall time. The failures are drawn from the
Llama 3 405B paper's interruption mix as a rate per GPU-hour (``_chaos/trace.py``), so larger jobs
fail more often; the same trace goes to every system. This project's decisions are its real
objects (``_chaos/recover.py``): ``WorkloadPolicy`` (plan, replan, exclude, admit,
observe_speeds; committed microbatches == B checked on every plan it returns), the split-brain
arbiter, the relaunch tier's ``lost_hosts`` / ``plan_relaunch`` and the hang bound
``ProgressBound``. Event costs come from the project's measured results
(``benchmarks/results/*.json``; ``_chaos/inputs.py`` names the file of each, and the few stated
constants). Compared on the same trace: checkpoint-restart at Young's interval, a TorchFT-like
and an FT-HSDP-like policy (``_chaos/baselines.py``).

Steps are not simulated one by one: between two events every step is the same, so time is
accounted in bulk, and the real policy is called at each event (and the steps after it). At
large W a plan takes seconds, so above a budget the policy calls are a seeded sample ([Note:
sampled policy calls] in ``_chaos/probe.py``; the counts are in the output).

Writes benchmarks/results/chaos_sim.json (every figure, the trace's assumptions, the inputs and
their sources, a check against projection.py) and chaos_sim.png (effective training time vs GPUs
per system; one simulated week's timeline).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the real objects of this tree

from _chaos import baselines, inputs, recover  # noqa: E402
from _chaos import trace as traces  # noqa: E402
from _chaos.engine import simulate  # noqa: E402
from _common import RESULTS, machine, plt  # noqa: E402

SYSTEMS = ("this project", "this project, PRRTE surviving lost daemons", "checkpoint-restart",
           "TorchFT-like", "FT-HSDP-like")

ASSUMPTIONS = [
    "Weak scaling: W = GPUs / replica_gpus replicas, each with G_init microbatches a step "
    "(B = W x G_init); every system's failure-free step is stock HSDP's (gpu_step_model.json).",
    "Effective training time = failure-free training kept / wall time (a step with fewer "
    "microbatches, or a raised G, counts as the fraction of a failure-free step it is worth).",
    "Tokens per GPU-hour = committed tokens / (W x replica_gpus x wall hours); standby hosts "
    "are not counted.",
    "Every interruption hits one node = one replica; a repaired node is back in the standby "
    "pool after repair_s_host; a replacement waits for a host when none is free.",
    "This project rejoins lost replicas (respawn_after_steps = 1), checkpoints every Young's "
    "interval for the failures that redo steps (a lost host as built, a failed dependency), "
    "and relaunches through the relaunch tier when PRRTE 3.0 ends the job (a lost daemon); "
    "its emergency checkpoint is assumed to win the race with PRRTE on a cut link (keepalive "
    "30 s; relaunch.json measured it losing at keepalive 5 s).",
    "When max_relaunches is used up, the operator starts the launcher again at once (counted "
    "in given_up_at_h).",
    "Silent data corruption is found in the step it happens (this project: the culprit is "
    "excluded and retired; the others: an ordinary failure). A finite wrong backward needs "
    "[recover.bad_replicas] audit_interval (off by default), whose cost is not simulated.",
    "Straggler quotas (observe_speeds) are simulated on up to --rebalance-max-replicas "
    "replicas: its cost grows as W^2 (findings); above, a straggler slows every step.",
    "Not simulated: a failure of the launcher's own host, several nodes lost at once (a switch "
    "taking out a rack), the network's and storage's behaviour at scale, ULFM's repair time "
    "beyond 4-9 ranks (measured there).",
]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (every default is the documented run's)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", default="1000,10000,100000,1000000")
    parser.add_argument("--hours", type=float, default=168.0, help="simulated wall time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-interruptions", type=int, default=60,
                        help="simulate enough seeded weeks per size for this many in all")
    parser.add_argument("--max-trials", type=int, default=20)
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="multiply the Llama 3 interruption rate (a denser trace)")
    parser.add_argument("--straggler-rate-factor", type=float, default=0.1,
                        help="straggler episodes per GPU-hour / the interruption rate")
    parser.add_argument("--straggler-duration-s", type=float, default=600.0)
    parser.add_argument("--straggler-slowdown", type=float, default=None,
                        help="default: the slowdown straggler_bench.py measured")
    parser.add_argument("--restart-s", type=float, default=None,
                        help="a job restart at scale (default: inputs.RESTART_S, 600 s)")
    parser.add_argument("--standby-fraction", type=float, default=0.02,
                        help="standby hosts, as a fraction of the job's (at least 2)")
    parser.add_argument("--policy-budget", type=float, default=1e6,
                        help="replica-plans of real policy calls per run before sampling")
    parser.add_argument("--rebalance-max-replicas", type=int, default=500)
    parser.add_argument("--timeline-gpus", type=int, default=10000)
    parser.add_argument("--out", default=str(RESULTS / "chaos_sim.json"))
    parser.add_argument("--no-plot", action="store_true")
    return parser.parse_args(argv)


def load_inputs(args) -> tuple[dict, dict]:
    """The inputs as floats, and as {name: {value, source}} for the output."""
    values = inputs.load_all()
    if args.restart_s is not None:
        values["restart_s"] = inputs.Value(args.restart_s, "--restart-s")
    if args.straggler_slowdown is None:
        args.straggler_slowdown = values["straggler_slowdown"].value
    else:
        values["straggler_slowdown"] = inputs.Value(args.straggler_slowdown,
                                                    "--straggler-slowdown")
    return ({k: v.value for k, v in values.items()},
            {k: {"value": v.value, "source": v.source} for k, v in values.items()})


def build(name: str, trace, inp: dict, args, memo: dict, arbiter_dir: str):
    """One system on ``trace``."""
    horizon, standby = args.hours * 3600, baselines.standby_hosts(trace.replicas,
                                                                  args.standby_fraction)
    if name.startswith("this project"):
        return recover.Recover(trace, horizon, inp, standby, tolerant="PRRTE" in name,
                               budget=args.policy_budget,
                               rebalance_max_replicas=args.rebalance_max_replicas,
                               after_steps=3 if trace.replicas <= 500 else 1,
                               arbiter_dir=arbiter_dir, memo=memo)
    cls = {"checkpoint-restart": baselines.CheckpointRestart, "TorchFT-like": baselines.TorchFTLike,
           "FT-HSDP-like": baselines.FTHSDPLike}[name]
    return cls(trace, horizon, inp, standby)


def trials_for(gpus: int, args) -> int:
    """Seeded weeks simulated at this size: enough for ~``--min-interruptions`` in all (a week
    at 1k GPUs expects ~4), at most ``--max-trials``."""
    per_trial = traces.expected(gpus, args.hours, args.rate_scale)
    return max(1, min(args.max_trials, math.ceil(args.min_interruptions / max(per_trial, 1e-9))))


def run_size(gpus: int, inp: dict, args) -> tuple[dict, dict]:
    """Every system on the seeded traces of ``gpus`` GPUs; trial 0's trace and project ledger
    for the plot."""
    model = traces.StragglerModel(args.straggler_rate_factor, args.straggler_duration_s,
                                  args.straggler_slowdown)
    memo: dict = {}
    runs, first, counts = {name: [] for name in SYSTEMS}, {}, {}
    for trial in range(trials_for(gpus, args)):
        trace = traces.draw(gpus, int(inp["replica_gpus"]), args.hours, args.seed,
                            args.rate_scale, model, trial)
        b_tokens = trace.replicas * inp["g_init"] * inp["tokens_per_microbatch"]
        for name in SYSTEMS:
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="chaos-arbiter-") as folder:
                system = simulate(build(name, trace, inp, args, memo, folder))
            runs[name].append({**system.summary(inp["step_s"], b_tokens, gpus), **system.extra(),
                               "sim_wall_s": round(time.perf_counter() - start, 2)})
            if trial == 0 and name == SYSTEMS[0]:
                first = {"trace": trace, "ledger": system.ledger}
        for effect, n in trace.counts().items():
            counts[effect] = counts.get(effect, 0) + n
    row = {"gpus": gpus, "replicas": trace.replicas, "B": int(trace.replicas * inp["g_init"]),
           "trials": trial + 1, "interruptions": counts,
           "interruptions_per_trial": sum(counts.values()) / (trial + 1),
           "expected_per_trial": traces.expected(gpus, args.hours, args.rate_scale),
           "systems": {name: aggregate(r) for name, r in runs.items()},
           "projection_check": projection_check(first["trace"], inp, args, memo)}
    return row, first


def aggregate(runs: list[dict]) -> dict:
    """The mean of each figure over the trials, the range of the effective time, each trial."""
    keys = ("effective_training_time", "tokens_per_gpu_hour", "steps_committed", "steps_lost",
            "interruptions")
    out = {k: statistics.fmean(r[k] for r in runs) for k in keys}
    eff = [r["effective_training_time"] for r in runs]
    out["effective_training_time_range"] = [min(eff), max(eff)]
    out["per_trial"] = runs
    return out


def projection_check(trace, inp: dict, args, memo: dict) -> dict:
    """This simulator against projection.py's formulas where both apply: checkpoint-restart
    kept (projection's A2: no failure during a restart counted, no stragglers, hosts always
    there) at this trace's MTBF; the step time after one loss (its ceil(B/W)/G_init) against
    the real policy's plan."""
    import projection

    horizon = args.hours * 3600
    rate = baselines.job_rate_s(trace, set(traces.Effect))
    plain = traces.Trace(trace.gpus, trace.replicas, trace.hours, trace.seed, trace.rate_scale,
                         trace.failures, [])
    ours = simulate(baselines.CheckpointRestart(plain, horizon, inp, trace.replicas,
                                                restart_again=False)).ledger
    down = inp["cr_detect_exit_s"] + inp["restart_s"] + inp["load_s"]
    rng = random.Random(args.seed)
    theirs = [projection.simulate_checkpoint_restart(rng, args.hours, 1 / rate, inp["save_s"],
                                                     down)["kept"] for _ in range(50)]
    w, g = trace.replicas, int(inp["g_init"])
    after = next((o for k, o in memo.items() if k[:3] == ("death", 1, g) and o.real), None)
    return {
        "checkpoint_restart_kept": {"chaos_sim": ours.progress / ours.t,
                                    "projection_formula": sum(theirs) / len(theirs),
                                    "projection_trials": len(theirs)},
        "step_factor_after_one_loss": {
            "real_policy": after.units / g if after else None,
            "projection_formula": projection.step_time_factor(w, w - 1, g)},
        "not_compared": "projection.simulate_recover draws failures at its own MTBF (18 min x "
                        "100k / GPUs, inside the function), not at a rate it is given: its "
                        "step-time rule is compared above instead",
    }


def findings(rows: list[dict]) -> dict:
    """What the runs say would break first at scale, measured on the real objects."""
    from recover_hsdp.collectives.arbiter import SplitBrainArbiter
    from recover_hsdp.workload.policy import WorkloadPolicy
    from recover_hsdp.workload.rebalance import StragglerRule

    def both_go_on(w: int, arbiter: SplitBrainArbiter) -> bool:
        alive = tuple(range(w))
        majority = arbiter.claim(1, alive, set(alive[:-1]), alive[:-1], rank=0)
        return majority and arbiter.claim(1, alive, {w - 1}, {w - 1}, rank=w - 1)

    with tempfile.TemporaryDirectory() as folder:
        arbiter = SplitBrainArbiter(folder, sleep=lambda s: None)
        first_fail = next((w for w in range(2, 1000) if both_go_on(w, arbiter)), None)
    costs = {}
    for w in (125, 1250):
        policy = WorkloadPolicy(initial_replicas=w, microbatches_per_replica=4,
                                straggler=StragglerRule(1.5, 1.2, 3))
        start = time.perf_counter()
        policy.observe_speeds({r: 1.0 + (r == 0) for r in range(w)})
        costs[w] = time.perf_counter() - start
    per_w2 = costs[1250] / 1250 ** 2
    return {
        "arbiter_claim_fails_from_replicas": first_fail,
        "arbiter_note": "the first replica count (2-999) at which both sides of a partition "
                        "go on (a claim that cannot be written); None: none. Until e08bed4 "
                        "claim_path held the whole alive list and from 79 replicas the name "
                        "passed 255 bytes (ENAMETOOLONG: every side went on)",
        "observe_speeds_s": {str(w): round(c, 4) for w, c in costs.items()},
        "observe_speeds_extrapolated_s": {str(w): round(per_w2 * w * w, 1)
                                          for w in (12_500, 125_000)},
        "observe_speeds_note": "each replica's median of all the others: O(W^2 log W) per "
                               "step on every rank; timed here (wall clock, this box)",
        "max_relaunches_first_used_up_h": {
            str(r["gpus"]): [(t["given_up_at_h"] or [None])[0]
                             for t in r["systems"]["this project"]["per_trial"]]
            for r in rows},
    }


def markdown(rows: list[dict]) -> str:
    """The README's table: per size and system, effective training time (tokens per GPU-hour,
    steps redone per week); means over the seeded weeks."""
    head = ["GPUs (replicas)", "interruptions / week (weeks)", *SYSTEMS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['gpus']:,} ({r['replicas']:,})",
                 f"{r['interruptions_per_trial']:.1f} ({r['trials']})"]
        for name in SYSTEMS:
            x = r["systems"][name]
            cells.append(f"**{x['effective_training_time']:.1%}** "
                         f"({x['tokens_per_gpu_hour'] / 1e6:.1f}M, {x['steps_lost']:,.0f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timeline(extra: dict, horizon_s: float) -> dict:
    """One simulated run's alive replicas and G over time, failures and relaunches."""
    ledger, trace = extra["ledger"], extra["trace"]
    return {"gpus": trace.gpus, "replicas": trace.replicas, "horizon_s": horizon_s,
            "samples": [[round(t, 1), a, g] for t, a, g in ledger.samples],
            "failures": [[round(f.t, 1), f.effect.value] for f in trace.failures],
            "relaunches": [round(t, 1) for t, what in ledger.marks if what == "relaunch"],
            "down": down_periods(ledger.marks)}


def down_periods(marks: list[tuple[float, str]]) -> list[list[float]]:
    """[start, end] of each stretch between a relaunch and training again."""
    out, start = [], None
    for t, what in marks:
        if what == "relaunch" and start is None:
            start = t
        elif what == "training again" and start is not None:
            out.append([round(start, 1), round(t, 1)])
            start = None
    return out


def plot(result: dict, path: Path) -> None:
    """Effective training time vs GPUs per system (log x); one simulated week's timeline."""
    pyplot = plt()
    fig = pyplot.figure(figsize=(12, 4.6))
    grid = fig.add_gridspec(2, 2)
    left = fig.add_subplot(grid[:, 0])
    gpus = [r["gpus"] for r in result["sizes"]]
    for i, name in enumerate(SYSTEMS):
        left.semilogx(gpus, [r["systems"][name]["effective_training_time"]
                             for r in result["sizes"]], "o-", color=f"C{i}", label=name)
    left.set_xlabel("GPUs")
    left.set_ylabel("effective training time")
    left.set_ylim(0, 1.02)
    left.set_title(f"{result['args']['hours']:g} h simulated, Llama 3 interruption mix",
                   fontsize=9)
    left.legend(fontsize=7)
    _plot_timeline(fig, grid, result)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_timeline(fig, grid, result: dict) -> None:
    """Alive replicas and G of the project (as built) over one simulated run; failures as grey
    lines, relaunches as orange ones, the time down in them shaded."""
    tl = result["timeline"]
    top = fig.add_subplot(grid[0, 1])
    bottom = fig.add_subplot(grid[1, 1], sharex=top)
    hours = [0.0] + [s[0] / 3600 for s in tl["samples"]] + [tl["horizon_s"] / 3600]
    alive = [tl["replicas"]] + [s[1] for s in tl["samples"]]
    g = [result["inputs"]["g_init"]["value"]] + [s[2] for s in tl["samples"]]
    top.step(hours, alive + alive[-1:], where="post", color="C0")
    bottom.step(hours, g + g[-1:], where="post", color="C3")
    for ax in (top, bottom):
        ax.ticklabel_format(axis="y", useOffset=False)
        for t, _ in tl["failures"]:
            ax.axvline(t / 3600, color="0.8", lw=0.5, zorder=0)
        for start, end in tl["down"]:
            ax.axvspan(start / 3600, end / 3600, color="C1", alpha=0.6, lw=0)
            ax.axvline(start / 3600, color="C1", lw=0.9, ls="--")
    top.set_ylabel("alive replicas", fontsize=8)
    bottom.set_ylabel("G", fontsize=8)
    bottom.set_xlabel("hours")
    top.yaxis.get_major_locator().set_params(integer=True)
    bottom.yaxis.get_major_locator().set_params(integer=True)
    top.set_title(f"this project (as built), {tl['gpus']:,} GPUs: {len(tl['failures'])} "
                  "failures (grey),\nrelaunches (orange; shaded: down, 10 min each)", fontsize=9)


def main() -> None:
    """Every size, the findings, the JSON, the table, the plot."""
    args = parse()
    started = time.perf_counter()
    inp, sources = load_inputs(args)
    rows, timelines = [], {}
    for gpus in (int(g) for g in args.gpus.split(",")):
        row, extra = run_size(gpus, inp, args)
        rows.append(row)
        timelines[gpus] = extra
        print(f"{gpus:>9,} GPUs: " + ", ".join(
            f"{n} {row['systems'][n]['effective_training_time']:.1%}" for n in SYSTEMS), flush=True)
    pick = args.timeline_gpus if args.timeline_gpus in timelines else min(timelines)
    result = {
        "what": __doc__.split("\n")[0], "command": " ".join(["python", *sys.argv]),
        "machine": machine(), "args": vars(args), "assumptions": ASSUMPTIONS,
        "trace": traces.describe(traces.StragglerModel(args.straggler_rate_factor,
                                                       args.straggler_duration_s,
                                                       args.straggler_slowdown), args.rate_scale),
        "inputs": sources, "sizes": rows, "findings": findings(rows),
        "timeline": timeline(timelines[pick], args.hours * 3600),
    }
    result["run_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(rows))
    if not args.no_plot:
        try:
            plot(result, out.with_suffix(".png"))
        except ModuleNotFoundError as err:   # matplotlib is optional
            print(f"no plot ({err})")
    print(f"wrote {out} ({result['run_s']} s)")


if __name__ == "__main__":
    main()
