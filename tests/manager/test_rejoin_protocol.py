"""Replica rejoin ([Note: rejoin at a boundary] in recover_hsdp/manager/rejoin.py) in-process: the
real ``RecoverManager``, ``WorkloadPolicy`` and ``BucketSync`` over the fake world (tests/fakes.py)
and the fake join primitives (tests/fake_join.py), with the stand-in model and the ledger oracle
of tests/manager/test_manager.py.

A replica dies, its replacement is spawned ``respawn_after_steps`` later, trains from the
donor's state and the survivors' step on. Every test asserts: every step commits B microbatch
gradients (measured), every rank's applied gradient equals the oracle's recomputation from the
ledger, G is back at G_init once the replica joined, and the parameters of every replica are
equal at every step (``consistency_check_interval = 1``; the join checks the newcomer's checksum
against the donor's). What the real spawn adds (processes, MPI, PRRTE) is covered by
tests/jobs/test_rejoin.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fake_join import FakeJoins
from fakes import FakeHub, FakeUnit, Killed, Retired, run_ranks, values_of
from recover_hsdp.config import BadReplicas, Tiers
from recover_hsdp.manager import RecoverManager
from recover_hsdp.outputs import RunMetrics
from recover_hsdp.recovery import BucketSync, fingerprint
from recover_hsdp.workload import WorkloadPolicy
from recover_hsdp.workload.ledger import read_ledger
from test_manager import TOKENS, UNITS, WIDTH, FakeFaults, StandInWork, oracle

LR, MOMENTUM = 0.01, 0.9


class JoiningWork(StandInWork):
    """``StandInWork`` with state to move (``JoinWork``): per unit a parameter and a momentum
    vector that every update changes. A newcomer's start as garbage: only the transfer makes
    them right."""

    def __init__(self, world, units, newcomer: bool):
        super().__init__(world, units)
        fill = (lambda u: np.full(WIDTH, -7.0)) if newcomer else (
            lambda u: np.arange(WIDTH, dtype=np.float64) * (u + 1))
        self.params = [fill(u) for u in range(UNITS)]
        self.momentum = [fill(u) * 0.5 for u in range(UNITS)]
        self.updates = -1 if newcomer else 0
        self.first_step = 1
        self.before_step: dict[int, list[np.ndarray]] = {}  # step -> join tensors before it
        self.stagings = 0  # join_tensors calls: the donor's and the newcomers' only

    def apply_update(self, grad_scale: float) -> float:
        norm = super().apply_update(grad_scale)
        for param, momentum, grad in zip(self.params, self.momentum, self.applied[-1]):
            momentum *= MOMENTUM
            momentum += grad.numpy()
            param -= LR * momentum
        self.updates += 1
        return norm

    def checksum(self) -> int:
        """[Note: exact fingerprints]: a newcomer one bit off the donor is refused."""
        return fingerprint([torch.from_numpy(p) for p in self.params])

    # JoinWork
    def join_meta(self) -> dict:
        return {"updates": self.updates}

    def load_join_meta(self, meta: dict) -> None:
        self.updates = meta["updates"]

    def join_tensors(self) -> list[np.ndarray]:
        self.stagings += 1  # what a GPU rank would stage to host memory
        return self.state()

    def join_nbytes(self) -> int:
        return sum(a.nbytes for a in self.state())

    def state(self) -> list[np.ndarray]:
        """The join tensors, for the test's own checks (not counted)."""
        return [*self.params, *self.momentum]

    def spawn_command(self, replicas: list[int]) -> tuple[str, list[str]]:
        return "recover-hsdp-newcomer", [",".join(map(str, replicas))]


