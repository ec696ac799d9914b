"""Oracle for in-step recovery: the gradient applied in a failure step equals the gradient
recomputed on one process from the data the ledger says was committed.

A contributing replica is SIGKILLed during the gradient sync after k of n buckets were reduced.
The debug model has n = 8 buckets (FSDP units with parameters: 6 blocks, embeddings,
norm+output), so k in {0, 1, n-1, n}, all in the default suite (4x1: two failure steps per
job, both victims contribute). Also: a spare promoted when the replica it stands in for dies,
in exact and in stream mode (stream: the windows are recomputed from the ledger's stream slot
positions), a second death during the re-reduce, 2x2 one rank (k = 0 by default; the other k
with the slow tests). Tolerance: fp32 reduction order only (rtol 1e-4, atol 1e-6 on gradients
of magnitude ~1e-3..1e-1: a lost or doubled microbatch changes them by ~1e-2 relative).
"""

import pytest
import torch

from recover_hsdp.collectives.processes import read_registry
from conftest import DEBUG_CONFIG, read_jsonl, run_cli
from oracle import committed_refs, recompute_gradient
from recover_hsdp.workload.ledger import read_ledger

N_BUCKETS = 8
STEPS = 4


def _run_with_faults(out, replicas, ranks, faults, dump_steps, extra=()):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas),
            "--ranks-per-replica", str(ranks), "--out", str(out)]
    for fault in faults:
        args += ["--fault", fault]
    result = run_cli(args + ["--", "--training.steps", str(STEPS), "--recover.timeouts.hang_s",
                             "10", "--recover.debug.dump_step_gradients",
                             ",".join(map(str, dump_steps)), *extra])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    (out / "stdout.log").write_text(result.stdout)
    return out


