"""Divergence votes in process ([Note: divergence votes], [Note: exact fingerprints]): the real
fingerprint, vote, manager, BucketSync, policy, ledger and fault specs (``mode=bitflip``) over the
fake world (tests/fakes.py); gradients checked EXACTLY against the ledger oracle of
tests/manager/test_manager.py, parameters compared bit for bit across replicas."""

from __future__ import annotations

import json

import pytest
import torch

from fakes import values_of
from recover_hsdp.config import BadReplicas
from recover_hsdp.faults import Mode, Phase, failure_schedule
from recover_hsdp.manager.divergence import NoMajority, diverged_replicas
from recover_hsdp.recovery import fingerprint, flip_bit, from_halves, halves
from recover_hsdp.workload.ledger import ledger_records
from test_culprits import NormWork
from test_manager import check_against_oracle, run_job


# ---------------------------------------------------------------- the fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int8])
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    """Each bit of a word, flipped alone, changes the fingerprint (a float sum misses the low
    mantissa bits); flipped back, the fingerprint is the original again."""
    torch.manual_seed(0)
    tensors = [(torch.randn(5, 3) * 100).to(dtype), (torch.randn(7) * 100).to(dtype)]
    width = tensors[0].element_size() * 8
    for layout_free in (False, True):  # 64-bit words where they fit (15 x 2 bytes do not)
        before = fingerprint(tensors, layout_free)
        for element in (0, 14, 15, 21):  # both tensors, first and last words
            for bit in range(width):
                flip_bit(tensors, element, bit)
                assert fingerprint(tensors, layout_free) != before, (dtype, element, bit)
                flip_bit(tensors, element, bit)
                assert fingerprint(tensors, layout_free) == before


def test_a_flip_that_a_float_sum_cannot_see_is_seen():
    """A float64 sum (the old check) rounds a low mantissa flip of a small value away beside a
    large one; the word sum does not."""
    tensors = [torch.tensor([1e20, 1.0], dtype=torch.float32)]
    before_sum, before = float(tensors[0].double().sum()), fingerprint(tensors)
    flip_bit(tensors, element=1, bit=0)
    assert float(tensors[0].double().sum()) == before_sum
    assert fingerprint(tensors) != before


def test_fingerprint_is_order_free_and_survives_the_float64_totals():
    """Tensor order never matters, and one word per element makes the split into shards not
    matter either (a 3-way split of 6 float32 does not fit 64-bit words); the two halves are
    exact in float64 and their sums over ranks fold back to the sum of the ranks' fingerprints
    modulo 2^64."""
    a, b = torch.randn(6), torch.randn(4)
    assert fingerprint([a, b]) == fingerprint([b, a]) == fingerprint([torch.cat([a, b])])
    shards = [fingerprint([p], layout_free=True) for p in a.tensor_split(3)]
    assert sum(shards) % (1 << 64) == fingerprint([a], layout_free=True)
    values = [fingerprint([a]), fingerprint([b]), (1 << 64) - 1]
    summed = [sum(halves(v)[i] for v in values) for i in (0, 1)]
    assert from_halves(*summed) == sum(values) % (1 << 64)
    assert fingerprint([torch.empty(0)]) == 0
    with pytest.raises(ValueError, match="fewer elements"):
        flip_bit([a], element=6)
    with pytest.raises(ValueError, match="bits 0..31"):
        flip_bit([a], bit=32)


# ---------------------------------------------------------------- the vote


def test_vote_finds_the_minority_or_refuses_in_one_line():
    assert diverged_replicas(3, {0: 7, 1: 7, 2: 7}) == ()
    assert diverged_replicas(3, {0: 7, 1: 7, 2: 9, 3: 7}) == (2,)
    assert diverged_replicas(3, {0: 7, 1: 8, 2: 9, 4: 7, 5: 7}) == (1, 2)
    for votes in ({0: 7, 1: 9}, {0: 7, 1: 7, 2: 9, 3: 9}, {0: 1, 1: 2, 2: 3}):
        with pytest.raises(NoMajority) as caught:
            diverged_replicas(5, votes, restart_point="step-4 (certified)")
        message = str(caught.value)
        assert "\n" not in message and message.startswith("step 5: refusing to commit")
        assert "step-4 (certified)" in message
    with pytest.raises(NoMajority, match=r"replicas 0 \| 1 hold different bits"):
        diverged_replicas(2, {0: 7, 1: 9})