def run_rejoin_job(tmp_path, replicas, g, steps, faults=(), shards=1, respawn=1,
                   before_join=None, start_steps=1):
    """Run ``steps`` steps; newcomers join as the manager decides. Returns (hub, joins,
    {(r, s) or (r, s, life): JoiningWork or exception}). ``before_join(world)``: called on a
    newcomer's thread before it joins (to kill it there)."""
    hub = FakeHub(replicas, shards)

    def build(world, newcomer: bool):
        units = [FakeUnit(f"u{i}") for i in range(UNITS)]
        sync = BucketSync(units, world)
        policy = WorkloadPolicy(initial_replicas=replicas, microbatches_per_replica=g,
                                keep_spares=True, data_assignment="exact")
        # as RecoverMetricsProcessor: a replacement rank never starts as the writer
        outputs = RunMetrics(tmp_path, is_writer=world.world_rank == 0 and not newcomer,
                             mode="recover")
        work = JoiningWork(world, units, newcomer)
        work.initial_replicas, work.bucket_sync = replicas, sync
        manager = RecoverManager(
            world=world, bucket_sync=sync, policy=policy,
            faults=FakeFaults(faults, hub, world.replica, world.shard, tmp_path),
            outputs=outputs, out_dir=tmp_path, tokens_per_microbatch=TOKENS * shards,
            bad_replicas=BadReplicas(consistency_check_interval=1),
            tiers=Tiers(respawn_after_steps=respawn), parameter_fingerprint=work.checksum,
            die=lambda: hub.kill(world.replica, world.shard),
            joins=joins)
        return manager, work, outputs

    def run(manager, work, outputs, world, first: int, admit_first: bool):
        for step in range(first, steps + 1):
            if step > first or admit_first:
                manager.maybe_admit(step, work)
            work.before_step[step] = [t.copy() for t in work.state()]
            work.step = step
            record = manager.step(step, work)
            outputs.log_step({**record, "step_time_s": 0.0})
        manager.finish_run(lambda: outputs.write_summary(
            {"alive_replicas": len(world.alive_replicas)}))
        return work

    def survivor(world):
        manager, work, outputs = build(world, newcomer=False)
        return run(manager, work, outputs, world, 1, admit_first=True)

    def newcomer(world):
        manager, work, outputs = build(world, newcomer=True)
        if before_join is not None:
            before_join(world)
        work.first_step = manager.join_as_newcomer(work)
        return run(manager, work, outputs, world, work.first_step, admit_first=False)

    joins = FakeJoins(hub, newcomer, start_steps=start_steps)
    return hub, joins, run_ranks(hub, survivor)


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check(tmp_path, works, replicas, steps, g_init):
    """B every step, measured; every rank's applied gradients equal the oracle's from its first
    step on; G back at G_init once every replica is alive; every rank of a shard ends with the
    same parameters. Returns the join events."""
    b = replicas * g_init
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [e.step for e in ledger] == list(range(steps))
    assert all(e.committed_total == b for e in ledger)
    metrics = _jsonl(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["reduced_microbatches"] for m in metrics] == [b] * steps
    assert all(m["g"] == g_init for m in metrics if m["alive_replicas"] == replicas)
    for key, work in works.items():
        assert len(work.applied) == steps - work.first_step + 1, key
        for entry, applied in zip(ledger[work.first_step - 1:], work.applied):
            expected = oracle(entry, work.shard, replicas)
            for unit in range(UNITS):
                assert torch.equal(applied[unit], expected[unit]), (key, entry.step, unit)
    for shard in {w.shard for w in works.values()}:
        final = [w.state() for w in works.values() if w.shard == shard]
        assert all(all(np.array_equal(a, b) for a, b in zip(final[0], f)) for f in final)
    assert metrics[-1]["alive_replicas"] == replicas
    return [e for e in _jsonl(tmp_path / "events.jsonl") if e.get("phase") == "join"]


def check_transfer(works, newcomer_key, donor_key):
    """The newcomer's state before its first step is the donor's, bit for bit."""
    newcomer, donor = works[newcomer_key], works[donor_key]
    step = newcomer.first_step
    assert all(np.array_equal(a, b) for a, b in
               zip(newcomer.before_step[step], donor.before_step[step]))
    assert newcomer.updates == donor.updates


