"""Explicit cases of the workload policy, the paper's replay table, the ledger and validation."""

import json
from dataclasses import replace

import pytest

from recover_hsdp.workload.ledger import LEDGER_NAME, LedgerWriter, plan_record, read_ledger
from recover_hsdp.workload import (DataAssignment, DataRef, ReplicaAssignment, Role,
                                   WorkloadPolicy, validate_workload_fields)
from recover_hsdp.workload.replay import main as replay_main
from recover_hsdp.workload.replay import replay


def policy(w=4, g=3, **kw):
    return WorkloadPolicy(initial_replicas=w, microbatches_per_replica=g, **kw)


# ---- stock equivalence and failure-free plans ---------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "stream"])
def test_failure_free_plan_is_stock_hsdp(mode):
    """W_init x G_init, no spares: replica r's g-th microbatch at step t is t*B + r*G + g."""
    p = policy(4, 3, data_assignment=mode)
    for t in range(3):
        plan = p.plan(t)
        assert plan.count(Role.MAJOR) == 4 and plan.g == 3
        for r in range(4):
            a = plan.assignment(r)
            want = [t * 12 + r * 3 + g for g in range(3)] if mode == "exact" \
                else [t * 3 + g for g in range(3)]          # stream: own shard positions
            assert list(a.compute_ids) == want == list(a.committed_ids)
        p.commit(plan)


def test_roles_after_losses_raise_g_ceil():
    p = policy(32, 8, alive_replicas=range(31))
    plan = p.plan(0)
    assert plan.g == 9 and plan.count(Role.MAJOR) == 28 and plan.count(Role.SPARE) == 2
    minor = [a for a in plan.assignments if a.role is Role.MINOR]
    assert [(a.replica, a.quota) for a in minor] == [(28, 4)]
    assert [a.replica for a in plan.assignments if a.role is Role.SPARE] == [29, 30]


def test_reserve_keeps_one_spare_and_no_spares_means_idle():
    plan = policy(32, 8, g_raise="reserve", alive_replicas=range(29)).plan(0)
    assert plan.g == 10 and plan.count(Role.SPARE) == 3      # ceil(256/28) = 10: 26 contribute
    idle = policy(32, 8, keep_spares=False, alive_replicas=range(31)).plan(0)
    assert idle.count(Role.IDLE) == 2 and idle.count(Role.SPARE) == 0
    assert all(a.compute_ids == () for a in idle.assignments if a.role is Role.IDLE)


# ---- in-step failures --------------------------------------------------------------------------
def test_major_failure_without_spares_spreads_one_extra_each():
    p = policy(32, 8)
    plan = p.replan(p.plan(0), [5])
    assert plan.extras_total() == 8 and plan.max_extras() == 1 and plan.committed_total() == 256
    assert [a.replica for a in plan.assignments if a.extra_ids] == [0, 1, 2, 3, 4, 6, 7, 8]


def test_stream_major_failure_promotes_a_spare():
    p = policy(32, 8, alive_replicas=range(31))
    plan = p.replan(p.plan(0), [3])
    assert plan.promoted() == (29,) and plan.extras_total() == 0
    assert plan.assignment(29).committed_ids == plan.assignment(29).compute_ids


def test_exact_spare_is_promoted_only_for_the_replica_it_shadows():
    p = policy(32, 8, data_assignment="exact", alive_replicas=range(31))
    plan = p.plan(2)
    assert plan.assignment(29).shadow_of == 0 and plan.assignment(30).shadow_of == 1
    assert plan.assignment(29).compute_ids == plan.assignment(0).compute_ids
    covered = p.replan(plan, [1])
    assert covered.promoted() == (30,) and covered.extras_total() == 0
    uncovered = p.replan(plan, [7])                     # nobody shadows 7: its ids become extras
    assert uncovered.promoted() == () and uncovered.extras_total() == 9
    extra = sorted(i for a in uncovered.assignments for i in a.extra_ids)
    assert extra == list(plan.assignment(7).compute_ids)


