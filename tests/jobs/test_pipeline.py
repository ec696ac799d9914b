"""A replica that is a pipeline ([Note: pipeline stages in a replica] in titan/pipeline.py).

- Equivalence: 2 replicas x (PP 2) (1F1B, Interleaved1F1B, GPipe), 2 x (PP 2 x TP 2) and
  2 x (PP 2 x FSDP 2) against stock TorchTitan HSDP + PP with the same config (G = 2, so the
  held sync carries a microbatch's gradient to the next): per-step loss within 1e-4, final
  parameters allclose. The optimizer is made indifferent to the gradient's scale on both sides
  (no clipping, Adam's eps 1e-30): TorchTitan 0.2.2 under PP backpropagates the token sum (it
  divides the logged loss only), a gradient the step's tokens times larger than the one without
  stages, which ReCoVer keeps; clipping at max_norm = 1 cuts the one and not the other, and
  eps = 1e-8 weighs on an embedding row's tiny gradient at one scale and not at the other
  (measured with both: losses within 4e-4, embedding rows 1.6e-3 apart). The gradient itself
  is checked against the one-process oracle by the kill test.
- NaN: a first-stage bucket poisoned: its replica is the agreed culprit for that step (slow).
- Real kill: 3 replicas x PP 2, the stage-1 rank of replica 1 SIGKILLed in the gradient sync
  after 2 buckets: its stage-0 peer leaves with it, B measured every step, and the gradient
  committed in the failure step equals the one recomputed on one process from the ledger's
  microbatch ids (the oracle; the dump gathers every stage).
- Frozen, then rejoin: a stage-0 rank SIGSTOPped mid-step is ended, its stage-1 peer leaves
  with it, a replacement pipeline replica is spawned and rejoins (G back); the loss within 1e-3
  of the failure-free run (slow).
"""

import shutil

import pytest
import torch

from conftest import (PIPELINE_CONFIG, REPO, assert_matches_stock, read_jsonl, run_cli,
                      train_job)
from c4_local import make_local_c4
from oracle import committed_refs, recompute_gradient
from recover_hsdp.collectives.processes import read_registry
from recover_hsdp.workload.ledger import read_ledger

G, LBS, STEPS = 2, 2, 5
SCALE_FREE = ("--training.max_norm", "1e9", "--optimizer.eps", "1e-30")


