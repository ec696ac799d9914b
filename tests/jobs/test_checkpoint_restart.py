"""TorchTitan DCP checkpoints on the MPI path: saved by one replica and agreed complete by all
([Note: a checkpoint the survivors agree on]); a job restarted from a checkpoint with fewer
replicas keeps the same B and, in exact mode, the same trajectory."""

import json
import shutil

import pytest

from conftest import DEBUG_CONFIG, read_jsonl, run_cli


def _train(out, replicas, ckpt, steps, *extra, faults=()):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas), "--out", str(out),
            *(a for f in faults for a in ("--fault", f)),
            "--", "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval",
            "4", "--checkpoint.folder", str(ckpt), "--recover.timeouts.hang_s", "10", *extra]
    result = run_cli(args, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return read_jsonl(out / "metrics.jsonl")


def _copy(ckpt, step, to):
    shutil.copytree(ckpt / f"step-{step}", to / f"step-{step}")
    return to


@pytest.mark.slow  # default suite time: tests/manager/test_checkpoint_agreement.py kills the saver in
# process; tests/cluster/test_relaunch.py restarts a real job from its checkpoint on fewer replicas
def test_saver_deaths_in_saves_then_restarts_with_fewer_replicas(tmp_path, local_corpus):
    """Real process: the saving replica SIGKILLed inside a mid-run DCP save (step 4, replica 0)
    and inside the last one (step 10, replica 1, the saver by then): the next saver writes each
    again before the run goes on or ends; summary.json counts the 2 replicas alive at the end.
    Then real restarts on fewer replicas from both: from step 4 (3 replicas, the same
    trajectory: exact mode) and from step 10 (2 replicas, it continues at step 11)."""
    ckpt = tmp_path / "ckpt"
    first = _train(tmp_path / "four", 4, ckpt, 10, "--checkpoint.no-last_save_model_only",
                   faults=["replica=0,step=4,phase=checkpoint",
                           "replica=1,step=10,phase=checkpoint"])  # the last save: full state
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-10", "step-4", "step-8"]
    assert all((p / ".metadata").is_file() for p in ckpt.iterdir())
    assert [s["alive_replicas"] for s in first] == [4] * 4 + [3] * 6
    summary = json.loads((tmp_path / "four" / "summary.json").read_text())
    assert summary["completed"] and summary["alive_replicas"] == 2 and summary["failures"] == 2
    saves = [e for e in read_jsonl(tmp_path / "four" / "events.jsonl")
             if e.get("phase") == "checkpoint"]
    assert [(e["step"], e["saved_by"], e["redone"], e["saved"]) for e in saves] == [
        (4, 1, True, True), (10, 2, True, True)]

    resumed = _train(tmp_path / "three", 3, _copy(ckpt, 4, tmp_path / "ckpt3"), 10,
                     "--checkpoint.load_step", "4")
    assert [s["step"] for s in resumed] == [5, 6, 7, 8, 9, 10]
    assert all(s["alive_replicas"] == 3 and s["reduced_microbatches"] == 4 for s in resumed)
    assert all(s["g"] == 2 for s in resumed)             # G raised: B = 4 over 3 replicas
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(resumed, first[4:])]
    assert max(diffs) <= 1e-3, diffs                     # exact mode: the same microbatches

    last = _train(tmp_path / "two", 2, _copy(ckpt, 10, tmp_path / "ckpt2"), 11,
                  "--checkpoint.load_step", "10")
    assert [(s["step"], s["alive_replicas"], s["reduced_microbatches"]) for s in last] == [
        (11, 2, 4)]
