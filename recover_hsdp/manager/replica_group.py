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
  (``ReplicaHeartbeat``: UDP among the S ranks, period ``detect_timeout_s / 4``, on its own
  thread; addresses exchanged at bootstrap, [Note: rendezvous address]): a peer silent for
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

Timers, shortest first (defaults ``detect_timeout_s`` 4, ``hang_timeout_s`` H = 300), and which
fires first for a failure of a rank of this replica:

  ==========================  ============================================  ===================
  failure                     first to fire                                 after
  ==========================  ============================================  ===================
  dead process                gloo socket reset; NCCL: heartbeat / MPI      ms; detect_timeout_s
  frozen process (SIGSTOP)    heartbeat (+ MPI detector for the others)     detect_timeout_s
  cut link                    heartbeat on both sides (+ MPI detector)      detect_timeout_s
  stuck main thread           hang watchdog of the stuck rank (then: dead)  learned, <= H
  slow step / save / build    nothing (threads beat; watchdog paused)       --
  deadlock inside Open MPI    MPI-call deadline (+ backstop 10 s)           2H+30 / 3H+30
  all of the above missed     replica group timeout (gloo; NCCL watchdog,   2H+30 + 3H+30 + 20
                              TORCH_NCCL_ASYNC_ERROR_HANDLING=3: kill)
  ==========================  ============================================  ===================

Invariant, asserted at start-up: detect_timeout_s < H < call_s < repair_s < the group timeout.
The group timeout exceeds the longest legitimate wait of a healthy rank in MPI (one call that
runs to its deadline, then one repair step to its own), so neither gloo nor the NCCL watchdog
ever ends a healthy rank whose peer waits in MPI. TorchTitan's ``[comm] train_timeout_seconds``
(applied to the groups after step 1) is set to the same value; ``init_timeout_seconds`` stays
the rendezvous' (TCPStore) wait.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from recover_hsdp.collectives.guard import Deadlines, die, log_line
from recover_hsdp.manager.failures import write_reason
from recover_hsdp.manager.replica_heartbeat import ReplicaHeartbeat

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_ACTIVE: ReplicaHeartbeat | None = None


def job_deadlines(job_config) -> Deadlines:
    """The MPI deadlines of a job, derived from ``[recover] hang_timeout_s`` (the ceiling of the
    learned hang bound: [Note: a hang bound from progress] in collectives/guard.py)."""
    rc = job_config.recover
    hang = rc.hang_timeout_s
    return Deadlines(call_s=2 * hang + 30, repair_s=3 * hang + 30, hang_timeout_s=hang,
                     hang_floor_s=rc.hang_floor_s, hang_progress_factor=rc.hang_progress_factor,
                     retire_grace_s=min(2.0, hang / 4))


def group_timeout_s(deadlines: Deadlines, detect_timeout_s: float = 0.0) -> float:
    """The replica group's collective timeout: after the longest legitimate MPI wait."""
    timeout = deadlines.call_s + deadlines.repair_s + 2 * deadlines.backstop_s
    hang = deadlines.hang_timeout_s or 0.0
    assert detect_timeout_s < hang < deadlines.call_s < deadlines.repair_s < timeout, \
        "timers out of order: [Note: a replica leaves as a unit]"
    return timeout


def init_replica_group(replica_world, job_config, step_of: Callable[[], int]) -> None:
    """The replica's process group (gloo on CPU, NCCL on GPU) with the timeouts of the table
    above, then its heartbeat ([Note: a replica leaves as a unit])."""
    layout = replica_world.layout
    rc = job_config.recover
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = group_timeout_s(job_deadlines(job_config), rc.detect_timeout_s)
    if backend == "nccl":  # the watchdog kills this process on a timeout or an async error
        os.environ.setdefault(ASYNC_ERROR_HANDLING, "3")
    dist.init_process_group(backend, store=replica_world.store, rank=layout.shard,
                            world_size=layout.ranks_per_replica,
                            timeout=timedelta(seconds=timeout))
    job_config.comm.train_timeout_seconds = int(timeout)  # TorchTitan resets it after step 1
    wiring = replica_world.beats
    if wiring is not None and rc.detect_timeout_s > 0:
        start_heartbeat(wiring, rc.detect_timeout_s, layout, job_config.job.dump_folder, step_of)


def start_heartbeat(wiring, detect_timeout_s: float, layout, out_dir,
                    step_of: Callable[[], int]) -> ReplicaHeartbeat:
    """Start this rank's heartbeat; a lost peer makes this rank leave (:func:`leave_replica`)."""
    global _ACTIVE

    def lost(shard: int, silent_s: float) -> None:
        rank = layout.replica * layout.ranks_per_replica + shard
        leave_replica(out_dir, layout, step_of(),
                      f"replica peer shard {shard} (rank {rank}) silent for {silent_s:.1f} s > "
                      f"detect_timeout_s={detect_timeout_s:g} (replica heartbeat)")

    _ACTIVE = ReplicaHeartbeat(wiring.sock, layout.shard, wiring.peers, wiring.token,
                               period_s=detect_timeout_s / 4, timeout_s=detect_timeout_s,
                               on_lost=lost).start()
    return _ACTIVE


def active_heartbeat() -> ReplicaHeartbeat | None:
    """This process's running heartbeat (None: S = 1, off, or not started)."""
    return _ACTIVE


def leave_replica(out_dir, layout, step: int, reason: str) -> None:
    """[Note: replica-local errors] from any thread: the reason to ``errors/``, the NCCL
    communicators aborted (bounded), then SIGKILL of this process."""
    write_reason(out_dir, {"step": step, "replica": layout.replica, "shard": layout.shard,
                           "rank": layout.world_rank, "reason": reason, "time": time.time()})
    abort_nccl(timeout_s=5.0)
    die(f"[recover-hsdp] replica {layout.replica} shard {layout.shard}: a rank of this replica "
        f"is lost, this rank leaves at step {step}: {reason}")


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