def _train(out, replicas, ranks, *, steps=STEPS, **kwargs):
    return train_job(out, PIPELINE_CONFIG, replicas, ranks, steps, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("tp,fsdp,schedule", [
    (1, 1, "1F1B"),
    (1, 1, "Interleaved1F1B"),                             # two stages per rank: 4 in all
    pytest.param(1, 1, "GPipe", marks=pytest.mark.soak),   # the same sums as 1F1B
    pytest.param(2, 1, "1F1B", marks=pytest.mark.soak),    # 8 ranks
    pytest.param(1, 2, "1F1B", marks=pytest.mark.soak),    # 8 ranks, FSDP inside each stage
    pytest.param(1, 1, "stream", marks=pytest.mark.soak)])  # 1F1B over C4 streams
def test_pipeline_replicas_match_stock_hsdp_pp(tmp_path, local_corpus, tp, fsdp, schedule):
    """Real process: TorchTitan's pipeline split and schedule in replicas against stock HSDP +
    PP under torchrun (``stream``: 1F1B, both reading a local C4 copy as streams)."""
    ranks = 2 * tp * fsdp
    data = ()
    if schedule == "stream":
        schedule, data = "1F1B", ("--training.dataset", "c4", "--training.dataset_path",
                                  str(make_local_c4(tmp_path / "c4")),
                                  "--recover.workload.data_assignment", "stream")
    extra = (*SCALE_FREE, *data, "--parallelism.tensor_parallel_degree", str(tp),
             "--parallelism.pipeline_parallel_schedule", schedule,
             "--recover.debug.save_final_params",
             "--training.global_batch_size", str(G * 2 * fsdp * LBS))
    mpi = _train(tmp_path / "mpi", 2, ranks, extra=extra)
    stock = _train(tmp_path / "stock", 2, ranks, stock=True, extra=extra)
    params = assert_matches_stock(mpi, stock, STEPS, reduced=G * 2, g=G,  # measured, every stage
                                  tokens=G * 2 * fsdp * LBS * 128)  # once per FSDP rank and stage
    assert any(name.startswith("tok_embeddings") for name in params)     # both stages in it
    assert any(name.startswith("output") for name in params)


# default suite time: the oracle checks the recovered step; slow: the whole trajectory against
# the failure-free run as well
@pytest.mark.parametrize("against_failure_free", [False,
                                                  pytest.param(True, marks=pytest.mark.slow)])
def test_stage_rank_killed_mid_sync_replica_leaves_as_a_unit(tmp_path, local_corpus,
                                                             against_failure_free):
    """Real process: the last stage's rank SIGKILLed mid-sync; its first-stage peer leaves."""
    common = ("--training.global_batch_size", str(G * 3 * LBS), "--recover.timeouts.hang_s", "10")
    out = _train(tmp_path / "pp", 3, 2,
                 faults=["replica=1,step=2,phase=grad_sync,bucket=2,rank=1"],
                 extra=(*common, "--recover.debug.dump_step_gradients", "2"))
    steps = read_jsonl(out / "metrics.jsonl")
    if against_failure_free:
        reference = read_jsonl(_train(tmp_path / "ref", 3, 2, extra=common) / "metrics.jsonl")
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, reference)) <= 1e-3
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["reduced_microbatches"] == G * 3 for s in steps)  # B = 6, measured
    assert [s["alive_replicas"] for s in steps] == [3, 2, 2, 2, 2]
    events = read_jsonl(out / "events.jsonl")
    assert [e["dead_replicas"] for e in events] == [[1]], events
    assert events[0]["extra_microbatches"] == G               # replica 1's, absorbed
    procs = read_registry(out)
    assert [procs[r].state() for r in (2, 3)] == [None, None]  # both stages of replica 1 gone

    entry = [e for e in read_ledger(out) if e.step == 1][0]
    assert list(entry.failures) == [1]
    refs = committed_refs(entry)
    assert [r.index for r in refs] == list(range(G * 3, 2 * G * 3))  # step 2's ids, exactly
    dump = torch.load(out / "grads_step2.pt")
    assert any(name.startswith("output") for name in dump["grads"])  # the last stage's too
    oracle = recompute_gradient(dump["params"], refs, 1)
    for name, grad in dump["grads"].items():
        torch.testing.assert_close(grad, oracle[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_frozen_first_stage_rank_then_the_pipeline_replica_rejoins(tmp_path, local_corpus):
    """Real process: a stage-0 rank SIGSTOPped in its backward; the survivors end it, its
    stage-1 peer (blocked in a pipeline receive or the replica's gloo) leaves; a replacement
    pipeline replica is spawned, takes both stages' state from a donor's same-stage ranks and
    rejoins (G back to 2); every step B, parameters agreed every step, the loss within 1e-3 of
    the failure-free run, nothing left alive."""
    common = ("--training.global_batch_size", str(G * 3 * LBS),
              "--recover.timeouts.hang_s", "10",
              "--recover.bad_replicas.consistency_check_interval", "1")
    out = _train(tmp_path / "pp", 3, 2, faults=["replica=1,step=2,phase=backward,rank=0,mode=stop"],
                 extra=(*common, "--recover.tiers.respawn_after_steps", "1"), timeout=600,
                 steps=40)
    reference = read_jsonl(_train(tmp_path / "ref", 3, 2, extra=common, timeout=600, steps=40)
                           / "metrics.jsonl")
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 41))
    assert all(s["reduced_microbatches"] == G * 3 for s in steps)   # B, measured
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(steps, reference)]
    assert max(diffs) <= 1e-3, diffs
    events = read_jsonl(out / "events.jsonl")
    death = events[0]
    assert death["dead_replicas"] == [1] and death["step"] == 2
    assert death["detect_s"] < 15                                    # not the hang watchdog
    joins = [e for e in events if e.get("phase") == "join" and e["ok"]]
    assert joins and joins[-1]["joined_replicas"] == [1], events
    joined_at = joins[-1]["step"]
    for record in steps:
        expected = (3, G) if record["step"] >= joined_at else \
            (2, 3) if record["step"] > 2 else (record["alive_replicas"], G)
        assert (record["alive_replicas"], record["g"]) == expected, record
    procs = read_registry(out)
    assert [p.pid for p in procs if p.state() not in (None, "Z")] == []


