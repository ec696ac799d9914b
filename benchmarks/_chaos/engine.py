"""The event loop every simulated system runs in, and what it accounts.

Time is wall seconds from the job's start. Between two events a system trains at a rate: the
fraction of failure-free training it does per wall second (1: as fast as failure-free stock
TorchTitan at this size), a product of factors each with the cause of its shortfall (checkpoint
saves, a raised G, a smaller batch, a straggler). A stall trains nothing for a while; a restart
discards the training done since the last checkpoint. Steps are never simulated one by one:
between two events every step is the same, so the ledger accounts them in bulk.

``Ledger`` keeps, at every instant, progress + every lost second == elapsed wall time, and the
checks at the end assert it.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque

from _chaos.trace import Failure, Straggler, Trace


class Ledger:
    """Progress (seconds of failure-free training kept) and lost seconds by cause."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self.t = 0.0
        self.progress = 0.0
        self.run_time = 0.0          # wall seconds spent training (not stalled)
        self.lost: dict[str, float] = defaultdict(float)
        self.discarded = 0.0         # training redone after a restart, in seconds
        self.samples: list[tuple[float, int, int]] = []   # (t, alive replicas, G)
        self.marks: list[tuple[float, str]] = []          # (t, what happened)

    def run(self, t_to: float, factors: list[tuple[float, str]]) -> None:
        """Train until ``t_to`` at the product of ``factors``; each factor's shortfall goes to
        its cause, in order."""
        dt = t_to - self.t
        if dt <= 0:
            return
        rate = 1.0
        for factor, cause in factors:
            if factor < 1.0:
                self.lost[cause] += dt * rate * (1.0 - factor)
            rate *= factor
        self.progress += dt * rate
        self.run_time += dt
        self.t = t_to

    def stall(self, t_to: float, cause: str) -> None:
        """Train nothing until ``t_to``."""
        if t_to > self.t:
            self.lost[cause] += t_to - self.t
            self.t = t_to

    def discard(self, seconds: float, cause: str) -> None:
        """Training done and lost (redone after a restart)."""
        seconds = min(seconds, self.progress)
        self.progress -= seconds
        self.discarded += seconds
        self.lost[cause] += seconds

    def check(self) -> None:
        """Progress and losses add up to the wall time (the accounting's invariant)."""
        total = self.progress + sum(self.lost.values())
        assert math.isclose(total, self.t, rel_tol=1e-9, abs_tol=1e-6), (total, self.t)


class Checkpoints:
    """Periodic checkpoints: a save of ``save_s`` after every ``tau_s`` seconds of training;
    a restart loses the training since the last completed save."""

    def __init__(self, tau_s: float, save_s: float) -> None:
        self.tau_s, self.save_s = tau_s, save_s
        self.factor = tau_s / (tau_s + save_s)
        self._base = (0.0, 0.0)      # (run_time, progress) when training last resumed

    @staticmethod
    def young(save_s: float, mtbf_s: float, horizon_s: float) -> "Checkpoints":
        """Young's interval sqrt(2 x save x MTBF); no failure that needs it: one interval."""
        tau = math.sqrt(2 * save_s * mtbf_s) if math.isfinite(mtbf_s) else horizon_s
        return Checkpoints(min(tau, horizon_s), save_s)

    def restart(self, ledger: Ledger, cause: str) -> float:
        """A restart: discard the training since the last completed save; the cycle starts
        again. Returns the seconds discarded."""
        run0, progress0 = self._base
        elapsed = ledger.run_time - run0
        cycle = self.tau_s + self.save_s
        since = elapsed - math.floor(elapsed / cycle) * cycle if elapsed > 0 else 0.0
        lost = (ledger.progress - progress0) * since / elapsed if elapsed > 0 else 0.0
        ledger.discard(lost, cause)
        self.mark(ledger)
        return lost

    def mark(self, ledger: Ledger) -> None:
        """A complete checkpoint now (an emergency save); the cycle starts again."""
        self._base = (ledger.run_time, ledger.progress)


