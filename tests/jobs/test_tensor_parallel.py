"""A replica of FSDP x TP ranks ([Note: replica layout] in recover_hsdp/config/checks.py).

- Equivalence: 2 replicas x (FSDP 1 x TP 2) and 2 x (FSDP 2 x TP 2) against stock TorchTitan
  HSDP + TP with the same config (G = 2): per-step loss within 1e-4, final parameters allclose.
- Real kill: 3 replicas x TP 2, the TP rank 1 of replica 1 SIGKILLed in the gradient sync after
  3 of 8 buckets were reduced: its TP peer leaves with it, B is measured every step, the loss
  stays within 1e-3 of the failure-free 3 x TP 2 run (a TP layout initialises its weights
  through DTensor's RNG: the reference must have the same layout), and the gradient committed
  in the failure step equals the one recomputed on one process from the ledger's microbatch ids (the
  oracle; the dump gathers the FSDP x TP
  DTensor gradients into full tensors).
"""

import pytest
import torch

from conftest import DEBUG_CONFIG, assert_matches_stock, read_jsonl, train_job
from oracle import committed_refs, recompute_gradient
from recover_hsdp.collectives.processes import read_registry
from recover_hsdp.workload.ledger import read_ledger

G, LBS, STEPS = 2, 2, 5
TP = ("--parallelism.tensor_parallel_degree", "2")


def _train(out, replicas, ranks, **kwargs):
    return train_job(out, DEBUG_CONFIG, replicas, ranks, STEPS, **kwargs)


@pytest.mark.slow  # default suite time: the TP kill test below runs TP every commit
@pytest.mark.parametrize("fsdp", [1, pytest.param(2, marks=pytest.mark.soak)])  # 8 ranks: soak
def test_fsdp_x_tp_replicas_match_stock_hsdp_tp(tmp_path, local_corpus, fsdp):
    """Real process: TorchTitan's TP plan in replicas against stock HSDP + TP under torchrun."""
    ranks = fsdp * 2
    extra = (*TP, "--recover.debug.save_final_params",
             "--training.global_batch_size", str(G * 2 * fsdp * LBS))
    mpi = _train(tmp_path / "mpi", 2, ranks, extra=extra)
    stock = _train(tmp_path / "stock", 2, ranks, stock=True, extra=extra)
    assert_matches_stock(mpi, stock, STEPS, reduced=G * 2, g=G,
                         tokens=G * 2 * fsdp * LBS * 128)  # counted once per FSDP rank


# default suite time: without the failure-free twin run (the gradient oracle checks the
# recovered step); slow: the whole trajectory against the failure-free run as well
@pytest.mark.parametrize("against_failure_free", [
    pytest.param(False, marks=pytest.mark.slow),  # default suite time (CI runs it)
    pytest.param(True, marks=pytest.mark.soak)])
def test_tp_rank_killed_mid_sync_replica_leaves_as_a_unit(tmp_path, local_corpus,
                                                         against_failure_free):
    """Real process: a TP rank SIGKILLed mid-sync; its TP peer's collective fails; the replica
    leaves as a unit."""
    common = ("--recover.timeouts.hang_s", "10")
    out = _train(tmp_path / "tp", 3, 2, faults=["replica=1,step=2,phase=grad_sync,bucket=3,rank=1"],
                 extra=(*TP, *common, "--recover.debug.dump_step_gradients", "2"))
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["reduced_microbatches"] == 3 for s in steps)       # B = 3, measured
    assert [s["alive_replicas"] for s in steps] == [3, 2, 2, 2, 2]
    events = read_jsonl(out / "events.jsonl")
    assert [e["dead_replicas"] for e in events] == [[1]], events
    if against_failure_free:
        reference = read_jsonl(_train(tmp_path / "ref", 3, 2, extra=(*TP, *common))
                               / "metrics.jsonl")
        diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, reference)]
        assert max(diffs) <= 1e-3, diffs
    procs = read_registry(out)
    assert [procs[r].state() for r in (2, 3)] == [None, None]       # both ranks of replica 1 gone
    text = (out / "stdout.log").read_text()
    assert "RETIRE rank 2" in text or (out / "errors" / "rank2.json").exists(), text[-3000:]

    entry = [e for e in read_ledger(out) if e.step == 1][0]
    assert list(entry.failures) == [1]
    refs = committed_refs(entry)
    assert [r.index for r in refs] == [3, 4, 5]                     # step 2's ids, exactly
    dump = torch.load(out / "grads_step2.pt")
    oracle = recompute_gradient(dump["params"], refs, 1)             # D = 1 FSDP rank per replica
    for name, grad in dump["grads"].items():
        torch.testing.assert_close(grad, oracle[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
