"""The project's real ``WorkloadPolicy``, called at the simulated events, the invariant checked.

At each event the simulator asks the real policy what the project would do: ``replan`` after a
death, ``exclude`` for a culprit (silent data corruption), ``admit`` for a rejoined replica,
``observe_speeds`` for a straggler, a fresh policy from ``state_dict`` for a relaunch; then it
plans the steps after the event and reads the step's cost off the plan: the failure step's
extra microbatches (``max_extras``) and the critical path of the steps after (the most
microbatches one replica computes, weighted by its speed). Every plan the policy returns is checked
here too (the policy asserts it itself): ``committed_total() == B``, and, in exact mode up to
B = 100,000, the committed ids are exactly t*B .. t*B+B-1. Between two events
the steps are copies of the last checked plan, accounted in bulk (never planned one by one).

[Note: sampled policy calls] A replan, and reading every replica's work off a plan as this probe
does, is O(W x G) (a rank's own plan is O(1): [Note: a plan in O(1) per step]): ~0.12 s at
W = 12,500 and ~1.5 s at W = 125,000 (measured on the 2-core box), and a week at 1M GPUs has
thousands of events. So each run has a budget of replica-plans (``budget``; an event costs about
PLANS_PER_EVENT x W); when the events expected would exceed it, an event calls the real policy
with probability p = budget / (PLANS_PER_EVENT x W x events expected), drawn from the run's seeded generator,
and always when no earlier real call had the same shape: the event's kind, the replicas it
affects, and G before and after it by the policy's own rule (``g_for``, O(1)). An event not
sampled reuses the figures (G, critical path, extras) of the last real call of its shape, and
the policy is then behind the simulated membership: the next real call first brings it there
through the project's own restart path (``WorkloadPolicy.from_state_dict`` with the membership
overridden), as a relaunch does. The counts of real and reused events are in the output; at
p = 1 (every run up to ~10k GPUs by default) every event is a real call. The runs of one size
share their shapes' figures (``memo``: the same policy settings and W_init). Which events are
sampled depends only on the seed, never on timing.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from recover_hsdp.workload.policy import DataAssignment, StepPlan, WorkloadPolicy
from recover_hsdp.workload.rebalance import StragglerRule

EXACT_IDS_CHECK_MAX_B = 100_000
PLANS_PER_EVENT = 3     # a death: plan, replan, the step after


@dataclass(frozen=True)
class Outcome:
    """What the policy's plans say an event costs."""

    units: float        # the steps after: most microbatch-times one replica computes
    g: int              # their G
    extras: int = 0     # the failure step: most extra microbatches one survivor runs
    real: bool = True   # from a real call (False: reused from an earlier one of this shape)


class Sampler:
    """Which events call the real code: all, or a seeded sample within a budget."""

    def __init__(self, rng: random.Random, budget: float, cost_per_call: float) -> None:
        self.rng, self.budget, self.cost = rng, budget, cost_per_call
        self.p = 1.0
        self.real_calls = self.reused = 0

    def expect(self, events: int) -> None:
        """``events`` events expected in the run: sample if they would exceed the budget."""
        self.p = min(1.0, self.budget / (self.cost * max(1, events)))

    def real(self, known: bool) -> bool:
        draw = self.rng.random()     # drawn for every event: the stream depends on the seed only
        is_real = not known or draw < self.p
        self.real_calls += is_real
        self.reused += not is_real
        return is_real


class SampledCalls:
    """One kind of real decision besides the policy (the arbiter's claims, the relaunch tier's
    planning), O(hosts) or O(W) each: every call, or a seeded sample within ``budget`` whose
    figures are reused for the same ``key`` ([Note: sampled policy calls])."""

    def __init__(self, rng: random.Random, budget: float, cost_per_call: float,
                 events: int) -> None:
        self.sampler = Sampler(rng, budget, cost_per_call)
        self.sampler.expect(events)
        self.memo: dict = {}

    def __call__(self, key: tuple, call):
        if self.sampler.real(key in self.memo):
            self.memo[key] = call()
        return self.memo[key]

    def stats(self) -> dict:
        return {"real": self.sampler.real_calls, "reused": self.sampler.reused,
                "sample_probability": self.sampler.p}