def _check_step_against_oracle(out, step, ranks, expected_dead, global_batch, overrides=(),
                               slots=None):
    """The gradient committed at ``step`` (1-based) == the one-process recomputation."""
    entry = [e for e in read_ledger(out) if e.step == step - 1][0]
    assert sorted(entry.failures) == expected_dead
    refs = committed_refs(entry)
    assert len(refs) == global_batch
    if entry.mode == "exact":  # the failure-free ids of the step, whatever died
        assert [r.index for r in refs] == list(range((step - 1) * global_batch,
                                                     step * global_batch))
    dump = torch.load(out / f"grads_step{step}.pt")
    oracle = recompute_gradient(dump["params"], refs, ranks, list(overrides), slots=slots)
    for name, grad in dump["grads"].items():
        torch.testing.assert_close(grad, oracle[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow  # default suite time: the 2 x 2 oracle case below + test_manager
@pytest.mark.parametrize("k_first,k_second", [(0, N_BUCKETS),
                                              pytest.param(1, N_BUCKETS - 1,
                                                           marks=pytest.mark.soak)])
def test_kill_after_k_buckets_4x1(tmp_path, local_corpus, k_first, k_second):
    """4 x 1: replica 2 (a major) dies at step 2 after k_first buckets; replica 1 (a major of
    the 3 survivors: G = 2, replica 3 is the spare) at step 3 after k_second; both failure
    steps are checked against the oracle (k covers {0, 1, n-1, n}, victims contribute).
    Real process: FSDP2's real all-reduce hooks on TorchTitan's gradients against a one-process
    recomputation."""
    out = _run_with_faults(tmp_path, 4, 1, [
        f"replica=2,step=2,phase=grad_sync,bucket={k_first}",
        f"replica=1,step=3,phase=grad_sync,bucket={k_second}"], dump_steps=(2, 3))
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["reduced_microbatches"] == 4 for s in steps)
    events = read_jsonl(out / "events.jsonl")
    assert [e["dead_replicas"] for e in events] == [[2], [1]]
    assert events[1]["promoted"] == [] and events[1]["extra_microbatches"] == 2
    _check_step_against_oracle(out, 2, 1, [2], 4)
    _check_step_against_oracle(out, 3, 1, [1], 4)


@pytest.mark.slow  # default suite time: the promotion is proven in-process
@pytest.mark.parametrize("mode", ["exact", pytest.param("stream", marks=pytest.mark.soak)])
def test_promoted_spare(tmp_path, local_corpus, mode):
    """After replica 2 dies, replica 3 is the spare (exact: it shadows replica 0's ids;
    stream: it computes its next positions without drawing them). Replica 0 dies at step 3:
    the spare is promoted, nothing is recomputed, and its gradient is the committed one.
    Real process: (slow: test_manager proves the promotion) a promoted spare's real
    gradient."""
    extra = ("--recover.workload.data_assignment", mode)
    out = _run_with_faults(tmp_path, 4, 1, [
        "replica=2,step=2,phase=grad_sync,bucket=3",
        "replica=0,step=3,phase=grad_sync,bucket=2"], dump_steps=(3,), extra=extra)
    events = read_jsonl(out / "events.jsonl")
    assert [e["dead_replicas"] for e in events] == [[2], [0]]
    assert events[1]["promoted"] == [3] and events[1]["extra_microbatches"] == 0
    assert all(s["reduced_microbatches"] == 4 for s in read_jsonl(out / "metrics.jsonl"))
    _check_step_against_oracle(out, 3, 1, [0], 4, overrides=extra, slots=4)


# default suite: the oracle on both planes (torch after one overlapped bucket); the rest slow
@pytest.mark.parametrize("k,data_plane", [
    (0, "mpi"), pytest.param(1, "torch", marks=pytest.mark.soak),  # CI time: k = 0 on torch
    pytest.param(0, "torch", marks=pytest.mark.slow),
    pytest.param(N_BUCKETS, "mpi", marks=pytest.mark.soak),
    pytest.param(1, "mpi", marks=pytest.mark.soak),  # k = 0 and n run in CI
    pytest.param(N_BUCKETS - 1, "mpi", marks=pytest.mark.soak)])
def test_kill_one_rank_of_a_2x2_replica(tmp_path, local_corpus, k, data_plane):
    """2 x 2: shard rank 1 of replica 1 dies after k buckets; its live peer must leave with it
    (it retires at the consensus, or its intra-replica collective fails and it leaves with the
    error recorded) and the surviving replica commits both ids of the step (B = 2 x G = 1).
    Real process: FSDP2 sharding over 2 real ranks; the dead rank's peer leaves; gradients against
    the oracle."""
    out = _run_with_faults(tmp_path, 2, 2, [f"replica=1,step=2,phase=grad_sync,bucket={k},rank=1"],
                           dump_steps=(2,), extra=("--recover.reduce.plane", data_plane))
    text = (out / "stdout.log").read_text()
    assert "RETIRE rank 2" in text or (out / "errors" / "rank2.json").exists()
    assert read_registry(out)[2].state() is None            # replica 1's live rank left with it
    assert [s["alive_replicas"] for s in read_jsonl(out / "metrics.jsonl")] == [2, 1, 1, 1]
    _check_step_against_oracle(out, 2, 2, [1], 2)


@pytest.mark.slow  # default suite time: proven in-process in both modes
@pytest.mark.parametrize("data_plane", ["mpi", pytest.param("torch", marks=pytest.mark.soak)])
def test_second_death_during_rereduce(tmp_path, local_corpus, data_plane):
    """Real process: (slow: test_manager::test_second_death_during_rereduce proves it in
    both modes) a real death inside the re-reduce."""
    out = _run_with_faults(tmp_path, 4, 1, [
        "replica=1,step=2,phase=grad_sync,bucket=3",
        "replica=3,step=2,phase=rereduce,bucket=2"], dump_steps=(2,),
        extra=("--recover.reduce.plane", data_plane))
    events = read_jsonl(out / "events.jsonl")
    assert [e["dead_replicas"] for e in events] == [[1], [3]] and events[1]["epoch"] == 2
    _check_step_against_oracle(out, 2, 1, [1, 3], 4)
