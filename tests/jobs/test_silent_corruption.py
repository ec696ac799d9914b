"""Silent corruption that stays finite, in real jobs: a flipped bit in one replica's parameters
([Note: divergence votes] in manager/divergence.py) and changed bytes in a checkpoint ([Note:
certified checkpoints] in recover_hsdp/certificates.py). Exact data assignment, so the loss of
a run that absorbed the fault is checked against the failure-free run's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from conftest import DEBUG_CONFIG, no_step_waited_for_a_deadline, read_jsonl, run_cli
from recover_hsdp import certificates
from recover_hsdp.collectives.processes import read_registry
from recover_hsdp.workload.ledger import ledger_records

STEPS = 10
BITFLIP = "phase=optimizer,mode=bitflip"  # at rest: the replica's own check sees it
UPDATE_BITFLIP = "phase=optimizer,mode=update_bitflip"  # inside the update: only the vote does


def _train(out, replicas, *extra, faults=(), steps=STEPS, ok=True):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas), "--out", str(out),
            *(a for f in faults for a in ("--fault", f)),
            "--", "--training.steps", str(steps), "--recover.timeouts.hang_s", "20", *extra]
    result = run_cli(args, timeout=400)
    if ok:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return result


def _events(out, phase):
    return [e for e in read_jsonl(out / "events.jsonl") if e.get("phase") == phase]


def _checkpoint(ckpt, interval):
    return ["--checkpoint.enable", "--checkpoint.interval", str(interval),
            "--checkpoint.folder", str(ckpt)]


def _corrupt(folder: Path) -> None:
    """One byte changed in the middle of the largest shard file of a DCP folder."""
    shard = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def test_a_bitflip_a_nan_and_a_wrong_backward_in_a_4x1_job(tmp_path, failure_free):
    """4 x 1, gradients audited every step: replica 1's first bucket turns NaN before its
    reduce at step 3 (excluded for that step: [Note: bad replicas]); replica 2 flips bit 20 of
    one parameter inside step 5's update: step 6's vote (3 against 1) sends it away before step
    6's update, so nothing it computed from the flipped state is committed; from step 7 replica
    3's every gradient is 1.001 x right, its loss right: the audits of steps 7 and 8 (its pairs
    settled by a third) exclude it, step 9's retires it ([Note: gradient audits]); replica 1's
    bit flips at rest after step 9's update: its own check sees it at step 10 and it leaves,
    though only 2 replicas were left to vote. B = 4 measured every step, the loss equals the
    failure-free run's at every step.
    Real process: the flip in the real FSDP2 parameter, the fingerprints in the real MPI totals
    all-reduce, the culprit's rank ending itself, ULFM shrinking around it; FSDP2's real
    reduce-scatter buffer poisoned and restored, TorchTitan's clip_grad_norm_ (DTensor) seeing
    the NaN on every rank, the MPI agreement on the culprit; the audits' passes through the
    real FSDP2 hooks, their third computation in a real MPI all-reduce."""
    _train(tmp_path, 4, "--recover.bad_replicas.audit_interval", "1",
           faults=["replica=1,step=3,phase=grad_sync,mode=nan",
                   f"replica=2,step=5,{UPDATE_BITFLIP}",
                   "replica=3,step=7,phase=forward,mode=corrupt", f"replica=1,step=9,{BITFLIP}"])
    steps = read_jsonl(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["reduced_microbatches"] for s in steps] == [4] * STEPS
    assert [s["alive_replicas"] for s in steps] == [4] * 5 + [3] * 3 + [2, 1]
    assert [s["audit"]["culprits"] for s in steps] == [[]] * 6 + [[3]] * 3 + [[]]
    assert all(s["audit"]["max_rel_diff"] == 0 for s in steps[:6] + steps[9:])
    audits = _events(tmp_path, "audit")
    assert [(e["step"], e["culprits"]["3"]["action"]) for e in audits] == [
        (7, "excluded"), (8, "excluded"), (9, "retired")]
    diffs = [abs(a["loss"] - r["loss"]) for a, r in zip(steps, failure_free["exact"])]
    assert max(diffs) <= 1e-6, diffs
    (nan,) = _events(tmp_path, "nonfinite")
    assert nan["step"] == 3 and nan["culprits"] == {
        "1": {"buckets": [0], "loss": False, "offences": 1, "action": "excluded"}}
    (vote,) = _events(tmp_path, "diverged")
    assert vote["step"] == 6 and vote["diverged"] == [2]
    assert len(set(vote["fingerprints"].values())) == 2
    ledger = ledger_records(tmp_path)
    assert "2" not in {r for r, w in ledger[5]["replicas"].items() if w["committed"]}
    assert all("3" not in {r for r, w in entry["replicas"].items() if w["committed"]}
               for entry in ledger[6:])  # nothing of the wrong backward committed
    death, retired, at_rest = [e for e in read_jsonl(tmp_path / "events.jsonl")
                               if "dead_replicas" in e]
    assert death["step"] == 6 and death["dead_replicas"] == [2]
    assert "diverged" in death["errors"]["2"][0]
    assert retired["step"] == 9 and retired["dead_replicas"] == [3]
    assert "audited gradients that differ" in retired["errors"]["3"][0]
    assert at_rest["step"] == 10 and at_rest["dead_replicas"] == [1]
    assert "changed at rest" in at_rest["errors"]["1"][0]
    assert [p.pid for p in read_registry(tmp_path) if p.state() is not None] == []
    no_step_waited_for_a_deadline(steps)


@pytest.mark.slow  # default suite time: tests/titan/test_certified_load.py walks the folders,
# tests/manager/test_checkpoint_agreement.py certifies and verifies over the fake world
def test_restart_skips_a_model_only_save_and_refuses_a_changed_byte(tmp_path, local_corpus):
    """2 x 1, checkpoints every 2 of 8 steps (TorchTitan's default makes the last save,
    step-8, model-only), then one byte of step-6's largest shard file changed. The same folder
    restarted (the same 8 steps: the LR schedule spans them): step-8 is skipped (not a restart
    point), step-6 refused (it loads other bits than its certificate), step-4 loaded; steps
    5..8 repeat the first run's losses.
    Real process: TorchTitan's DCP save and load, the fingerprints agreed over MPI."""
    ckpt = tmp_path / "ckpt"
    _train(tmp_path / "first", 2, *_checkpoint(ckpt, 2), steps=8)
    first = read_jsonl(tmp_path / "first" / "metrics.jsonl")
    assert certificates.complete_checkpoints(ckpt) == [8, 6, 4, 2]
    assert certificates.restart_points(ckpt) == [6, 4, 2]
    assert [(e["step"], e["certified"], e["restart_point"])
            for e in _events(tmp_path / "first", "certificate")] == [
        (2, True, True), (4, True, True), (6, True, True), (8, True, False)]
    _corrupt(ckpt / "step-6")
    result = _train(tmp_path / "again", 2, *_checkpoint(ckpt, 20), steps=8)
    again = read_jsonl(tmp_path / "again" / "metrics.jsonl")
    assert [s["step"] for s in again] == [5, 6, 7, 8]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(again, first[4:])]
    assert max(diffs) <= 1e-6, diffs
    lines = [x for x in result.stdout.splitlines() if "refused:" in x]
    assert len(lines) == 2, lines
    assert "checkpoint step-8 refused: model-only" in lines[0]
    assert "checkpoint step-6 refused: does not" in lines[1]
    (load,) = _events(tmp_path / "again", "checkpoint load")
    assert load["loaded"] == 4 and sorted(load["refused"]) == ["6", "8"]


