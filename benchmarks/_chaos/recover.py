"""This project in the chaos simulator: each event decided by the project's own code.

- a death (a GPU fault, a software bug, a hang once the hang bound has passed): the real
  ``WorkloadPolicy`` replans the step (``probe.PolicyProbe``); the survivors stall for the
  detection + repair + restore + the extra microbatches the replan gives the busiest survivor;
  the steps after take the plan's critical path (G raised) until the replacement rejoins
  (``admit``) ``respawn_after_steps`` steps later on a standby host, after the measured start-up;
- a hang: a rank's main thread is stuck; it ends itself after the bound the real
  ``ProgressBound`` (collectives/guard.py, [Note: a hang bound from progress]) learns from the
  rank's own microbatches, then it is a death;
- silent data corruption: the real ``exclude`` keeps B for the step without the culprit; the
  culprit leaves at the boundary (retired) and is replaced like a dead replica;
- a cut link: each side sees the other as dead; the real ``SplitBrainArbiter`` decides which
  side goes on (claims in a temporary folder: real files); the majority repairs in-job;
- a lost node (a host down with its PRRTE daemon, or cut off): PRRTE 3.0 ends the job (as
  built), so the relaunch tier starts it again: the lost hosts from simulated evidence by the
  real ``lost_hosts`` (PRRTE's lost-daemon line, the launcher's unanswered probe), the next
  attempt by the real ``plan_relaunch`` (the hostfile's hosts minus the lost ones, as many
  replicas as fit, at most ``max_relaunches``), the policy from its saved state; a crash redoes
  the steps since the newest periodic checkpoint, a cut link none (the emergency checkpoint);
  with ``tolerant`` (PRRTE surviving lost daemons, openpmix/prrte#2443, in no release yet) a
  lost node is an in-job death instead;
- a failure of the whole job (a dependency): a relaunch from the newest checkpoint.

Above the run's budget the arbiter's claims and the relaunch planning, like the policy, are a
seeded sample reused by shape ([Note: sampled policy calls] in probe.py); the counts are in the
output. Failures while the job is being relaunched: a lost host starts the relaunch again
(PRRTE ends the starting job); any other failure there costs nothing but the node (a death
after the world is built is an ordinary in-job death at start-up: docs/failures.md
"Start-up").
"""

from __future__ import annotations

import random

from _chaos.baselines import job_rate_s
from _chaos.engine import Checkpoints, HostPool, System
from _chaos.probe import PolicyProbe, SampledCalls
from _chaos.trace import Effect, Failure, Straggler, Trace
from recover_hsdp.cli import relaunch
from recover_hsdp.cli.hostfile import HostEntry
from recover_hsdp.collectives.arbiter import SplitBrainArbiter
from recover_hsdp.collectives.guard import ProgressBound


