"""Replay the paper's example through the workload policy and print the per-failure plan table.

    python -m recover_hsdp.workload --replay-paper [--failures 16] [--mode stream|exact]
                                                   [--victim major|minor|spare] [--no-spares]

32 replicas x 8 microbatches (B = 256). Failure i hits step i at gradient sync and kills one replica
(by default the lowest-id major); the step is replanned (promotion, then extras), committed, and the
next step's plan shows the raised G and the new roles.
"""

from __future__ import annotations

import argparse

from recover_hsdp.workload.plan import Role, StepPlan
from recover_hsdp.workload.policy import WorkloadPolicy

HEADER = ("failure", "victim", "alive W", "promoted", "extra mb", "max extra/replica",
          "G", "majors", "minor (quota)", "spares")


def pick_victim(plan: StepPlan, victim: str) -> int:
    """The lowest-id replica with the wanted role, falling back to the lowest-id major, then any."""
    for role in (Role(victim), Role.MAJOR, Role.MINOR, Role.SPARE, Role.IDLE):
        ids = [a.replica for a in plan.assignments if a.role is role and not a.promoted]
        if ids:
            return ids[0]
    raise AssertionError("a plan always has a replica")


def replay(replicas: int = 32, microbatches: int = 8, failures: int = 16, mode: str = "stream",
           victim: str = "major", keep_spares: bool = True, g_raise: str = "ceil") -> list[tuple]:
    """Run the failure sequence; one row per failure (see HEADER), row 0 = the initial plan."""
    policy = WorkloadPolicy(initial_replicas=replicas, microbatches_per_replica=microbatches,
                            keep_spares=keep_spares, data_assignment=mode, g_raise=g_raise)
    plan = policy.plan(0)
    rows = [(0, "-", len(plan.alive), 0, 0, 0, *_roles(plan))]
    for i in range(1, failures + 1):
        if len(plan.alive) == 1:
            break
        dead = pick_victim(plan, victim)
        role = plan.assignment(dead).role.value
        plan = policy.replan(plan, [dead])
        promoted, extra, max_extra = len(plan.promoted()), plan.extras_total(), plan.max_extras()
        policy.commit(plan)
        plan = policy.plan(i)
        rows.append((i, f"{dead} ({role})", len(plan.alive), promoted, extra, max_extra,
                     *_roles(plan)))
    return rows


def _roles(plan: StepPlan) -> tuple:
    """G, majors, minor (quota), spares of a failure-free plan."""
    minor = [a.quota for a in plan.assignments if a.role is Role.MINOR]
    spares = plan.count(Role.SPARE) or plan.count(Role.IDLE) and f"{plan.count(Role.IDLE)} idle"
    return plan.g, plan.count(Role.MAJOR), f"1 ({minor[0]})" if minor else "0", spares


def format_table(rows: list[tuple]) -> str:
    """Markdown table of `replay` rows."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints the table."""
    ap = argparse.ArgumentParser(prog="python -m recover_hsdp.workload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay-paper", action="store_true", required=True,
                    help="replay 32 replicas x 8 microbatches with failures one by one")
    ap.add_argument("--failures", type=int, default=16,
                    help="failures to inject (stops at 1 alive)")
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mode", choices=("stream", "exact"), default="stream")
    ap.add_argument("--victim", choices=("major", "minor", "spare"), default="major")
    ap.add_argument("--g-raise", choices=("ceil", "reserve"), default="ceil")
    ap.add_argument("--no-spares", action="store_true", help="keep_spares = false (surplus idles)")
    args = ap.parse_args(argv)
    rows = replay(args.replicas, args.microbatches, args.failures, args.mode, args.victim,
                  not args.no_spares, args.g_raise)
    print(f"B = {args.replicas * args.microbatches} = {args.replicas} x {args.microbatches}, "
          f"mode={args.mode}, victim={args.victim}, g_raise={args.g_raise}, "
          f"keep_spares={not args.no_spares}")
    print("columns after 'alive W' describe the boundary step; G..spares the next step's plan")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
