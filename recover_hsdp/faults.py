"""Real failure injection: a rank or a whole replica really dies (SIGKILL / exit) or hangs.

Faults come from ``[recover.faults]`` (``inject``: specs separated by ";") or the launcher's
repeatable ``--fault replica=R,step=N,phase=P[,rank=K][,mode=M][,bucket=B][,at=A]`` (M in
sigkill|exit|hang|stop|raise|busy|nan|inf_loss|slow|bitflip|update_bitflip|corrupt; A, for
phase=consensus only, where inside the consensus: consensus (before the agreement, the
default), shrink, rebuild, agree-membership),
plus an optional paper-like schedule (:func:`failure_schedule`): one failure every ``every``
steps at a seeded random step inside each interval, ``max_failures`` in all, each of a mode
drawn from ``modes``; its victim is drawn when the step is planned, among the replicas alive
at that step (newcomers included; never the lowest alive one, so one survivor remains), from
the agreed membership, so every rank draws the same victim with no message.

``rank=K`` kills only shard rank K of the replica (its peers must then leave with it: a replica
lives or dies as a unit); without it every rank of the replica dies at the same point.
``bucket=B`` (phases grad_sync / rereduce): fire just before the B-th bucket's cross-replica
reduce; B >= the number of buckets fires after the last one.

Faults that do not end the rank ([Note: bad replicas] in manager/culprits.py):

* ``mode=nan`` (phase grad_sync): the replica's bucket ``bucket=B`` becomes NaN just before its
  cross-replica reduce, snapshot included (the replica computed garbage: what silent data
  corruption or a bad HBM page gives); ``bucket=B`` >= the number of FSDP units: the last
  unit's.
* ``mode=inf_loss`` (any phase of step N): the loss the replica reports for its microbatches of
  step N is +inf (its gradient is left as computed).
* ``mode=slow`` (phase forward): ``seconds`` extra before every microbatch's forward from step N
  on, or for ``steps=K`` steps (a thermally throttled node: alive, progressing, slow);
  ``times=F`` instead: every microbatch takes F times as long as this rank's last microbatch
  before the fault fired (measured by the manager: its own work, without waits).
* ``mode=bitflip`` (phase optimizer): right after step N's update, bit ``bit=K`` (default 20, a
  float32 mantissa bit) of element ``element=E`` (default 0) of this rank's parameter shard is
  flipped: the replica's state silently differs from the others' and stays finite, at rest
  (a flipped bit in memory: the replica's own fingerprint taken right after its update sees
  it, [Note: divergence votes] in manager/divergence.py). ``mode=update_bitflip``: the same
  flip inside the update, before that fingerprint (an optimizer whose arithmetic was wrong):
  only the vote among replicas sees it.
* ``mode=corrupt`` (phase forward): from step N on, every backward of the replica (each of its
  ranks) computes its gradient scaled by ``factor=F`` (default 1.001) while the loss it reports
  stays right: wrong but finite, every step, in every computation of that replica, audits
  included ([Note: gradient audits] in manager/audits.py finds it).

Before dying the victim appends one line to ``faults_fired.jsonl`` (fsync'ed), the counter the
tests check afterwards.
"""

from __future__ import annotations

import enum
import json
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from recover_hsdp.errors import ConfigError
from recover_hsdp.phases import Phase

__all__ = ["ConsensusPoint", "FaultInjector", "FaultSpec", "Mode", "Phase", "ScheduledFault",
           "build_injector", "failure_schedule", "schedule_modes"]


