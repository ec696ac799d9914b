"""The step protocol (``RecoverManager``) in-process: R replicas x S ranks on threads over the fake
world (tests/fakes.py), a real ``BucketSync``, a real ``WorkloadPolicy``, a real ledger, and the real
fault specs (``FaultInjector`` whose "death" is the fake's kill). The model is a stand-in whose
gradient for dataset microbatch ``d`` in unit ``u`` on shard ``s`` is the integer vector
``grad_of(d, u, s)``, so every committed gradient is checked EXACTLY against an oracle: the sum of
``grad_of`` over the data ids the ledger says were committed.

What a job adds on top (processes, MPI, FSDP, TorchTitan) is covered by the real-kill tests.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from fakes import FakeHub, FakeUnit, HubBroken, run_ranks, values_of
from recover_hsdp.faults import FaultInjector, FaultSpec, Mode
from recover_hsdp.manager import RecoverManager, heap
from recover_hsdp.manager import manager as manager_module
from recover_hsdp.outputs import RunMetrics
from recover_hsdp.recovery import BucketSync
from recover_hsdp.workload import WorkloadPolicy
from recover_hsdp.workload.ledger import ledger_records, read_ledger

UNITS, WIDTH, TOKENS = 3, 4, 8


def data_number(data, initial_replicas: int) -> int:
    """One integer per microbatch of data: a global id, or slot s's position p -> p * W + s."""
    return data.index if data.stream is None else data.index * initial_replicas + data.stream


def grad_of(data_id: int, unit: int, shard: int) -> torch.Tensor:
    """The stand-in model's gradient of one microbatch (small integers: sums are exact)."""
    base = torch.arange(WIDTH, dtype=torch.float32)
    return (data_id + 1) * (unit + 1) + 10 * shard + base


class FakeFaults(FaultInjector):
    """The real fault specs and matching; firing kills the rank in the fake world."""

    def __init__(self, specs, hub: FakeHub, replica: int, shard: int, out_dir, schedule=()):
        super().__init__([FaultSpec.parse(s) for s in specs], replica, shard, out_dir, schedule)
        self.hub = hub

    def _fire(self, spec) -> None:
        if spec.mode is Mode.RAISE:
            super()._fire(spec)  # the real RuntimeError
        self.hub.kill(self.replica, self.shard)


class Deferred:
    """A value still "on the device": reading it alone (``float``, ``int``, a comparison) is
    the host sync per microbatch the manager must not make; only ``measures`` reads it."""

    def __init__(self, value):
        self.value = value

    def _read_alone(self, *args):
        raise AssertionError("a microbatch's measure read on its own (a host sync per "
                             "microbatch): read them once per step with StepWork.measures")

    __float__ = __int__ = __index__ = __bool__ = __lt__ = __gt__ = __eq__ = _read_alone
    __add__ = __radd__ = __mul__ = __truediv__ = _read_alone
    __hash__ = None


class StandInWork:
    """``StepWork`` of one rank: FSDP-like accumulation with sync on the last microbatch."""

    def __init__(self, world, units: list[FakeUnit], errors: dict[int, str] | None = None,
                 update_errors: dict[int, str] | None = None, transient: set[int] = frozenset()):
        self.world, self.shard, self.units = world, world.shard, units
        self.sync = True
        self.acc = [torch.zeros(WIDTH) for _ in units]
        self.grads: list[torch.Tensor | None] = [None] * len(units)
        self.applied: list[list[torch.Tensor]] = []
        self.errors = errors or {}
        self.update_errors = update_errors or {}
        self.transient = set(transient)
        self.step = 0
        self.initial_replicas = 1

    def set_gradient_sync(self, enabled: bool) -> None:
        self.sync = enabled

    def forward_backward(self, data, nominal_tokens, before_backward, grad_factor=1.0):
        data_id = data_number(data, self.initial_replicas)
        if self.step in self.errors:
            raise RuntimeError(self.errors.pop(self.step))
        if self.step in self.transient:  # an MPI-level failure in which nobody dies
            self.transient.discard(self.step)
            self.world.fail_epoch("transient failure (test)")
        before_backward()
        for unit in range(len(self.units)):
            self.acc[unit] += grad_of(data_id, unit, self.shard) * grad_factor
            self.bucket_sync.count_backward(unit)  # what the real units' gradient hooks do
        if self.sync:  # FSDP: hooks in reverse unit order; .grad is a view of the first bucket
            for unit in reversed(range(len(self.units))):
                bucket, self.acc[unit] = self.acc[unit], torch.zeros(WIDTH)
                self.units[unit].sync(bucket)
                if self.grads[unit] is None:
                    self.grads[unit] = bucket
                else:
                    self.grads[unit] += bucket
        return Deferred(float(data_id)), Deferred(TOKENS), TOKENS

    def measures(self, measured):
        """As the trainer: what ``forward_backward`` returned, read once per step (a
        ``Deferred`` read earlier, one by one, fails the test)."""
        return [(loss.value, tokens.value, positions) for loss, tokens, positions in measured]

    def apply_update(self, grad_scale: float) -> float:
        if self.step in self.update_errors:
            raise RuntimeError(self.update_errors.pop(self.step))
        self.applied.append([g.clone() * grad_scale for g in self.grads])
        self.grads = [None] * len(self.units)
        return 0.0


