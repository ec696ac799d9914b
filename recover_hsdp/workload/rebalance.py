"""Straggler rebalancing: quotas follow the replicas' measured speed (plain Python: no MPI/torch).

[Note: straggler quotas] A synchronous step waits for its slowest replica, so a replica that is
alive but slow (a throttled GPU, a noisy host) sets everyone's step time. Each committed step the
manager feeds :meth:`Rebalancer.observe` every alive replica's measured compute seconds per
microbatch (summed across ranks in the step's totals, so every rank sees the same figures and
keeps the same state: no messages). A replica whose time per microbatch exceeds ``slow_ratio``
times the median of the others' for ``patience`` steps in a row gets a weight
``median / its time`` (< 1); it goes back to weight 1 after ``patience`` steps in a row under
``recover_ratio`` x the median (``recover_ratio < slow_ratio``: the band between them is the
hysteresis, so measurement noise around one threshold never flips the quota back and forth).
A weighted replica is re-weighted only when its measured ratio leaves the band
``[w / slow_ratio, w * slow_ratio]`` around its weight's for ``patience`` steps. The figure is
per microbatch, so a replica's own quota does not feed back into it.

:func:`apportion` turns the weights into the contributors' quotas: proportional to the weights,
at least 1 each, summing to exactly B (largest remainder, ties to the lower index); with every
weight 1 it returns the failure-free layout itself (G each, the minor's remainder last), so a
run without stragglers plans exactly as before. The policy lays the contributors' id blocks out
contiguously in that order, so exact mode commits the same global ids t*B .. t*B+B-1 every step
whatever the quotas (the trajectory is unchanged up to float summation order).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class StragglerRule:
    """The ``[recover.bad_replicas]`` straggler thresholds (config/sections.py documents each field).
    ``slow_ratio`` 0: off."""

    slow_ratio: float = 0.0
    recover_ratio: float = 1.2
    patience: int = 3

    def check(self) -> None:
        """ValueError, one line naming the field, if the thresholds cannot work."""
        if self.slow_ratio == 0:
            return
        if self.slow_ratio <= 1.0:
            raise ValueError(f"recover.bad_replicas.slow_ratio must be 0 (off) or > 1 (got "
                             f"{self.slow_ratio!r}): e.g. 1.5")
        if not 1.0 <= self.recover_ratio < self.slow_ratio:
            raise ValueError(f"recover.bad_replicas.recover_ratio must be >= 1 and below "
                             f"slow_ratio={self.slow_ratio} (got "
                             f"{self.recover_ratio!r}): the band between them is the hysteresis")
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) \
                or self.patience < 1:
            raise ValueError(f"recover.bad_replicas.slow_patience must be an integer >= 1 (got "
                             f"{self.patience!r})")


class Rebalancer:
    """Per-replica weights from measured speed, with hysteresis; see [Note: straggler quotas]."""

    def __init__(self, rule: StragglerRule) -> None:
        rule.check()
        self.rule = rule
        self.weights: dict[int, float] = {}   # replica -> weight < 1 (absent: 1)
        self.streaks: dict[int, int] = {}     # replica -> steps in a row out of its band

    @property
    def enabled(self) -> bool:
        return self.rule.slow_ratio > 0

    def observe(self, seconds: Mapping[int, float]) -> bool:
        """One committed step's seconds per microbatch of the alive replicas (<= 0: not
        measured, e.g. a culprit that computed nothing it committed). Replicas absent from
        ``seconds`` are forgotten (dead). Returns whether a weight changed."""
        if not self.enabled:
            return False
        alive = set(seconds)
        for r in [r for r in self.weights if r not in alive]:
            del self.weights[r]
        for r in [r for r in self.streaks if r not in alive]:
            del self.streaks[r]
        measured = {r: s for r, s in seconds.items() if s > 0}
        ordered = sorted(measured.values())  # each replica against the median of the others:
        changed = False                      # O(W log W), not a sort per replica
        for r in sorted(measured) if len(ordered) > 1 else ():
            changed |= self._observe_one(r, measured[r] / _median_without(ordered,
                                                                          measured[r]))
        return changed

    def _observe_one(self, replica: int, ratio: float) -> bool:
        rule, weight = self.rule, self.weights.get(replica)
        if weight is None:
            out, target = ratio > rule.slow_ratio, 1.0 / ratio
        elif ratio < rule.recover_ratio:
            out, target = True, None
        else:
            implied = 1.0 / weight
            out = not implied / rule.slow_ratio <= ratio <= implied * rule.slow_ratio
            target = 1.0 / ratio
        if not out:
            self.streaks.pop(replica, None)
            return False
        self.streaks[replica] = self.streaks.get(replica, 0) + 1
        if self.streaks[replica] < rule.patience:
            return False
        del self.streaks[replica]
        if target is None:
            del self.weights[replica]
        else:
            self.weights[replica] = round(target, 6)  # a short decimal: the same in JSON
        return True

    def quotas(self, contributors: Sequence[int], b: int, g: int) -> list[int]:
        """Quotas of ``contributors`` (in order) for a step of ``b`` microbatches at G = ``g``."""
        base = [g] * (b // g) + ([b % g] if b % g else [])
        weights = [self.weights.get(r, 1.0) for r in contributors]
        if not self.enabled or all(w == 1.0 for w in weights) or len(contributors) < 2:
            return base
        return apportion(b, weights)

    def state_dict(self) -> dict:
        return {"slow_ratio": self.rule.slow_ratio, "recover_ratio": self.rule.recover_ratio,
                "patience": self.rule.patience,
                "weights": {str(r): w for r, w in sorted(self.weights.items())},
                "streaks": {str(r): n for r, n in sorted(self.streaks.items())}}

    @classmethod
    def from_state_dict(cls, state: Mapping) -> "Rebalancer":
        rebalancer = cls(StragglerRule(float(state["slow_ratio"]), float(state["recover_ratio"]),
                                       int(state["patience"])))
        rebalancer.weights = {int(r): float(w) for r, w in state["weights"].items()}
        rebalancer.streaks = {int(r): int(n) for r, n in state["streaks"].items()}
        return rebalancer


def apportion(b: int, weights: Sequence[float]) -> list[int]:
    """``b`` split proportionally to ``weights``: at least 1 each (needs len <= b), sum == b,
    largest remainders first, ties to the lower index."""
    n, total = len(weights), sum(weights)
    if not 1 <= n <= b or total <= 0:
        raise ValueError(f"cannot split {b} microbatches over {n} weights {list(weights)}")
    ideal = [b * w / total for w in weights]
    quotas = [max(1, math.floor(x)) for x in ideal]
    while sum(quotas) > b:  # the minimum of 1 took too much: from the largest
        i = max(range(n), key=lambda k: (quotas[k], -k))
        quotas[i] -= 1
    order = sorted(range(n), key=lambda k: (-(ideal[k] - quotas[k]), k))  # what each lacks
    k = 0
    while sum(quotas) < b:
        quotas[order[k % n]] += 1
        k += 1
    assert sum(quotas) == b and min(quotas) >= 1, (b, weights, quotas)
    return quotas


def _median_without(ordered: Sequence[float], value: float) -> float:
    """``_median`` of sorted ``ordered`` less one occurrence of ``value``: the same number
    (the same two middle values added in the same order), without copying."""
    i, m = bisect.bisect_left(ordered, value), len(ordered) - 1

    def at(p: int) -> float:
        return ordered[p] if p < i else ordered[p + 1]
    mid = m // 2
    return at(mid) if m % 2 else (at(mid - 1) + at(mid)) / 2


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
