"""Real jobs on Hugging Face datasets (a local C4-format copy built here, no network).

* stream mode on ``c4`` (a streaming ``IterableDataset``), 4 x 1, B = 4: replica 1 SIGKILLed
  at step 2, a checkpoint at step 3, replica 2 SIGKILLed at step 4; then a restart from the
  step-3 checkpoint on 3 replicas. Every rank logs the sequences it committed; the audit checks
  them against windows recomputed on one process (TorchTitan's own tokenise-and-pack per
  data-parallel part): no (part, position) twice across both runs, no hole, and a dead slot's
  committed data ends exactly at the cursor ``events.jsonl`` declares unread;
* exact mode on ``c4_test`` (the same files as a map-style Arrow dataset), same kills: step t
  commits exactly global microbatches t*B .. t*B+B-1, each sequence's tokens checked;
* 2 x 2, G = 2, one rank (not the whole replica) SIGKILLed, both modes.
"""

from collections import Counter
from pathlib import Path

import pytest

from c4_local import audit_stream_samples, make_local_c4
from conftest import DEBUG_CONFIG, read_jsonl, run_cli
from recover_hsdp.workload.ledger import ledger_records

SEQ, LBS = 64, 2


@pytest.fixture(scope="module")
def c4(tmp_path_factory, local_corpus) -> Path:
    return make_local_c4(tmp_path_factory.mktemp("c4data"))


def _train(out, c4, dataset, mode, replicas, ranks, steps, faults=(), extra=(), g=1):
    args = ["train", "--config", str(DEBUG_CONFIG), "--replicas", str(replicas),
            "--ranks-per-replica", str(ranks), "--out", str(out)]
    for fault in faults:
        args += ["--fault", fault]
    args += ["--", "--training.dataset", dataset, "--training.dataset_path", str(c4),
             "--training.seq_len", str(SEQ), "--training.global_batch_size",
             str(g * replicas * ranks * LBS), "--recover.workload.data_assignment", mode,
             "--recover.debug.log_samples", "--recover.timeouts.hang_s", "10",
             "--training.steps", str(steps), *extra]
    result = run_cli(args, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "events.jsonl")


def _committed_per_step(out, shards):
    """Microbatches committed per step, counted from the ranks' own sample logs."""
    count = Counter()
    for log in (out / "samples").glob("rank*.jsonl"):
        for line in read_jsonl(log):
            count[line["step"]] += 1
    return {step: n / shards for step, n in sorted(count.items())}


# B = 4: after the first kill G = 2, replicas 0 and 2 are majors and 3 a spare (stream mode: it
# computes its next positions without drawing them); the second kill takes a major, the spare
# is promoted (stream) or the lost ids become extras (exact: the spare shadows replica 0)
KILLS = ["replica=1,step=2,phase=grad_sync", "replica=2,step=4,phase=backward"]


@pytest.mark.slow  # default suite time (CI runs it): tests/titan/test_sources proves the streams
def test_stream_c4_4x1_kills_then_restart_on_3_continues_the_streams(tmp_path, c4):
    """Real process: streaming `datasets` readers in real ranks, their DCP loader state, a real
    restart."""
    ckpt = tmp_path / "ckpt"
    steps, events = _train(tmp_path / "run", c4, "c4", "stream", 4, 1, 6, KILLS, [
        "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.folder", str(ckpt)])
    b = 4
    assert [s["reduced_microbatches"] for s in steps] == [b] * 6
    assert [s["roles"]["spare"] for s in steps] == [0, 0, 1, 1, 0, 0]
    assert _committed_per_step(tmp_path / "run", 1) == {t: b for t in range(1, 7)}
    repairs = [e for e in events if "dead_replicas" in e]  # not the saves' certificates
    assert [e["dead_replicas"] for e in repairs] == [[1], [2]] and repairs[1]["promoted"] == [3]
    unread = {int(s): c for e in repairs for s, c in e["unread_streams"].items()}
    counts = audit_stream_samples([(tmp_path / "run", None)], "c4", c4, SEQ, LBS)
    assert counts[1] == unread[1] and counts[2] == unread[2]   # dead slots stop at the cursor
    ledger = ledger_records(tmp_path / "run")
    last = ledger[-1]["replicas"]
    for replica in ("0", "3"):                                  # survivors: up to their cursor
        entry = last[replica]
        assert counts[entry["slot"]] == entry["stream_start"] + len(entry["committed"])

    # restart from the step-3 checkpoint (alive 0, 2, 3; slot 1 unread) on 3 replicas
    steps, events = _train(tmp_path / "again", c4, "c4", "stream", 3, 1, 6, (), [
        "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.folder", str(ckpt),
        "--checkpoint.load_step", "3"])
    assert [s["step"] for s in steps] == [4, 5, 6]
    assert all(s["reduced_microbatches"] == b and s["alive_replicas"] == 3 for s in steps)
    assert all(s["roles"]["spare"] == 1 for s in steps)
    restart = [e for e in events if e.get("phase") == "restart"][0]
    assert restart["slots"] == {"0": 0, "1": 2, "2": 3} and list(restart["unread_streams"]) == ["1"]
    audit_stream_samples([(tmp_path / "run", 3), (tmp_path / "again", None)], "c4", c4, SEQ, LBS)