class Mode(str, enum.Enum):
    SIGKILL = "sigkill"  # the process dies at once (SIGKILL)
    EXIT = "exit"        # the process exits (os._exit(17)), no MPI_Finalize
    HANG = "hang"        # the main thread sleeps forever; other threads run (the watchdog)
    STOP = "stop"        # SIGSTOP to itself: every thread frozen, sockets stay open (a hung node)
    RAISE = "raise"      # a RuntimeError at that point (what a CUDA OOM looks like)
    BUSY = "busy"        # NOT a failure: ``seconds`` of pure-Python compute holding the GIL, no
                         # MPI call, no heartbeat (a very long step: must not be declared dead)
    NAN = "nan"          # NOT a death: one gradient bucket of the replica becomes NaN
    INF_LOSS = "inf_loss"  # NOT a death: the replica's loss of that step is +inf
    SLOW = "slow"        # NOT a death: ``seconds`` extra per microbatch from that step on
    BITFLIP = "bitflip"  # NOT a death: one bit of the parameter shard flipped after the update
    UPDATE_BITFLIP = "update_bitflip"  # NOT a death: the same, inside the update
    CORRUPT = "corrupt"  # NOT a death: every gradient of the replica scaled by ``factor`` from N on


class ConsensusPoint(str, enum.Enum):
    """Where inside the consensus a ``phase=consensus`` fault fires (the collectives layer's
    ``on_phase`` hook): before the agreement, or inside a repair (shrink, rebuild of the
    communicators, agreement on the new membership)."""

    AGREE = "consensus"
    SHRINK = "shrink"
    REBUILD = "rebuild"
    MEMBERSHIP = "agree-membership"


@dataclass(frozen=True)
class FaultSpec:
    replica: int
    step: int
    phase: Phase
    rank: int | None = None
    mode: Mode = Mode.SIGKILL
    bucket: int = 0
    seconds: float = 30.0
    point: ConsensusPoint = ConsensusPoint.AGREE
    steps: int = 0  # mode=slow: for this many steps (0: until the end of the run)
    times: float = 0.0  # mode=slow: F times the last microbatch before the fault (0: seconds)
    element: int = 0  # mode=bitflip: which element of the shard (in parameter order)
    bit: int = 20  # mode=bitflip: which bit of its raw word
    factor: float = 1.001  # mode=corrupt: the replica's gradients are this many times right

    def covers(self, step: int) -> bool:
        """Whether ``step`` is one this fault fires at (a slow fault spans its ``steps``, a
        corrupt one every step from its own)."""
        if self.mode is Mode.CORRUPT:
            return step >= self.step
        if self.mode is not Mode.SLOW:
            return step == self.step
        return step >= self.step and (self.steps <= 0 or step < self.step + self.steps)

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        fields = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = item.partition("=")
            fields[key.strip()] = value.strip()
        try:
            mode = Mode(fields.pop("mode", "sigkill"))
            default_phase = "forward" if mode in (Mode.SLOW, Mode.CORRUPT) else "grad_sync"
            spec = cls(replica=int(fields.pop("replica")), step=int(fields.pop("step")),
                       phase=Phase(fields.pop("phase", default_phase)),
                       rank=int(fields["rank"]) if "rank" in fields else None,
                       mode=mode, bucket=int(fields.pop("bucket", 0)),
                       seconds=float(fields.pop("seconds", 30.0)),
                       point=ConsensusPoint(fields.pop("at", "consensus")),
                       steps=int(fields.pop("steps", 0)),
                       times=float(fields.pop("times", 0.0)),
                       element=int(fields.pop("element", 0)), bit=int(fields.pop("bit", 20)),
                       factor=float(fields.pop("factor", 1.001)))
            fields.pop("rank", None)
        except (KeyError, ValueError) as err:
            raise ConfigError(
                f"--fault {text!r}: {err}: expected replica=R,step=N,phase="
                f"{'|'.join(p.value for p in Phase)}[,rank=K][,mode="
                f"{'|'.join(m.value for m in Mode)}][,bucket=B][,seconds=S][,steps=K]"
                f"[,times=F][,element=E][,bit=K][,factor=F]"
                f"[,at={'|'.join(c.value for c in ConsensusPoint)}]"
                ) from None
        if fields:
            raise ConfigError(f"--fault {text!r}: unknown key {sorted(fields)[0]!r}")
        if spec.mode is Mode.RAISE and spec.phase is Phase.CONSENSUS:
            raise ConfigError(f"--fault {text!r}: mode=raise cannot fire inside the consensus (an "
                              "exception there is not a replica-local error); use sigkill, exit, "
                              "hang or stop, or another phase")
        _check_bad_replica_mode(text, spec)
        return spec


