"""The two data assignments alone (workload/assignment.py), then through the policy: one assigner
per policy, built once, and checkpoints written before the assigners existed still load."""

import json

import pytest

from recover_hsdp.workload import DataAssignment, ReplicaAssignment, Role, StepPlan, WorkloadPolicy
from recover_hsdp.workload.assignment import Assigner, ExactIds, StreamSlots, make_assigner


def plan_of(assigner, step, b, g, assignments) -> StepPlan:
    return StepPlan(step, b, g, assigner.mode, tuple(assignments))


# ---- exact global ids ---------------------------------------------------------------------------
def test_exact_ids_place_a_contributor_on_its_block_and_a_spare_on_its_shadow():
    ex = ExactIds()
    major = ex.place(0, Role.MAJOR, range(8, 12), None, 4)
    spare = ex.place(3, Role.SPARE, range(12, 14), 1, 4)
    idle = ex.place(4, Role.IDLE, range(0), None, 4)
    assert major == ReplicaAssignment(0, Role.MAJOR, (8, 9, 10, 11))
    assert spare.compute_ids == (12, 13) and spare.shadow_of == 1    # the minor's q ids, not G
    assert idle.compute_ids == () and idle.slot is None and idle.stream_start is None


def test_exact_ids_promote_only_a_spare_inside_the_loss_and_deal_the_lost_ids_themselves():
    ex = ExactIds()
    spare = ReplicaAssignment(3, Role.SPARE, (4, 5), extra_ids=(9,))
    assert ex.promotable(spare, [0, 4, 5, 7]) and not ex.promotable(spare, [0, 4, 7])
    assert ex.cover(spare, [0, 4, 5, 7]) == [0, 7]                   # order kept
    assert ex.extra_id(7, spare) == 7


def test_exact_ids_check_the_failure_free_set_and_keep_no_stream_state():
    ex = ExactIds()
    good = [ReplicaAssignment(0, Role.MAJOR, (4, 5)), ReplicaAssignment(1, Role.MAJOR, (6, 7))]
    ex.check(plan_of(ex, 1, 4, 2, good))                             # step 1 of B = 4: 4..7
    with pytest.raises(AssertionError, match="differ from the failure-free set"):
        ex.check(plan_of(ex, 2, 4, 2, good))
    ex.commit(plan_of(ex, 1, 4, 2, good))
    ex.admit([0, 1], [2])
    assert ex.cursors == {} and ex.slots == {} and ex.slot_of(5) == 5
    assert ex.orphaned([0, 1], [1]) == {}
    assert ex.state_dict([0, 2]) == {"cursors": {}, "slots": {"0": 0, "2": 2}}


# ---- stream slots -------------------------------------------------------------------------------
def test_stream_slots_place_from_the_cursor_and_a_spare_computes_g_whatever_its_block():
    st = StreamSlots(4)
    st.cursors, st.slots = {1: 6}, {2: 1}
    major = st.place(2, Role.MAJOR, range(100, 103), None, 3)
    spare = st.place(3, Role.SPARE, range(200, 201), 0, 3)
    idle = st.place(0, Role.IDLE, range(0), None, 3)
    assert (major.slot, major.stream_start, major.compute_ids) == (1, 6, (6, 7, 8))
    assert (spare.slot, spare.compute_ids, spare.shadow_of) == (3, (0, 1, 2), None)
    assert (idle.slot, idle.compute_ids) == (0, ())


def test_stream_slots_promote_by_size_never_with_extras_and_extras_continue_the_slot():
    st = StreamSlots(3)
    spare = ReplicaAssignment(2, Role.SPARE, (5, 6), stream_start=5, slot=2)
    assert st.promotable(spare, [0, 0, 1]) and not st.promotable(spare, [0])
    assert not st.promotable(ReplicaAssignment(2, Role.SPARE, (5, 6), extra_ids=(5,),
                                               stream_start=5, slot=2), [0, 1, 2])
    assert st.cover(spare, [3, 4, 9]) == [9]
    assert st.extra_id(123, spare) == 5                               # an unpromoted spare: cursor
    major = ReplicaAssignment(0, Role.MAJOR, (5, 6), extra_ids=(7,), stream_start=5, slot=0)
    assert st.extra_id(123, major) == 8