@pytest.mark.soak  # the 4 x 1 vote (default suite) and tests/jobs/test_rejoin.py; passed once (190 s)
def test_bitflipped_replica_comes_back_fresh(tmp_path, local_corpus):
    """4 x 1, 40 steps (a newcomer's start-up outlasts 10 short ones), ``respawn_after_steps =
    2``: replica 2 is voted out at step 4 and a fresh replacement joins from a healthy donor;
    the run ends with 4 replicas, no vote after the join finds anything, B every step, the
    loss equals a failure-free run's of the same length (the LR schedule spans it)."""
    steps_n = 40
    _train(tmp_path / "ref", 4, steps=steps_n)
    _train(tmp_path / "run", 4, "--recover.tiers.respawn_after_steps", "2", steps=steps_n,
           faults=[f"replica=2,step=3,{UPDATE_BITFLIP}"])
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    reference = read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    assert [s["reduced_microbatches"] for s in steps] == [4] * steps_n
    assert steps[3]["alive_replicas"] == 3 and steps[-1]["alive_replicas"] == 4
    diffs = [abs(a["loss"] - r["loss"]) for a, r in zip(steps, reference)]
    assert max(diffs) <= 1e-6, diffs
    assert [e["step"] for e in _events(tmp_path / "run", "diverged")] == [4]
    assert [p.pid for p in read_registry(tmp_path / "run") if p.state() is not None] == []


