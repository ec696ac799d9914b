"""A plan in O(1) per step ([Note: a plan in O(1) per step] in workload/plan.py) and the compact
ledger ([Note: the compact ledger] in workload/ledger.py), against an oracle: every replica's
work built the direct way (the roles, blocks and stream cursors written out, as the policy did
before), over random runs of failures, culprits, joins, quota weights and checkpoint restarts.
Pure Python, fast."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recover_hsdp.workload import ReplicaAssignment, Role, StragglerRule, WorkloadPolicy
from recover_hsdp.workload.ledger import (LedgerWriter, ledger_line, ledger_records, plan_record,
                                          read_ledger, runs, unruns)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EVENTS = ("none", "none", "none", "die", "die_between", "culprit", "join", "weights", "restart")


def direct_plan(policy: WorkloadPolicy, step: int, alive: tuple[int, ...],
                cursors: dict[int, int]) -> tuple:
    """Every replica's failure-free work, written out (the oracle): contributor k owns block k
    of the step's B ids (the straggler quotas' sizes), spare j shadows contributor j mod n, a
    stream replica reads from its slot's cursor."""
    b = policy.global_microbatches
    g = policy.g_for(len(alive))
    n_major, q = divmod(b, g)
    n = n_major + (q > 0)
    sizes = policy.rebalancer.quotas(alive[:n], b, g)
    starts = [step * b + sum(sizes[:k]) for k in range(n)]
    out = []
    for k, r in enumerate(alive):
        if k < n:
            role, block, shadow = (Role.MAJOR if k < n_major else Role.MINOR,
                                   range(starts[k], starts[k] + sizes[k]), None)
        elif policy.keep_spares:
            j = (k - n) % n
            role, block, shadow = Role.SPARE, range(starts[j], starts[j] + sizes[j]), alive[j]
        else:
            role, block, shadow = Role.IDLE, range(0), None
        if policy.data_assignment.value == "exact":
            out.append(ReplicaAssignment(r, role, tuple(block), shadow_of=shadow))
        else:
            slot = policy.slot_of(r)
            start, count = cursors.get(slot, 0), g if role is Role.SPARE else len(block)
            out.append(ReplicaAssignment(r, role, tuple(range(start, start + count)),
                                         stream_start=start, slot=slot))
    return tuple(out)


@st.composite
def runs_of_steps(draw):
    w = draw(st.integers(1, 12))
    return {"w": w, "g": draw(st.integers(1, 6)), "keep_spares": draw(st.booleans()),
            "mode": draw(st.sampled_from(["stream", "exact"])),
            "g_raise": draw(st.sampled_from(["ceil", "reserve"])),
            "events": draw(st.lists(st.tuples(st.sampled_from(EVENTS), st.integers(0, 999)),
                                    min_size=1, max_size=14))}


@SETTINGS
@given(runs_of_steps())
def test_fresh_plans_equal_the_direct_plans_and_the_ledger_reads_back(tmp_path_factory, run):
    """Each step's fresh plan equals the direct one, asked one replica at a time before the
    commit and in full after it (the ledger writer's order); commits, replans and restarts
    keep the stream cursors; the compact ledger reads back as every committed plan."""
    out = tmp_path_factory.mktemp("ledger")
    policy = WorkloadPolicy(initial_replicas=run["w"], microbatches_per_replica=run["g"],
                            keep_spares=run["keep_spares"], data_assignment=run["mode"],
                            g_raise=run["g_raise"], straggler=StragglerRule(1.3, 1.1, 2))
    committed, short_lines = [], 0
    with LedgerWriter(out) as ledger:
        for step, (event, pick) in enumerate(run["events"]):
            alive = policy.alive
            if event == "join" and len(alive) < run["w"]:
                policy.admit([min(set(range(run["w"])) - set(alive))])
            if event == "weights" and len(policy.alive) > 1:  # a straggler's measured weight
                policy.rebalancer.weights = {policy.alive[pick % len(policy.alive)]: 0.5}
            if event == "restart":
                policy = WorkloadPolicy.from_state_dict(json.loads(json.dumps(
                    policy.state_dict())))
            members = policy.alive
            if event == "die_between" and len(members) > 1:  # lost between two steps
                members = tuple(r for r in members if r != members[pick % len(members)])
            cursors = dict(policy.cursors)
            expected = direct_plan(policy, step, members, cursors)
            plan = policy.plan(step, list(members))
            assert plan.is_fresh and plan.committed_total() == policy.global_microbatches
            mine = expected[pick % len(expected)]
            assert plan.assignment(mine.replica) == mine  # one replica, built alone
            if event == "die" and len(plan.alive) > 1:
                plan = policy.replan(plan, [plan.alive[pick % len(plan.alive)]])
            if event == "culprit" and len(plan.alive) > 1:
                plan = policy.exclude(plan, [plan.alive[pick % len(plan.alive)]])
            policy.commit(plan)
            line = ledger.append(plan, epoch=step)
            short_lines += "next_of" in line
            if plan.is_fresh:                 # in full after the commit: as planned
                assert tuple(plan.assignments) == expected
            committed.append(plan)
    records = ledger_records(out)
    assert records == [plan_record(p, e) for e, p in enumerate(committed)]
    assert [e.committed_total for e in read_ledger(out)] == \
        [policy.global_microbatches] * len(committed)
    fresh_pairs = sum(a.is_fresh and b.is_fresh and a.layout is b.layout
                      for a, b in zip(committed, committed[1:]))
    assert short_lines == fresh_pairs


