"""[Note: a checkpoint the survivors agree on] in-process: the real ``ReplicaCheckpointer`` and
``RecoverManager`` over the fake world (tests/fakes.py), with a stand-in for TorchTitan's
``CheckpointManager`` that writes a DCP-like folder (one data file per rank, ``.metadata``
renamed in last). The saving replica is killed inside a save (before it writes, or after its
data file: a half-written folder); the next saver must write the step again before anyone goes
on or ends, and the summary must count the replicas alive at the end. The real job
(tests/jobs/test_checkpoint_restart.py) checks the same with TorchTitan's DCP and a restart."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import torch

from fakes import values_of
from recover_hsdp import certificates
from recover_hsdp.recovery import fingerprint
from recover_hsdp.titan.trainer import ReplicaCheckpointer
from test_manager import check_against_oracle, run_job


class StandInCheckpoints:
    """TorchTitan's ``CheckpointManager`` as ``ReplicaCheckpointer`` uses it. A save writes
    ``step-N/__<shard>_0.distcp`` (this rank's state: the sum of every update it applied), then
    ``.metadata`` (through a temporary file, as DCP does). ``die_after_data``: (replica, step)
    whose rank is killed between the two; ``fail``: (replica, step) whose save raises
    (storage) after its data file."""

    def __init__(self, folder: Path, work, interval: int, steps: int,
                 die_after_data=(), fail=()):
        self.folder, self.work, self.interval, self.steps = folder, work, interval, steps
        self.die_after_data, self.fail = set(die_after_data), set(fail)
        self.states = {"dataloader": types.SimpleNamespace(gathers_state=False)}
        self.last_save_model_only = False
        self.saved: list[int] = []

    def _should_save(self, step: int, last_step: bool = False) -> bool:
        return last_step or step % self.interval == 0

    def _create_checkpoint_id(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def save(self, step: int, last_step: bool = False) -> None:
        world = self.work.world
        path = Path(self._create_checkpoint_id(step))
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"replica": world.replica, "state": state_of(self.work)},
                   path / f"__{world.shard}_0.distcp")
        if (world.replica, step) in self.die_after_data:
            world.hub.kill(world.replica, world.shard)
        if (world.replica, step) in self.fail:
            raise OSError(28, "No space left on device")
        (path / ".metadata.tmp").write_text(json.dumps({"step": step}))
        os.rename(path / ".metadata.tmp", path / ".metadata")
        self.saved.append(step)


def state_of(work) -> list[torch.Tensor]:
    """A rank's "parameters": the sum of every gradient it applied (the same on every replica)."""
    return [sum(step[u] for step in work.applied) for u in range(len(work.applied[0]))]


def run_with_checkpoints(tmp_path, replicas, steps, interval, faults=(), **stand_in):
    folder = tmp_path / "ckpt"
    savers: dict = {}

    def after_step(manager, work, step):
        key = (work.world.replica, work.world.shard)
        if key not in savers:
            savers[key] = ReplicaCheckpointer(
                StandInCheckpoints(folder, work, interval, steps, **stand_in), manager)
        savers[key].save(step, last_step=step == steps)
        work.saved_state = {**getattr(work, "saved_state", {}), step: state_of(work)}

    hub, results = run_job(tmp_path, replicas=replicas, g=1, steps=steps, faults=faults,
                           after_step=after_step)
    return hub, results, folder, savers


def _complete(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if (p / ".metadata").is_file())


def _checkpoint_events(tmp_path):
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("phase") == "checkpoint"]


def _check_saved_state(folder: Path, step: int, works) -> int:
    saved = torch.load(folder / f"step-{step}" / "__0_0.distcp")
    for work in works.values():  # every survivor's state at that step == what was saved
        assert all(torch.equal(a, b) for a, b in zip(saved["state"], work.saved_state[step]))
    return saved["replica"]