def _audit_exact(out, c4, shards, b):
    """Exact mode: each step commits global microbatches t*B..t*B+B-1 once; tokens checked."""
    import numpy as np
    import torch
    import zlib

    from recover_hsdp.titan.data import PackedSequences, microbatch_sequence_ids

    packed = list((out / "data_cache").glob("c4_test-*.npy"))
    assert len(packed) == 1
    sequences = PackedSequences(np.load(packed[0]), SEQ)
    per_step: dict[int, Counter] = {}
    for log in (out / "samples").glob("rank*.jsonl"):
        for line in read_jsonl(log):
            mb = line["ref"][1]
            per_step.setdefault(line["step"], Counter())[mb] += 1
            for seq_id, crc in zip(line["sequences"], line["crc32"]):
                tokens = sequences[seq_id][0].to(torch.int64).numpy().tobytes()
                assert zlib.crc32(tokens) == crc
            assert any(line["sequences"] == list(microbatch_sequence_ids(mb, s, shards, LBS))
                       for s in range(shards))
    for step, ids in per_step.items():
        t = step - 1
        assert sorted(ids) == list(range(t * b, t * b + b)), step
        assert set(ids.values()) == {shards}                   # every rank of one replica


@pytest.mark.soak  # exact mode through deaths: test_end_to_end
def test_exact_c4_map_style_4x1_two_replicas_killed(tmp_path, c4):
    """Real process: a map-style `datasets` dataset read by real ranks through two real deaths."""
    steps, events = _train(tmp_path, c4, "c4_test", "exact", 4, 1, 5, KILLS)
    assert [s["reduced_microbatches"] for s in steps] == [4] * 5
    assert [e["dead_replicas"] for e in events] == [[1], [2]]
    _audit_exact(tmp_path, c4, 1, 4)


@pytest.mark.soak  # CI time: test_recovery_oracle's 2 x 2 kill + the 4 x 1 streams above
@pytest.mark.parametrize("mode,dataset", [("stream", "c4"), ("exact", "c4_test")])
def test_2x2_one_rank_killed(tmp_path, c4, mode, dataset):
    """Real process: a rank of a 2-rank replica SIGKILLed while real ranks read their stream parts."""
    steps, events = _train(tmp_path, c4, dataset, mode, 2, 2, 4,
                           ["replica=1,step=2,phase=grad_sync,rank=1"], g=2)
    assert [s["reduced_microbatches"] for s in steps] == [4] * 4
    assert [s["alive_replicas"] for s in steps] == [2, 1, 1, 1]
    assert _committed_per_step(tmp_path, 2) == {t: 4 for t in range(1, 5)}
    if mode == "stream":
        counts = audit_stream_samples([(tmp_path, None)], dataset, c4, SEQ, LBS)
        assert counts[2] == counts[3] == events[0]["unread_streams"]["1"]  # slot 1: parts 2, 3
    else:
        _audit_exact(tmp_path, c4, 2, 4)