def test_a_steady_step_builds_only_what_is_asked_and_writes_one_short_line():
    """At W = 5,000 a step planned from the same layout builds the one assignment asked for,
    commits in O(1) (the stream cursors are not written out) and its ledger line is short;
    the first plan, a replan and a join build and write everything. Counted, not timed."""
    for mode in ("stream", "exact"):
        policy = WorkloadPolicy(initial_replicas=5000, microbatches_per_replica=4,
                                data_assignment=mode)
        first = policy.plan(0)
        policy.commit(first)
        previous = first
        for step in range(1, 4):
            plan = policy.plan(step, policy.alive)
            assert plan.layout is first.layout
            assert plan.assignment(4321).compute_ids[0] == (
                step * 20000 + 4321 * 4 if mode == "exact" else step * 4)
            policy.commit(plan)
            line = ledger_line(plan, step, previous)
            assert line == {"step": step, "epoch": step, "next_of": step - 1}
            assert len(plan.assignments._built) == 1  # noqa: SLF001 - what was built
            previous = plan
        if mode == "stream":
            assert policy.assigner._n == 4  # noqa: SLF001 - four commits kept as one count
            assert policy.cursors[4321] == 16 and policy.assigner._n == 0  # noqa: SLF001
        failed = policy.replan(policy.plan(4), [7])
        assert not failed.is_fresh and len(ledger_line(failed, 4, previous)["replicas"]) == 4999


def test_id_runs_round_trip():
    for ids in ([], [3], [4, 5, 6, 0], [6, 7, 4, 5], [1, 3, 5], list(range(100))):
        assert unruns(runs(ids)) == ids
    assert runs(range(8, 12)) == [[8, 12]] and unruns([1, 2]) == [1, 2]  # format 1 as it is


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.3, 0.7, 1.0, 2.5]), min_size=1,
                max_size=12), st.integers(1, 3))
def test_straggler_medians_in_one_sort_equal_one_sort_per_replica(speeds, patience):
    """``observe`` compares each replica with the median of the others from one sort; the
    oracle sorts the others of each replica. Same weights and streaks, step after step."""
    from recover_hsdp.workload import rebalance

    def by_hand(rebalancer, seconds):  # the O(W^2) way: a median of the others per replica
        measured = {r: s for r, s in seconds.items() if s > 0}
        changed = False
        for r in sorted(measured):
            others = [s for q, s in measured.items() if q != r]
            if others:
                changed |= rebalancer._observe_one(  # noqa: SLF001
                    r, measured[r] / rebalancer_median(others))
        return changed

    rebalancer_median = rebalance._median  # noqa: SLF001
    fast = rebalance.Rebalancer(StragglerRule(1.3, 1.1, patience))
    slow = rebalance.Rebalancer(StragglerRule(1.3, 1.1, patience))
    for shift in range(4):  # the same speeds, rotated: replicas slow down and recover
        seconds = {r: speeds[(r + shift) % len(speeds)] for r in range(len(speeds))}
        assert fast.observe(seconds) == by_hand(slow, seconds)
        assert (fast.weights, fast.streaks) == (slow.weights, slow.streaks)