def test_respawn_4x1(tmp_path):
    """Replica 1 dies at step 2; respawned before step 4 (one step after the loss), ready at
    step 5's boundary check, joined before step 6: G goes back to 1, B = 4 every step."""
    hub, joins, results = run_rejoin_job(tmp_path, replicas=4, g=1, steps=7,
                                         faults=["replica=1,step=2,phase=grad_sync,bucket=1"])
    works = values_of(results, killed=[(1, 0)])
    assert sorted(works) == [(0, 0), (1, 0, 1), (2, 0), (3, 0)]
    joins_seen = check(tmp_path, works, replicas=4, steps=7, g_init=1)
    (join,) = joins_seen
    assert join["ok"] and join["joined_replicas"] == [1] and join["step"] == 6
    assert join["step_started"] == 4 and join["bytes_per_donor_rank"] > 0
    assert works[(1, 0, 1)].first_step == 6
    assert join["donor"] == 2  # the lowest alive replica that is not the spawner's (0)
    check_transfer(works, (1, 0, 1), (2, 0))
    # staged: the donor's state once, the newcomer's buffers once; no other survivor stages
    assert {k: w.stagings for k, w in works.items()} == {(0, 0): 0, (1, 0, 1): 1, (2, 0): 1,
                                                         (3, 0): 0}
    assert join["bytes_per_donor_rank"] == sum(a.nbytes for a in works[(2, 0)].state())
    metrics = _jsonl(tmp_path / "metrics.jsonl")
    assert [m["alive_replicas"] for m in metrics] == [4, 3, 3, 3, 3, 4, 4]
    assert [m["g"] for m in metrics] == [1, 1, 2, 2, 2, 1, 1]  # step 2 keeps its plan's G
    assert joins.spawned == [("recover-hsdp-newcomer", ["1"], (1,), 0)]  # by rank 0 alone
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["joins"] == 1 and summary["failures"] == 1 and summary["alive_replicas"] == 4
    assert hub.epoch == 2 and hub.layout.alive_replicas == (0, 1, 2, 3)


def test_newcomer_killed_mid_transfer_aborts_the_join_only(tmp_path):
    """The newcomer dies after the donor's header, before the tensors (``phase=join`` of the
    join started before step 4): the attempt before step 6 fails, the spawner's check of the
    link finds the newcomer dead, the join is given up before step 7 (a newcomer's own death
    is not survived), and the next respawn (before step 8) brings replica 1 back."""
    hub, joins, results = run_rejoin_job(
        tmp_path, replicas=4, g=1, steps=10,
        faults=["replica=1,step=2,phase=grad_sync,bucket=1", "replica=1,step=4,phase=join"])
    works = values_of(results, killed=[(1, 0), (1, 0, 1)])
    assert sorted(works) == [(0, 0), (1, 0, 2), (2, 0), (3, 0)]
    failed, given_up, joined = check(tmp_path, works, replicas=4, steps=10, g_init=1)
    assert not failed["ok"] and failed["joined_replicas"] == [] and failed["step"] == 6
    assert failed["step_started"] == 4 and failed["alive_replicas"] == [0, 2, 3]
    assert not given_up["ok"] and given_up["step"] == 7 and "newcomers died" in given_up["reason"]
    assert joined["ok"] and joined["step_started"] == 8 and joined["step"] == 10
    check_transfer(works, (1, 0, 2), (2, 0))
    # the newcomer's death revoked its own epoch (-1), not the survivors' world
    assert [f for f in hub.failures if f[1] == -1] == [(1, -1, "replica 1 shard 0 killed")]
    assert hub.epoch == 2  # the loss and the one join that grew: the abort changed nothing