class HostPool:
    """The job's hosts and its standby hosts; a failed host is repaired and comes back."""

    def __init__(self, replicas: int, standby: int, repair_s: float) -> None:
        self.host_of = [f"node{r}" for r in range(replicas)]
        self.hostfile = self.host_of + [f"standby{i}" for i in range(standby)]
        self.free = deque(self.hostfile[replicas:])
        self.repairing: list[tuple[float, str]] = []
        self.repair_s = repair_s
        self.most_in_repair = 0

    def _release(self, t: float) -> None:
        while self.repairing and self.repairing[0][0] <= t:
            self.free.append(heapq.heappop(self.repairing)[1])

    def replace(self, t: float, replica: int, repair: bool) -> float:
        """``replica``'s host failed at ``t`` (``repair``: it must be repaired); a standby host
        takes its place. Returns when one is there (a repaired one, if none is free)."""
        if not repair:
            return t
        self._release(t)
        heapq.heappush(self.repairing, (t + self.repair_s, self.host_of[replica]))
        self.most_in_repair = max(self.most_in_repair, len(self.repairing))
        if self.free:
            self.host_of[replica] = self.free.popleft()
            return t
        back, host = heapq.heappop(self.repairing)
        self.host_of[replica] = host
        return back

    def in_repair(self, t: float) -> set[str]:
        self._release(t)
        return {h for _, h in self.repairing}


class System:
    """What the engine needs of a simulated system; subclasses handle the events."""

    name = "system"

    def __init__(self, trace: Trace, horizon_s: float) -> None:
        self.trace = trace
        self.ledger = Ledger(horizon_s)
        self.paused_until, self.pause_cause = 0.0, ""
        self.timers: list[tuple[float, str, object]] = []
        self.slow: dict[int, float] = {}       # replica -> slowdown of its straggler episode
        self.failures_seen = 0

    def pause(self, t: float, seconds: float, cause: str, *, restart: bool = False) -> None:
        """Stall from ``t``: ``seconds`` more after any stall under way (``restart``: the stall
        starts again from ``t``, as a restart interrupted by a failure does)."""
        self.paused_until = (t if restart else max(t, self.paused_until)) + seconds
        self.pause_cause = cause

    def factors(self) -> list[tuple[float, str]]:
        raise NotImplementedError

    def straggler_factor(self) -> float:
        """A synchronous step waits for its slowest replica."""
        return 1.0 / max(self.slow.values()) if self.slow else 1.0

    def on_failure(self, t: float, failure: Failure) -> None:
        raise NotImplementedError

    def on_timer(self, t: float, what: str, payload) -> None:
        raise NotImplementedError

    def on_straggler(self, t: float, episode: Straggler, start: bool) -> None:
        if start:
            self.slow[episode.replica] = max(self.slow.get(episode.replica, 1.0),
                                             episode.slowdown)
        else:
            self.slow.pop(episode.replica, None)

    def advance(self, t: float) -> None:
        """Account the time up to ``t``: the stall under way, then training."""
        if self.paused_until > self.ledger.t:
            self.ledger.stall(min(self.paused_until, t), self.pause_cause)
        if t > self.ledger.t:
            self.ledger.run(t, self.factors())

    def summary(self, step_s: float, tokens_per_step: float, gpus: int) -> dict:
        """The figures of the run: effective training time (failure-free training kept / wall
        time), tokens per GPU-hour of the job's GPUs, steps redone, lost seconds by cause."""
        ledger = self.ledger
        hours = ledger.t / 3600
        return {
            "effective_training_time": ledger.progress / ledger.t,
            "tokens_per_gpu_hour": ledger.progress / step_s * tokens_per_step / (gpus * hours),
            "steps_committed": ledger.progress / step_s,
            "steps_lost": ledger.discarded / step_s,
            "interruptions": self.failures_seen,
            "lost_s_by_cause": {k: round(v, 3) for k, v in sorted(ledger.lost.items())},
        }


def simulate(system: System) -> System:
    """Run ``system`` through its trace to the horizon (events and its own timers, in time
    order; ties: failures before timers, in the order they were made)."""
    horizon = system.ledger.horizon_s
    heap: list = [(f.t, 0, i, "failure", f) for i, f in enumerate(system.trace.failures)]
    for i, s in enumerate(system.trace.stragglers):
        heap += [(s.t, 1, i, "slow", s), (s.t + s.duration_s, 1, i, "slow_end", s)]
    heapq.heapify(heap)
    seq = len(heap)
    while heap:
        t, _, _, what, payload = heapq.heappop(heap)
        if t >= horizon:
            break
        system.advance(t)
        if what == "failure":
            system.failures_seen += 1
            system.on_failure(t, payload)
        elif what in ("slow", "slow_end"):
            system.on_straggler(t, payload, what == "slow")
        else:
            system.on_timer(t, what, payload)
        for timer in system.timers:
            seq += 1
            heapq.heappush(heap, (timer[0], 2, seq, timer[1], timer[2]))
        system.timers.clear()
    system.advance(horizon)
    system.ledger.check()
    return system