class Recover(System):
    """The project, as built (``tolerant`` False) or with a runtime that survives lost daemons."""

    def __init__(self, trace: Trace, horizon_s: float, inp: dict, standby: int, *,
                 tolerant: bool, budget: float, rebalance_max_replicas: int,
                 after_steps: int, arbiter_dir: str, memo: dict | None = None) -> None:
        super().__init__(trace, horizon_s)
        self.name = "this project" + (", PRRTE surviving lost daemons" if tolerant else "")
        self.inp, self.tolerant, self.s = inp, tolerant, int(inp["replica_gpus"])
        self.probe = PolicyProbe(trace.replicas, int(inp["g_init"]), inp,
                                 random.Random(f"{trace.seed}-recover-{tolerant}"), budget,
                                 trace.replicas <= rebalance_max_replicas, after_steps, memo)
        self.probe.sampler.expect(2 * len(trace.failures))
        self.units, self.g = float(inp["g_init"]), int(inp["g_init"])
        self.pool = HostPool(trace.replicas, standby, inp["repair_s_host"])
        self.hostfile = [HostEntry(h, h, self.s) for h in self.pool.hostfile]
        self.hostnames = list(self.pool.hostfile)
        redo = {Effect.JOB} if tolerant else {Effect.JOB, Effect.HOST}
        rate = job_rate_s(trace, redo)
        self.ckpt = Checkpoints.young(inp["save_s"], 1 / rate if rate else float("inf"),
                                      horizon_s)
        self.arbiter = SplitBrainArbiter(arbiter_dir, sleep=self._head_start,
                                         log=self._arbiter_log)
        rng, counts = random.Random(f"{trace.seed}-decisions-{tolerant}"), trace.counts()
        self.claims = SampledCalls(rng, budget, 2 * trace.replicas, counts["link"])
        self.plans = SampledCalls(rng, budget, 3 * len(self.hostfile),
                                  counts["link"] + counts["host"] + counts["job"])
        self.epoch, self.generation, self.down_generation = 0, 0, 0
        self.down, self.pending = False, None
        self.relaunches_done, self.launcher_runs = 0, 1
        self.stats = {"relaunches": 0, "relaunches_restarted": 0, "given_up_at_h": [],
                      "in_job_recoveries": 0, "rejoins": 0, "culprits_excluded": 0,
                      "arbiter_claims": 0, "split_brain": 0, "majority_refused": 0,
                      "arbiter_errors": 0, "head_starts_s": set(), "hang_bounds_s": set()}

    # ---- accounting -------------------------------------------------------------------------
    def factors(self):
        """Checkpoint saves, the failure-free overhead, the plan's critical path (a raised G;
        with the rebalancer on, the quotas weighed by speed), else the slowest straggler."""
        rebalanced = self.probe.rule is not None
        out = [(self.ckpt.factor, "checkpoint saves"),
               (1.0 / self.inp["recover_overhead"], "failure-free overhead"),
               (min(1.0, self.inp["g_init"] / self.units),
                "raised G / rebalanced quotas" if rebalanced else "raised G (replicas out)")]
        return out if rebalanced else out + [(self.straggler_factor(), "stragglers")]

    def step(self) -> int:
        """The step the job is at: failure-free training kept / the step time."""
        return int(self.ledger.progress / self.inp["step_s"])

    def _set(self, t: float, outcome) -> None:
        self.units, self.g = outcome.units, outcome.g
        self.ledger.samples.append((t, len(self.probe.alive), self.g))

    def _head_start(self, seconds: float) -> None:
        self.stats["head_starts_s"].add(seconds)

    def _arbiter_log(self, line: str) -> None:
        self.stats["arbiter_errors"] += 1
        self.stats.setdefault("arbiter_error_example", line[:160])

    # ---- events -----------------------------------------------------------------------------
    def on_failure(self, t: float, f: Failure) -> None:
        """Dispatch an interruption by its effect (the module docstring says what each does)."""
        if f.effect is Effect.JOB:
            return self._relaunch(t, [], emergency=False)
        if self.down:
            host = self.pool.host_of[f.replica]
            self.pool.replace(t, f.replica, f.effect not in (Effect.PROCESS, Effect.HANG))
            if f.effect in (Effect.HOST, Effect.LINK) and not self.tolerant:
                self._relaunch(t, [host], emergency=False)
            return
        if f.replica not in self.probe.alive:   # its slot's node is being replaced already
            return
        inp, r = self.inp, f.replica
        if f.effect in (Effect.GPU, Effect.PROCESS):
            self._death(t, r, inp["detect_death_s"], f.effect is Effect.GPU)
        elif f.effect is Effect.HANG:
            self._death(t, r, self._hang_bound(r) + inp["detect_death_s"], False)
        elif f.effect is Effect.SDC:
            self._culprit(t, r)
        elif f.effect is Effect.LINK:
            self._arbitrate(r)
            host = self.pool.host_of[r]
            self._death(t, r, inp["detect_node_s"], True)
            if not self.tolerant:
                self._relaunch(t, [host], emergency=True)
        elif self.tolerant:                        # Effect.HOST
            self._death(t, r, inp["detect_node_s"], True)
        else:
            host = self.pool.host_of[r]
            self.pool.replace(t, r, True)
            self._relaunch(t, [host], emergency=False)

    def _death(self, t: float, r: int, detect_s: float, repair: bool) -> None:
        """An in-job recovery: the real replan; the replacement's rejoin is scheduled."""
        out = self.probe.death([r], self.step())
        inp = self.inp
        self.pause(t, detect_s + inp["repair_s"] + inp["restore_s"]
                   + out.extras * inp["microbatch_s"], "in-job recovery")
        self.stats["in_job_recoveries"] += 1
        self._set(t, out)
        self._replace(t, r, repair)

    def _culprit(self, t: float, r: int) -> None:
        out = self.probe.culprit([r], self.step())
        self.pause(t, self.inp["restore_s"] + out.extras * self.inp["microbatch_s"],
                   "in-job recovery")
        self.stats["culprits_excluded"] += 1
        self._set(t, out)
        self._replace(t, r, True)

    def _replace(self, t: float, r: int, repair: bool) -> None:
        ready = self.pool.replace(t, r, repair)
        when = max(ready, t) + self.inp["respawn_after_steps"] * self.inp["step_s"] \
            + self.inp["join_after_s"]
        self.timers.append((when, "join", (r, self.generation)))

    def on_timer(self, t: float, what: str, payload) -> None:
        """A relaunch trains again, or a replacement joins at a step boundary (``admit``)."""
        if what == "relaunched":
            if payload == self.down_generation:
                self._relaunched(t)
            return
        r, generation = payload
        if generation != self.generation or self.down or r in self.probe.alive:
            return          # a relaunch came first and brought every replica back
        out = self.probe.join([r], self.step())
        self.pause(t, self.inp["join_stall_s"], "rejoin stall")
        self.stats["rejoins"] += 1
        self._set(t, out)

    def on_straggler(self, t: float, episode: Straggler, start: bool) -> None:
        """With the rebalancer on, the measured speeds go to ``observe_speeds``; else the
        engine's straggler factor slows every step."""
        super().on_straggler(t, episode, start)
        if self.probe.rule is None or self.down:
            return
        self.probe.speed = {r: s for r, s in self.slow.items() if r in self.probe.alive}
        out = self.probe.observe(self.step())
        if start:   # the patience steps before the quota moves run at the straggler's pace
            self.pause(t, self.probe.rule.patience * self.inp["step_s"] * (episode.slowdown - 1),
                       "stragglers (until rebalanced)")
        self._set(t, out)

    # ---- the real decisions besides the policy ----------------------------------------------
    def _hang_bound(self, r: int) -> float:
        """The stuck rank's bound, learned by the real ``ProgressBound`` from its own steps
        (one warm-up step, then the 20-step window, G microbatches each)."""
        inp = self.inp
        bound = ProgressBound(inp["hang_s"], inp["hang_floor_s"], inp["hang_progress_factor"])
        unit = inp["microbatch_s"] * self.slow.get(r, 1.0)
        for _ in range(21):
            for _ in range(self.g):
                bound.gap(unit)
            bound.step_done(unit)
        self.stats["hang_bounds_s"].add(round(bound.seconds, 3))
        return bound.seconds

    def _arbitrate(self, r: int) -> None:
        """A cut link: the cut node's side and the rest each claim the transition (sampled
        above the budget, by the replicas alive)."""
        self.epoch += 1
        majority, minority = self.claims(("claim", len(self.probe.alive)),
                                         lambda: self._claim_both(r))
        self.stats["arbiter_claims"] += 2
        self.stats["majority_refused"] += not majority
        self.stats["split_brain"] += minority

    def _claim_both(self, r: int) -> tuple[bool, bool]:
        """The majority claims first (the minority waits its head start), then the cut node's
        side; each replica is named by its first rank."""
        old = tuple(sorted(self.probe.alive))
        rest = self.probe.alive - {r}
        if not rest:
            return True, False
        majority = self.arbiter.claim(self.epoch, old, {x * self.s for x in rest}, rest,
                                      rank=min(rest) * self.s)
        minority = self.arbiter.claim(self.epoch, old, {r * self.s}, {r}, rank=r * self.s)
        return majority, minority

    # ---- the relaunch tier ------------------------------------------------------------------
    def _relaunch(self, t: float, lost: list[str], *, emergency: bool) -> None:
        """The MPI job ended: relaunch from the newest checkpoint (``emergency``: the one the
        survivors just saved, nothing redone)."""
        inp = self.inp
        restarted = self.down
        if emergency:
            self.pause(t, inp["save_s"], "emergency checkpoint")
            self.ckpt.mark(self.ledger)
        elif not restarted:
            self.ckpt.restart(self.ledger, "redone after a relaunch")
        self.pending = self._plan(t, lost)
        self.down, self.down_generation = True, self.down_generation + 1
        down = inp["launcher_react_s"] + inp["restart_s"] + inp["load_s"]
        self.pause(t, down, "relaunches", restart=restarted)
        self.timers.append((self.paused_until, "relaunched", self.down_generation))
        self.stats["relaunches_restarted" if restarted else "relaunches"] += 1
        self.ledger.marks.append((t, "relaunch"))

    def _plan(self, t: float, lost_now: list[str]) -> int:
        """The replicas of the next attempt, from the real launcher decisions (sampled above the
        budget; the shape: the hosts newly lost, the relaunches used, whether the standby hosts
        cover every lost one). When the relaunches are used up the operator starts
        ``recover-hsdp train`` again (counted)."""
        in_repair = self.pool.in_repair(t)
        spare = len(self.hostfile) - self.trace.replicas
        key = (len(lost_now), self.relaunches_done, len(in_repair | set(lost_now)) <= spare)
        replicas, gave_up = self.plans(key, lambda: self._plan_real(in_repair, lost_now))
        if gave_up:
            self.stats["given_up_at_h"].append(round(t / 3600, 2))
            self.relaunches_done, self.launcher_runs = 0, self.launcher_runs + 1
        self.relaunches_done += 1
        return replicas

    def _plan_real(self, in_repair: set[str], lost_now: list[str]) -> tuple[int, bool]:
        """``lost_hosts`` on simulated evidence (PRRTE's lost-daemon line, the unanswered
        probe; hosts still in repair were lost before), then ``plan_relaunch``; again with a
        fresh launcher's count if the relaunches are used up."""
        log = "".join(f"Remote daemon: [prterun-launcher-1@0,{i}] on node {h}\n"
                      for i, h in enumerate(lost_now))
        evidence = relaunch.Evidence(log_text=log, unanswered=set(lost_now),
                                     launcher_host="launcher", ranks_per_replica=self.s)
        found = relaunch.lost_hosts(self.hostnames, evidence)
        assert set(found) == set(lost_now), (found, lost_now)
        lost = {**{h: "in repair" for h in in_repair}, **found}
        gave_up = False
        for done in (self.relaunches_done, 0):
            plan = relaunch.plan_relaunch(self.hostfile, lost, self.s, self.trace.replicas,
                                          self.s, self.step(), done,
                                          int(self.inp["max_relaunches"]))
            if not isinstance(plan, str):
                return plan.replicas, gave_up
            assert "used up" in plan, plan
            gave_up = True
        raise AssertionError("plan_relaunch refused a fresh launcher")

    def _relaunched(self, t: float) -> None:
        """The new attempt trains: replicas 0..R-1 of the plan (a failed node's replica is on
        the standby host that replaced it), the policy from the checkpoint's state; replicas
        waiting to rejoin are in it already."""
        self.down, self.generation = False, self.generation + 1
        self.ledger.marks.append((t, "training again"))
        self._set(t, self.probe.restart(list(range(self.pending)), self.step()))

    def extra(self) -> dict:
        """What the real decisions did in this run (counts), for the output."""
        stats = dict(self.stats)
        for key in ("head_starts_s", "hang_bounds_s"):
            stats[key] = sorted(stats[key])
        return {**stats, "launcher_runs": self.launcher_runs,
                "checkpoint_interval_s": self.ckpt.tau_s, "policy": self.probe.stats(),
                "arbiter_calls": self.claims.stats(), "relaunch_plans": self.plans.stats(),
                "most_hosts_in_repair": self.pool.most_in_repair,
                "policy_wall_s": round(self.probe.call_s, 2)}