def run_job(tmp_path, replicas, g, steps, faults=(), shards=1, mode="exact", keep_spares=True,
            errors=None, update_errors=None, transient=None, work_class=None, policy_kwargs=None,
            manager_kwargs=None, after_step=None, schedule=(), units_of_shard=None):
    """Run ``steps`` steps on every rank; returns (hub, {(r, s): StandInWork or exception}).
    ``work_class`` (default ``StandInWork``), ``policy_kwargs`` and ``manager_kwargs`` (a dict,
    or a function of the rank's work returning one) extend the rank's parts
    (tests/manager/test_culprits.py); ``after_step(manager, work, step)`` runs between steps,
    where the trainer saves checkpoints (tests/manager/test_checkpoint_agreement.py);
    ``schedule``: ``ScheduledFault``s of ``[recover.faults] every`` (recover_hsdp/faults.py);
    ``units_of_shard(shard)``: FSDP units of a shard position (default ``UNITS``; pipeline
    stages have different ones)."""
    hub = FakeHub(replicas, shards)
    errors, update_errors, transient = errors or {}, update_errors or {}, transient or {}

    def rank(world):
        count = units_of_shard(world.shard) if units_of_shard else UNITS
        units = [FakeUnit(f"u{i}") for i in range(count)]
        sync = BucketSync(units, world)
        policy = WorkloadPolicy(initial_replicas=replicas, microbatches_per_replica=g,
                                keep_spares=keep_spares, data_assignment=mode,
                                **(policy_kwargs or {}))
        outputs = RunMetrics(tmp_path, is_writer=world.world_rank == 0, mode="recover")
        key = (world.replica, world.shard)
        work = (work_class or StandInWork)(world, units, errors.get(key), update_errors.get(key),
                           transient.get(key, set()))
        work.initial_replicas, work.bucket_sync = replicas, sync
        extra = manager_kwargs(work) if callable(manager_kwargs) else manager_kwargs or {}
        manager = RecoverManager(
            world=world, bucket_sync=sync, policy=policy,
            faults=FakeFaults(faults, hub, world.replica, world.shard, tmp_path, schedule),
            outputs=outputs, out_dir=tmp_path, tokens_per_microbatch=TOKENS * shards,
            die=lambda: hub.kill(world.replica, world.shard), **extra)
        for step in range(1, steps + 1):
            work.step = step
            record = manager.step(step, work)
            outputs.log_step({**record, "step_time_s": 0.0})  # what the trainer adds, then logs
            if after_step is not None:
                after_step(manager, work, step)
        manager.finish_run(lambda: outputs.write_summary(
            {"writer": list(key), "alive_replicas": len(world.alive_replicas)}))
        return work

    return hub, run_ranks(hub, rank)


def oracle(entry, shard: int, initial_replicas: int) -> list[torch.Tensor]:
    """The step's gradient recomputed from the ledger's committed microbatch ids."""
    total = [torch.zeros(WIDTH) for _ in range(UNITS)]
    for replica, ids in entry.committed.items():
        for mb in ids:
            data_id = mb if entry.mode == "exact" else mb * initial_replicas + entry.slots[replica]
            for unit in range(UNITS):
                total[unit] += grad_of(data_id, unit, shard)
    return total


def check_against_oracle(tmp_path, works, replicas, steps, b):
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [e.step for e in ledger] == list(range(steps))  # policy steps are 0-based
    for entry in ledger:
        assert entry.committed_total == b
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["reduced_microbatches"] for m in metrics] == [b] * steps   # measured, not planned
    for (replica, shard), work in works.items():
        assert len(work.applied) == steps
        for entry, applied in zip(ledger, work.applied):
            expected = oracle(entry, shard, replicas)
            for unit in range(UNITS):
                assert torch.equal(applied[unit], expected[unit]), (replica, entry.step, unit)
    return ledger