def test_stream_slots_check_refuses_a_position_committed_twice():
    st = StreamSlots(2)
    twice = ReplicaAssignment(0, Role.MAJOR, (0, 1), extra_ids=(1,), stream_start=0, slot=0)
    with pytest.raises(AssertionError, match="replica 0 commits a position twice"):
        st.check(plan_of(st, 0, 3, 2, [twice]))


def test_stream_slots_commit_admit_and_orphans():
    st = StreamSlots(4)
    committed = [ReplicaAssignment(r, Role.MAJOR, (0, 1, 2), stream_start=0, slot=r)
                 for r in (0, 2)]
    st.commit(plan_of(st, 0, 6, 3, committed))
    assert st.cursors == {0: 3, 2: 3} and st.slots == {0: 0, 2: 2}
    st.cursors[3] = 1                                                 # slot 3 died mid-run
    assert st.orphaned([0, 2], ()) == {3: 1} and st.orphaned([0, 2], [2]) == {2: 3, 3: 1}
    st.slots[0] = 1                                                   # replica 0 now reads slot 1
    st.admit([0, 2], [1, 3])                                          # newcomers 1 and 3
    assert st.slot_of(3) == 3 and st.slot_of(1) == 0                  # 1 is read: first free slot
    assert st.orphaned([0, 1, 2, 3], ()) == {}


def test_stream_slots_restart_takes_read_slots_then_orphans_then_never_read():
    st = StreamSlots(4)
    state = {"alive": [1, 3], "cursors": {"0": 5, "1": 4, "3": 6}, "slots": {"1": 3, "3": 1}}
    st.load_state_dict(state, [1, 3])
    assert st.slots == {1: 3, 3: 1} and st.cursors == {0: 5, 1: 4, 3: 6}
    st.load_state_dict(state, [0, 1, 2, 3])
    assert st.slots == {0: 3, 1: 1, 2: 0, 3: 2}
    assert st.state_dict([0, 1]) == {"cursors": {"0": 5, "1": 4, "3": 6},
                                     "slots": {"0": 3, "1": 1}}


# ---- through the policy -------------------------------------------------------------------------
@pytest.mark.parametrize("mode, cls", [("exact", ExactIds), ("stream", StreamSlots)])
def test_the_policy_builds_one_assigner_for_its_mode(mode, cls):
    assert isinstance(make_assigner(DataAssignment(mode), 3), cls)
    p = WorkloadPolicy(initial_replicas=3, microbatches_per_replica=2, data_assignment=mode)
    assigner = p.assigner
    assert isinstance(assigner, cls) and p.data_assignment is DataAssignment(mode)
    p.commit(p.replan(p.plan(0), [1]))
    p.admit([1])
    p.plan(1)
    q = WorkloadPolicy.from_state_dict(json.loads(json.dumps(p.state_dict())))
    assert p.assigner is assigner and p.cursors is assigner.cursors
    assert type(q.assigner) is cls
    for name in [n for n in vars(Assigner) if not n.startswith("_")]:
        assert hasattr(assigner, name), name


# Written by the policy before the assigners existed (same bytes out, same plan after).
OLD_STATES = [
    '{"version": 2, "global_microbatches": 8, "initial_replicas": 4, "microbatches_per_replica": '
    '2, "keep_spares": true, "data_assignment": "stream", "g_raise": "ceil", "step": 2, "alive": '
    '[0, 1, 2], "g": 3, "cursors": {"0": 6, "2": 6, "3": 4}, "slots": {"0": 0, "1": 2, "2": 3}}',
    '{"version": 2, "global_microbatches": 6, "initial_replicas": 3, "microbatches_per_replica": '
    '2, "keep_spares": false, "data_assignment": "exact", "g_raise": "ceil", "step": 1, "alive": '
    '[0, 1], "g": 3, "cursors": {}, "slots": {"0": 0, "1": 1}}',
]


@pytest.mark.parametrize("text", OLD_STATES)
def test_checkpoints_written_before_load_and_save_the_same_bytes(text):
    p = WorkloadPolicy.from_state_dict(json.loads(text))
    assert json.dumps(p.state_dict()) == text
    plan = p.plan(p.step)
    assert plan.committed_total() == p.global_microbatches
    if p.data_assignment is DataAssignment.STREAM:
        assert [(a.slot, a.stream_start) for a in plan.assignments] == [(0, 6), (2, 6), (3, 4)]
    else:
        assert plan.committed_ids() == {0: (6, 7, 8), 1: (9, 10, 11)}
