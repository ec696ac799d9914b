"""Giving up a torch.distributed group without waiting for it.

[Note: bounded teardown] A group the control plane gives up (a member died, froze or was cut
off) is never used again and never torn down collectively: its members cannot all take part.
What is left to do is local and must be bounded, because the step waits for it:

* an NCCL communicator is aborted (its kernels spinning on a dead peer return, so a re-reduce
  queued on the same stream can run), on its own thread, waited for at most ``ABORT_WAIT_S``:
  the abort can itself wait for the group's timeout (~30 min), and past the bound the step
  goes on and the thread is left (one line says so);
* a group still being built when the build is given up (a member lost during the group's
  rendezvous: the helper thread blocks in the TCPStore or in NCCL's eager connect) is handed
  over through ``PendingBuild``: an NCCL one already constructed is aborted at once (its
  connect returns), one that the helper finishes later is aborted by the helper and never
  connected nor used;
* every abandoned group stays referenced for the process's life (``NEVER_DESTROYED``).

gloo has no abort: its threads are left to the group's timeout, and nothing waits for them.
Used by ``TorchDataPlane`` (data_plane.py); tests/groups/test_teardown.py.
"""

from __future__ import annotations

import threading
from typing import Any

from recover_hsdp.collectives.guard import log_line

#: Abandoned groups, referenced until the process ends: a gloo group's destructor waits for its
#: blocked work (up to the group timeout, measured), which would stall whichever thread dropped
#: the last reference.
NEVER_DESTROYED: list[Any] = []
#: How long the control plane waits for an NCCL abort before it goes on without it
#: ([Note: bounded teardown]).
ABORT_WAIT_S = 10.0


def abort_bounded(group, seconds: float) -> bool:
    """[Note: bounded teardown] ``group.abort()`` on its own thread, waited for at most
    ``seconds``: an NCCL abort returns once its kernels stop spinning on a dead peer, but can
    also wait for the group's timeout (~30 min); the step must not. True: it returned in time
    (a later re-reduce on the same stream is no longer queued behind the dead group's kernel);
    False: it is left to its thread (one line says so) and the caller goes on."""
    done = threading.Event()

    def run() -> None:
        try:
            group.abort()
        except Exception as err:  # noqa: BLE001 - best effort
            log_line(f"data plane: NCCL abort failed: {err!r}")
        finally:
            done.set()

    threading.Thread(target=run, name="recover-hsdp-nccl-abort", daemon=True).start()
    if done.wait(seconds):
        return True
    log_line(f"data plane: an abandoned NCCL group's abort still runs after {seconds:g} s; "
             "left to its thread")
    return False


class PendingBuild:
    """The group a helper thread builds, handed over under a lock: once the waiting thread
    has abandoned the build, a group the helper finishes later is never connected nor used
    (NCCL: aborted)."""

    def __init__(self, nccl: bool) -> None:
        self._lock = threading.Lock()
        self.nccl = nccl
        self.group: Any = None
        self.error: str | None = None
        self.abandoned = False

    def offer(self, group) -> bool:
        """The helper's group; False: the build was abandoned meanwhile."""
        with self._lock:
            self.group = group
            late = self.abandoned
        if late:
            NEVER_DESTROYED.append(group)
            if self.nccl:
                abort_bounded(group, ABORT_WAIT_S)
        return not late

    def abandon(self) -> Any:
        """The waiting thread gives up: the group built so far, or None (then ``offer``
        deals with a later one)."""
        with self._lock:
            self.abandoned = True
            return self.group