@pytest.mark.parametrize("bucket", [0, 1, UNITS - 1, UNITS])
def test_contributing_victim_after_k_of_n_buckets(tmp_path, bucket):
    """4x1, G=1: replica 1 dies after ``bucket`` of the step's buckets were reduced; replica 2
    dies in backward two steps later. Every survivor applies exactly the oracle's gradient."""
    faults = [f"replica=1,step=2,phase=grad_sync,bucket={bucket}",
              "replica=2,step=4,phase=backward"]
    hub, results = run_job(tmp_path, replicas=4, g=1, steps=5, faults=faults)
    works = values_of(results, killed=[(1, 0), (2, 0)])
    assert sorted(works) == [(0, 0), (3, 0)]
    ledger = check_against_oracle(tmp_path, works, 4, 5, b=4)
    assert [len(e.alive) for e in ledger] == [4, 3, 3, 2, 2]
    assert hub.epoch == 2


def test_spare_promoted_in_exact_mode_needs_no_extra_compute(tmp_path):
    """4 replicas, B = 4: after one loss G = 2 and one replica is a spare shadowing a
    contributor; when that contributor dies the spare is promoted and covers its ids."""
    hub, results = run_job(tmp_path, replicas=4, g=1, steps=4,
                           faults=["replica=3,step=1,phase=backward",
                                   "replica=0,step=3,phase=grad_sync,bucket=1"])
    works = values_of(results, killed=[(3, 0), (0, 0)])
    ledger = check_against_oracle(tmp_path, works, 4, 4, b=4)
    step3 = ledger_records(tmp_path)[2]
    assert [r for r, w in step3["replicas"].items() if w["promoted"]], step3
    assert not any(ledger[2].extra.values())


@pytest.mark.parametrize("mode", ["exact", "stream"])
def test_second_death_during_rereduce(tmp_path, mode):
    """A survivor dies while the buckets of the first failure are reduced again."""
    faults = ["replica=1,step=2,phase=grad_sync,bucket=1",
              "replica=2,step=2,phase=rereduce,bucket=1"]
    hub, results = run_job(tmp_path, replicas=4, g=2, steps=3, faults=faults, mode=mode)
    works = values_of(results, killed=[(1, 0), (2, 0)])
    check_against_oracle(tmp_path, works, 4, 3, b=8)
    assert hub.epoch == 2


def test_a_recovery_that_drops_one_microbatch_gradient_is_refused(tmp_path, monkeypatch):
    """A deliberately broken recovery layer: the hook drops the first extra microbatch's
    gradient it is handed. The measured count ([Note: measured microbatches]) is B - 1 in the
    failure step, so no survivor commits it: the step is refused with one line, the ledger and
    the applied updates stop before it."""
    dropped = []

    def drop_first_extra(self, unit, tensor):
        if not dropped:
            dropped.append(unit)
            self._pending[unit] -= 1          # the gradient never reaches the bucket
        return original(self, unit, tensor)

    original = BucketSync._collect_extra
    monkeypatch.setattr(BucketSync, "_collect_extra", drop_first_extra)
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=3,
                           faults=["replica=1,step=2,phase=grad_sync,bucket=1"])
    refusal = ("refusing to commit: the buckets summed 2 microbatch gradients over 24 token "
               "positions (buckets disagree on 1 ranks), the plan commits B = 3")
    survivors = [v for k, v in results.items() if k != (1, 0)]
    # each survivor raises it (in the fake world the first to raise releases the other)
    assert all(isinstance(v, (RuntimeError, HubBroken)) and refusal in str(v)
               for v in survivors), survivors
    assert [e.step for e in read_ledger(tmp_path / "ledger.jsonl")] == [0]


def test_one_rank_of_a_replica_dies_and_the_replica_leaves_as_a_unit(tmp_path):
    """2 ranks per replica: shard 1 of replica 1 dies; shard 0 of it retires at the consensus."""
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=3, shards=2,
                           faults=["replica=1,step=2,phase=grad_sync,bucket=2,rank=1"])
    works = values_of(results, killed=[(1, 1)], retired=[(1, 0)])
    check_against_oracle(tmp_path, works, 3, 3, b=3)


def test_writer_dies_and_the_next_one_writes_everything(tmp_path):
    """Rank 0 (the writer) dies after step 2's commit: the ledger and metrics stay complete."""
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=4,
                           faults=["replica=0,step=3,phase=forward"])
    works = values_of(results, killed=[(0, 0)])
    check_against_oracle(tmp_path, works, 3, 4, b=3)
    events = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(events) == 1 and '"dead_replicas": [0]' in events[0]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]


def test_clean_run_matches_the_failure_free_sum(tmp_path):
    hub, results = run_job(tmp_path, replicas=2, g=3, steps=3)
    works = values_of(results)
    check_against_oracle(tmp_path, works, 2, 3, b=6)
    assert hub.epoch == 0
    assert all(np.isfinite(w.applied[-1][0].numpy()).all() for w in works.values())


