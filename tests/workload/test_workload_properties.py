"""Property tests of the workload policy over random failure schedules (pure Python, fast).

Each scenario: a random W_init, G_init, keep_spares, data assignment and g_raise rule, then a few
steps; every step may lose replicas between iterations (membership change) and, inside the
iteration, several replan rounds each killing replicas picked by kind (a spare, the minor, a replica
already running extras, a promoted spare, a major, anyone), down to one survivor.
"""

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recover_hsdp.workload import DataAssignment, Role, StepPlan, WorkloadPolicy

KINDS = ("major", "minor", "spare", "idle", "promoted", "extra", "any")
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw):
    """A policy configuration plus a failure schedule (kinds and indices, resolved at run time)."""
    kill = st.tuples(st.sampled_from(KINDS), st.integers(0, 10_000))
    step = st.fixed_dictionaries({
        "between": st.lists(kill, max_size=2),                              # before the plan
        "rounds": st.lists(st.lists(kill, min_size=1, max_size=3), max_size=4),  # inside the step
    })
    w = draw(st.integers(1, 40))
    return {
        "w": w, "g": draw(st.integers(1, 12)),
        # restart from a checkpoint with fewer replicas (same B): spares appear from step 0
        "start": draw(st.one_of(st.just(None), st.sets(st.integers(0, w - 1), min_size=1))),
        "keep_spares": draw(st.booleans()), "mode": draw(st.sampled_from(["stream", "exact"])),
        "g_raise": draw(st.sampled_from(["ceil", "reserve"])),
        "steps": draw(st.lists(step, min_size=1, max_size=5)),
    }


def pick(plan: StepPlan, kind: str, index: int, exclude: set) -> int | None:
    """A replica of the wanted kind (else anyone) not in `exclude`; None if nobody is left."""
    def matches(a):
        return {"major": a.role is Role.MAJOR, "minor": a.role is Role.MINOR,
                "spare": a.role is Role.SPARE and not a.promoted, "idle": a.role is Role.IDLE,
                "promoted": a.promoted, "extra": bool(a.extra_ids), "any": True}[kind]
    pool = [a.replica for a in plan.assignments if a.replica not in exclude]
    wanted = [a.replica for a in plan.assignments if a.replica not in exclude and matches(a)]
    pool = wanted or pool
    return pool[index % len(pool)] if pool else None


def victims(plan: StepPlan, kills) -> list[int]:
    """Resolve a kill list against `plan`, always leaving at least one survivor."""
    dead: set[int] = set()
    for kind, index in kills:
        if len(plan.alive) - len(dead) <= 1:
            break
        r = pick(plan, kind, index, dead)
        dead.add(r)
    return sorted(dead)


def check_fresh(policy: WorkloadPolicy, plan: StepPlan) -> None:
    """Roles and quotas of a failure-free plan are the documented ones."""
    b, w, g = policy.global_microbatches, len(plan.alive), plan.g
    assert g == policy.g_for(w) and g >= math.ceil(b / w)
    n_major, q = divmod(b, g)
    contrib = n_major + (q > 0)
    assert plan.count(Role.MAJOR) == n_major and plan.count(Role.MINOR) == (q > 0)
    surplus = w - contrib
    assert plan.count(Role.SPARE) == (surplus if policy.keep_spares else 0)
    assert plan.count(Role.IDLE) == (0 if policy.keep_spares else surplus)
    if policy.g_raise.value == "reserve" and 2 <= w < policy.initial_replicas:
        assert surplus >= 1
    if w == policy.initial_replicas:
        assert g == policy.initial_g
    exact = policy.data_assignment is DataAssignment.EXACT
    for k, a in enumerate(plan.assignments):
        assert not a.extra_ids and not a.promoted
        assert a.quota == {Role.MAJOR: g, Role.MINOR: q}.get(a.role, 0)
        if a.role is Role.MINOR:
            assert 0 < a.quota < g and k == n_major
        if a.role is Role.SPARE:
            assert a.discarded_ids == a.compute_ids and a.compute_ids
            if exact:
                assert a.compute_ids == plan.assignment(a.shadow_of).compute_ids
            else:
                assert len(a.compute_ids) == g
        if a.role is Role.IDLE:
            assert a.compute_ids == ()
        if not exact:
            start = policy.cursors.get(a.slot, 0)
            assert a.compute_ids == tuple(range(start, start + len(a.compute_ids)))


def check_invariant(policy: WorkloadPolicy, plan: StepPlan, seen: set) -> None:
    """Sum == B, no id committed twice (ever), exact ids == the failure-free set."""
    b = policy.global_microbatches
    assert plan.committed_total() == b
    if policy.data_assignment is DataAssignment.EXACT:
        ids = sorted(i for ids in plan.committed_ids().values() for i in ids)
        assert ids == list(range(plan.step * b, plan.step * b + b))
    else:
        keys = [(r, i) for r, ids in plan.committed_ids().items() for i in ids]
        assert len(set(keys)) == b and not seen & set(keys)
    for a in plan.assignments:
        if a.role in (Role.SPARE, Role.IDLE) and not a.promoted:
            assert a.committed_ids == a.extra_ids      # spares commit nothing of their own


