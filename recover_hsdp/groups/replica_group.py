"""The replica's torch.distributed group: its timeouts, its heartbeat, and leaving as a unit.

[Note: a replica leaves as a unit] A replica whose rank is lost must leave whole and at once:
its remaining ranks hold a model shard nobody else has, and every other replica waits for them
in the next agreement. A rank learns of a lost peer of its own replica in one of three ways:

* in MPI: a guarded call fails and the world reports the failed ranks (``world.on_failed``;
  ``RecoverManager._on_failed`` leaves at once if one is of this replica), or the consensus
  excludes the replica (the rank retires with the others);
* in its intra-replica collective: gloo raises when the dead peer's sockets close (19-30 ms,
  docs/ULFM_NOTES.md) -> [Note: replica-local errors];
* neither, while it is blocked in gloo/NCCL on a peer that stopped without closing anything: a
  frozen process (SIGSTOP keeps its sockets), a host whose link is cut, a dead peer on NCCL (a
  kernel spins on it). Measured before this: 120 s (gloo's timeout) at that rank, and every
  other replica waited in the agreement with it. Here the replica's own heartbeat decides
  (``ReplicaHeartbeat``, groups/heartbeat.py: UDP among the S ranks, period
  ``detect_timeout_s / 4``, on its own thread; addresses exchanged at bootstrap, [Note: rendezvous
  address]): a peer silent for
  ``detect_timeout_s`` -> this rank writes its reason to ``errors/`` and SIGKILLs itself
  (on NCCL it first aborts its communicators, best effort, bounded by 5 s). Its death is an
  ordinary death to MPI, so the other replicas repair within seconds.

Why a heartbeat and not the MPI detector's report alone: that report reaches a rank only
inside an MPI call, never while it sits in gloo/NCCL. Why a thread of this process and not a
watch of the peers' processes: a watch sees only this host, and a helper process would go on
beating for a frozen rank. Why it never fires on a slow peer: the thread does not wait for the
main thread (long compute, a checkpoint save, the model build at start-up all beat on; pure
Python releases the GIL every 5 ms), a rank that leaves normally says goodbye (the world's
``on_leave``: retire, end of run), and a thread that could not run itself restarts its peers'
clocks. Left to the hang watchdog: a live rank whose main thread is stuck (its heartbeat thread
beats on) -- it kills itself after its hang bound and is then a dead peer. S = 1: no
heartbeat. ``detect_timeout_s = 0``: no heartbeat either (as for the MPI detector).

The timers that decide which of these fires first: [Note: the timer table] in groups/timeouts.py.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from recover_hsdp.collectives.guard import die, log_line
from recover_hsdp.groups.heartbeat import ReplicaHeartbeat
from recover_hsdp.groups.timeouts import replica_group_timeout_s
from recover_hsdp.outputs import write_reason

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@dataclass
class ReplicaGroup:
    """The replica's process group as this rank built it.

    Attributes:
        backend: "gloo" (CPU) or "nccl" (GPU).
        timeout_s: its collective timeout ([Note: the timer table] in groups/timeouts.py).
        heartbeat: this rank's running heartbeat (None: S = 1 or ``detect_timeout_s = 0``).
    """

    backend: str
    timeout_s: float
    heartbeat: ReplicaHeartbeat | None = None


def init_replica_group(replica_world, job_config, step_of: Callable[[], int]) -> ReplicaGroup:
    """The replica's process group (gloo on CPU, NCCL on GPU) with the timeouts of [Note: the
    timer table], then its heartbeat ([Note: a replica leaves as a unit])."""
    layout = replica_world.layout
    rc = job_config.recover
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = replica_group_timeout_s(job_config)
    if backend == "nccl":  # the watchdog kills this process on a timeout or an async error
        os.environ.setdefault(ASYNC_ERROR_HANDLING, "3")
    dist.init_process_group(backend, store=replica_world.store, rank=layout.shard,
                            world_size=layout.ranks_per_replica,
                            timeout=timedelta(seconds=timeout))
    job_config.comm.train_timeout_seconds = int(timeout)  # TorchTitan resets it after step 1
    group = ReplicaGroup(backend, timeout)
    wiring = replica_world.beats
    if wiring is not None and rc.timeouts.detect_s > 0:
        group.heartbeat = start_heartbeat(wiring, rc.timeouts.detect_s, layout,
                                          job_config.job.dump_folder, step_of,
                                          slow_phase_s=rc.timeouts.slow_phase_s,
                                          procs=replica_world.procs)
    return group


def start_heartbeat(wiring, detect_timeout_s: float, layout, out_dir,
                    step_of: Callable[[], int], slow_phase_s: float | None = None,
                    procs: list | None = None) -> ReplicaHeartbeat:
    """Start this rank's heartbeat; a lost peer makes this rank leave (:func:`leave_replica`).
    It starts in its start-up phase ([Note: detection margins by phase] in groups/heartbeat.py):
    the caller says ``steady()`` after the first committed step. ``procs`` (world rank ->
    ``ProcessInfo``; empty for a newcomer) lets it read a same-host peer's process: [Note:
    silence the host can explain]."""
    beats: list[ReplicaHeartbeat] = []

    def witness(shard: int):
        rank = layout.replica * layout.ranks_per_replica + shard
        return procs[rank].cpu_ticks() if procs and rank < len(procs) else None

    def lost(shard: int, silent_s: float) -> None:
        rank = layout.replica * layout.ranks_per_replica + shard
        beat = beats[0]
        bound = beat.allowed_silence(shard)
        if shard in beat.working:
            which = "slow_phase_s (its process was seen working on this host)"
        elif beat.slow or beat.peer_slow[shard]:
            which = "slow_phase_s (a slow phase)"
        elif bound > detect_timeout_s:  # [Note: a steady timeout learned from beat gaps]
            which = f"{beat.gaps.factor:g} x its recent largest beat gap"
        else:
            which = "detect_s"
        leave_replica(out_dir, layout, step_of(),
                      f"replica peer shard {shard} (rank {rank}) silent for {silent_s:.1f} s > "
                      f"{which}={bound:g} (replica heartbeat)",
                      headline="a rank of this replica is lost")

    beats.append(ReplicaHeartbeat(wiring.sock, layout.shard, wiring.peers, wiring.token,
                                  period_s=detect_timeout_s / 4, timeout_s=detect_timeout_s,
                                  slow_timeout_s=slow_phase_s, on_lost=lost,
                                  witness=witness if procs else None))
    return beats[0].start()


def leave_replica(out_dir, who, step: int, reason: str, headline: str,
                  end: Callable[[str], None] = die) -> NoReturn:
    """The one way a rank leaves its replica ([Note: replica-local errors] in
    manager/failures.py), from any thread: the reason to ``errors/``, the NCCL communicators
    aborted (bounded), then ``end`` (default: SIGKILL of this process; in-process tests pass
    their fake's kill). ``who``: anything with ``replica``, ``shard``, ``world_rank``."""
    write_reason(out_dir, {"step": step, "replica": who.replica, "shard": who.shard,
                           "rank": who.world_rank, "reason": reason, "time": time.time()})
    abort_nccl(timeout_s=5.0)
    end(f"[recover-hsdp] replica {who.replica} shard {who.shard}: {headline}, this rank "
        f"leaves at step {step}: {reason}")
    raise AssertionError("leave_replica: end() returned")


def abort_nccl(timeout_s: float) -> None:
    """Abort this process's NCCL communicators (a kernel spinning on a lost peer then
    returns), on a helper thread given ``timeout_s``: best effort, never a hang. No-op on gloo."""
    try:
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return
    except (RuntimeError, ValueError):
        return
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None) or dist.destroy_process_group

    def run() -> None:
        try:
            abort()
        except Exception as err:  # noqa: BLE001 - best effort: the process ends next
            log_line(f"NCCL abort failed: {err!r}")

    helper = threading.Thread(target=run, name="recover-hsdp-nccl-abort", daemon=True)
    helper.start()
    helper.join(timeout_s)