#: The phase a fault that does not end the rank must fire at (inf_loss: any).
_BAD_REPLICA_PHASES = {Mode.NAN: (Phase.GRAD_SYNC,), Mode.SLOW: (Phase.FORWARD,),
                       Mode.BITFLIP: (Phase.OPTIMIZER,), Mode.UPDATE_BITFLIP: (Phase.OPTIMIZER,),
                       Mode.CORRUPT: (Phase.FORWARD,)}


#: The bit flips (fired at the optimizer's points that pass ``updated``).
FLIPS = (Mode.BITFLIP, Mode.UPDATE_BITFLIP)

def _check_bad_replica_mode(text: str, spec: FaultSpec) -> None:
    phases = _BAD_REPLICA_PHASES.get(spec.mode)
    if phases and spec.phase not in phases:
        raise ConfigError(f"--fault {text!r}: mode={spec.mode.value} fires at phase="
                          f"{phases[0].value}; set phase={phases[0].value} or drop phase")
    if spec.mode is Mode.SLOW and spec.seconds < 0:
        raise ConfigError(f"--fault {text!r}: seconds must be >= 0 for mode=slow")
    if spec.steps and spec.mode is not Mode.SLOW:
        raise ConfigError(f"--fault {text!r}: steps=K is for mode=slow only; drop it")
    flips = spec.mode in FLIPS
    if (spec.element, spec.bit) != (0, 20) and not flips:
        raise ConfigError(f"--fault {text!r}: element=E and bit=K are for mode=bitflip or "
                          "update_bitflip only")
    if flips and (spec.element < 0 or not 0 <= spec.bit < 64):
        raise ConfigError(f"--fault {text!r}: mode=bitflip needs element >= 0 and bit in "
                          "0..63 (within the element's word, e.g. 0..31 for float32)")
    if spec.factor != 1.001 and spec.mode is not Mode.CORRUPT:
        raise ConfigError(f"--fault {text!r}: factor=F is for mode=corrupt only; drop it")
    if spec.mode is Mode.CORRUPT and not (math.isfinite(spec.factor) and spec.factor != 1.0):
        raise ConfigError(f"--fault {text!r}: mode=corrupt needs a finite factor other than 1 "
                          "(e.g. factor=1.001)")
    if spec.times and (spec.mode is not Mode.SLOW or spec.times < 1):
        raise ConfigError(f"--fault {text!r}: times=F is for mode=slow only, with F >= 1 "
                          "(2: every microbatch twice as long)")


#: The modes a schedule may draw (slow and busy are not failures of one step).
SCHEDULE_MODES = (Mode.SIGKILL, Mode.EXIT, Mode.HANG, Mode.STOP, Mode.RAISE, Mode.NAN,
                  Mode.INF_LOSS, Mode.BITFLIP, Mode.UPDATE_BITFLIP, Mode.CORRUPT)


@dataclass(frozen=True)
class ScheduledFault:
    """One failure of the schedule: its step, mode, phase and ``pick`` in [0, 1), which of
    the candidates alive at that step is the victim (:meth:`victim`)."""

    step: int
    mode: Mode
    phase: Phase
    pick: float

    def victim(self, alive) -> int | None:
        """The victim among the ``alive`` replicas (sorted; never the lowest), or None."""
        candidates = sorted(alive)[1:]
        return candidates[int(self.pick * len(candidates))] if candidates else None

    def spec(self, replica: int) -> FaultSpec:
        return FaultSpec(replica=replica, step=self.step, phase=self.phase, mode=self.mode)


