"""The failure trace: the Llama 3 405B paper's interruption mix, as a rate per GPU-hour.

Source: "The Llama 3 Herd of Models" (Meta, 2024), section 3.3.4 and its Table 5: a 54-day
snapshot of pre-training on 16,384 H100 GPUs had 466 job interruptions, 47 planned (automated
maintenance) and 419 unexpected, by root cause (the counts below are the table's; they sum to
419). The rate is 466 / (54 days x 24 h x 16,384 GPUs) = 2.19e-5 interruptions per GPU-hour, so
a job of N GPUs sees N times that: the rates grow with the GPUs. Arrivals are Poisson; each
interruption hits one replica slot (one node of ``replica_gpus`` GPUs), drawn uniformly; its root
cause is drawn by the table's counts and mapped to what it does to a job (``Effect``).

Stragglers are not in the table: they are an assumption of this simulator (``--straggler-*``):
episodes at a rate that is a fraction of the interruption rate, each slowing one replica's
microbatches by a factor for a while.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

LLAMA3_GPUS, LLAMA3_DAYS, LLAMA3_INTERRUPTIONS = 16_384, 54, 466
RATE_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)


class Effect(str, Enum):
    """What an interruption does to a training job (the same for every system simulated)."""

    GPU = "gpu"          # a GPU fails: its process ends (CUDA error); the host answers; repaired
    PROCESS = "process"  # a software bug ends one replica's process; nothing to repair
    HANG = "hang"        # a collective never completes (NCCL watchdog): a rank is stuck
    SDC = "sdc"          # silent data corruption: a replica's numbers are wrong, nothing dies
    LINK = "link"        # a node is cut off the network (switch, cable, NIC): its daemon too
    HOST = "host"        # a host goes down with its daemon (power, chassis, maintenance, ...)
    JOB = "job"          # a dependency of the whole job fails (storage, scheduler): all stop


class Kind(NamedTuple):
    name: str
    count: int      # interruptions of this root cause in the 54-day snapshot
    effect: Effect


KINDS = (
    Kind("faulty GPU", 148, Effect.GPU), Kind("GPU HBM3 memory", 72, Effect.GPU),
    Kind("software bug", 54, Effect.PROCESS), Kind("network switch/cable", 35, Effect.LINK),
    Kind("host maintenance (unplanned)", 32, Effect.HOST), Kind("GPU SRAM memory", 19, Effect.GPU),
    Kind("GPU system processor", 17, Effect.GPU), Kind("NIC", 7, Effect.LINK),
    Kind("NCCL watchdog timeouts", 7, Effect.HANG), Kind("silent data corruption", 6, Effect.SDC),
    Kind("GPU thermal interface + sensor", 6, Effect.GPU), Kind("SSD", 3, Effect.HOST),
    Kind("power supply", 3, Effect.HOST), Kind("server chassis", 2, Effect.HOST),
    Kind("IO expansion board", 2, Effect.HOST), Kind("dependency", 2, Effect.JOB),
    Kind("CPU", 2, Effect.HOST), Kind("system memory", 2, Effect.HOST),
    Kind("planned maintenance", 47, Effect.HOST),
)
assert sum(k.count for k in KINDS) == LLAMA3_INTERRUPTIONS


class Failure(NamedTuple):
    t: float          # seconds from the start of the job
    kind: str
    effect: Effect
    replica: int      # the replica slot (node) it hits


class Straggler(NamedTuple):
    t: float
    replica: int
    duration_s: float
    slowdown: float   # seconds per microbatch, in multiples of a healthy replica's


@dataclass(frozen=True)
class StragglerModel:
    """Stragglers (not in the Llama 3 table): the rate and the duration are assumptions; the
    slowdown is measured (chaos_sim passes straggler_bench.py's)."""

    rate_factor: float = 0.1     # episodes per GPU-hour, as a fraction of the interruption rate
    duration_s: float = 600.0
    slowdown: float = 2.0


@dataclass
class Trace:
    """One seeded trace: what every system simulated at this size sees."""

    gpus: int
    replicas: int
    hours: float
    seed: str
    rate_scale: float
    failures: list[Failure] = field(default_factory=list)
    stragglers: list[Straggler] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Interruptions per effect in this trace."""
        out = {e.value: 0 for e in Effect}
        for f in self.failures:
            out[f.effect.value] += 1
        return out


def expected(gpus: int, hours: float, rate_scale: float = 1.0) -> float:
    """Interruptions a job of ``gpus`` GPUs expects in ``hours``."""
    return RATE_PER_GPU_HOUR * rate_scale * gpus * hours


def draw(gpus: int, replica_gpus: int, hours: float, seed: int, rate_scale: float = 1.0,
         stragglers: StragglerModel = StragglerModel(), trial: int = 0) -> Trace:
    """The trace of a job of ``gpus`` GPUs over ``hours``: Poisson interruptions at
    ``rate_scale`` x the Llama 3 rate per GPU-hour, root causes by the table's counts. One
    generator per (seed, size, trial), seeded by a string (the same on every machine)."""
    replicas = gpus // replica_gpus
    key = f"chaos-{seed}-{gpus}-{replica_gpus}-{hours:g}-{rate_scale:g}-{trial}"
    trace = Trace(gpus, replicas, hours, key, rate_scale)
    rng = random.Random(key)
    horizon = hours * 3600
    per_s = RATE_PER_GPU_HOUR * gpus * rate_scale / 3600
    weights = [k.count for k in KINDS]
    t = rng.expovariate(per_s)
    while t < horizon:
        kind = rng.choices(KINDS, weights)[0]
        trace.failures.append(Failure(t, kind.name, kind.effect, rng.randrange(replicas)))
        t += rng.expovariate(per_s)
    s_rate = per_s * stragglers.rate_factor
    t = rng.expovariate(s_rate) if s_rate > 0 else math.inf
    while t < horizon:
        trace.stragglers.append(Straggler(t, rng.randrange(replicas), stragglers.duration_s,
                                          stragglers.slowdown))
        t += rng.expovariate(s_rate)
    return trace


def describe(model: StragglerModel, rate_scale: float) -> dict:
    """The trace's assumptions, for the output JSON."""
    return {
        "source": "The Llama 3 Herd of Models (Meta, 2024), section 3.3.4, Table 5: 466 "
                  "interruptions (47 planned, 419 unexpected) in 54 days on 16,384 H100 GPUs",
        "rate_per_gpu_hour": RATE_PER_GPU_HOUR * rate_scale,
        "rate_scale": rate_scale,
        "arrivals": "Poisson; each interruption hits one replica slot (a node of replica_gpus "
                    "GPUs), uniformly; root cause drawn by the table's counts",
        "kinds": [{"name": k.name, "count": k.count, "share": k.count / LLAMA3_INTERRUPTIONS,
                   "effect": k.effect.value} for k in KINDS],
        "stragglers": {"rate_per_gpu_hour": RATE_PER_GPU_HOUR * rate_scale * model.rate_factor,
                       "duration_s": model.duration_s, "slowdown": model.slowdown,
                       "source": "rate and duration: assumptions of this simulator (not in "
                                 "the Llama 3 table); slowdown: inputs.straggler_slowdown"},
    }
