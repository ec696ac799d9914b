"""Bad replicas in real jobs ([Note: bad replicas] in manager/culprits.py): a replica whose
gradient bucket becomes NaN just before its cross-replica reduce (``mode=nan``) is excluded from
that step, the others compute its microbatch, B is committed, and the run stays on the
failure-free trajectory (exact data assignment); the same replica bad K times is retired and the
run finishes with B. 4 x 1 slow (the default suite runs the same NaN fault in the 4 x 1 job of
tests/jobs/test_silent_corruption.py), 2 x 2 soak (the fake world proves the
protocol at 2 x 2: tests/manager/test_culprits.py)."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import DEBUG_CONFIG, no_step_waited_for_a_deadline, read_jsonl, run_cli
from recover_hsdp.collectives.processes import read_registry

STEPS = 10


def _train(out, faults=(), replicas=4, ranks=1, extra=()):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas),
            "--ranks-per-replica", str(ranks), "--out", str(out)]
    for fault in faults:
        args += ["--fault", fault]
    started = time.monotonic()
    result = run_cli(args + ["--", "--recover.timeouts.hang_s", "20",
                             "--recover.debug.save_final_params", *extra], timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return read_jsonl(out / "metrics.jsonl"), time.monotonic() - started


def _check(out, steps, reference, b, alive):
    """B measured every step, the alive counts, the loss within 1e-3 of ``reference`` at every
    step, finite parameters, nothing left alive."""
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["reduced_microbatches"] for s in steps] == [b] * STEPS
    assert [s["committed_microbatches"] for s in steps] == [b] * STEPS
    assert [s["alive_replicas"] for s in steps] == alive
    diffs = [abs(a["loss"] - r["loss"]) for a, r in zip(steps, reference)]
    assert max(diffs) <= 1e-3, diffs
    params = torch.load(out / "final_params.pt")
    assert all(bool(torch.isfinite(p).all()) for p in params.values())
    assert [p.pid for p in read_registry(out) if p.state() is not None] == []


def _nonfinite(out):
    return [e for e in read_jsonl(out / "events.jsonl") if e.get("phase") == "nonfinite"]


@pytest.mark.slow  # default suite time: tests/jobs/test_silent_corruption.py's 4 x 1 job has the
# same NaN fault (beside a bitflip in another replica)
def test_nan_bucket_in_one_replica_4x1(tmp_path, failure_free):
    """4 x 1, replica 1's first bucket NaN before its reduce at step 3: the step commits B = 4,
    the loss equals the failure-free run's at every step, no parameter is non-finite, nobody
    died, one event names the culprit and its bucket.
    Real process: FSDP2's real reduce-scatter buffer poisoned and restored, TorchTitan's
    clip_grad_norm_ (DTensor) seeing the NaN on every rank, the MPI agreement on the culprit."""
    steps, wall = _train(tmp_path, ["replica=1,step=3,phase=grad_sync,mode=nan"])
    _check(tmp_path, steps, failure_free["exact"], b=4, alive=[4] * STEPS)
    (event,) = _nonfinite(tmp_path)
    assert event["step"] == 3 and event["culprits"]["1"]["action"] == "excluded"
    assert event["culprits"]["1"]["buckets"] == [0]
    assert not [e for e in read_jsonl(tmp_path / "events.jsonl") if "dead_replicas" in e]
    no_step_waited_for_a_deadline(steps)


@pytest.mark.slow  # default suite time: test_culprits proves the K offences
def test_nan_k_times_retires_the_replica_4x1(tmp_path, failure_free):
    """4 x 1, nonfinite_max_offences = 2: replica 2 NaN at steps 2 and 3: excluded at step 2,
    retired at step 3 (its rank leaves, the others repair the death in the same step); B every
    step, loss == failure-free, three replicas from step 3 on.
    Real process: the retiring rank really ends itself (SIGKILL) mid-step and ULFM shrinks the
    world around it while the others are re-reducing the step."""
    faults = [f"replica=2,step={s},phase=grad_sync,mode=nan,bucket=1" for s in (2, 3)]
    steps, wall = _train(tmp_path, faults, extra=["--recover.bad_replicas.max_offences", "2"])
    _check(tmp_path, steps, failure_free["exact"], b=4, alive=[4, 4] + [3] * (STEPS - 2))
    assert [(e["step"], e["culprits"]["2"]["action"]) for e in _nonfinite(tmp_path)] == [
        (2, "excluded"), (3, "retired")]
    (death,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if "dead_replicas" in e]
    assert death["step"] == 3 and death["dead_replicas"] == [2]
    assert "retired: 2 non-finite contributions" in death["errors"]["2"][0]
    no_step_waited_for_a_deadline(steps)


@pytest.fixture(scope="module")
def failure_free_2x2(tmp_path_factory, local_corpus):
    out = tmp_path_factory.mktemp("ref2x2")
    steps, _ = _train(out, replicas=2, ranks=2)
    return steps


@pytest.mark.soak  # the 4 x 1 cases above + the 2 x 2 protocol in process
def test_nan_in_one_rank_of_a_2x2_replica(tmp_path, failure_free_2x2):
    """2 x 2, NaN in shard rank 1's bucket of replica 1 at step 3: the whole replica contributes
    zero, replica 0 computes its microbatch, B = 2, loss == the 2 x 2 failure-free run's.
    Real process: the NaN of one rank reaches its replica peer only through the replica's own
    gloo group (the gradient norm), and both agree with the other replica over MPI."""
    steps, _ = _train(tmp_path, ["replica=1,step=3,phase=grad_sync,mode=nan,rank=1"],
                      replicas=2, ranks=2)
    _check(tmp_path, steps, failure_free_2x2, b=2, alive=[2] * STEPS)
    (event,) = _nonfinite(tmp_path)
    assert event["step"] == 3 and list(event["culprits"]) == ["1"]


@pytest.mark.soak  # the 4 x 1 retirement above proves the real-process part
def test_nan_k_times_retires_a_2x2_replica(tmp_path, failure_free_2x2):
    """2 x 2, K = 2: replica 1 NaN at steps 2 and 3 (both its ranks): retired at step 3 as a
    unit, replica 0 finishes alone with B = 2 and the failure-free loss.
    Real process: both ranks of the culprit end themselves and the survivor's gloo group is
    untouched."""
    faults = [f"replica=1,step={s},phase=grad_sync,mode=nan" for s in (2, 3)]
    steps, _ = _train(tmp_path, faults, replicas=2, ranks=2,
                      extra=["--recover.bad_replicas.max_offences", "2"])
    _check(tmp_path, steps, failure_free_2x2, b=2, alive=[2, 2] + [1] * (STEPS - 2))