def test_minor_failure_then_extra_runner_failure_then_promoted_spare_failure():
    p = policy(32, 8, alive_replicas=range(31))
    plan = p.plan(0)
    plan = p.replan(plan, [28])                          # the minor (4): extras on 0..3
    assert plan.extras_total() == 4 and plan.promoted() == ()
    plan = p.replan(plan, [0])                           # 9 + 1 extra lost: spare + 1 extra
    assert plan.promoted() == (29,) and plan.extras_total() == 4
    plan = p.replan(plan, [29])                          # the promoted spare: the other spare
    assert plan.promoted() == (30,) and plan.extras_total() == 4
    plan = p.replan(plan, [30])                          # no spare left: 9 more extras
    assert plan.extras_total() == 13 and plan.max_extras() == 1
    assert plan.dead == (28, 0, 29, 30) and plan.round == 4 and plan.committed_total() == 256
    lost = dict(plan.lost_work)
    assert len(lost[0]) == 9 + 1 and len(lost[29]) == len(lost[30]) == 9


def test_single_survivor_commits_everything_and_g_becomes_b():
    p = policy(3, 2, data_assignment="exact")
    plan = p.replan(p.replan(p.plan(1), [0]), [2])
    assert plan.alive == (1,) and sorted(plan.assignment(1).committed_ids) == list(range(6, 12))
    p.commit(plan)
    assert p.g == 6 and p.plan(2).assignment(1).compute_ids == tuple(range(12, 18))
    with pytest.raises(RuntimeError):
        p.replan(p.plan(2), [1])


def test_replan_rejects_unknown_replicas():
    p = policy()
    with pytest.raises(ValueError):
        p.replan(p.plan(0), [])
    with pytest.raises(ValueError):
        p.replan(p.plan(0), [9])


def test_stream_cursors_advance_by_everything_committed():
    p = policy(4, 3, alive_replicas=[0, 1, 2])          # G = 4: 3 majors, no spare
    plan = p.replan(p.plan(0), [2])                     # 4 extras on 2 survivors
    p.commit(plan)
    assert p.cursors == {0: 6, 1: 6}
    nxt = p.plan(1)
    assert nxt.g == 6 and nxt.assignment(0).compute_ids == tuple(range(6, 12))


def test_restart_from_state_with_fewer_replicas_keeps_b():
    p = policy(32, 8)
    p.commit(p.replan(p.plan(0), [4]))
    state = json.loads(json.dumps(p.state_dict()))
    assert state["g"] == 9 and len(state["alive"]) == 31
    again = WorkloadPolicy.from_state_dict(state, alive_replicas=range(20))
    plan = again.plan(1)
    assert plan.committed_total() == 256 and plan.g == 13 and again.step == 1
    assert again.cursors[5] == 9                        # replica 5 ran one extra in step 0


def test_stream_spare_draws_nothing_and_its_positions_stay_contiguous():
    q = policy(6, 2, alive_replicas=range(5))           # B = 12, W = 5: G = 3, 4 majors, 1 spare
    plan = q.plan(0)
    spare = plan.assignment(4)
    assert spare.role is Role.SPARE and spare.compute_ids == (0, 1, 2)
    q.commit(plan)
    assert q.cursors[4] == 0                            # a spare consumes nothing ...
    assert q.plan(1).assignment(4).compute_ids == (0, 1, 2)   # ... and computes them again
    plan = q.replan(q.replan(q.plan(1), [1]), [0])      # spare promoted for 1, then 0's 3 extras
    assert plan.assignment(4).promoted and plan.assignment(4).extra_ids == (3,)
    q.commit(plan)
    assert q.cursors[4] == 4 and q.orphaned_slots() == {0: 3, 1: 3}
    # an unpromoted spare (or idle replica) commits only extras: from its cursor, not after
    # the compute it discards, so its committed positions have no hole
    idle = ReplicaAssignment(7, Role.SPARE, (5, 6, 7), stream_start=5, slot=7)
    assert idle.next_extra_position() == 5
    assert replace(idle, extra_ids=(5,)).next_extra_position() == 6
    assert replace(idle, promoted=True).next_extra_position() == 8


