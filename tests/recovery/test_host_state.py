"""[Note: host-memory state] (recovery/host_state.py): the files, the generations a rank keeps,
what a listing says, and a snapshot that round-trips a model's and an optimizer's state bit for
bit. In process, no MPI (the relaunch from it: tests/cluster/test_relaunch.py)."""

from __future__ import annotations

import os
import threading

import torch

from recover_hsdp.host_files import host_dir, job_key, job_root, newest_complete, parse_listing
from recover_hsdp.recovery.host_state import (KEEP, HostStateStore, Snapshotter, checksum,
                                              read_payload)


def _payload(step, tensors):
    return {"step": step, "tensors": tensors, "meta": {}, "checksum": checksum(tensors)}


def test_job_key_is_the_same_for_the_same_folder(tmp_path):
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "out", tmp_path / "link")
    assert job_key(tmp_path / "out") == job_key(tmp_path / "link") == job_key(f"{tmp_path}/out/")
    assert job_key(tmp_path / "out") != job_key(tmp_path / "other")
    assert job_key(tmp_path / "out").startswith("out-")
    root = job_root("/dev/shm/x", tmp_path / "out")
    assert host_dir(root, "n1") == root / "n1"


def test_newest_complete_needs_every_shard_position_on_some_host():
    host_a = parse_listing(["/r/a/gen-000000004/r0-s0.pt", "/r/a/gen-000000004/r0-s1.pt",
                            "/r/a/gen-000000006/r0-s0.pt", "/r/a/gen-000000006/.r0-s1.pt.9.tmp"])
    host_b = parse_listing(["/r/b/gen-000000006/r1-s1.pt", "/r/b/gen-000000008/r1-s1.pt"])
    assert host_a == {4: {0, 1}, 6: {0}}                        # a temporary file is not one
    assert newest_complete([host_a, host_b], shards=2) == 6      # 6: s0 on a, s1 on b
    assert newest_complete([host_a], shards=2) == 4
    assert newest_complete([host_b], shards=2) is None
    assert newest_complete([], shards=1) is None


def test_a_rank_keeps_its_last_two_generations(tmp_path):
    store = HostStateStore(tmp_path / "host", replica=1, shard=0)
    other = HostStateStore(tmp_path / "host", replica=0, shard=0)
    other.write(2, _payload(2, [torch.ones(3)]))
    for step in (2, 4, 6, 8):
        store.write(step, _payload(step, [torch.full((3,), float(step))]))
    assert store.own_steps() == [8, 6] and KEEP == 2
    assert other.own_steps() == [2]                # another rank's files are its own business
    assert not list(tmp_path.rglob("*.tmp"))
    assert store.find(8) == store.path(8)
    assert store.find(2) == other.path(2)          # the same shard position, another replica
    assert HostStateStore(tmp_path / "host", replica=1, shard=1).find(8) is None
    store.remove_own()
    assert store.own_steps() == [] and not (tmp_path / "host" / "gen-000000008").exists()


def test_a_write_that_dies_leaves_the_older_generation(tmp_path, monkeypatch):
    """The file is written under a temporary name and renamed: a write that raises midway
    leaves no file of that step and the older generation intact."""
    store = HostStateStore(tmp_path, replica=0, shard=0)
    store.write(2, _payload(2, [torch.ones(4)]))

    def torn(obj, path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError("no space left on device")

    monkeypatch.setattr(torch, "save", torn)
    snapshotter = Snapshotter(store)
    assert snapshotter.submit(4, [torch.ones(4)], {}, wait=True).startswith(
        "host-state write of step 4: OSError")
    assert store.own_steps() == [2] and store.find(4) is None
    assert not list(tmp_path.rglob("*.tmp"))
    payload, why = read_payload(store.find(2))
    assert why is None and payload["step"] == 2


def test_a_changed_byte_is_refused(tmp_path):
    store = HostStateStore(tmp_path, replica=0, shard=0)
    path = store.write(2, _payload(2, [torch.arange(64, dtype=torch.float32)]))
    data = bytearray(path.read_bytes())
    payload, why = read_payload(bytes(data))
    assert why is None and torch.equal(payload["tensors"][0], torch.arange(64.0))
    index = bytes(data).rfind(torch.arange(64, dtype=torch.float32).numpy().tobytes()[8:16])
    assert index > 0
    data[index] ^= 0x10                                          # one bit of the tensor bytes
    payload, why = read_payload(bytes(data))
    assert payload is None and "checksum mismatch" in why
    assert read_payload(b"not a file")[1].startswith("unreadable")


def test_a_snapshot_round_trips_model_and_optimizer_state(tmp_path):
    """Copied at submit (later in-place updates do not reach the file), written by the thread,
    and read back equal bit for bit: the state a relaunched rank loads."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()

    def state():
        tensors = [p.detach() for p in model.parameters()]
        for p in model.parameters():
            tensors += [v for _, v in sorted(optimizer.state[p].items())]
        return tensors

    expected = [t.clone() for t in state()]
    store = HostStateStore(tmp_path, replica=0, shard=0)
    snapshotter = Snapshotter(store)
    assert snapshotter.submit(3, state(), {"lr": 0.01}) is None
    with torch.no_grad():
        for t in state():
            t.add_(1.0)                                           # the next step trains on
    assert snapshotter.wait() is None and snapshotter.last_written == 3
    payload, why = read_payload(store.find(3))
    assert why is None and payload["meta"] == {"lr": 0.01} and payload["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(payload["tensors"], expected))


def test_the_write_runs_beside_the_caller(tmp_path, monkeypatch):
    """submit returns while the file is still being written (off the critical path); the next
    submit waits for it (one write in flight)."""
    store = HostStateStore(tmp_path, replica=0, shard=0)
    release, started = threading.Event(), threading.Event()
    real_write = store.write

    def slow_write(step, payload):
        started.set()
        release.wait(10)
        return real_write(step, payload)

    monkeypatch.setattr(store, "write", slow_write)
    snapshotter = Snapshotter(store)
    snapshotter.submit(2, [torch.ones(2)], {})
    assert started.wait(10) and store.own_steps() == []          # still writing
    threading.Timer(0.3, release.set).start()
    snapshotter.submit(4, [torch.ones(2)], {})                    # waits for step 2's
    assert 2 in store.own_steps()
    assert snapshotter.wait() is None and store.own_steps() == [4, 2]
    # what it cost, as measured: the wait for step 2's write is on the caller's path, the
    # write itself is not (counted as background time)
    assert snapshotter.waited_s > 0 and snapshotter.written_s >= snapshotter.waited_s
    assert snapshotter.bytes == 2 * 4
