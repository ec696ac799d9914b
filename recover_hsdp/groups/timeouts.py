"""The timers of a rank of a job: derived once from ``[recover]``, ordered, and checked.

[Note: the timer table] Timers, shortest first (defaults ``detect_timeout_s`` 4,
``hang_timeout_s`` H = 300), and which fires first for a failure of a rank of a replica:

  ==========================  ============================================  ===================
  failure                     first to fire                                 after
  ==========================  ============================================  ===================
  dead process                gloo socket reset; NCCL: heartbeat / MPI      ms; detect_timeout_s
  frozen process (SIGSTOP)    heartbeat (+ MPI detector for the others;     detect_timeout_s
                              a spawned rank: a waiting peer on its host)
  cut link                    heartbeat on both sides (+ MPI detector)      detect_timeout_s
  stuck main thread           hang watchdog of the stuck rank (then: dead)  learned, <= H
  slow step / save / build    nothing (threads beat; watchdog paused)       --
  deadlock inside Open MPI    MPI-call deadline (+ backstop 10 s)           2H+30 / 3H+30
  all of the above missed     replica group timeout (gloo; NCCL watchdog,   2H+30 + 3H+30 + 20
                              TORCH_NCCL_ASYNC_ERROR_HANDLING=3: kill)
  ==========================  ============================================  ===================

On the data plane's groups (``plane = "torch"``) the control plane decides on both backends: a
dead, frozen or cut-off peer is seen by MPI (detector or error, detect_timeout_s), the waiting
call is abandoned at the next poll (10 ms) and the group given up (NCCL: aborted); their
backend timeout is the replica group's (a last resort) and their NCCL watchdog never kills
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: [Note: no watchdog decides on the data plane] in
groups/data_plane.py).

Invariant, asserted at start-up: detect_timeout_s < H < call_s < repair_s < the group timeout.
The group timeout exceeds the longest legitimate wait of a healthy rank in MPI (one call that
runs to its deadline, then one repair step to its own), so neither gloo nor the NCCL watchdog
ever ends a healthy rank whose peer waits in MPI. TorchTitan's ``[comm] train_timeout_seconds``
(applied to the groups after step 1) is set to the same value; ``init_timeout_seconds`` stays
the rendezvous' (TCPStore) wait.
"""

from __future__ import annotations

from recover_hsdp.collectives.guard import Deadlines


def job_deadlines(job_config) -> Deadlines:
    """The MPI deadlines of a job, derived from ``[recover.timeouts] hang_s`` (the ceiling of the
    learned hang bound: [Note: a hang bound from progress] in collectives/guard.py)."""
    timeouts = job_config.recover.timeouts
    hang = timeouts.hang_s
    return Deadlines(call_s=2 * hang + 30, repair_s=3 * hang + 30, hang_timeout_s=hang,
                     hang_floor_s=timeouts.hang_floor_s,
                     hang_progress_factor=timeouts.hang_progress_factor,
                     retire_grace_s=min(2.0, hang / 4))


def group_timeout_s(deadlines: Deadlines, detect_timeout_s: float = 0.0) -> float:
    """The replica group's collective timeout: after the longest legitimate MPI wait (the
    table's last row). Asserts the table's order."""
    timeout = deadlines.call_s + deadlines.repair_s + 2 * deadlines.backstop_s
    hang = deadlines.hang_timeout_s or 0.0
    assert detect_timeout_s < hang < deadlines.call_s < deadlines.repair_s < timeout, \
        "timers out of order: [Note: the timer table]"
    return timeout


def replica_group_timeout_s(job_config) -> float:
    """:func:`group_timeout_s` of a job: the timeout of the replica's group and of the per-epoch
    data-plane groups (a last resort: the control plane abandons a blocked call first)."""
    return group_timeout_s(job_deadlines(job_config), job_config.recover.timeouts.detect_s)