def test_restart_maps_replicas_to_the_slots_that_were_read():
    p = policy(4, 1)                                    # B = 4
    p.commit(p.plan(0))
    p.commit(p.replan(p.plan(1), [1]))                  # slot 1 orphaned at cursor 1
    assert p.orphaned_slots() == {1: 1} and p.cursors == {0: 3, 1: 1, 2: 2, 3: 2}
    state = json.loads(json.dumps(p.state_dict()))
    same = WorkloadPolicy.from_state_dict(state)
    assert same.slot_of(2) == 2 and tuple(same.orphaned_slots()) == (1,)
    fewer = WorkloadPolicy.from_state_dict(state, alive_replicas=range(2))
    assert [fewer.slot_of(r) for r in (0, 1)] == [0, 2]
    assert tuple(fewer.orphaned_slots()) == (1, 3)
    plan = fewer.plan(2)
    assert plan.assignment(1).data_ref(plan.assignment(1).compute_ids[0]) == DataRef(2, 2)
    more = WorkloadPolicy.from_state_dict(state, alive_replicas=range(4))
    assert [more.slot_of(r) for r in range(4)] == [0, 2, 3, 1]   # the orphan last, at cursor 1
    assert more.plan(2).assignment(3).compute_ids[0] == 1 and more.orphaned_slots() == {}


# ---- the paper's example -----------------------------------------------------------------------
PAPER = [  # (alive W, promoted, extras, G, majors, minor quota, spares): victim = lowest-id major
    (32, 0, 0, 8, 32, None, 0), (31, 0, 8, 9, 28, 4, 2), (30, 1, 0, 9, 28, 4, 1),
    (29, 1, 0, 9, 28, 4, 0), (28, 0, 9, 10, 25, 6, 2), (27, 1, 0, 10, 25, 6, 1),
    (26, 1, 0, 10, 25, 6, 0), (25, 0, 10, 11, 23, 3, 1), (24, 1, 0, 11, 23, 3, 0),
    (23, 0, 11, 12, 21, 4, 1), (22, 1, 0, 12, 21, 4, 0), (21, 0, 12, 13, 19, 9, 1),
    (20, 1, 0, 13, 19, 9, 0), (19, 0, 13, 14, 18, 4, 0), (18, 0, 14, 15, 17, 1, 0),
    (17, 0, 15, 16, 16, None, 1), (16, 1, 0, 16, 16, None, 0)]


@pytest.mark.parametrize("mode", ["stream", "exact"])
def test_paper_replay_table(mode):
    rows = replay(32, 8, 16, mode=mode)
    got = [(w, prom, extra, g, maj, None if minor == "0" else int(minor[3:-1]), spares)
           for _, _, w, prom, extra, _, g, maj, minor, spares in rows]
    assert got == PAPER
    assert all(row[5] <= 1 for row in rows)             # every boundary step: <= 1 extra each


def test_replay_runs_down_to_one_survivor_and_cli_prints(capsys):
    rows = replay(32, 8, 100, victim="minor")
    assert rows[-1][2] == 1 and rows[-1][6] == 256
    assert replay_main(["--replay-paper", "--failures", "3"]) == 0
    out = capsys.readouterr().out
    assert "| failure | victim | alive W |" in out and "| 1 | 0 (major) | 31 |" in out


# ---- ledger ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["stream", "exact"])
def test_ledger_round_trip(tmp_path, mode):
    p = policy(6, 2, data_assignment=mode, alive_replicas=range(5))
    plans = []
    with LedgerWriter(tmp_path) as ledger:
        for t in range(3):
            plan = p.plan(t)
            if t == 1:
                plan = p.replan(p.replan(plan, [0]), [4])
            ledger.append(plan, epoch=t)
            p.commit(plan)
            plans.append(plan)
    entries = read_ledger(tmp_path)
    assert [e.step for e in entries] == [0, 1, 2] and entries[1].failures == (0, 4)
    for e, plan in zip(entries, plans):
        assert e.committed_total == 12 == e.global_microbatches
        assert e.committed == {a.replica: a.committed_ids for a in plan.assignments}
        assert e.discarded == {a.replica: a.discarded_ids for a in plan.assignments}
        assert e.lost == dict(plan.lost_work) and e.g == plan.g
        assert e.roles == {a.replica: a.role.value for a in plan.assignments}
        assert (e.stream_start != {}) == (mode == "stream")
    keys = [k for e in entries for k in e.committed_keys()]
    assert len(keys) == len(set(keys)) == 36
    if mode == "exact":
        assert sorted(i for _, i in keys) == list(range(36))


