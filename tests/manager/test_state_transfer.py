"""``RecoverManager.send_between`` over the fake world (tests/fakes.py): a host-memory generation
sent from a rank that holds it to the ranks of its shard position that do not ([Note:
host-memory state] in recovery/host_state.py), point to point: nobody else receives a byte; the
donor killed while it sends, the survivors agree the transfer failed, ask again who holds what
and get it from the next donor; the training steps after it keep the oracle's gradients."""

from __future__ import annotations

import numpy as np

from fakes import values_of
from test_manager import check_against_oracle, run_job

REPLICAS, SHARDS, STEPS = 4, 2, 3


def _fetch(manager, holds: set[int], kill_donor: int | None, hub) -> tuple[bytes | None, int]:
    """HostState.restore's loop with a stand-in payload: (what this rank ends up holding,
    the rounds it took)."""
    world = manager.world
    mine = f"state of shard {world.shard}".encode() * 1000 if world.replica in holds else None
    rounds = 0
    while True:
        rounds += 1
        have = manager.gather_for_checkpoint(mine is not None)
        donors = [r for r, ok in sorted(have.items()) if ok]
        needy = [r for r, ok in sorted(have.items()) if not ok]
        if not needy or not donors:
            return mine, rounds
        if world.replica == donors[0] == kill_donor:
            hub.kill(world.replica, world.shard)       # dies before it sent a byte
        done, data = manager.send_between(mine if world.replica == donors[0] else None,
                                          donors[0], needy)
        if not done:
            continue
        if data is not None:
            mine = data.tobytes()
        return mine, rounds


def _run(tmp_path, kill_donor):
    got: dict[tuple[int, int], tuple] = {}
    received: dict[tuple[int, int], int] = {}

    def after_step(manager, work, step):
        if step != 1:
            return
        world = manager.world
        calls = world.calls["bytes"]
        got[(world.replica, world.shard)] = _fetch(manager, {0, 2}, kill_donor, world.hub)
        received[(world.replica, world.shard)] = world.calls["bytes"] - calls

    hub, results = run_job(tmp_path, replicas=REPLICAS, g=1, steps=STEPS, shards=SHARDS,
                           after_step=after_step)
    return hub, results, got, received


def test_the_state_goes_only_to_the_ranks_without_it(tmp_path):
    hub, results, got, received = _run(tmp_path, kill_donor=None)
    works = values_of(results)
    for (replica, shard), (data, rounds) in got.items():
        assert data == f"state of shard {shard}".encode() * 1000 and rounds == 1
    # the donor (replica 0) sends once per receiver, each receiver receives once, replica 2
    # (a holder, not the donor) takes no part
    assert {k: n for k, n in received.items()} == {
        **{(0, s): 2 for s in range(SHARDS)}, **{(1, s): 1 for s in range(SHARDS)},
        **{(2, s): 0 for s in range(SHARDS)}, **{(3, s): 1 for s in range(SHARDS)}}
    check_against_oracle(tmp_path, works, REPLICAS, STEPS, b=REPLICAS)


def test_a_donor_killed_while_it_sends_is_replaced_by_the_next(tmp_path):
    hub, results, got, received = _run(tmp_path, kill_donor=0)
    works = values_of(results, killed=[(0, s) for s in range(SHARDS)])
    assert set(got) == {(r, s) for r in (1, 2, 3) for s in range(SHARDS)}
    for (replica, shard), (data, rounds) in got.items():
        assert data == f"state of shard {shard}".encode() * 1000
        assert rounds == 2, (replica, shard, rounds)     # asked again after the repair
    assert all(np.asarray(w.applied[-1][0]).size for w in works.values())
    ledger = check_against_oracle(tmp_path, works, REPLICAS, STEPS, b=REPLICAS)
    assert len(ledger[-1].committed) == 3                # 3 replicas from step 2 on
