"""What the control plane costs a rank per step as the job grows: W = 8 ... 125,000 replicas,
over the real objects, in one process ([Note: a plan in O(1) per step] in
recover_hsdp/workload/plan.py, [Note: the compact ledger] in workload/ledger.py).

Per W (G = 4, exact and stream; G = 128 stream at the issue's 12,500) it times, median of
``--repeats``, what every rank does every step on the manager's path:

  plan      ``policy.plan(step, alive)`` and this rank's ``plan.assignment(me)``
  commit    ``policy.commit(plan)`` (stream: the cursors)
  ledger    ``ledger_line(plan, epoch, previous)`` (every rank keeps it; the writer also
            serializes it: ``json.dumps``, timed with it)
  totals    the step's ``StepTotals`` built, ``to_array``, ``from_array`` (the all-reduce itself
            is MPI's: one array of 3 W + 8 float64), the vote's common case
            (``fingerprints_agree``) and the step record's ``slowest(16)``

and, with straggler quotas on (``[recover.straggler]``, off by default), ``observe_speeds``
fed the step's W measured seconds (``speeds``); and, side by side, the same step done in full
(every replica's assignment built and the O(B) check, the full ledger record, the totals as
Python lists): what each step cost before. Then what only a failure or a checkpoint pays:
``replan`` of one dead replica with its full ledger line, and ``state_dict``.

Writes benchmarks/results/control_scaling.json and prints the table. ~2 min.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np

from _common import machine, write_json
from recover_hsdp.manager.totals import StepTotals
from recover_hsdp.workload import StragglerRule, WorkloadPolicy
from recover_hsdp.workload.ledger import ledger_line, plan_record

SIZES = (8, 64, 512, 4096, 12_500, 125_000)


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def totals_step(w: int, me: int, alive: tuple[int, ...], lists: bool) -> None:
    """One step's totals on one rank: built, flattened, read back; the vote's common case and
    the record's slowest replicas. ``lists``: as before (Python lists, a dict per replica)."""
    totals = StepTotals(loss=1.0, tokens=8.0, positions=8.0, reduced=4.0)
    if lists:
        totals.compute_s, totals.fingerprints = [0.0] * w, [0.0] * (2 * w)
        totals.compute_s[me] = 0.1
        values = np.array([getattr(totals, f) for f in ("loss", "tokens", "positions",
                                                        "reduced", "disagree", "join_requests",
                                                        "join_ready", "join_failed")]
                          + list(totals.compute_s) + list(totals.fingerprints), np.float64)
        values[8:8 + w] = 0.1
        back = [float(v) for v in values]
        compute_s, prints = back[8:8 + w], back[8 + w:]
        any(prints)
        {str(r): compute_s[r] for r in alive}
        return
    totals.compute_s, totals.fingerprints = np.zeros(w), np.zeros(2 * w)
    totals.compute_s[me] = 0.1
    values = totals.to_array()
    values[8:8 + w] = 0.1
    back = StepTotals.from_array(values, w)
    assert not back.fingerprints.any() or back.fingerprints_agree(alive)
    back.fingerprints_agree(alive)
    back.slowest(16)


def measure(w: int, g: int, mode: str, repeats: int) -> dict:
    policy = WorkloadPolicy(initial_replicas=w, microbatches_per_replica=g, data_assignment=mode)
    alive, me = policy.alive, w // 2
    previous = policy.plan(0, alive)
    policy.commit(previous)
    state = {"step": 1, "previous": previous}

    def fresh_step() -> None:
        t = state["step"]
        plan = policy.plan(t, alive)
        plan.assignment(me)
        policy.commit(plan)
        line = ledger_line(plan, 0, state["previous"])
        json.dumps(line)
        state["step"], state["previous"] = t + 1, plan

    def parts() -> dict:
        samples: dict[str, list[float]] = {"plan": [], "ledger": [], "commit": []}
        for _ in range(repeats):  # consecutive steps, each piece timed on its own
            t, clock = state["step"], time.perf_counter
            started = clock()
            plan = policy.plan(t, alive)
            plan.assignment(me)
            planned = clock()
            json.dumps(ledger_line(plan, 0, state["previous"]))
            logged = clock()
            policy.commit(plan)
            samples["plan"].append(planned - started)
            samples["ledger"].append(logged - planned)
            samples["commit"].append(clock() - logged)
            state["step"], state["previous"] = t + 1, plan
        out = {k: statistics.median(v) for k, v in samples.items()}
        out["totals"] = timed(lambda: totals_step(w, me, alive, lists=False), repeats)
        return out

    def full_step() -> None:  # the same step's work, every replica's ids written out
        t = state["step"]
        plan = policy.plan(t, alive)
        eager = dataclasses.replace(plan, assignments=tuple(plan.assignments))
        policy._checked(eager)  # noqa: SLF001 - the O(B) check every plan had
        eager.assignment(me)
        json.dumps(plan_record(eager, 0))
        totals_step(w, me, alive, lists=True)

    row = {"w": w, "g": g, "mode": mode, **parts()}
    row["per_step"] = timed(fresh_step, repeats) + row["totals"]
    full_repeats = max(1, min(repeats, 20_000 // w))
    row["per_step_full"] = timed(full_step, full_repeats)
    t = state["step"]
    row["replan_1_dead"] = timed(lambda: json.dumps(ledger_line(
        policy.replan(policy.plan(t, alive), [me]), 0, None)), full_repeats)
    rng = np.random.default_rng(w)
    seconds = dict(zip(alive, (0.1 * (1 + 0.01 * rng.random(w))).tolist()))
    rebalancing = WorkloadPolicy(initial_replicas=w, microbatches_per_replica=g,
                                 data_assignment=mode, straggler=StragglerRule(1.3, 1.1, 3))
    row["speeds"] = timed(lambda: rebalancing.observe_speeds(seconds), full_repeats)
    row["state_dict"] = timed(lambda: json.dumps(policy.state_dict()), full_repeats)
    row["ledger_line_bytes"] = len(json.dumps(ledger_line(policy.plan(t, alive), 0,
                                                          state["previous"])))
    row["ledger_full_line_bytes"] = len(json.dumps(ledger_line(policy.plan(t, alive), 0)))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    args = parser.parse_args()
    rows = []
    for w in args.sizes:
        for g, mode in ((4, "exact"), (4, "stream")) + (((128, "stream"),) if w == 12_500
                                                        else ()):
            rows.append(measure(w, g, mode, args.repeats))
            r = rows[-1]
            print(f"W={w:>7,} G={g:>3} {mode:6}  per step {r['per_step'] * 1e6:9.1f} us "
                  f"(plan {r['plan'] * 1e6:7.1f}, commit {r['commit'] * 1e6:7.1f}, ledger "
                  f"{r['ledger'] * 1e6:6.1f}, totals {r['totals'] * 1e6:8.1f})   in full "
                  f"{r['per_step_full'] * 1e3:9.2f} ms   replan {r['replan_1_dead'] * 1e3:8.2f}"
                  f" ms   speeds {r['speeds'] * 1e3:8.2f} ms   state_dict {r['state_dict'] * 1e3:7.2f} ms"
                  f"   ledger line "
                  f"{r['ledger_line_bytes']} B (full {r['ledger_full_line_bytes']:,} B)",
                  flush=True)
    path = write_json("control_scaling.json", {"machine": machine(), "repeats": args.repeats,
                                          "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