@pytest.mark.slow
def test_checkpoint_with_stages_saved_after_a_stage_death_then_restarted_on_fewer(tmp_path,
                                                                                  local_corpus):
    """Real process, on the torch data plane: the saving replica's stage-1 rank SIGKILLed
    inside the step-4 DCP save; the next replica saves step 4 again (both stages), the run goes
    on; restarted from that checkpoint on 2 replicas, certified and verified on load, it
    continues with G raised and the same losses (exact mode: the same microbatches)."""
    ckpt = tmp_path / "ckpt"
    common = ("--training.global_batch_size", str(G * 3 * LBS),
              "--recover.timeouts.hang_s", "10", "--checkpoint.enable", "--checkpoint.interval",
              "2")
    first = read_jsonl(_train(tmp_path / "three", 3, 2,
                              faults=["replica=0,step=4,phase=checkpoint,rank=1"], steps=6,
                              extra=(*common, "--checkpoint.folder", str(ckpt),
                                     "--recover.reduce.plane", "torch")) / "metrics.jsonl")
    assert [s["alive_replicas"] for s in first] == [3, 3, 3, 3, 2, 2]
    saves = [e for e in read_jsonl(tmp_path / "three" / "events.jsonl")
             if e.get("phase") == "checkpoint"]
    assert [(e["step"], e["saved_by"], e["redone"], e["saved"]) for e in saves] == [
        (4, 1, True, True)]
    (tmp_path / "ckpt2").mkdir()
    shutil.copytree(ckpt / "step-4", tmp_path / "ckpt2" / "step-4")
    resumed = read_jsonl(_train(tmp_path / "two", 2, 2, steps=6, extra=(
        *common, "--checkpoint.folder", str(tmp_path / "ckpt2"), "--checkpoint.load_step", "4"))
        / "metrics.jsonl")
    assert [(s["step"], s["g"], s["reduced_microbatches"]) for s in resumed] == [
        (5, 3, 6), (6, 3, 6)]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(resumed, first[4:])]
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("stock", [False, True])
def test_the_papers_3d_config_is_refused_where_it_cannot_fit(tmp_path, stock):
    """torchtitan_configs/llama3_7b_3d.toml (and its stock twin) on this CPU host: one line
    naming what is missing, nothing started."""
    name = "llama3_7b_3d_stock.toml" if stock else "llama3_7b_3d.toml"
    (tmp_path / "c4").mkdir()  # past the dataset's own check: the model is what cannot fit
    result = run_cli(["train", "--config", str(REPO / "torchtitan_configs" / name),
                      "--replicas", "2", "--ranks-per-replica", "8", "--out", str(tmp_path / "o"),
                      *(["--stock"] if stock else []),
                      "--", "--training.dataset_path", str(tmp_path / "c4")], timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "model.flavor='7B' does not fit: 16 rank(s) of 14.0 GiB each" in lines[0]
    assert "pipeline_parallel_degree=2 x tensor_parallel_degree=4" in lines[0]
    assert "this host's RAM has" in lines[0]
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_nan_in_a_first_stage_bucket_excludes_its_replica_for_the_step(tmp_path, local_corpus):
    """Real process: replica 1's stage-0 rank's bucket NaN before its reduce at step 3 (its
    stage-1 rank is finite): replica 1 is the agreed culprit, the others compute its
    microbatches, B every step, nobody dies, the loss equals the failure-free run's."""
    common = ("--training.global_batch_size", str(G * 3 * LBS), "--recover.timeouts.hang_s", "20")
    out = _train(tmp_path / "nan", 3, 2, faults=["replica=1,step=3,phase=grad_sync,mode=nan,rank=0"],
                 extra=common, steps=4)
    reference = read_jsonl(_train(tmp_path / "ref", 3, 2, extra=common, steps=4)
                           / "metrics.jsonl")
    steps = read_jsonl(out / "metrics.jsonl")
    assert [(s["step"], s["alive_replicas"], s["reduced_microbatches"]) for s in steps] == [
        (step, 3, G * 3) for step in range(1, 5)]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, reference)) <= 1e-5
    (event,) = [e for e in read_jsonl(out / "events.jsonl") if e.get("phase") == "nonfinite"]
    assert event["step"] == 3 and list(event["culprits"]) == ["1"]
    assert event["culprits"]["1"]["action"] == "excluded"
