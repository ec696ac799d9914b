"""Bad replicas in process ([Note: bad replicas], [Note: straggler quotas]): the real manager,
BucketSync, policy, ledger and fault specs over the fake world (tests/fakes.py), gradients
checked EXACTLY against the ledger oracle of tests/manager/test_manager.py.

A replica whose bucket is NaN (``mode=nan``) or whose loss is Inf (``mode=inf_loss``) is excluded
from that step only and B is committed; after K offences it retires and the others go on with
B; a slow replica (``mode=slow``) gets a smaller quota and gets it back when it recovers."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import torch

from fakes import values_of
from recover_hsdp.config import BadReplicas
from recover_hsdp.workload import StragglerRule
from recover_hsdp.workload.ledger import ledger_records
from test_manager import StandInWork, check_against_oracle, run_job


class NormWork(StandInWork):
    """``StepWork`` whose update returns the gradient's norm and, as the real trainer does,
    updates nothing when it is not finite. The real norm is reduced over the replica's ranks
    (FSDP's DTensor), so every rank of every replica sees the same; here one global sum of
    squares stands for it (the same on every rank, not finite if any rank's part is not)."""

    pause_s = 0.0  # per microbatch (a baseline compute time for the straggler tests)

    def forward_backward(self, data, nominal_tokens, before_backward, grad_factor=1.0):
        if self.pause_s:
            time.sleep(self.pause_s)
        return super().forward_backward(data, nominal_tokens, before_backward, grad_factor)

    def apply_update(self, grad_scale: float) -> float:
        squares = np.array([sum(float((g * grad_scale).pow(2).sum()) for g in self.grads)])
        self.world.allreduce_global(squares)
        norm = math.sqrt(squares[0]) if squares[0] >= 0 else float("nan")
        if not math.isfinite(norm):
            return norm
        super().apply_update(grad_scale)
        return norm


class PausedWork(NormWork):
    pause_s = 0.01


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _nonfinite_events(tmp_path):
    return [e for e in _lines(tmp_path / "events.jsonl") if e.get("phase") == "nonfinite"]


def _all_finite(works):
    return all(bool(torch.isfinite(g).all()) for w in works.values() for step in w.applied
               for g in step)


def test_nan_bucket_at_step_3_commits_b_and_the_oracle_gradient(tmp_path):
    """4x1, G=2: replica 1's bucket 1 becomes NaN (snapshot too) before its reduce at step 3.
    The step commits B = 8 with replica 1 excluded (its ids computed by the others), every
    replica, the culprit included, applies the oracle's gradient, nothing is non-finite."""
    hub, results = run_job(tmp_path, replicas=4, g=2, steps=5, work_class=NormWork,
                           faults=["replica=1,step=3,phase=grad_sync,mode=nan,bucket=1"])
    works = values_of(results)
    ledger = check_against_oracle(tmp_path, works, 4, 5, b=8)
    assert _all_finite(works) and hub.epoch == 0 and len(works[(1, 0)].applied) == 5
    step3 = ledger_records(tmp_path)[2]
    assert step3["replicas"]["1"]["excluded"] and step3["replicas"]["1"]["committed"] == []
    assert sorted(i for r in (0, 2, 3) for i in ledger[2].extra[r]) == [18, 19]
    assert [len(e.alive) for e in ledger] == [4] * 5 and ledger[3].committed[1] == (26, 27)
    (event,) = _nonfinite_events(tmp_path)
    assert event["step"] == 3 and event["culprits"] == {
        "1": {"buckets": [1], "loss": False, "offences": 1, "action": "excluded"}}


def test_nan_in_one_rank_of_a_2x2_replica(tmp_path):
    """2 replicas x 2 ranks, NaN in shard 1's last bucket of replica 0: replica 0 as a whole
    contributes zero, replica 1 computes all B."""
    hub, results = run_job(tmp_path, replicas=2, g=2, steps=4, shards=2, work_class=NormWork,
                           faults=["replica=0,step=2,phase=grad_sync,mode=nan,bucket=9,rank=1"])
    works = values_of(results)
    ledger = check_against_oracle(tmp_path, works, 2, 4, b=4)
    assert ledger[1].committed == {0: (), 1: (6, 7, 4, 5)} and _all_finite(works)
    (event,) = _nonfinite_events(tmp_path)
    assert event["culprits"]["0"]["buckets"] == [2]


def test_nan_where_the_replicas_ranks_have_different_units(tmp_path):
    """Pipeline stages: shard 0 has 2 FSDP units, shard 1 has 3 ([Note: pipeline stages in a
    replica]). The agreement's rows are one width on every rank (rows as wide as a rank's own
    units made ranks of different stages call one all-reduce with different lengths: MPI
    truncated it and the step hung, found on a real 3 x (PP 2) job)."""
    hub, results = run_job(tmp_path, replicas=2, g=2, steps=3, shards=2, work_class=NormWork,
                           units_of_shard=lambda shard: 2 + shard,
                           faults=["replica=1,step=2,phase=grad_sync,mode=nan,rank=0"])
    works = values_of(results)
    assert not [w for w in works.values() if isinstance(w, BaseException)], works
    assert hub.epoch == 0 and _all_finite(works)
    assert all(len(w.applied) == 3 for w in works.values())
    (event,) = _nonfinite_events(tmp_path)
    assert event["step"] == 2 and list(event["culprits"]) == ["1"]


def test_inf_loss_is_caught_from_the_totals(tmp_path):
    """``mode=inf_loss``: the loss in the step's totals is not finite (free on the good path):
    the culprit is found by its own losses, excluded, and the committed loss is finite."""
    hub, results = run_job(tmp_path, replicas=3, g=2, steps=3, work_class=NormWork,
                           faults=["replica=2,step=2,phase=forward,mode=inf_loss"])
    works = values_of(results)
    check_against_oracle(tmp_path, works, 3, 3, b=6)
    metrics = _lines(tmp_path / "metrics.jsonl")
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert metrics[1]["loss"] == metrics[1]["loss"] and _nonfinite_events(tmp_path)[0][
        "culprits"] == {"2": {"buckets": [], "loss": True, "offences": 1, "action": "excluded"}}


def test_k_offences_retire_the_replica_and_b_is_kept(tmp_path):
    """K = 3: replica 1 is NaN at steps 2, 3, 4: excluded twice, retired (it leaves as a unit)
    at the third; the others commit B every step, gradient == oracle."""
    faults = [f"replica=1,step={s},phase=grad_sync,mode=nan,bucket=0" for s in (2, 3, 4)]
    hub, results = run_job(tmp_path, replicas=4, g=1, steps=6, work_class=NormWork,
                           faults=faults,
                           manager_kwargs={"bad_replicas": BadReplicas(max_offences=3)})
    works = values_of(results, killed=[(1, 0)])
    ledger = check_against_oracle(tmp_path, works, 4, 6, b=4)
    assert [len(e.alive) for e in ledger] == [4, 4, 4, 3, 3, 3] and _all_finite(works)
    events = _nonfinite_events(tmp_path)
    assert [(e["step"], e["culprits"]["1"]["action"]) for e in events] == [
        (2, "excluded"), (3, "excluded"), (4, "retired")]
    (death,) = [e for e in _lines(tmp_path / "events.jsonl") if "dead_replicas" in e]
    assert death["dead_replicas"] == [1] and "retired: 3 non-finite" in death["errors"]["1"][0]


def test_offences_outside_the_window_do_not_retire(tmp_path):
    faults = [f"replica=1,step={s},phase=grad_sync,mode=nan" for s in (1, 3, 5)]
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=5, work_class=NormWork, faults=faults,
                           manager_kwargs={"bad_replicas": BadReplicas(
                               max_offences=2, offence_window_steps=2)})
    works = values_of(results)
    check_against_oracle(tmp_path, works, 3, 5, b=3)
    assert [e["culprits"]["1"]["offences"] for e in _nonfinite_events(tmp_path)] == [1, 1, 1]


def test_a_slow_replica_gets_less_then_its_quota_back(tmp_path):
    """4x1, G=2, every microbatch 10 ms; replica 1 is 30 ms slower per microbatch for steps
    2..6: after patience (2) its quota drops, B every step, gradient == oracle; after it
    recovers its quota comes back."""
    rule = StragglerRule(slow_ratio=1.5, recover_ratio=1.2, patience=2)
    hub, results = run_job(tmp_path, replicas=4, g=2, steps=11, work_class=PausedWork,
                           faults=["replica=1,step=2,mode=slow,seconds=0.03,steps=5"],
                           policy_kwargs={"straggler": rule})
    works = values_of(results)
    ledger = check_against_oracle(tmp_path, works, 4, 11, b=8)
    quotas = [len(e.committed[1]) for e in ledger]
    assert quotas[:3] == [2, 2, 2] and quotas[3:7] == [1, 1, 1, 1], quotas
    assert quotas[-2:] == [2, 2], quotas
    assert len({tuple(sorted(i for ids in e.committed.values() for i in ids)) ==
                tuple(range(8 * e.step, 8 * e.step + 8)) for e in ledger}) == 1
    changes = [e for e in _lines(tmp_path / "events.jsonl") if e.get("phase") == "rebalance"]
    assert [sorted(e["weights"]) for e in changes] == [["1"], []]


def test_nan_in_a_spares_bucket(tmp_path):
    """4 replicas, B = 4, replica 3 dead at step 1 so G = 2 and one replica is a spare; the
    spare's zeroed bucket is poisoned at step 3: it is found (its snapshot), excluded, B kept."""
    hub, results = run_job(tmp_path, replicas=4, g=1, steps=4, work_class=NormWork,
                           faults=["replica=3,step=1,phase=backward",
                                   "replica=2,step=3,phase=grad_sync,mode=nan,bucket=0"])
    works = values_of(results, killed=[(3, 0)])
    ledger = check_against_oracle(tmp_path, works, 4, 4, b=4)
    assert ledger[2].roles[2] == "spare" and ledger[2].committed[2] == ()
    assert [e["culprits"] for e in _nonfinite_events(tmp_path)] == [
        {"2": {"buckets": [0], "loss": False, "offences": 1, "action": "excluded"}}]


def test_nan_in_stream_mode_consumes_nothing_of_the_culprits_slot(tmp_path):
    """Stream mode: the culprit commits no position at step 2 (its slot's cursor stays), the
    others' extras are positions of their own slots; B and the oracle gradient every step."""
    hub, results = run_job(tmp_path, replicas=3, g=2, steps=4, mode="stream", work_class=NormWork,
                           faults=["replica=0,step=2,phase=grad_sync,mode=nan,bucket=2"])
    works = values_of(results)
    ledger = check_against_oracle(tmp_path, works, 3, 4, b=6)
    assert ledger[1].committed[0] == () and ledger[2].stream_start[0] == 2
    assert ledger[2].stream_start[1] + ledger[2].stream_start[2] == 10  # 4 + 2 extras
