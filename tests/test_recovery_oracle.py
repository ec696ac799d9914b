"""Oracle for in-step recovery: the gradient applied in a failure step equals the gradient
recomputed on one process from the microbatches the ledger says were committed.

A replica is SIGKILLed during the gradient sync after k of n buckets were reduced. The debug
model has n = 8 FSDP units (6 blocks, embeddings, norm+output; the root unit holds no params
of its own and fires no hook), so k in {0, 1, n-1, n}. Tolerance: fp32 reduction order only
(rtol 1e-4, atol 1e-6 on gradients of magnitude ~1e-3..1e-1).
"""

import pytest
import torch

from conftest import DEBUG_CONFIG, read_jsonl, run_cli
from oracle import recompute_gradient
from recover_hsdp.ledger import read_ledger

N_BUCKETS = 8
STEP = 2


def _run_with_faults(out, replicas, ranks, faults):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas),
            "--ranks-per-replica", str(ranks), "--out", str(out)]
    for fault in faults:
        args += ["--fault", fault]
    result = run_cli(args + ["--", "--training.steps", "3", "--recover.hang_timeout_s", "10",
                             "--recover.dump_step_gradients", str(STEP)])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return out


def _check_against_oracle(out, ranks, expected_dead):
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["committed_microbatches"] == 4 for s in steps)
    events = read_jsonl(out / "events.jsonl")
    assert sorted(d for e in events for d in e["dead_replicas"]) == expected_dead
    entry = [e for e in read_ledger(out) if e.step == STEP - 1][0]
    assert sorted(entry.failures) == expected_dead
    committed = sorted(i for ids in entry.committed.values() for i in ids)
    assert committed == list(range((STEP - 1) * 4, STEP * 4))   # exact: the failure-free ids
    dump = torch.load(out / f"grads_step{STEP}.pt")
    oracle = recompute_gradient(dump["params"], committed, ranks)
    for name, grad in dump["grads"].items():
        torch.testing.assert_close(grad, oracle[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("k", [0, 1, N_BUCKETS - 1, N_BUCKETS])
def test_kill_after_k_buckets_4x1(tmp_path, local_corpus, k):
    out = _run_with_faults(tmp_path / f"k{k}", 4, 1, [f"replica=2,step={STEP},phase=grad_sync,"
                                                       f"bucket={k}"])
    _check_against_oracle(out, 1, [2])


@pytest.mark.parametrize("k", [0, 1, N_BUCKETS - 1, N_BUCKETS])
def test_kill_one_rank_of_a_2x2_replica(tmp_path, local_corpus, k):
    """2 x 2: shard rank 1 of replica 1 dies after k buckets; its live peer must leave with it
    (RETIRE line) and the surviving replica commits both ids of the step (B = 2 x G = 1)."""
    out = tmp_path / "r22"
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", "2", "--ranks-per-replica", "2",
            "--out", str(out), "--fault", f"replica=1,step={STEP},phase=grad_sync,bucket={k},rank=1"]
    result = run_cli(args + ["--", "--training.steps", "3", "--recover.hang_timeout_s", "10",
                             "--recover.dump_step_gradients", str(STEP)])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "RETIRE" in result.stdout                       # replica 1's live rank left with it
    entry = [e for e in read_ledger(out) if e.step == STEP - 1][0]
    committed = sorted(i for ids in entry.committed.values() for i in ids)
    assert committed == [2, 3] and entry.failures == (1,)
    dump = torch.load(out / f"grads_step{STEP}.pt")
    oracle = recompute_gradient(dump["params"], committed, 2)
    for name, grad in dump["grads"].items():
        torch.testing.assert_close(grad, oracle[name], rtol=1e-4, atol=1e-6)


def test_second_death_during_rereduce(tmp_path, local_corpus):
    out = _run_with_faults(tmp_path / "second", 4, 1, [
        f"replica=1,step={STEP},phase=grad_sync,bucket=3",
        f"replica=3,step={STEP},phase=rereduce,bucket=2"])
    _check_against_oracle(out, 1, [1, 3])
    events = read_jsonl(out / "events.jsonl")
    assert len(events) == 2 and events[1]["epoch"] == 2