def test_ledger_reader_skips_a_torn_last_line_only(tmp_path):
    p = policy(2, 2)
    with LedgerWriter(tmp_path) as ledger:
        ledger.append(p.plan(0), epoch=0)
    path = tmp_path / LEDGER_NAME
    good = path.read_text()
    path.write_text(good + good[:20])
    assert len(read_ledger(path)) == 1
    path.write_text(good[:20] + "\n" + good)
    with pytest.raises(ValueError, match=":1: malformed"):
        read_ledger(path)
    assert plan_record(p.plan(0), 3)["epoch"] == 3


# ---- validation --------------------------------------------------------------------------------
GOOD = dict(microbatches_per_replica=8, keep_spares=True, data_assignment="stream", g_raise="ceil")


@pytest.mark.parametrize("field,value,message", [
    ("microbatches_per_replica", 0, "recover.microbatches_per_replica must be an integer >= 1 "
                                    "(got 0): set it in the [recover] section"),
    ("microbatches_per_replica", 2.5, "recover.microbatches_per_replica"),
    ("keep_spares", "yes", "recover.workload.keep_spares must be true or false (got 'yes')"),
    ("data_assignment", "random", "recover.workload.data_assignment must be 'stream' or 'exact' "
                                  "(got 'random')"),
    ("g_raise", "double", "recover.workload.g_raise must be 'ceil' or 'reserve' (got 'double')"),
])
def test_validation_names_the_field_and_the_fix(field, value, message):
    with pytest.raises(ValueError) as err:
        validate_workload_fields(**{**GOOD, field: value})
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=f"recover.*{field}"):
        WorkloadPolicy(initial_replicas=2, **{**GOOD, field: value})


def test_policy_rejects_inconsistent_sizes():
    validate_workload_fields(**GOOD)
    with pytest.raises(ValueError, match="global_microbatches=10"):
        policy(4, 3, global_microbatches=10)
    with pytest.raises(ValueError, match="data_parallel_replicate_degree"):
        policy(0, 3)
    assert policy(data_assignment=DataAssignment.EXACT).data_assignment is DataAssignment.EXACT


# ---- rejoin ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "stream"])
def test_admitted_replicas_bring_g_back_and_keep_b(mode):
    """[Note: rejoin at a boundary]: 4 x 3, replica 1 lost at step 0, back before step 2."""
    p = policy(4, 3, data_assignment=mode)
    plan = p.replan(p.plan(0), [1])
    p.commit(plan)
    during = p.plan(1)
    assert during.g == 4 and during.committed_total() == 12 and 1 not in during.alive
    p.commit(during)
    p.admit([1])
    after = p.plan(2)
    assert after.alive == (0, 1, 2, 3) and after.g == 3 and after.committed_total() == 12
    assert [a.role for a in after.assignments] == [Role.MAJOR] * 4
    if mode == "exact":  # the failure-free ids again
        assert after.committed_ids() == {r: tuple(range(24 + 3 * r, 27 + 3 * r)) for r in range(4)}
    else:  # the newcomer resumes replica 1's slot where its committed positions stopped
        assert p.slot_of(1) == 1 and p.orphaned_slots() == {}
        assert after.assignment(1).compute_ids == (0, 1, 2)
    with pytest.raises(ValueError, match="cannot join"):
        p.admit([2])


def test_admitted_replicas_recreate_spares_under_reserve():
    """A join gives spares back as well as G: under g_raise = "reserve" the plan keeps one
    replica's worth in reserve while W < W_init; at W_init every replica is a major again."""
    p = policy(32, 8, g_raise="reserve", data_assignment="exact")
    p.commit(p.replan(p.plan(0), [3, 7, 11, 15]))
    during = p.plan(1)
    assert (during.g, during.count(Role.SPARE), during.committed_total()) == (10, 2, 256)
    p.commit(during)
    p.admit([3])
    one_back = p.plan(2)
    assert (one_back.g, one_back.count(Role.SPARE), one_back.committed_total()) == (10, 3, 256)
    p.commit(one_back)
    p.admit([7, 11, 15])
    full = p.plan(3)
    assert full.g == 8 and [a.role for a in full.assignments] == [Role.MAJOR] * 32
    assert full.committed_ids() == {r: tuple(range(3 * 256 + 8 * r, 3 * 256 + 8 * r + 8))
                                    for r in range(32)}