def _events(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def test_error_inside_a_replica_makes_it_leave_and_the_others_continue(tmp_path):
    """An exception in replica 1's forward at step 2 (what an OOM raises): replica 1 leaves (its
    rank ends, [Note: replica-local errors]) with the error text in events.jsonl, the survivors
    commit B every step."""
    hub, results = run_job(tmp_path, replicas=3, g=2, steps=4,
                           errors={(1, 0): {2: "CUDA out of memory (test)"}})
    works = values_of(results, killed=[(1, 0)])
    check_against_oracle(tmp_path, works, 3, 4, b=6)
    (event,) = _events(tmp_path)
    assert event["dead_replicas"] == [1] and event["step"] == 2
    assert "RuntimeError: CUDA out of memory (test)" in event["errors"]["1"][0]


def test_error_in_one_rank_takes_its_whole_replica_out(tmp_path):
    """S = 2: shard 1 of replica 1 raises; its peer (no error of its own) retires with it."""
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=3, shards=2,
                           errors={(1, 1): {2: "boom"}})
    works = values_of(results, killed=[(1, 1)], retired=[(1, 0)])
    check_against_oracle(tmp_path, works, 3, 3, b=3)
    assert _events(tmp_path)[0]["errors"] == {"1": ["rank 3 step 2: RuntimeError: boom"]}


def test_injected_raise_inside_the_all_reduce_hook(tmp_path):
    """``mode=raise`` at grad_sync after 1 bucket: the hook never raises, the replica leaves."""
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=3,
                           faults=["replica=2,step=2,phase=grad_sync,bucket=1,mode=raise"])
    works = values_of(results, killed=[(2, 0)])
    check_against_oracle(tmp_path, works, 3, 3, b=3)
    assert "all-reduce hook: RuntimeError: injected fault" in _events(tmp_path)[0]["errors"]["2"][0]


def test_optimizer_error_leaves_at_once(tmp_path):
    """The update of replica 1 fails after step 2 was committed: the replica leaves at once and
    never contributes its diverged state; step 3 is the failure step of the others."""
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=4,
                           update_errors={(1, 0): {2: "optimizer OOM (test)"}})
    works = values_of(results, killed=[(1, 0)])
    check_against_oracle(tmp_path, works, 3, 4, b=3)
    (event,) = _events(tmp_path)
    assert event["step"] == 3 and "optimizer OOM (test)" in event["errors"]["1"][0]


def test_failed_epoch_without_deaths_is_redone(tmp_path):
    """A failure in which nobody dies: the step is reduced again with the same plan."""
    hub, results = run_job(tmp_path, replicas=3, g=2, steps=3, transient={(2, 0): {2}})
    works = values_of(results)
    check_against_oracle(tmp_path, works, 3, 3, b=6)
    (event,) = _events(tmp_path)
    assert event["dead_replicas"] == [] and event["errors"] == {} and hub.epoch == 1


@pytest.mark.parametrize("victim", [0, 1])
def test_death_during_the_end_of_run_still_writes_every_output(tmp_path, victim):
    """The writer (replica 0) or another replica dies while the run's last outputs are written
    (after the last step's commit): the next writer writes the summary and the survivors end."""
    hub, results = run_job(tmp_path, replicas=3, g=1, steps=3,
                           faults=[f"replica={victim},step=3,phase=finish"] if victim == 0 else
                           ["replica=1,step=3,phase=forward"])
    works = values_of(results, killed=[(victim, 0)])
    check_against_oracle(tmp_path, works, 3, 3, b=3)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["writer"] == [1 if victim == 0 else 0, 0]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]


def test_free_heap_is_released_once_per_change_of_membership(tmp_path, monkeypatch):
    """[Note: the heap after a repair]: ``malloc_trim`` after the step of each repair (two
    deaths in two different steps: two calls per survivor), never after a clean step."""
    calls = []
    monkeypatch.setattr(manager_module, "release_free_heap",
                        lambda: calls.append(threading.get_ident()))
    hub, results = run_job(tmp_path, replicas=4, g=1, steps=6,
                           faults=["replica=1,step=2,phase=grad_sync,bucket=1",
                                   "replica=2,step=4,phase=backward"])
    works = values_of(results, killed=[(1, 0), (2, 0)])
    assert sorted(works) == [(0, 0), (3, 0)] and hub.epoch == 2
    assert len(calls) == 3 + 2  # after step 2 on replicas 0, 2, 3; after step 4 on 0 and 3
    assert heap.release_free_heap() is None or heap.release_free_heap() >= 0.0  # the real one
