"""Divergence votes: replicas that hold other bits than a strict majority leave.

[Note: divergence votes] Every ``[recover.bad_replicas] consistency_check_interval`` steps each
rank takes the exact fingerprint of its parameter shard ([Note: exact fingerprints] in
recovery/fingerprint.py) before the step's update, and adds it into its replica's slot of the
step's totals all-reduce (``StepTotals.fingerprints``): the vote costs no collective of its own
and the sums are the same on every rank, so every rank reaches the same verdict with no further
message. A replica's slot sums its ranks' fingerprints (the same-shard ranks of healthy replicas
hold the same bits, so healthy replicas' slots are equal; a flip on one rank changes its
replica's slot). The verdict (:func:`diverged_replicas`):

* all alive replicas agree: nothing happens;
* a strict majority agrees: every other replica diverged. Its ranks leave at once as a unit
  (their contribution to this step was computed from diverged parameters; it is never
  committed): the survivors see a death, re-plan the step without it and reduce every bucket
  again ([Note: the step protocol] 5), so the step commits exactly B from healthy replicas. The
  replica may come back fresh through the rejoin path (a healthy donor's state);
* no strict majority (two replicas that differ, a tie): nothing says which state is right. The
  step is refused on every rank with one line naming the groups, the step and the state to
  restart from (the newest certified checkpoint, [Note: certified checkpoints] in
  titan/certificates.py); nothing is trained on the diverged state.

A flip lands in the parameters after an update (or in the optimizer state, which moves the
parameters at the next update), so it is found at the first vote after it: with the interval
at 1, in the next step, before that step's update.

**At rest, no vote needed.** Before a voting step each rank also fingerprints its parameters
right after its own update (``RecoverManager._after_update``); when the vote's fingerprint
differs from it, the bits changed at rest (a flipped bit in memory, the common silent
corruption) and the rank knows it is the culprit: it leaves at once, like a replica voted out.
This settles what a vote cannot: two replicas, or a tie after losses (measured: a 300-step soak
of 4 replicas with a failure every 10 steps had only 2 alive when a flip came, and the vote
refused the step). Only a corruption inside the update itself (``mode=update_bitflip``: the
optimizer's arithmetic wrong on one replica) is seen by the vote alone. Cost: a second
fingerprint per voting step (the read of the shard, [Note: exact fingerprints]).
"""

from __future__ import annotations

from typing import Mapping, Sequence


class NoMajority(RuntimeError):
    """Replicas disagree and no strict majority holds one state: the step is refused."""


def diverged_replicas(step: int, fingerprints: Mapping[int, int], restart_point: str = "") \
        -> tuple[int, ...]:
    """The replicas whose fingerprint differs from a strict majority's (sorted; () when all
    agree). ``fingerprints``: each alive replica's slot. Raises :class:`NoMajority` (one line)
    when they disagree and no value holds a strict majority."""
    groups: dict[int, list[int]] = {}
    for replica, value in sorted(fingerprints.items()):
        groups.setdefault(value, []).append(replica)
    if len(groups) <= 1:
        return ()
    value, members = max(groups.items(), key=lambda item: len(item[1]))
    if 2 * len(members) > len(fingerprints):
        return tuple(r for r in sorted(fingerprints) if fingerprints[r] != value)
    raise NoMajority(
        f"step {step}: refusing to commit: the replicas' parameters diverged and no strict "
        f"majority agrees (replicas {_groups(groups.values())} hold different bits); nothing "
        f"was trained on them: restart from {restart_point or 'the newest certified checkpoint'}"
        " ([Note: divergence votes])")


def _groups(groups: Sequence[list[int]] | object) -> str:
    return " | ".join(",".join(str(r) for r in members) for members in groups)
