"""``RecoverManager.share_state`` over the fake world (tests/fakes.py): a host-memory generation
sent from a rank that holds it to the ranks of its shard position that do not ([Note:
host-memory state] in recovery/host_state.py), point to point: nobody else receives a byte;
positions that need different things (one complete, one not) still run the same rounds; the
donor killed while it sends: the survivors agree the transfer failed, ask again who holds what
and get it from the next holder; a position nobody holds is named; the training steps around it
keep the oracle's gradients."""

from __future__ import annotations

from fakes import values_of
from test_manager import check_against_oracle, run_job

REPLICAS, SHARDS, STEPS = 4, 2, 3


def _state(shard: int) -> bytes:
    return f"state of shard {shard}".encode() * 1000


def _run(tmp_path, holds, kill_donor=None):
    """After step 1 every rank shares its position's state; ``holds``: shard -> the replicas
    that hold it. Returns the job's results and, per rank, (what it holds after, the position
    nobody held, the "bytes" calls it made)."""
    seen: dict[tuple[int, int], tuple] = {}

    def after_step(manager, work, step):
        if step != 1:
            return
        world = manager.world
        calls = world.calls["bytes"]
        mine = world.replica in holds[world.shard]

        def read():
            if world.replica == kill_donor:
                world.hub.kill(world.replica, world.shard)   # dies before it sent a byte
            return _state(world.shard)

        got, orphans = manager.share_state(mine, read)
        held = _state(world.shard) if mine else (got.tobytes() if got is not None else None)
        seen[(world.replica, world.shard)] = (held, orphans, world.calls["bytes"] - calls)

    hub, results = run_job(tmp_path, replicas=REPLICAS, g=1, steps=STEPS, shards=SHARDS,
                           after_step=after_step)
    return results, seen


def test_the_state_goes_only_to_the_ranks_without_it(tmp_path):
    # shard 0: every replica holds it (nothing to send); shard 1: replicas 1 and 3 lack it
    results, seen = _run(tmp_path, {0: {0, 1, 2, 3}, 1: {0, 2}})
    works = values_of(results)
    assert {k: (held == _state(k[1]), orphans) for k, (held, orphans, _) in seen.items()} == \
        {(r, s): (True, []) for r in range(REPLICAS) for s in range(SHARDS)}
    # shard 1's donor (replica 0) sends once per receiver, each receiver receives once; replica
    # 2 (a holder, not the donor) and every rank of shard 0 send and receive nothing
    assert {k: calls for k, (_, _, calls) in seen.items()} == {
        **{(r, 0): 0 for r in range(REPLICAS)},
        (0, 1): 2, (1, 1): 1, (2, 1): 0, (3, 1): 1}
    check_against_oracle(tmp_path, works, REPLICAS, STEPS, b=REPLICAS)


def test_a_donor_killed_while_it_sends_is_replaced_by_the_next(tmp_path):
    results, seen = _run(tmp_path, {0: {0, 2}, 1: {0, 2}}, kill_donor=0)
    works = values_of(results, killed=[(0, s) for s in range(SHARDS)])
    assert set(seen) == {(r, s) for r in (1, 2, 3) for s in range(SHARDS)}
    for (replica, shard), (held, orphans, _) in seen.items():
        assert held == _state(shard) and orphans == [], (replica, shard)
    ledger = check_against_oracle(tmp_path, works, REPLICAS, STEPS, b=REPLICAS)
    assert len(ledger[-1].committed) == 3                # 3 replicas from step 2 on


def test_a_position_nobody_holds_is_named_and_nothing_is_sent(tmp_path):
    results, seen = _run(tmp_path, {0: {1}, 1: set()})
    values_of(results)
    assert {k: (orphans, calls) for k, (_, orphans, calls) in seen.items()} == \
        {(r, s): ([1], 0) for r in range(REPLICAS) for s in range(SHARDS)}
    assert seen[(1, 0)][0] == _state(0) and seen[(0, 0)][0] is None