def check_replan(old: StepPlan, new: StepPlan, dead: list[int], exact: bool) -> None:
    """Survivors keep their work; the extras cover exactly the uncovered loss, within the bound."""
    assert new.step == old.step and new.round == old.round + 1
    assert set(new.alive) == set(old.alive) - set(dead) and new.dead[-len(dead):] == tuple(dead)
    lost = sum(old.assignment(r).quota for r in dead)
    promoted = 0
    for a in new.assignments:
        before = old.assignment(a.replica)
        assert a.compute_ids == before.compute_ids and a.role is before.role
        assert a.extra_ids[:len(before.extra_ids)] == before.extra_ids
        if a.promoted and not before.promoted:
            promoted += len(a.compute_ids)
            if exact:
                lost_ids = {i for r in dead for i in old.assignment(r).committed_ids}
                assert set(a.compute_ids) <= lost_ids
    added = new.extras_total() - sum(len(old.assignment(r).extra_ids) for r in new.alive)
    assert added == lost - promoted >= 0
    w_s, extras = len(new.alive), new.extras_total()
    prev_max = max(len(old.assignment(r).extra_ids) for r in new.alive)
    assert new.max_extras() <= max(prev_max, math.ceil(extras / w_s))
    assert new.max_extras() <= math.ceil(new.global_microbatches / w_s)
    if old.round == 0 and len(dead) == 1:                 # one failure in a clean step
        assert new.max_extras() <= math.ceil(lost / w_s)


def run(sc: dict, check: bool) -> list[StepPlan]:
    """Play a scenario; return every plan produced (fresh and replanned)."""
    policy = WorkloadPolicy(initial_replicas=sc["w"], microbatches_per_replica=sc["g"],
                            keep_spares=sc["keep_spares"], data_assignment=sc["mode"],
                            g_raise=sc["g_raise"], alive_replicas=sc["start"])
    exact = sc["mode"] == "exact"
    plans, seen, alive = [], set(), list(policy.alive)
    for t, step in enumerate(sc["steps"]):
        probe = policy.plan(t, alive)
        gone = victims(probe, step["between"])
        alive = [r for r in alive if r not in gone]
        if check:                                              # checkpoint round trip, any time
            state = json.loads(json.dumps(policy.state_dict()))
            twin = WorkloadPolicy.from_state_dict(state)
            assert twin.state_dict() == policy.state_dict() and twin.plan(t, alive) == \
                policy.plan(t, alive)
        plan = policy.plan(t, alive)
        plans.append(plan)
        if check:
            check_fresh(policy, plan)
            check_invariant(policy, plan, seen)
        for kills in step["rounds"] + sc.get("chain", []):
            dead = victims(plan, kills)
            if not dead:
                break
            new = policy.replan(plan, dead)
            if check:
                check_replan(plan, new, dead, exact)
                check_invariant(policy, new, seen)
            plan = new
            plans.append(plan)
        if not exact:
            seen |= {(r, i) for r, ids in plan.committed_ids().items() for i in ids}
        policy.commit(plan)
        alive = list(policy.alive)
        if check and not exact:
            for a in plan.assignments:
                assert policy.cursors[a.slot] == a.stream_start + a.quota
    return plans


@SETTINGS
@given(scenarios())
def test_invariant_roles_and_bounds_hold_under_random_failures(sc):
    run(sc, check=True)


@SETTINGS
@given(scenarios())
def test_two_policies_fed_the_same_events_produce_identical_plans(sc):
    assert run(sc, check=False) == run(sc, check=False)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.sampled_from(["stream", "exact"]),
       st.sampled_from(["ceil", "reserve"]), st.booleans())
def test_killing_down_to_one_survivor_inside_one_step(w, g, mode, g_raise, keep):
    policy = WorkloadPolicy(initial_replicas=w, microbatches_per_replica=g, keep_spares=keep,
                            data_assignment=mode, g_raise=g_raise)
    plan = policy.plan(3)
    while len(plan.alive) > 1:
        plan = policy.replan(plan, [plan.alive[len(plan.alive) // 2]])
        check_invariant(policy, plan, set())
    assert plan.assignments[0].quota == w * g
    policy.commit(plan)
    nxt = policy.plan(4)
    assert nxt.g == w * g and nxt.count(Role.MAJOR) == 1


CHAIN = [[("major", 0)], [("promoted", 0)], [("minor", 0)], [("extra", 0)], [("spare", 0)],
         [("promoted", 1)], [("extra", 1), ("major", 1)], [("any", 0)]]


@st.composite
def spare_scenarios(draw):
    """Restarts with fewer replicas than W_init and keep_spares: spares exist from step 0."""
    w = draw(st.integers(4, 40))
    alive = draw(st.integers(2, w - 1))
    return {"w": w, "g": draw(st.integers(1, 12)), "keep_spares": True,
            "start": list(range(w - alive, w)), "mode": draw(st.sampled_from(["stream", "exact"])),
            "g_raise": draw(st.sampled_from(["ceil", "reserve", "reserve"])),
            "steps": [{"between": [], "rounds": []}] * 2}


@settings(max_examples=150, deadline=None)
@given(spare_scenarios(), st.permutations(range(len(CHAIN))))
def test_failure_chains_on_spares_minor_and_extra_runners(sc, order):
    """In one step: a major (spare promoted), the promoted spare, the minor, an extra-runner."""
    sc["chain"] = [CHAIN[i] for i in order]
    run(sc, check=True)
