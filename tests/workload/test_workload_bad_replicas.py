"""The policy's answer to replicas that are alive but bad (plain Python, fast): a culprit of one
step is excluded for that step only (``WorkloadPolicy.exclude``), a straggler gets a smaller
quota with hysteresis ([Note: straggler quotas] in workload/rebalance.py). Property test: any
sequence of deaths, rejoins (admit), culprits and speed changes keeps the sum of quotas == B
and, in exact mode, the committed id set of every step equal to the failure-free plan's."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recover_hsdp.workload import Role, StragglerRule, WorkloadPolicy
from recover_hsdp.workload.rebalance import Rebalancer, apportion

RULE = StragglerRule(slow_ratio=1.5, recover_ratio=1.2, patience=3)


def ids_of(plan):
    return sorted(i for ids in plan.committed_ids().values() for i in ids)


def test_a_culprit_is_excluded_for_one_step_only():
    policy = WorkloadPolicy(initial_replicas=4, microbatches_per_replica=2,
                            data_assignment="exact")
    plan = policy.exclude(policy.plan(3), [1])
    bad = plan.assignment(1)
    assert bad.excluded and bad.quota == 0 and bad.discarded_ids == (26, 27)
    assert ids_of(plan) == list(range(24, 32)) and plan.culprits == (1,)
    assert sorted(i for r in (0, 2, 3) for i in plan.assignment(r).extra_ids) == [26, 27]
    policy.commit(plan)
    nxt = policy.plan(4)
    assert nxt.alive == (0, 1, 2, 3) and nxt.assignment(1).quota == 2
    assert not nxt.assignment(1).excluded


def test_a_death_after_an_exclusion_never_gives_the_culprit_work():
    policy = WorkloadPolicy(initial_replicas=3, microbatches_per_replica=2,
                            data_assignment="exact")
    plan = policy.replan(policy.exclude(policy.plan(0), [0]), [1])
    assert plan.alive == (0, 2) and plan.assignment(0).quota == 0
    assert plan.assignment(2).quota == 6 and ids_of(plan) == list(range(6))
    with pytest.raises(RuntimeError, match="nothing can keep the step"):
        policy.exclude(plan, [2])


def test_an_excluded_spare_is_never_promoted():
    policy = WorkloadPolicy(initial_replicas=4, microbatches_per_replica=1,
                            data_assignment="exact")
    plan = policy.plan(0, alive_replicas=[0, 1, 2])     # G = 2: replica 2 shadows replica 0
    assert plan.assignment(2).role is Role.SPARE and plan.assignment(2).shadow_of == 0
    plan = policy.replan(policy.exclude(plan, [2]), [0])
    assert not plan.assignment(2).promoted and plan.assignment(2).quota == 0
    assert plan.assignment(1).quota == 4 and ids_of(plan) == [0, 1, 2, 3]


def test_stream_mode_culprit_consumes_nothing():
    policy = WorkloadPolicy(initial_replicas=2, microbatches_per_replica=2)
    plan = policy.exclude(policy.plan(0), [1])
    assert plan.assignment(0).committed_ids == (0, 1, 2, 3)
    policy.commit(plan)
    assert policy.cursors == {0: 4, 1: 0}


def test_apportion():
    assert apportion(8, [1, 1, 1, 1]) == [2, 2, 2, 2]
    assert apportion(8, [0.5, 1, 1, 1]) == [1, 3, 2, 2]
    assert apportion(4, [0.05, 1, 1, 1]) == [1, 1, 1, 1]
    assert apportion(12, [0.5, 1, 1, 1]) == [2, 4, 3, 3]
    assert apportion(8, [1, 0.25, 1, 1]) == [3, 1, 2, 2]   # the minimum 1 is not topped up


def test_rule_refused_in_one_line():
    for rule, field in ((StragglerRule(1.0), "bad_replicas.slow_ratio"),
                        (StragglerRule(1.5, 1.6), "bad_replicas.recover_ratio"),
                        (StragglerRule(1.5, 1.2, 0), "bad_replicas.slow_patience")):
        with pytest.raises(ValueError, match=field):
            rule.check()
    StragglerRule().check()  # off


def test_a_straggler_gets_less_after_patience_and_it_comes_back_after_recovering():
    policy = WorkloadPolicy(initial_replicas=4, microbatches_per_replica=3,
                            data_assignment="exact", straggler=RULE)
    quotas = []
    speeds = [1.0] * 2 + [2.0] * 6 + [1.0] * 5   # replica 1: 2x slower for 6 steps
    for step, s in enumerate(speeds):
        plan = policy.plan(step)
        assert ids_of(plan) == list(range(12 * step, 12 * step + 12))
        quotas.append(plan.assignment(1).quota)
        policy.commit(plan)
        policy.observe_speeds({0: 1.0, 1: s, 2: 1.0, 3: 1.0})
    assert quotas == [3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 3, 3]


def test_noise_inside_the_band_never_moves_a_quota():
    rebalancer = Rebalancer(RULE)
    for k in range(200):   # flips between 1.1x and 1.45x: under slow_ratio, never flagged
        assert not rebalancer.observe({0: 1.0, 1: 1.1 if k % 2 else 1.45, 2: 1.0})
    rebalancer.weights = {1: 0.5}
    for k in range(200):   # flagged at 2x: 1.3x .. 2.9x stays inside its band
        assert not rebalancer.observe({0: 1.0, 1: 1.3 if k % 2 else 2.9, 2: 1.0})
    assert rebalancer.weights == {1: 0.5}


def test_state_dict_round_trip_and_off_by_default_keeps_the_old_format():
    plain = WorkloadPolicy(initial_replicas=2, microbatches_per_replica=2)
    assert "straggler" not in plain.state_dict()
    policy = WorkloadPolicy(initial_replicas=3, microbatches_per_replica=2, straggler=RULE)
    for _ in range(3):
        policy.observe_speeds({0: 1.0, 1: 3.0, 2: 1.0})
    again = WorkloadPolicy.from_state_dict(policy.state_dict())
    assert again.rebalancer.weights == policy.rebalancer.weights == {1: 0.333333}
    assert again.plan(5) == policy.plan(5)


EVENT = st.one_of(
    st.tuples(st.just("die"), st.integers(0, 999)),
    st.tuples(st.just("culprit"), st.integers(0, 999)),
    st.tuples(st.just("admit"), st.integers(0, 999)),
    st.tuples(st.just("speed"), st.integers(0, 999), st.sampled_from([0.5, 1.0, 1.3, 2.0, 20.0])),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.integers(1, 8), g=st.integers(1, 4), mode=st.sampled_from(["exact", "stream"]),
       keep_spares=st.booleans(), patience=st.integers(1, 3),
       steps=st.lists(st.lists(EVENT, max_size=4), min_size=1, max_size=10))
def test_any_sequence_keeps_b_and_the_failure_free_ids(w, g, mode, keep_spares, patience, steps):
    rule = StragglerRule(1.5, 1.2, patience)
    policy = WorkloadPolicy(initial_replicas=w, microbatches_per_replica=g, data_assignment=mode,
                            keep_spares=keep_spares, straggler=rule)
    b, speed = w * g, {r: 1.0 for r in range(w)}
    for step, events in enumerate(steps):
        plan = policy.plan(step)
        for event in events:
            kind, index = event[0], event[1]
            pick = plan.alive[index % len(plan.alive)]
            if kind == "die" and len(plan.alive) > 1 and any(
                    not a.excluded for a in plan.assignments if a.replica != pick):
                plan = policy.replan(plan, [pick])
            elif kind == "culprit" and any(
                    not a.excluded for a in plan.assignments if a.replica != pick):
                plan = policy.exclude(plan, [pick])
            elif kind == "speed":
                speed[pick] = event[2]
            assert plan.committed_total() == b
            assert all(a.quota == 0 for a in plan.assignments if a.excluded)
        if mode == "exact":
            assert ids_of(plan) == list(range(step * b, step * b + b))   # the failure-free set
        else:
            assert all(len(set(ids)) == len(ids) for ids in plan.committed_ids().values())
        policy.commit(plan)
        policy.observe_speeds({r: speed[r] for r in policy.alive})
        gone = [r for r in range(w) if r not in policy.alive]
        admits = [e[1] for e in events if e[0] == "admit"]
        if gone and admits:
            policy.admit([gone[admits[0] % len(gone)]])
        assert sum(policy.rebalancer.quotas(policy.alive[:b], b, b)) == b  # any split sums to B


@pytest.mark.parametrize("field,value,words", [
    ("max_offences", 0, "recover.bad_replicas.max_offences must be an integer >= 1"),
    ("offence_window_steps", -3,
     "recover.bad_replicas.offence_window_steps must be an integer >= 1"),
    ("slow_ratio", 0.9, "recover.bad_replicas.slow_ratio must be 0 (off) or > 1"),
    ("recover_ratio", 2.0, "recover.bad_replicas.recover_ratio must be >= 1 and below"),
])
def test_config_fields_refused_in_one_line(field, value, words):
    from recover_hsdp.config import BadReplicas, ConfigError

    section = BadReplicas(slow_ratio=1.5)
    section.check()
    assert section.straggler_rule() == StragglerRule(1.5, 1.2, 3)
    setattr(section, field, value)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        section.check()
    assert "\n" not in str(info.value)
