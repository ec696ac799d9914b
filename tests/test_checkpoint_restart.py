"""TorchTitan DCP checkpoints on the MPI path: saved by one replica; a job restarted from a
checkpoint with fewer replicas keeps the same B and, in exact mode, the same trajectory."""

from conftest import DEBUG_CONFIG, read_jsonl, run_cli


def _train(out, replicas, ckpt, *extra):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas), "--out", str(out),
            "--", "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4",
            "--checkpoint.folder", str(ckpt), "--recover.hang_timeout_s", "10", *extra]
    result = run_cli(args, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return read_jsonl(out / "metrics.jsonl")


def test_restart_with_fewer_replicas_keeps_b_and_trajectory(tmp_path, local_corpus):
    """Real process: TorchTitan's DCP save by one replica, then a real restart on fewer replicas."""
    ckpt = tmp_path / "ckpt"
    first = _train(tmp_path / "four", 4, ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-4", "step-8"]
    resumed = _train(tmp_path / "three", 3, ckpt, "--checkpoint.load_step", "4")
    assert [s["step"] for s in resumed] == [5, 6, 7, 8]
    assert all(s["alive_replicas"] == 3 and s["reduced_microbatches"] == 4 for s in resumed)
    assert all(s["g"] == 2 for s in resumed)             # G raised: B = 4 over 3 replicas
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(resumed, first[4:])]
    assert max(diffs) <= 1e-3, diffs                     # exact mode: the same microbatches
