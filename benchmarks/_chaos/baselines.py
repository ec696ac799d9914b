"""The systems this project is compared with, on the same trace (none calls the project's code).

- ``CheckpointRestart``: synchronous training that stops on every interruption: detect and
  exit (a hang: after TorchTitan's collective timeout), restart, load the newest checkpoint,
  redo the training since it. Checkpoints every Young's interval sqrt(2 x save x MTBF) (its best
  case), MTBF = 1 / this job's interruption rate. A restart needs every node: a failed node's
  place is taken by a standby host (``HostPool``; if none is free, the restart waits for a
  repaired one). An interruption during a restart starts the restart again.
- ``TorchFTLike``: per-replica fault tolerance as TorchFT does it: on a failure the survivors
  stall for TorchFT's measured stall (its timeout on the dead peer), then go on without the lost
  replica: the global batch drops by that replica's G microbatches until a replacement has
  joined (``join_after_s``, the same as the project's rejoin; a healing replica commits a zero
  gradient); the others do not wait for the replacement's recovery. A whole-job failure
  (dependency) restarts from a checkpoint (Young's interval for that rate).
- ``FTHSDPLike``: the published FT-HSDP figure: every failure stalls the job for a fixed time
  (3 minutes at O(100K) GPUs); the batch is kept; a whole-job failure restarts.

Silent data corruption counts as an ordinary failure for all three (assumed found; found late,
it would cost them more).
"""

from __future__ import annotations

import math

from _chaos.engine import Checkpoints, HostPool, System
from _chaos.trace import KINDS, RATE_PER_GPU_HOUR, Effect, Failure, Trace

REPAIRED = {Effect.GPU, Effect.SDC, Effect.LINK, Effect.HOST}   # the node must be repaired


def job_rate_s(trace: Trace, effects) -> float:
    """Interruptions per second of ``effects`` in this trace's mix (its expected rate)."""
    share = sum(k.count for k in KINDS if k.effect in effects) / sum(k.count for k in KINDS)
    return RATE_PER_GPU_HOUR * trace.rate_scale * trace.gpus / 3600 * share


def standby_hosts(replicas: int, fraction: float) -> int:
    """The standby hosts of a job of ``replicas`` nodes: ``fraction`` of them, at least 2."""
    return max(2, math.ceil(replicas * fraction))


class CheckpointRestart(System):
    """Synchronous training with checkpoints at Young's interval (the module docstring);
    ``restart_again`` False ignores failures during a restart (projection.py's A2)."""

    name = "checkpoint-restart"

    def __init__(self, trace: Trace, horizon_s: float, inp: dict, standby: int,
                 restart_again: bool = True) -> None:
        super().__init__(trace, horizon_s)
        self.inp, self.restart_again = inp, restart_again
        rate = job_rate_s(trace, set(Effect))
        self.ckpt = Checkpoints.young(inp["save_s"], 1 / rate if rate else float("inf"),
                                      horizon_s)
        self.pool = HostPool(trace.replicas, standby, inp["repair_s_host"])
        self.restarts = 0

    def factors(self):
        return [(self.ckpt.factor, "checkpoint saves"), (self.straggler_factor(), "stragglers")]

    def on_failure(self, t: float, f: Failure) -> None:
        """Stop, redo since the last checkpoint, restart (again, if already restarting)."""
        inp = self.inp
        ready = self.pool.replace(t, f.replica, f.effect in REPAIRED)
        down_from = max(t, ready)
        detect = inp["cr_hang_s"] if f.effect is Effect.HANG else inp["cr_detect_exit_s"]
        if self.paused_until > t:   # down already: the restart starts again
            if not self.restart_again:    # (projection.py's A2: not counted)
                return
            self.pause(t, down_from - t + inp["restart_s"] + inp["load_s"], "restarts",
                       restart=True)
            return
        self.ckpt.restart(self.ledger, "redone after a restart")
        self.restarts += 1
        self.pause(t, down_from - t + detect + inp["restart_s"] + inp["load_s"], "restarts",
                   restart=True)
        self.ledger.marks.append((t, "restart"))

    def on_timer(self, t, what, payload) -> None:
        raise AssertionError(what)

    def extra(self) -> dict:
        return {"checkpoint_interval_s": self.ckpt.tau_s, "restarts": self.restarts}


class _ReplicaTolerant(System):
    """Shared by the TorchFT-like and FT-HSDP-like systems: a stall per failure, a whole-job
    failure restarts from a checkpoint."""

    stall_key = ""

    def __init__(self, trace: Trace, horizon_s: float, inp: dict, standby: int) -> None:
        super().__init__(trace, horizon_s)
        self.inp = inp
        rate = job_rate_s(trace, {Effect.JOB})
        self.ckpt = Checkpoints.young(inp["save_s"], 1 / rate if rate else float("inf"),
                                      horizon_s)
        self.pool = HostPool(trace.replicas, standby, inp["repair_s_host"])
        self.out: set[int] = set()
        self.restarts = 0

    def on_failure(self, t: float, f: Failure) -> None:
        """A whole-job failure restarts; any other stalls the job and loses one replica."""
        inp = self.inp
        if f.effect is Effect.JOB:
            self.ckpt.restart(self.ledger, "redone after a restart")
            self.restarts += 1
            self.pause(t, inp["cr_detect_exit_s"] + inp["restart_s"] + inp["load_s"],
                       "restarts", restart=True)
            return
        if f.replica in self.out:   # its slot's node is being replaced already
            return
        self.pause(t, inp[self.stall_key], "stall per failure")
        self.lose(t, f)

    def lose(self, t: float, f: Failure) -> None:
        """What happens to the lost replica (nothing more by default)."""

    def on_timer(self, t: float, what: str, replica) -> None:
        assert what == "join", what
        self.out.discard(replica)

    def extra(self) -> dict:
        return {"checkpoint_interval_s": self.ckpt.tau_s, "restarts": self.restarts}


class TorchFTLike(_ReplicaTolerant):
    """The batch drops with the replicas out until they rejoin."""

    name = "TorchFT-like"
    stall_key = "torchft_stall_s"

    def factors(self):
        alive = self.trace.replicas - len(self.out)
        return [(self.ckpt.factor, "checkpoint saves"),
                (alive / self.trace.replicas, "smaller batch (replicas out)"),
                (self.straggler_factor(), "stragglers")]

    def lose(self, t: float, f: Failure) -> None:
        self.out.add(f.replica)
        ready = self.pool.replace(t, f.replica, f.effect in REPAIRED)
        self.timers.append((ready + self.inp["join_after_s"], "join", f.replica))


class FTHSDPLike(_ReplicaTolerant):
    """A fixed stall per failure, the batch kept."""

    name = "FT-HSDP-like"
    stall_key = "fthsdp_stall_s"

    def factors(self):
        return [(self.ckpt.factor, "checkpoint saves"), (self.straggler_factor(), "stragglers")]