def failure_schedule(every: int, max_failures: int, phase: Phase, seed: int,
                     modes=(Mode.SIGKILL,)) -> list[ScheduledFault]:
    """``max_failures`` failures, one per ``every``-step interval at a seeded random step, each
    of a mode drawn from ``modes`` (a mode with a phase of its own fires there: nan at
    grad_sync, bitflip at optimizer); the victims are drawn when their step is planned."""
    rng = random.Random(seed)
    schedule = []
    for index in range(max_failures if every > 0 else 0):
        step = index * every + rng.randint(1, every)
        mode = modes[rng.randrange(len(modes))]
        own = _BAD_REPLICA_PHASES.get(mode)
        schedule.append(ScheduledFault(step, mode, own[0] if own else phase, rng.random()))
    return schedule


def schedule_modes(text: str, phase: Phase) -> tuple[Mode, ...]:
    """``[recover.faults] modes`` (comma-separated) checked; a ``ConfigError`` names the field."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    allowed = ", ".join(m.value for m in SCHEDULE_MODES)
    try:
        modes = tuple(Mode(name) for name in names)
    except ValueError:
        modes = ()
    if not modes or any(m not in SCHEDULE_MODES for m in modes):
        raise ConfigError(f"recover.faults.modes={text!r}: use a comma-separated list of {allowed}")
    if Mode.RAISE in modes and phase is Phase.CONSENSUS:
        raise ConfigError("recover.faults.modes: raise cannot fire inside the consensus "
                          "(recover.faults.phase=consensus): drop raise or pick another phase")
    return modes


class FaultInjector:
    """Fires this rank's faults at the (step, phase[, bucket | point]) the phase hooks announce."""

    def __init__(self, specs: list[FaultSpec], replica: int, shard: int, out_dir: str | Path,
                 schedule: list[ScheduledFault] = ()):
        self.mine = [s for s in specs if s.replica == replica and s.rank in (None, shard)]
        self.schedule = {f.step: f for f in schedule}  # drawn at the step's plan point
        self.replica, self.shard = replica, shard
        self.out_dir = Path(out_dir)
        self._recorded: set[FaultSpec] = set()  # faults that fire many times, recorded once
        self._base_s: dict[FaultSpec, float] = {}  # mode=slow,times=F: the microbatch before

    def on_phase(self, step: int, phase: Phase, detail: dict) -> None:
        """The ``PhaseHooks`` subscriber ([Note: phases as data] in recover_hsdp/phases.py)."""
        self.at(step, phase, **detail)

    def at(self, step: int, phase: Phase, bucket: int | None = None,
           buckets_total: int | None = None, point: ConsensusPoint | None = None,
           tensors: tuple = (), last_microbatch_s: float | None = None,
           updated=None, microbatch: int | None = None, alive=None,
           inside_update: bool = False) -> None:
        """``tensors``: what a ``mode=nan`` fault poisons (a bucket and its snapshot);
        ``last_microbatch_s``: this rank's last microbatch (the base of ``mode=slow,times=F``);
        ``updated``: given at the point right after the update, ``updated(element, bit)`` flips
        a bit of the shard (``mode=bitflip`` fires only there, nothing else does; with
        ``inside_update``, the point before the replica's own post-update fingerprint, only
        ``mode=update_bitflip`` does); ``alive``:
        the plan point's replicas alive at the step, among which the schedule draws."""
        if alive is not None and step in self.schedule:
            drawn = self.schedule.pop(step)
            if drawn.victim(alive) == self.replica:
                self.mine.append(drawn.spec(self.replica))
        for spec in self.mine:
            if spec.phase != phase or not spec.covers(step):
                continue
            if (spec.mode in FLIPS) != (updated is not None):
                continue
            if updated is not None and (spec.mode is Mode.UPDATE_BITFLIP) != inside_update:
                continue
            if updated is not None:
                self._record(spec)
                updated(spec.element, spec.bit)
                continue
            if spec.mode is Mode.INF_LOSS:
                continue  # applied by ``loss_of``
            if spec.mode is Mode.CORRUPT:
                self._record_once(spec)  # applied by ``gradient_factor``
                continue
            if spec.mode is Mode.NAN:
                self._poison(spec, bucket, buckets_total, tensors)
                continue
            if phase is Phase.CONSENSUS and spec.point is not point:
                continue
            if bucket is not None and spec.bucket != bucket and not (
                    buckets_total is not None and bucket >= buckets_total
                    and spec.bucket >= buckets_total):
                continue
            if spec.mode is Mode.SLOW:
                self._record_once(spec)
                time.sleep(self._slow_seconds(spec, last_microbatch_s))
            else:
                self._fire(spec)

    def _slow_seconds(self, spec: FaultSpec, last_microbatch_s: float | None) -> float:
        if not spec.times:
            return spec.seconds
        base = self._base_s.setdefault(spec, last_microbatch_s or 0.0)
        return (spec.times - 1.0) * base

    def _poison(self, spec: FaultSpec, bucket: int | None, buckets_total: int | None,
                tensors: tuple) -> None:
        """``mode=nan``: before the reduce of bucket ``spec.bucket`` (beyond the last: the last
        of ``buckets_total``), every tensor of ``tensors`` becomes NaN."""
        if not tensors or bucket is None:
            return
        wanted = spec.bucket if buckets_total is None else min(spec.bucket, buckets_total - 1)
        if bucket == wanted:
            self._record(spec)
            for tensor in tensors:
                tensor.fill_(float("nan"))

    def loss_of(self, step: int, loss: float) -> float:
        """The loss this replica reports for a microbatch of ``step``: +inf under a
        ``mode=inf_loss`` fault of that step (recorded once), else ``loss`` unchanged."""
        for spec in self.mine:
            if spec.mode is Mode.INF_LOSS and spec.step == step:
                self._record_once(spec)
                return float("inf")
        return loss

    def gradient_factor(self, step: int) -> float:
        """What this replica's backward multiplies its gradients by in ``step``: a ``mode=
        corrupt`` fault's ``factor`` from its step on, else 1.0."""
        factor = 1.0
        for spec in self.mine:
            if spec.mode is Mode.CORRUPT and spec.covers(step):
                factor *= spec.factor
        return factor

    def _record_once(self, spec: FaultSpec) -> None:
        if spec not in self._recorded:
            self._recorded.add(spec)
            self._record(spec)

    def _record(self, spec: FaultSpec) -> None:
        """One line in ``faults_fired.jsonl`` (fsync'ed) and one on stdout."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"replica": self.replica, "shard": self.shard, "step": spec.step,
                  "phase": spec.phase.value, "mode": spec.mode.value, "bucket": spec.bucket,
                  "pid": os.getpid(), "time": time.time()}
        with open(self.out_dir / "faults_fired.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        print(f"[recover-hsdp fault] replica {self.replica} shard {self.shard}: "
              f"{spec.mode.value} at step {spec.step} {spec.phase.value}", flush=True)

    def _fire(self, spec: FaultSpec) -> None:
        self._record(spec)
        if spec.mode is Mode.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.mode is Mode.EXIT:
            os._exit(17)
        if spec.mode is Mode.STOP:
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # continued (SIGCONT): carry on as a slow rank would
        if spec.mode is Mode.BUSY:
            until = time.monotonic() + spec.seconds
            while time.monotonic() < until:  # the GIL is held: only C threads run meanwhile
                sum(range(10000))
            return
        if spec.mode is Mode.RAISE:
            raise RuntimeError(f"injected fault at step {spec.step} {spec.phase.value} "
                               f"(replica {self.replica} shard {self.shard})")
        while True:  # HANG: alive but stuck; the hang watchdog must kill this rank
            time.sleep(3600)


def build_injector(fault_config, replicas: int, replica: int, shard: int,
                   out_dir: str | Path) -> FaultInjector:
    specs = [FaultSpec.parse(t) for t in fault_config.inject.split(";") if t.strip()]
    phase = Phase(fault_config.phase)
    schedule = failure_schedule(fault_config.every, fault_config.max_failures, phase,
                                fault_config.seed, schedule_modes(fault_config.modes, phase)) \
        if fault_config.every > 0 else []
    return FaultInjector(specs, replica, shard, out_dir, schedule)