def test_donor_killed_mid_transfer_is_retried_with_a_new_donor(tmp_path):
    """The donor (replica 2) dies mid-transfer of the attempt before step 6: that attempt
    fails, the survivors repair (replica 2 gone) but the started newcomer is kept: it goes back
    to its link, and the next boundary's attempt completes with a new donor (replica 3). Then
    replica 2 is respawned and joins too: 4 of 4, G back to 1, B every step."""
    hub, joins, results = run_rejoin_job(
        tmp_path, replicas=4, g=1, steps=12,
        faults=["replica=1,step=2,phase=grad_sync,bucket=1", "replica=2,step=4,phase=join"])
    works = values_of(results, killed=[(1, 0), (2, 0)])
    assert sorted(works) == [(0, 0), (1, 0, 1), (2, 0, 1), (3, 0)]
    assert joins.exited == [] and len(joins.spawned) == 2  # the first newcomer was kept
    failed, retried, second = check(tmp_path, works, replicas=4, steps=12, g_init=1)
    assert not failed["ok"] and failed["step"] == 6 and failed["donor"] == 2
    assert retried["ok"] and retried["step"] == 7 and retried["attempt"] == 2
    assert retried["step_started"] == 4 and retried["donor"] == 3
    assert retried["joined_replicas"] == [1] and retried["alive_replicas"] == [0, 1, 3]
    assert second["ok"] and second["joined_replicas"] == [2] and second["step"] == 10
    metrics = _jsonl(tmp_path / "metrics.jsonl")
    assert [m["alive_replicas"] for m in metrics] == [4, 3, 3, 3, 3, 2, 3, 3, 3, 4, 4, 4]
    deaths = [e for e in _jsonl(tmp_path / "events.jsonl") if e.get("dead_replicas")]
    assert [(e["step"], e["dead_replicas"]) for e in deaths] == [(2, [1]), (6, [2])]
    check_transfer(works, (2, 0, 1), (1, 0, 1))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["joins"] == 2 and summary["failures"] == 2


def test_survivor_death_while_the_newcomer_starts_keeps_the_join(tmp_path):
    """Issue 22's scenario: replica 3 dies at step 2, its newcomer is spawned before step 5
    (``respawn_after_steps = 2``); replica 2 (not the spawner) dies in step 6 while it starts.
    The world repairs as usual, the join is kept and completes before step 7 with the world as
    it is then (replica 3 still a missing id); replica 2 comes back later: 4 of 4."""
    hub, joins, results = run_rejoin_job(
        tmp_path, replicas=4, g=1, steps=14, respawn=2, start_steps=2,
        faults=["replica=3,step=2,phase=forward", "replica=2,step=6,phase=forward"])
    works = values_of(results, killed=[(3, 0), (2, 0)])
    assert sorted(works) == [(0, 0), (1, 0), (2, 0, 1), (3, 0, 1)]
    assert joins.exited == [] and [j[2] for j in joins.spawned] == [(3,), (2,)]
    first, second = check(tmp_path, works, replicas=4, steps=14, g_init=1)
    assert first["ok"] and first["step_started"] == 5 and first["step"] == 7
    assert first["attempt"] == 1 and first["joined_replicas"] == [3]
    assert first["alive_replicas"] == [0, 1, 3]
    assert second["ok"] and second["joined_replicas"] == [2] and second["step"] == 12
    metrics = _jsonl(tmp_path / "metrics.jsonl")
    assert [m["alive_replicas"] for m in metrics] == [4, 3, 3, 3, 3, 2] + [3] * 5 + [4] * 3
    assert [m["g"] for m in metrics][-3:] == [1, 1, 1]
    check_transfer(works, (3, 0, 1), (1, 0))


def test_spawner_death_while_the_newcomer_starts_aborts_the_join(tmp_path):
    """The spawner (rank 0, the writer's) dies while its newcomer starts: the newcomers' only
    link is lost, so the join is given up and the newcomer exits (it notices the lost parent);
    the next respawn, by the new lowest replica's rank, brings both lost replicas back."""
    hub, joins, results = run_rejoin_job(
        tmp_path, replicas=4, g=1, steps=12, start_steps=2,
        faults=["replica=3,step=2,phase=forward", "replica=0,step=5,phase=forward"])
    works = values_of(results, killed=[(3, 0), (0, 0)], retired=[(3, 0, 1)])
    assert joins.exited == [(3, 0)]
    assert [(j[2], j[3]) for j in joins.spawned] == [((3,), 0), ((0, 3), 1)]
    given_up, joined = check(tmp_path, works, replicas=4, steps=12, g_init=1)
    assert not given_up["ok"] and "spawner died" in given_up["reason"]
    assert given_up["step"] == 6 and given_up["attempts"] == 0
    assert joined["ok"] and joined["joined_replicas"] == [0, 3] and joined["step"] == 10
    check_transfer(works, (0, 0, 1), (2, 0))


