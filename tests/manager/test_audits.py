"""[Note: gradient audits] (manager/audits.py): pairs, signatures, the third computation.

The pure parts on hand-made plans; the protocol in-process over the fake world (tests/fakes.py)
with the real ``BucketSync`` in audit mode, the real policy and the real ``mode=corrupt`` fault
(every gradient of the replica scaled, its reported loss right), every committed gradient
checked against the oracle of the ledger's ids (tests/manager/test_manager.py). Real processes:
tests/jobs/test_silent_corruption.py.
"""

from __future__ import annotations

import json
import math

import pytest

from fakes import values_of
from recover_hsdp.config import BadReplicas
from recover_hsdp.manager.audits import (AuditPair, audit_pairs, compare, relative_difference,
                                         settle, third_for)
from recover_hsdp.manager.divergence import NoMajority
from recover_hsdp.workload import DataRef, Role
from recover_hsdp.workload.plan import DataAssignment, ReplicaAssignment, StepPlan
from test_culprits import NormWork
from test_manager import check_against_oracle, run_job

AUDITS = {"bad_replicas": BadReplicas(audit_interval=1, max_offences=3)}


def _plan(roles: dict[int, tuple[Role, tuple[int, ...]]]) -> StepPlan:
    assignments = tuple(ReplicaAssignment(r, role, ids) for r, (role, ids) in sorted(roles.items()))
    return StepPlan(step=0, global_microbatches=sum(len(i) for _, i in roles.values()), g=2,
                    data_assignment=DataAssignment.EXACT, assignments=assignments)


def _events(tmp_path, phase):
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("phase") == phase]


