"""The split-brain arbiter's decisions ([Note: split brain] in recover_hsdp/collectives/arbiter.py),
in process and without MPI: which side of a partition claims first, which side goes on, what a
claim already taken means, and that without a reachable folder every side goes on."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from hypothesis import given, strategies as st

from recover_hsdp.collectives.arbiter import SplitBrainArbiter


class Recorder:
    """Stands in for the (watchdog-paused) sleep and the log: records what the arbiter asked."""

    def __init__(self):
        self.slept: list[float] = []
        self.lines: list[str] = []


def arbiter(folder, delay=10.0) -> tuple[SplitBrainArbiter, Recorder]:
    rec = Recorder()
    return SplitBrainArbiter(folder, delay, sleep=rec.slept.append, log=rec.lines.append), rec


def claim(arb, members, side=None, epoch=0, old_alive=(0, 1, 2)) -> bool:
    """One side's claim; with one rank per replica its replicas are its ranks."""
    members = set(members)
    return arb.claim(epoch, old_alive, members, members if side is None else set(side),
                     rank=min(members))


def test_no_folder_every_side_goes_on_at_once():
    arb, rec = arbiter(None)
    assert claim(arb, {0, 1}) and claim(arb, {2})
    assert rec.slept == [] and rec.lines == []


def test_majority_side_claims_at_once_and_wins(tmp_path):
    arb, rec = arbiter(tmp_path / "membership")
    assert claim(arb, {0, 1})
    assert rec.slept == []
    path = Path(arb.claim_path(0, (0, 1, 2)))
    assert path.name.startswith("epoch0-alive3-") and path.name.endswith(".json")
    assert path.read_text() == "0 1"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left


def test_minority_side_waits_its_head_start_then_stops(tmp_path):
    arb, rec = arbiter(tmp_path, delay=7.5)
    assert claim(arb, {0, 1})
    assert not claim(arb, {2})
    assert rec.slept == [7.5]
    assert Path(arb.claim_path(0, (0, 1, 2))).read_text() == "0 1"  # the claim is not replaced


def test_exact_half_the_side_with_the_lowest_replica_goes_first(tmp_path):
    arb, rec = arbiter(tmp_path)
    four = (0, 1, 2, 3)
    assert arb.head_start({0, 3}, four) == 0.0
    assert arb.head_start({1, 2}, four) == 10.0
    assert claim(arb, {0, 3}, old_alive=four)
    assert rec.slept == []
    assert not claim(arb, {1, 2}, old_alive=four)
    assert rec.slept == [10.0]


def test_the_first_claim_wins_even_if_a_smaller_side_made_it(tmp_path):
    # a majority that detected the partition later than the minority's head start stops
    arb, rec = arbiter(tmp_path)
    assert claim(arb, {2})
    assert not claim(arb, {0, 1})
    assert rec.slept == [10.0]


def test_a_later_round_of_the_same_repair_finds_its_own_claim(tmp_path):
    arb, _ = arbiter(tmp_path)
    assert claim(arb, {0, 1, 2, 3}, old_alive=(0, 1, 2, 3, 4))
    assert claim(arb, {0, 1, 3}, old_alive=(0, 1, 2, 3, 4))  # rank 2 died during the repair
    assert claim(arb, {0, 1, 2, 3}, old_alive=(0, 1, 2, 3, 4))  # the same members again
    assert not claim(arb, {0, 1, 4}, old_alive=(0, 1, 2, 3, 4))  # not a part of the owner


def test_a_repair_with_one_side_always_wins(tmp_path):
    arb, rec = arbiter(tmp_path)
    assert claim(arb, {0, 1}, old_alive=(0, 1, 2))  # replica 2 died
    assert claim(arb, {1}, epoch=1, old_alive=(0, 1))  # then replica 0: half, without the lowest
    assert rec.slept == [10.0]  # a lone minority waits, then claims unopposed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        Path(arb.claim_path(e, alive)).name for e, alive in ((0, (0, 1, 2)), (1, (0, 1))))


def test_claims_of_different_transitions_do_not_meet(tmp_path):
    arb, _ = arbiter(tmp_path)
    assert claim(arb, {0, 1}, epoch=3)
    assert claim(arb, {2}, epoch=4)
    assert claim(arb, {2}, epoch=3, old_alive=(0, 2))


def test_side_is_the_replicas_members_are_the_ranks(tmp_path):
    # two ranks per replica: ranks 0-1 are replica 0, 2-3 replica 1, 4-5 replica 2
    arb, rec = arbiter(tmp_path)
    assert arb.claim(0, (0, 1, 2), {0, 1, 2, 3}, {0, 1}, rank=0)
    assert not arb.claim(0, (0, 1, 2), {4, 5}, {2}, rank=4)
    assert rec.slept == [10.0]
    assert Path(arb.claim_path(0, (0, 1, 2))).read_text() == "0 1 2 3"


def test_unreachable_folder_a_majority_goes_on_a_minority_stops(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    arb, rec = arbiter(blocker / "membership")  # its parent is not a folder
    assert not claim(arb, {2})  # a minority side: never two sides going on for want of it
    assert rec.slept == [10.0]  # the head start comes before the folder is tried
    assert len(rec.lines) == 1 and "stopping" in rec.lines[0] and "rank 2" in rec.lines[0]
    assert claim(arb, {0, 1})
    assert len(rec.lines) == 2 and "going on" in rec.lines[1]


def test_a_claim_of_many_replicas_fits_a_file_name(tmp_path):
    """125,000 replicas (1M GPUs): the name is a digest, the members are in the file; two
    different alive sets of one epoch claim two files."""
    arb, rec = arbiter(tmp_path)
    many = tuple(range(125_000))
    assert arb.claim(3, many, set(range(1, 125_000)), set(range(1, 125_000)), rank=1)
    assert len(Path(arb.claim_path(3, many)).name) < 80
    assert arb.claim_path(3, many) != arb.claim_path(3, many[1:])
    assert rec.lines == []


def test_real_race_between_two_sides(tmp_path):
    # both sides at once, with the real sleep: the majority has a head start of 0.3 s
    arb = SplitBrainArbiter(tmp_path, claim_delay_s=0.3)
    results = {}

    def side(members):
        results[min(members)] = claim(arb, members)

    threads = [threading.Thread(target=side, args=(m,)) for m in ({2}, {0, 1})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == {0: True, 2: False}


@given(st.integers(min_value=1, max_value=8).flatmap(
    lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)))))
def test_of_two_sides_exactly_one_has_no_head_start(case):
    n, side = case
    old_alive = tuple(range(n))
    other = set(old_alive) - side
    arb = SplitBrainArbiter("unused", claim_delay_s=1.0)
    waits = [arb.head_start(side, old_alive), arb.head_start(other, old_alive)]
    assert sorted(waits) == [0.0, 1.0]


def test_arbiter_module_needs_no_mpi():
    code = ("import sys, recover_hsdp.collectives.arbiter; "
            "assert 'mpi4py' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