# ---------------------------------------------------------------- in the step protocol


class ParamWork(NormWork):
    """``StepWork`` with a parameter shard per unit, updated by SGD from the applied gradient
    (identical bits on every replica while in sync)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params = [torch.full((4,), 0.5) + self.shard for _ in self.units]

    def apply_update(self, grad_scale: float) -> float:
        updates = len(self.applied)
        norm = super().apply_update(grad_scale)
        if len(self.applied) > updates:  # updated (a finite norm)
            for param, grad in zip(self.params, self.applied[-1]):
                param.sub_(grad * 1e-3)
        return norm

    def parameter_shards(self):
        return self.params


def _vote_kwargs(work):
    return {"bad_replicas": BadReplicas(consistency_check_interval=1),
            "parameter_fingerprint": lambda: fingerprint(work.params)}


def _events(tmp_path, phase):
    path = tmp_path / "events.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [e for e in lines if e.get("phase") == phase]


@pytest.mark.parametrize("shards,mode", [(1, "update_bitflip"), (2, "update_bitflip"),
                                         (1, "bitflip"), (2, "bitflip")])
def test_bitflip_replica_leaves_before_anything_it_computed_is_committed(tmp_path, shards, mode):
    """4 x S, G=2: replica 2 (shard 0) flips one mantissa bit inside (``update_bitflip``) or
    after (``bitflip``, at rest) step 3's update. Step 4's vote finds the first (3 against 1),
    the rank's own at-rest check the second: replica 2's ranks leave before step 4's update,
    step 4 commits B = 8 from the others (the oracle's gradient, exactly), the survivors end
    bit-identical."""
    hub, results = run_job(tmp_path, replicas=4, g=2, steps=6, shards=shards,
                           work_class=ParamWork, manager_kwargs=_vote_kwargs,
                           faults=[f"replica=2,step=3,phase=optimizer,mode={mode},rank=0,bit=3"])
    if mode == "update_bitflip":  # the vote: every rank of replica 2 leaves
        works = values_of(results, killed=[(2, s) for s in range(shards)])
    else:  # its own check: the flipped rank leaves, its peer retires with it (a unit)
        works = values_of(results, killed=[(2, 0)], retired=[(2, s) for s in range(1, shards)])
    assert sorted(works) == [(r, s) for r in (0, 1, 3) for s in range(shards)]
    ledger = check_against_oracle(tmp_path, works, 4, 6, b=8)
    assert [len(e.alive) for e in ledger] == [4, 4, 4, 3, 3, 3]
    assert 2 not in ledger[3].committed
    events = _events(tmp_path, "diverged")
    if mode == "update_bitflip":
        assert [(e["step"], e["diverged"]) for e in events] == [(4, [2])]
    else:  # no vote needed: the flipped rank saw it changed at rest
        assert events == []
    for shard in range(shards):
        params = [works[(r, shard)].params for r in (0, 1, 3)]
        assert all(torch.equal(a, b) for p in params[1:] for a, b in zip(params[0], p))
    reasons = [json.loads(p.read_text())["reason"] for p in (tmp_path / "errors").glob("*.json")]
    assert any("diverged" in r for r in reasons), reasons
    if mode == "bitflip":
        assert any("changed at rest" in r for r in reasons), reasons


def test_two_replicas_that_differ_refuse_the_step_on_both(tmp_path):
    """2 x 1, a flip inside replica 1's update: nothing says which replica is right, so step 4
    is refused on both ranks with the same one line and nothing is updated from the diverged
    state."""
    hub, results = run_job(tmp_path, replicas=2, g=2, steps=6, work_class=ParamWork,
                           manager_kwargs=_vote_kwargs,
                           faults=["replica=1,step=3,phase=optimizer,mode=update_bitflip"])
    first = next(e for e in results.values() if isinstance(e, NoMajority))
    message = str(first)  # the other rank raises the same, or is released by the fake's break
    assert message.startswith("step 4: refusing to commit") and "replicas 0 | 1" in message
    assert "\n" not in message
    assert all(isinstance(e, Exception) and message in str(e) for e in results.values())


def test_two_replicas_a_flip_at_rest_is_settled_by_the_flipped_rank(tmp_path):
    """2 x 1, a flip at rest in replica 1 after step 3's update: no vote could say which is
    right, but replica 1's own check sees its bits changed since its update: it leaves at step
    4, replica 0 commits B = 4 alone (the oracle's gradient) to the end."""
    hub, results = run_job(tmp_path, replicas=2, g=2, steps=6, work_class=ParamWork,
                           manager_kwargs=_vote_kwargs,
                           faults=["replica=1,step=3,phase=optimizer,mode=bitflip"])
    works = values_of(results, killed=[(1, 0)])
    ledger = check_against_oracle(tmp_path, works, 2, 6, b=4)
    assert [len(e.alive) for e in ledger] == [2, 2, 2, 1, 1, 1]
    (reason,) = [json.loads(p.read_text())["reason"] for p in (tmp_path / "errors").glob("*")]
    assert "changed at rest" in reason


def test_a_mixed_schedule_draws_its_victims_among_the_alive(tmp_path):
    """``[recover.faults] every = 3``, 4 failures drawn from sigkill / nan / bitflip (seed 9:
    bitflip at step 2, sigkill at 4, nan at 7, sigkill at 12), 4 x 1, G = 2: every victim is
    alive at its step and not the lowest alive replica; the bitflipped replica is voted out at
    step 3, the nan one excluded for step 7; B = 8 committed every step against the oracle."""
    schedule = failure_schedule(3, 4, Phase.GRAD_SYNC, 9, (Mode.SIGKILL, Mode.NAN, Mode.BITFLIP))
    assert [(f.step, f.mode.value) for f in schedule] == [
        (2, "bitflip"), (4, "sigkill"), (7, "nan"), (12, "sigkill")]
    steps = 13
    hub, results = run_job(tmp_path, replicas=4, g=2, steps=steps, work_class=ParamWork,
                           manager_kwargs=_vote_kwargs, schedule=schedule)
    # the fake's kills record nothing (tests/manager/test_manager.py FakeFaults): the modes
    # that do not end the rank are in faults_fired.jsonl, the kills in the ranks' results
    fired = [json.loads(x) for x in (tmp_path / "faults_fired.jsonl").read_text().splitlines()]
    assert [(f["step"], f["mode"]) for f in fired] == [(2, "bitflip"), (7, "nan")]
    ledger = ledger_records(tmp_path)
    for record in fired:  # alive when its step was planned: the previous step's committers
        alive = sorted(map(int, ledger[record["step"] - 2]["replicas"]))
        assert record["replica"] in alive[1:], (record, alive)
    works = values_of(results, killed=[(r, 0) for r in (1, 2, 3)])
    assert sorted(works) == [(0, 0)]
    check_against_oracle(tmp_path, works, 4, steps, b=8)
    assert [len(e["replicas"]) for e in ledger] == [4, 4, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1]
    assert _events(tmp_path, "diverged") == []  # the flip at rest: its own check, no vote
    deaths = [e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
              if "dead_replicas" in e]
    assert (deaths[0]["step"], deaths[0]["dead_replicas"]) == (3, [fired[0]["replica"]])
    (nan,) = _events(tmp_path, "nonfinite")
    assert nan["step"] == 7 and list(nan["culprits"]) == [str(fired[1]["replica"])]