def _metrics(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_every_owner_is_audited_by_a_spare_first_then_by_the_previous_owner():
    plan = _plan({0: (Role.MAJOR, (0, 1)), 1: (Role.MAJOR, (2, 3)), 2: (Role.SPARE, (4,)),
                  3: (Role.MINOR, (5,))})
    pairs = audit_pairs(plan, step=3, interval=1)
    assert [(p.owner, p.auditor) for p in pairs] == [(0, 2), (1, 0), (3, 1)]
    assert [p.microbatch for p in pairs] == [1, 3, 5]  # turn 3: the 2nd of two, the only one
    assert pairs[0].data == DataRef(None, 1)
    auditors = [p.auditor for p in pairs]
    assert len(set(auditors)) == len(auditors)  # each replica audits at most one
    ring = audit_pairs(_plan({r: (Role.MAJOR, (r,)) for r in range(3)}), step=1, interval=1)
    assert [(p.owner, p.auditor) for p in ring] == [(0, 2), (1, 0), (2, 1)]
    assert audit_pairs(_plan({0: (Role.MAJOR, (0, 1))}), step=1, interval=1) == []


def test_the_audited_microbatch_takes_turns():
    plan = _plan({0: (Role.MAJOR, (0, 1, 2)), 1: (Role.MAJOR, (3, 4, 5))})
    seen = [audit_pairs(plan, step, interval=2)[0].microbatch for step in (2, 4, 6, 8)]
    assert seen == [1, 2, 0, 1]


def test_signatures_compare_relative_to_their_scale():
    a = [2.0, 0.5, 10.0, 4.0]  # loss, sum, sum |g|, sum g^2
    assert relative_difference(a, a) == 0.0 and compare(a, list(a), 0.0)
    assert relative_difference(a, [2.0, 0.5 + 1e-4, 10.0, 4.0]) == pytest.approx(1e-5)
    scaled = [2.0, 0.5 * 1.001, 10.0 * 1.001, 4.0 * 1.001 ** 2]  # mode=corrupt, factor 1.001
    assert not compare(a, scaled, 1e-5) and compare(a, scaled, 1e-2)
    assert relative_difference(a, [math.nan, 0.5, 10.0, 4.0]) == math.inf


def test_a_third_signature_settles_a_pair():
    pair = AuditPair(owner=1, auditor=0, microbatch=3, data=DataRef(None, 3))
    right, wrong = [1.0, 1.0, 2.0, 3.0], [1.0, 1.1, 2.2, 3.6]
    assert settle(pair, wrong, right, right, 1e-5) == 1  # the owner is wrong
    assert settle(pair, right, wrong, right, 1e-5) == 0  # the auditor is
    assert settle(pair, right, wrong, [1.0, 1.2, 2.4, 4.0], 1e-5) is None  # with neither
    assert settle(pair, right, wrong, None, 1e-5) is None  # nobody to ask


def test_the_third_is_outside_the_pair_a_spare_first():
    plan = _plan({0: (Role.MAJOR, (0,)), 1: (Role.MAJOR, (1,)), 2: (Role.SPARE, (2,)),
                  3: (Role.MAJOR, (3,))})
    pair = AuditPair(owner=1, auditor=0, microbatch=1, data=DataRef(None, 1))
    assert third_for(pair, plan, (0, 1, 2, 3), step=5) == 2
    assert third_for(pair, plan, (0, 1, 3), step=5) == 3
    assert third_for(pair, plan, (0, 1), step=5) is None


def test_corrupt_replica_found_absorbed_then_retired_with_b_and_the_oracle(tmp_path):
    """4 x 1, G = 2, audits every step; replica 1's gradients are 1.001 x right from step 3 (its
    loss right): found at step 3 (its pair with 0 and with 2 differ, each settled by a third),
    excluded at steps 3 and 4 (B held, its ids computed by the others), retired at step 5 (K =
    3). Every committed gradient equals the oracle of the ledger's ids: nothing it computed
    from step 3 on is in a commit."""
    hub, results = run_job(tmp_path, replicas=4, g=2, steps=6, work_class=NormWork,
                           faults=["replica=1,step=3,phase=forward,mode=corrupt"],
                           manager_kwargs=AUDITS)
    works = values_of(results, killed=[(1, 0)])
    ledger = check_against_oracle(tmp_path, works, 4, 6, b=8)
    assert all(not e.committed.get(1) for e in ledger[2:])
    events = _events(tmp_path, "audit")
    assert [(e["step"], e["culprits"]) for e in events] == [
        (3, {"1": {"offences": 1, "action": "excluded"}}),
        (4, {"1": {"offences": 2, "action": "excluded"}}),
        (5, {"1": {"offences": 3, "action": "retired"}})]
    assert {(d["owner"], d["auditor"]) for d in events[0]["differ"]} == {(1, 0), (2, 1)}
    assert all(d["third"] not in (d["owner"], d["auditor"]) for d in events[0]["differ"])
    metrics = _metrics(tmp_path)
    assert [m["audit"]["max_rel_diff"] == 0 for m in metrics] == [True, True, False, False,
                                                                  False, True]
    (death,) = [e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
                if "dead_replicas" in e]
    assert death["dead_replicas"] == [1] and "audited gradients" in death["errors"]["1"][0]


def test_no_audit_finds_anything_in_a_failure_free_run_with_a_death(tmp_path):
    """4 x 1 with audits every step and replica 2 killed in step 3's backward: no pair ever
    differs (pairs with the dead replica are skipped), B every step, the oracle's gradient."""
    hub, results = run_job(tmp_path, replicas=4, g=2, steps=5, work_class=NormWork,
                           faults=["replica=2,step=3,phase=backward"], manager_kwargs=AUDITS)
    works = values_of(results, killed=[(2, 0)])
    check_against_oracle(tmp_path, works, 4, 5, b=8)
    assert not (tmp_path / "events.jsonl").exists() or _events(tmp_path, "audit") == []
    # step 3: the pairs planned before the death, less the two with replica 2 in them
    assert [m["audit"]["pairs"] for m in _metrics(tmp_path)] == [4, 4, 2, 3, 3]
    assert all(m["audit"]["max_rel_diff"] == 0 for m in _metrics(tmp_path))


def test_two_replicas_that_differ_refuse_the_step_in_one_line(tmp_path):
    """2 x 1: nothing can settle which one is right: step 3 is refused on both (NoMajority, one
    line), nothing of it committed."""
    hub, results = run_job(tmp_path, replicas=2, g=1, steps=4, work_class=NormWork,
                           faults=["replica=1,step=3,phase=forward,mode=corrupt,factor=1.5"],
                           manager_kwargs=AUDITS)
    first = next(e for e in results.values() if isinstance(e, NoMajority))
    message = str(first)  # the other rank raises the same, or is released by the fake's break
    assert "\n" not in message and message.startswith("step 3: refusing to commit")
    assert "replicas 0 and 1" in message and "no third replica" in message
    assert all(isinstance(e, Exception) and message in str(e) for e in results.values())
    assert [m["step"] for m in _metrics(tmp_path)] == [1, 2]