def test_saver_killed_inside_the_last_save(tmp_path):
    """The writer's replica dies in the final save: replica 1 writes it again before the run
    ends; the summary counts 2 alive replicas, not 3."""
    hub, results, folder, _ = run_with_checkpoints(
        tmp_path, replicas=3, steps=4, interval=2, faults=["replica=0,step=4,phase=checkpoint"])
    works = values_of(results, killed=[(0, 0)])
    check_against_oracle(tmp_path, works, 3, 4, b=3)
    assert _complete(folder) == ["step-2", "step-4"]
    assert _check_saved_state(folder, 4, works) == 1       # written again by the next saver
    (event,) = _checkpoint_events(tmp_path)
    assert event["step"] == 4 and event["saved"] and event["redone"] and event["saved_by"] == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["alive_replicas"] == 2 and summary["writer"] == [1, 0]


def test_saver_killed_with_a_half_written_folder_mid_run(tmp_path):
    """Replica 0 dies after writing its data file of step 2's save, before ``.metadata``: the
    survivors do not go on to step 3 before replica 1 has written step 2 completely."""
    hub, results, folder, savers = run_with_checkpoints(
        tmp_path, replicas=3, steps=4, interval=2, die_after_data=[(0, 2)])
    works = values_of(results, killed=[(0, 0)])
    check_against_oracle(tmp_path, works, 3, 4, b=3)
    assert _complete(folder) == ["step-2", "step-4"]
    assert _check_saved_state(folder, 2, works) == 1
    assert savers[(1, 0)]._inner.saved == [2, 4] and savers[(2, 0)]._inner.saved == []
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["alive_replicas"] for m in metrics] == [3, 3, 2, 2]  # step 3 planned without it
    (event,) = _checkpoint_events(tmp_path)
    assert event["step"] == 2 and event["redone"] and event["saved_by"] == 1


def test_a_non_saver_dying_during_the_save_needs_no_second_save(tmp_path):
    """Replica 2 dies while replica 0 saves: the saver is alive, so it had saved before it
    agreed; nobody saves again."""
    hub, results, folder, savers = run_with_checkpoints(
        tmp_path, replicas=3, steps=4, interval=2, faults=["replica=2,step=3,phase=optimizer"])
    works = values_of(results, killed=[(2, 0)])
    check_against_oracle(tmp_path, works, 3, 4, b=3)
    assert savers[(0, 0)]._inner.saved == [2, 4] and savers[(1, 0)]._inner.saved == []
    assert _checkpoint_events(tmp_path) == []
    assert json.loads((tmp_path / "summary.json").read_text())["alive_replicas"] == 2


def test_a_save_that_fails_without_a_death_is_agreed_not_saved(tmp_path):
    """The storage refuses step 2's save: every rank agrees it was not saved, an event says
    why, the run goes on; an older ``.metadata`` of that step (an earlier run's) is gone, so
    the half-written folder is not taken as a checkpoint."""
    stale = tmp_path / "ckpt" / "step-2"
    stale.mkdir(parents=True)
    (stale / ".metadata").write_text("an earlier run's save of step 2")
    hub, results, folder, savers = run_with_checkpoints(
        tmp_path, replicas=2, steps=4, interval=2, fail=[(0, 2)])
    works = values_of(results)
    check_against_oracle(tmp_path, works, 2, 4, b=2)
    assert _complete(folder) == ["step-4"]
    (event,) = _checkpoint_events(tmp_path)
    assert event["step"] == 2 and not event["saved"] and not event["redone"]
    assert "No space left on device" in event["errors"][0]
    assert json.loads((tmp_path / "summary.json").read_text())["alive_replicas"] == 2


# ---------------------------------------------------------------- [Note: certified checkpoints]