class PolicyProbe:
    """One simulated run's real policy, the membership the simulation holds, and the checks."""

    def __init__(self, w_init: int, g_init: int, settings: dict, rng: random.Random,
                 budget: float, rebalance: bool, after_steps: int,
                 memo: dict | None = None) -> None:
        self.w_init, self.g_init, self.b = w_init, g_init, w_init * g_init
        self.rule = StragglerRule(settings["slow_ratio"], settings["recover_ratio"],
                                  settings["slow_patience"]) if rebalance else None
        self.policy = WorkloadPolicy(initial_replicas=w_init, microbatches_per_replica=g_init,
                                     keep_spares=settings["keep_spares"],
                                     data_assignment=settings["data_assignment"],
                                     g_raise=settings["g_raise"], straggler=self.rule)
        self.alive: set[int] = set(range(w_init))
        self.synced = True
        self.sampler = Sampler(rng, budget, w_init * PLANS_PER_EVENT)
        self.memo: dict[tuple, Outcome] = {} if memo is None else memo
        self.after_steps = after_steps
        self.speed: dict[int, float] = {}      # straggler slowdowns the plans are weighed with
        self.checked = {"plans": 0, "exact_id_sets": 0, "replans": 0, "excludes": 0,
                        "admits": 0, "observe_speeds": 0, "restarts_from_state": 0}
        self.call_s = 0.0                      # wall seconds inside the policy (not a result)

    # ---- the checks -------------------------------------------------------------------------
    def check(self, plan: StepPlan) -> StepPlan:
        """The invariant on a plan the policy returned: committed == B, and up to
        ``EXACT_IDS_CHECK_MAX_B`` the committed ids are the step's own (exact mode)."""
        committed = plan.committed_total()
        assert committed == self.b, f"step {plan.step}: {committed} committed, B = {self.b}"
        if plan.data_assignment is DataAssignment.EXACT and self.b <= EXACT_IDS_CHECK_MAX_B:
            ids = sorted(i for a in plan.assignments for i in a.committed_ids)
            assert ids == list(range(plan.step * self.b, (plan.step + 1) * self.b)), plan.step
            self.checked["exact_id_sets"] += 1
        self.checked["plans"] += 1
        return plan

    def units(self, plan: StepPlan) -> float:
        """The step's critical path in microbatch times: each replica's computed microbatches
        times its slowdown, the slowest replica's."""
        return max(a.computed_count * self.speed.get(a.replica, 1.0)
                   for a in plan.assignments if not a.excluded)

    # ---- the real calls ---------------------------------------------------------------------
    def _sync(self) -> None:
        """Bring the policy to the simulated membership through its restart path."""
        if not self.synced:
            self.policy = WorkloadPolicy.from_state_dict(self.policy.state_dict(),
                                                         alive_replicas=sorted(self.alive))
            self.checked["restarts_from_state"] += 1
            self.synced = True

    def _after(self, step: int, extras: int = 0, alive: list[int] | None = None) -> Outcome:
        """Plan ``after_steps`` steps after an event (for ``alive``, default the policy's own
        membership) and commit them; they must all cost the same."""
        costs = set()
        for k in range(self.after_steps):
            plan = self.check(self.policy.plan(step + k, alive))
            costs.add((self.units(plan), plan.g))
            self.policy.commit(plan)
        assert len(costs) == 1, f"steps after an event differ: {costs}"
        units, g = costs.pop()
        return Outcome(units, g, extras)

    def _key(self, kind: str, affected: int, change: int) -> tuple:
        """An event's shape: its kind, the replicas it affects, the real policy's G (``g_for``,
        O(1)) before and after it."""
        g_for, alive = self.policy.g_for, len(self.alive)
        return kind, affected, g_for(alive), g_for(alive + change)

    def _event(self, key: tuple, step: int, call) -> Outcome:
        """Run ``call`` (the real calls of one event) or reuse the figures of its shape."""
        if not self.sampler.real(key in self.memo):
            self.synced = False
            old = self.memo[key]
            return Outcome(old.units, old.g, old.extras, real=False)
        start = time.perf_counter()
        self._sync()
        outcome = call()
        self.call_s += time.perf_counter() - start
        self.memo[key] = outcome
        return outcome

    def death(self, dead: list[int], step: int) -> Outcome:
        """``dead`` died in the gradient sync of ``step``: replan, commit, the steps after."""
        key = self._key("death", len(dead), -len(dead))

        def call() -> Outcome:
            plan = self.check(self.policy.replan(self.policy.plan(step), dead))
            self.checked["replans"] += 1
            self.policy.commit(plan)
            return self._after(step + 1, plan.max_extras())

        out = self._event(key, step, call)
        self.alive -= set(dead)
        return out

    def culprit(self, bad: list[int], step: int) -> Outcome:
        """``bad`` contributed wrong numbers to ``step``: excluded from it (B held), then they
        leave at the boundary (a replica whose numbers cannot be trusted is retired)."""
        key = self._key("culprit", len(bad), -len(bad))

        def call() -> Outcome:
            plan = self.check(self.policy.exclude(self.policy.plan(step), bad))
            self.checked["excludes"] += 1
            self.policy.commit(plan)
            return self._after(step + 1, plan.max_extras(),
                               [r for r in plan.alive if r not in bad])

        out = self._event(key, step, call)
        self.alive -= set(bad)
        return out

    def join(self, joined: list[int], step: int) -> Outcome:
        """Replacements joined at the boundary before ``step``: admit, the steps after."""
        key = self._key("join", len(joined), len(joined))

        def call() -> Outcome:
            self.policy.admit(joined)
            self.checked["admits"] += 1
            return self._after(step)

        out = self._event(key, step, call)
        self.alive |= set(joined)
        return out

    def restart(self, alive: list[int], step: int) -> Outcome:
        """A relaunch onto ``alive`` from a checkpoint: the policy from its saved state."""
        self.synced, self.alive = False, set(alive)
        key = self._key("relaunch", 0, 0)
        return self._event(key, step, lambda: self._after(step))

    def observe(self, step: int) -> Outcome | None:
        """A straggler began or ended: ``patience`` committed steps of measured seconds per
        microbatch (slowdowns of ``speed``) go to ``observe_speeds``; then the steps after.
        None where the rebalancer is off (the step waits for the straggler)."""
        if self.rule is None:
            return None
        start = time.perf_counter()
        self._sync()
        seconds = {r: self.speed.get(r, 1.0) for r in self.policy.alive}
        for _ in range(self.rule.patience):
            self.policy.observe_speeds(seconds)
            self.checked["observe_speeds"] += 1
        out = self._after(step)
        self.call_s += time.perf_counter() - start
        return out

    def stats(self) -> dict:
        return {"real_events": self.sampler.real_calls, "reused_events": self.sampler.reused,
                "sample_probability": self.sampler.p, **self.checked,
                "rebalancer": "on" if self.rule else "off"}