def test_respawn_2x2(tmp_path):
    """S = 2: shard 1 of replica 1 dies, shard 0 retires with it; both come back as two
    newcomer ranks, each taking the state of the donor rank of its own shard."""
    hub, joins, results = run_rejoin_job(
        tmp_path, replicas=2, g=2, steps=7, shards=2,
        faults=["replica=1,step=2,phase=grad_sync,bucket=2,rank=1"])
    works = values_of(results, killed=[(1, 1)], retired=[(1, 0)])
    assert sorted(works) == [(0, 0), (0, 1), (1, 0, 1), (1, 1, 1)]
    (join,) = check(tmp_path, works, replicas=2, steps=7, g_init=2)
    assert join["ok"] and join["joined_replicas"] == [1] and join["step"] == 6
    check_transfer(works, (1, 0, 1), (0, 0))
    check_transfer(works, (1, 1, 1), (0, 1))
    assert not all(np.array_equal(a, b) for a, b in zip(works[(0, 0)].state(),
                                                         works[(0, 1)].state()))
    assert hub.layout.alive_replicas == (0, 1)


def test_newcomer_dies_while_starting(tmp_path):
    """A newcomer dies before it is ready: the survivors see it failed at their next boundary,
    give the join up and respawn one step later."""
    lives = []

    def die_first_life(world):
        lives.append(world.replica)
        if len(lives) == 1:
            world.hub.kill(world.replica, world.shard)

    hub, joins, results = run_rejoin_job(
        tmp_path, replicas=3, g=1, steps=9, before_join=die_first_life,
        faults=["replica=2,step=2,phase=forward"])
    works = values_of(results, killed=[(2, 0), (2, 0, 1)])
    failed, joined = check(tmp_path, works, replicas=3, steps=9, g_init=1)
    assert not failed["ok"] and "never got ready" in failed["reason"]
    assert failed["step"] == 5 and joined["ok"] and joined["step"] == 8
    check_transfer(works, (2, 0, 2), (0, 0))


@pytest.mark.parametrize("start_steps", [0, 3])
def test_join_waits_until_the_spawner_saw_the_newcomers_ready(tmp_path, start_steps):
    """The join completes at the first boundary after the step whose totals agreed that the
    spawner saw them ready: start_steps steps of training while the newcomers start."""
    hub, joins, results = run_rejoin_job(
        tmp_path, replicas=3, g=1, steps=9, start_steps=start_steps,
        faults=["replica=1,step=2,phase=backward"])
    works = values_of(results, killed=[(1, 0)])
    (join,) = check(tmp_path, works, replicas=3, steps=9, g_init=1)
    assert join["ok"] and join["step_started"] == 4 and join["step"] == 5 + start_steps


def test_aborted_newcomer_is_not_left_running_when_the_run_ends(tmp_path):
    """The run ends while the newcomers are still starting: they are told to exit."""
    hub, joins, results = run_rejoin_job(tmp_path, replicas=2, g=1, steps=4, start_steps=5,
                                         faults=["replica=1,step=2,phase=backward"])
    works = values_of(results, killed=[(1, 0)], retired=[(1, 0, 1)])
    assert sorted(works) == [(0, 0)] and joins.exited == [(1, 0)]
    (join,) = [e for e in _jsonl(tmp_path / "events.jsonl") if e.get("phase") == "join"]
    assert not join["ok"] and "the run ended" in join["reason"]
    assert isinstance(results[(1, 0, 1)], Retired) and isinstance(results[(1, 0)], Killed)