def _certified(folder: Path, steps, fingerprint_of, tmp_path, replicas=3, faults=(),
               last_save_model_only=False):
    """A run whose saves are certified: ``fingerprint_of(work, step)`` is a rank's state
    fingerprint at the save of ``step``."""
    savers: dict = {}

    def after_step(manager, work, step):
        key = (work.world.replica, work.world.shard)
        if key not in savers:
            inner = StandInCheckpoints(folder, work, 2, steps)
            inner.last_save_model_only = last_save_model_only
            savers[key] = ReplicaCheckpointer(
                inner, manager, state_fingerprint=lambda: fingerprint_of(work, work.step))
        savers[key].save(step, last_step=step == steps)

    return run_job(tmp_path, replicas=replicas, g=1, steps=steps, faults=faults,
                   after_step=after_step)


def _state_fingerprint(work, step):
    return fingerprint(state_of(work))


def test_every_agreed_save_is_certified_with_the_replicas_state(tmp_path):
    """3 replicas, saves at 2 and 4 (the last model-only): each folder gets a certificate with
    the fingerprint every replica holds; only step-2 is a restart point."""
    folder = tmp_path / "ckpt"
    hub, results = _certified(folder, 4, _state_fingerprint, tmp_path,
                              last_save_model_only=True)
    works = values_of(results)
    check_against_oracle(tmp_path, works, 3, 4, b=3)
    for step in (2, 4):
        certificate = certificates.read(folder / f"step-{step}")
        assert certificate.step == step and len(set(certificate.replicas.values())) == 1
        assert certificate.state_fingerprint == certificate.replicas["0"]
    assert certificates.restart_points(folder) == [2]
    assert certificates.why_not_restart_point(folder / "step-4").startswith("model-only")


def test_a_saver_outside_the_majority_is_not_certified_and_leaves(tmp_path):
    """At step 4's save replica 0 (the saver) holds other state bits than replicas 1 and 2:
    step-4 gets no certificate (the folder holds the minority's state) and replica 0 leaves;
    the others finish with B."""
    folder = tmp_path / "ckpt"

    def fingerprint_of(work, step):
        return _state_fingerprint(work, step) + (1 if (work.world.replica, step) == (0, 4) else 0)

    hub, results = _certified(folder, 4, fingerprint_of, tmp_path)
    works = values_of(results, killed=[(0, 0)])
    assert certificates.restart_points(folder) == [2]
    assert certificates.read(folder / "step-4") is None
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    (refused,) = [e for e in events if e.get("phase") == "certificate" and not e["certified"]]
    assert refused["step"] == 4 and refused["diverged"] == [0]
    assert sorted(works) == [(1, 0), (2, 0)]


def test_a_load_is_verified_by_every_replica_with_one_verdict(tmp_path):
    """After step 2 every rank reports what it "loaded": all of step-2's certified state
    verifies; one replica one bit off refuses it on every rank with the same line; a rank whose
    load raised refuses it on every rank too."""
    folder = tmp_path / "ckpt"
    verdicts: dict = {}

    def after_step(manager, work, step):
        key = (work.world.replica, work.world.shard)
        mine = _state_fingerprint(work, step)
        if step == 1 and key == (0, 0):  # the writer, before step 2's collectives
            (folder / "step-1").mkdir(parents=True)
            certificates.write(folder / "step-1", certificates.Certificate(
                step=1, restart_point=True, state_fingerprint=f"{mine:016x}"))
        if step == 2:
            folder_1 = folder / "step-1"
            state = fingerprint(manager_state[key])
            verdicts[key] = [
                manager.verify_checkpoint(1, folder_1, state),
                manager.verify_checkpoint(1, folder_1, state ^ (key == (1, 0))),
                manager.verify_checkpoint(1, folder_1, None if key == (2, 0) else state,
                                          "RuntimeError: bad zip" if key == (2, 0) else "")]
        manager_state[key] = state_of(work)

    manager_state: dict = {}
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=2, after_step=after_step)
    values_of(results)
    assert len({tuple(v) for v in verdicts.values()}) == 1  # one verdict everywhere
    ok, one_off, raised = verdicts[(0, 0)]
    assert ok is None
    assert one_off.startswith("does not verify (replica 1 loaded state fingerprint")
    assert raised == "does not load (replica 2: RuntimeError: bad zip)"