@pytest.mark.slow  # the protocol is in process (tests/manager/test_divergence.py)
def test_two_replicas_that_diverge_go_back_to_a_certified_checkpoint(tmp_path, local_corpus):
    """2 x 1, checkpoints every step: replica 1 flips a bit after step 3's update. Step 3's save
    is then not certified (the certificate's vote has no strict majority) and step 4's vote
    refuses the step, so no rank trains on: the job ends and the relaunch tier starts it again
    from the newest certified checkpoint, step-2. step-2 is changed on disk meanwhile (a byte
    of its largest file, once step 3's save is complete), so the relaunch refuses it in one
    line and loads step-1; the run completes 10 steps and steps 2-3 repeat their first losses.
    With the relaunch tier off the same fault stops the run with the one line."""
    ckpt = tmp_path / "ckpt"
    stop = threading.Event()

    def corrupt_step_2():
        while not stop.is_set():
            if (ckpt / "step-3" / ".metadata").is_file():
                _corrupt(ckpt / "step-2")
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=corrupt_step_2, daemon=True)
    watcher.start()
    result = _train(tmp_path / "run", 2, *_checkpoint(ckpt, 1),
                    faults=[f"replica=1,step=3,{UPDATE_BITFLIP}"])
    stop.set()
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    first = read_jsonl(tmp_path / "run" / "relaunch" / "attempt-0" / "metrics.jsonl")
    assert [s["step"] for s in first] == [1, 2, 3]          # step 4 was never committed
    assert max(abs(steps[i]["loss"] - first[i]["loss"]) for i in (1, 2)) <= 1e-6
    certified = [(e["step"], e["certified"]) for e in _events(tmp_path / "run", "certificate")
                 if e["attempt"] == 0]
    assert certified == [(1, True), (2, True), (3, False)]
    assert "no strict majority" in result.stdout
    lines = [x for x in result.stdout.splitlines() if "refused:" in x]
    assert len(lines) == 1 and "checkpoint step-2 refused: does not" in lines[0], lines

    stopped = _train(tmp_path / "off", 2, "--recover.tiers.max_relaunches", "0",
                     faults=[f"replica=1,step=3,{UPDATE_BITFLIP}"], ok=False)
    assert stopped.returncode != 0
    lines = [x for x in stopped.stderr.splitlines() if x.startswith("recover-hsdp: no relaunch")]
    assert len(lines) == 1 and "step 4: refusing to commit" in lines[0], stopped.stderr[-2000:]
    assert [s["step"] for s in read_jsonl(tmp_path / "off" / "metrics.jsonl")] == [1, 2, 3]
