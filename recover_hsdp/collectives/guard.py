"""Deadlines and a hang watchdog that turn "stuck" into "dead" for the ULFM collectives layer.

ULFM repairs communicators after a process *dies*. It cannot see a process that is alive but makes no
progress (a stuck kernel, a deadlock inside Open MPI, an endless loop): the survivors would wait for it
forever. This module bounds both cases and turns them into an ordinary death, which ULFM then handles:

* **MPI-call deadlines.** Every guarded MPI call runs inside ``MpiGuard.call(name, seconds)``. If it has
  not returned after ``seconds`` the watchdog thread logs one line and SIGKILLs its own process. A kernel
  timer (``setitimer(ITIMER_REAL)``, SIGALRM with the default action: terminate) fires ``backstop_s``
  later as a backstop, because a thread cannot run while an MPI call holds the GIL (``MPI_Finalize``
  does; collectives release it). See [Note: deadline as a safety net].
* **Hang watchdog.** Outside MPI calls the main thread must show progress: every guarded MPI call beats
  the heartbeat, and so must ``heartbeat()``. If nobody beats for the hang bound the watchdog logs
  and SIGKILLs its own process, so its peers see a death (within the bound plus detection) instead of
  waiting for it forever. The bound is ``hang_timeout_s``, or learned from the rank's own progress
  ([Note: a hang bound from progress]). Long legitimate computations either beat (cheap: a float
  store and a compare) or run inside ``paused()``.

Invariants: MPI is called by one thread at a time ([Note: MPI from autograd's thread]; the watchdog
thread only reads two floats and may kill its own process); the guard owns SIGALRM in this process;
``call()`` contexts do not nest, and a second thread entering one while another thread is inside
raises :class:`ConcurrentMpiCall` instead of breaking THREAD_SERIALIZED.

[Note: MPI from autograd's thread]
mpi4py initialises MPI at THREAD_SERIALIZED (collectives/mpi.py): any thread may call MPI, never
two at once. On CPU every MPI call of a rank is on its main thread. On CUDA, autograd runs
FSDP2's post-backward hook, and so ``BucketSync``'s hook, on its device thread while the main
thread waits inside ``backward()``: the bucket's reduce (the ``mpi`` plane), the torch plane's
group set-up (an all-gather) and its control-plane poll (``peers_failed``) then call MPI from
there. That is serialized by construction: while the hook runs, the main thread is blocked in
the autograd engine and calls no MPI; the other threads of a rank call none (the watchdog reads
floats, the replica heartbeat talks gloo, the data plane's helper thread builds a torch group,
Open MPI's detector is its own). What depends on the thread is handled here: ``call`` works on
any thread (``setitimer`` is process-wide, the SIGALRM backstop kills the process whichever
thread is blocked), :func:`die` flushes Python's streams only on the main thread, and the
guard's own SIGALRM handler is installed once, on the main thread. Every guarded call checks the
serialization it relies on (one lock, taken without waiting): a call that a second thread starts
while another is inside one raises :class:`ConcurrentMpiCall`. The real hook path on a second
thread, with a peer SIGKILLed mid-reduce, is tests/collectives/test_collectives_faults.py's
``*-on-autograd-thread`` scenarios.

[Note: deadline as a safety net]
On this stack (Open MPI 5.0.11 btl/tcp) a death can, rarely, deadlock a *healthy* survivor inside
Open MPI (see docs/ULFM_NOTES.md). A deadline converts that deadlock into a death of the stuck rank, which
costs one healthy rank but never hangs the job. It must therefore be generous: longer than the worst
legitimate wait, which includes a peer that computes longer (skew) and a hung peer that its own watchdog
has not killed yet. Hence ``Deadlines`` requires ``call_s`` and ``repair_s`` > ``hang_timeout_s``.

[Note: a hang bound from progress]
A fixed hang timeout must exceed the longest legitimate gap between two beats of any step of any run
(the first step's warm-up, a big model's microbatch), so a stuck rank stalls every replica for minutes
(300 s by default). But each rank measures its own progress: its units of work (a microbatch's forward
and backward, as the manager reports them) and the gaps between its beats (every phase point and
guarded MPI call beats; time inside an MPI call or ``paused()`` is not a gap). ``ProgressBound`` keeps
the longest unit or gap of each of the last ``window_steps`` steps after the first ``warmup_steps``
(compile, allocator and cache warm-up are not typical) and bounds the next gap by ``min(hang_timeout_s,
max(hang_floor_s, hang_progress_factor x longest))``. Until a step past the warm-up is done the bound
is ``hang_timeout_s``. A rank that slows down is never killed for it as long as a whole microbatch
grows less than ``hang_progress_factor``-fold at once (default 40: a microbatch 20x slower passes even
as one gap, and the longer units then raise the bound for the next steps); a quota raised to 4 G only
adds units of the usual length. A stuck rank costs max(floor, factor x its usual microbatch): tens of
seconds. ``hang_timeout_s`` stays the ceiling, so the MPI deadlines derived from it ([Note: deadline
as a safety net]) still outlive a hung peer's watchdog. Limits: a rank whose stuck main thread holds
the GIL (a C call that does not release it) starves this thread too; then its peers' MPI deadline or
the replica heartbeat ends it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """Time bounds of the fault-tolerant collectives (seconds).

    Attributes:
        call_s: Deadline of one ordinary guarded MPI call (one <= 4 MB chunk of an all-reduce, an
            allgather, a barrier). Must exceed the longest time a rank can wait for its slowest peer to
            arrive (compute skew) and ``hang_timeout_s``.
        repair_s: Deadline of one Revoke, Shrink, Agree or Split. Must exceed ``hang_timeout_s``: a hung
            peer blocks Shrink and Agree until its own watchdog kills it.
        hang_timeout_s: The watchdog kills this process when its main thread has been outside MPI
            without a heartbeat for this long. ``None`` disables the hang watchdog (deadlines stay).
            With ``hang_floor_s`` set it is the ceiling of the learned bound.
        hang_floor_s: ``None``: the hang bound is ``hang_timeout_s``. Else the bound is learned from
            this rank's progress, never below this ([Note: a hang bound from progress]).
        hang_progress_factor: The learned bound in multiples of the longest recent beat gap.
        backstop_s: Extra seconds after a deadline before the kernel timer (SIGALRM) terminates the
            process, in case the watchdog thread cannot run (GIL held inside MPI).
        poll_s: How often the watchdog thread checks. ``None``: min(1 s, smallest bound / 10).
        max_repair_rounds: Bound on Shrink/rebuild/agree rounds of one recovery; each extra round needs a
            new failure, so world size + 2 always suffices. ``None``: world size + 2. Exceeding it kills
            the rank (a death, never a hang).
        retire_grace_s: Seconds a retiring rank waits after the final agreement before it exits, so that
            slower peers finish that agreement before its death becomes visible to them.
    """

    call_s: float = 600.0
    repair_s: float = 900.0
    hang_timeout_s: float | None = 300.0
    hang_floor_s: float | None = None
    hang_progress_factor: float = 40.0
    backstop_s: float = 10.0
    poll_s: float | None = None
    max_repair_rounds: int | None = None
    retire_grace_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("call_s", "repair_s", "backstop_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Deadlines.{name} must be > 0 (got {getattr(self, name)!r})")
        if self.retire_grace_s < 0:
            raise ValueError(f"Deadlines.retire_grace_s must be >= 0 (got {self.retire_grace_s!r})")
        if self.hang_timeout_s is not None:
            if not self.hang_timeout_s > 0:
                raise ValueError("Deadlines.hang_timeout_s must be > 0 or None (got "
                                 f"{self.hang_timeout_s!r})")
            for name in ("call_s", "repair_s"):
                if not getattr(self, name) > self.hang_timeout_s:
                    raise ValueError(f"Deadlines.{name} ({getattr(self, name)}) must be > hang_timeout_s "
                                     f"({self.hang_timeout_s}): survivors must outlive a hung peer's "
                                     "watchdog")
        if self.hang_floor_s is not None and not self.hang_floor_s > 0:
            raise ValueError(f"Deadlines.hang_floor_s must be > 0 or None (got {self.hang_floor_s!r})")
        if not self.hang_progress_factor >= 1:
            raise ValueError("Deadlines.hang_progress_factor must be >= 1 (got "
                             f"{self.hang_progress_factor!r})")
        if self.max_repair_rounds is not None and self.max_repair_rounds < 1:
            raise ValueError(f"Deadlines.max_repair_rounds must be >= 1 (got {self.max_repair_rounds!r})")

    @classmethod
    def for_tests(cls, hang_timeout_s: float = 3.0) -> Deadlines:
        """Short bounds for tests on a small, oversubscribed machine."""
        return cls(call_s=hang_timeout_s + 20.0, repair_s=hang_timeout_s + 25.0,
                   hang_timeout_s=hang_timeout_s, backstop_s=5.0, retire_grace_s=0.5)

    @property
    def effective_poll_s(self) -> float:
        if self.poll_s is not None:
            return self.poll_s
        bounds = [self.call_s, self.repair_s] + [b for b in (self.hang_timeout_s, self.hang_floor_s)
                                                 if b]
        return min(1.0, min(bounds) / 10.0)


class ProgressBound:
    """The hang bound of one rank, learned from the gaps between its beats ([Note: a hang bound
    from progress]). Main thread: ``gap`` and ``step_done``; any thread may read ``seconds``."""

    def __init__(self, ceiling_s: float, floor_s: float | None, factor: float,
                 window_steps: int = 20, warmup_steps: int = 1) -> None:
        self.ceiling_s, self.floor_s, self.factor = ceiling_s, floor_s, factor
        self.warmup_steps = warmup_steps
        self._window: collections.deque[float] = collections.deque(maxlen=window_steps)
        self._steps = 0
        self._step_longest = 0.0  # the longest gap of the step under way
        self.seconds = ceiling_s  # a float store: read by the watchdog thread without a lock

    @property
    def learned(self) -> bool:
        return self.floor_s is not None and bool(self._window)

    @property
    def longest_gap_s(self) -> float:
        return max(max(self._window, default=0.0), self._step_longest)

    def gap(self, seconds: float) -> None:
        """The main thread beat ``seconds`` after its previous beat."""
        if seconds > self._step_longest:
            self._step_longest = seconds
            if self.learned:
                self._update()

    def step_done(self, longest_unit_s: float = 0.0) -> None:
        """A step ended: its longest gap, or its longest unit of work if longer, enters the
        window (after the warm-up steps)."""
        self._step_longest = max(self._step_longest, longest_unit_s)
        self._steps += 1
        if self._steps > self.warmup_steps:
            self._window.append(self._step_longest)
        self._step_longest = 0.0
        if self.floor_s is not None:
            self._update()

    def _update(self) -> None:
        if self._window:
            self.seconds = min(self.ceiling_s,
                               max(self.floor_s, self.factor * self.longest_gap_s))

    def describe(self) -> str:
        if not self.learned:
            return f"hang_timeout_s={self.ceiling_s}"
        return (f"hang bound {self.seconds:.1f} s = min(hang_timeout_s {self.ceiling_s}, "
                f"max(hang_floor_s {self.floor_s}, {self.factor} x longest recent microbatch or gap "
                f"{self.longest_gap_s:.2f} s))")


def log_line(msg: str) -> None:
    """Write one line to stderr with os.write: safe from any thread, even if the main thread is stuck
    holding the sys.stderr lock."""
    os.write(2, f"[recover_hsdp pid {os.getpid()} t={time.time():.3f}] {msg}\n".encode())


def die(msg: str) -> NoReturn:
    """The one self-kill: log ``msg`` and SIGKILL this process (no MPI_Finalize: [Note:
    exiting without Finalize] in world.py); to its MPI peers an ordinary process failure.
    mpirun (PRRTE 3.0) tolerates any number of ranks killed by a signal, but ends the job at
    the second rank that exits with a non-zero status (measured: survivors orphaned). On the
    main thread Python's buffered stdout/stderr are flushed first; another thread never
    touches them (the main thread may be stuck holding their lock)."""
    log_line(msg)
    if threading.current_thread() is threading.main_thread():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("SIGKILL returned")


class ConcurrentMpiCall(RuntimeError):
    """Two threads of one rank inside MPI at once ([Note: MPI from autograd's thread])."""


class MpiGuard:
    """Per-process deadline + hang watchdog. Create it on the main thread (it installs SIGALRM)."""

    def __init__(self, deadlines: Deadlines, name: str = "") -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("MpiGuard must be created on the main thread (it installs the "
                               "SIGALRM action, which only the main thread may do)")
        self.deadlines = deadlines
        self.name = name
        # [Note: deadline as a safety net] SIG_DFL terminates the process even while the main thread
        # sits in C code; a Python-level handler would never run there.
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        self.progress = (None if deadlines.hang_timeout_s is None else
                         ProgressBound(deadlines.hang_timeout_s, deadlines.hang_floor_s,
                                       deadlines.hang_progress_factor))
        self._beat = time.monotonic()
        self._call: tuple[str, float, float] | None = None  # (name, started, deadline)
        self._serial = threading.Lock()   # held by the thread inside ``call``
        self._owner: int | None = None    # that thread's ident
        self._paused = 0
        self._stop = threading.Event()
        # public: on_hung(reason) on the watchdog thread just before it kills this rank (the
        # manager records where the main thread was: [Note: rank status], recover_hsdp/status.py)
        self.on_hung: Callable[[str], None] | None = None
        # public: on_blocked(now) on the watchdog thread at every poll while a guarded call has
        # waited longer than one poll ([Note: stopped peers outside the detector], processes.py)
        self.on_blocked: Callable[[float], None] | None = None
        self._thread = threading.Thread(target=self._watch, name="recover-hsdp-watchdog", daemon=True)
        self._thread.start()

    # -- main-thread API ------------------------------------------------------------------------
    def beat(self) -> None:
        """Heartbeat: the main thread is making progress."""
        now = time.monotonic()
        if self.progress is not None and not self._paused:
            self.progress.gap(now - self._beat)
        self._beat = now

    def step_done(self, longest_unit_s: float = 0.0) -> None:
        """A training step ended; its longest unit of work took ``longest_unit_s`` ([Note: a
        hang bound from progress])."""
        self.beat()
        if self.progress is not None:
            self.progress.step_done(longest_unit_s)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Suspend the hang watchdog (not the MPI deadlines) for a long computation without beats."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._beat = time.monotonic()  # the pause is not a gap

    @contextlib.contextmanager
    def call(self, name: str, seconds: float) -> Iterator[None]:
        """Run one MPI call under a deadline of ``seconds`` (see module docstring), on any
        thread, one thread at a time ([Note: MPI from autograd's thread])."""
        if not self._serial.acquire(blocking=False):
            current = self._call[0] if self._call is not None else "?"
            if self._owner == threading.get_ident():
                raise AssertionError(f"nested guarded MPI calls ({current} then {name})")
            raise ConcurrentMpiCall(
                f"{self.name}: MPI call {name} on thread {threading.current_thread().name!r} "
                f"while {current} runs on another thread: MPI is THREAD_SERIALIZED here "
                "([Note: MPI from autograd's thread])")
        self._owner = threading.get_ident()
        try:
            self.beat()  # the compute before the call is a gap; the wait inside it is not
            now = self._beat
            self._call = (name, now, now + seconds)
            signal.setitimer(signal.ITIMER_REAL, seconds + self.deadlines.backstop_s)
            try:
                yield
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                self._call = None
                self._beat = time.monotonic()
        finally:
            self._owner = None
            self._serial.release()

    def close(self) -> None:
        """Stop the watchdog thread and disarm the kernel timer."""
        self._stop.set()
        signal.setitimer(signal.ITIMER_REAL, 0)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    # -- watchdog thread ------------------------------------------------------------------------
    def verdict(self, now: float) -> str | None:
        """Why this rank must die at ``now`` (a deadline passed, no progress), else None."""
        call = self._call
        if call is not None:
            name, started, deadline = call
            if now > deadline:
                return (f"{self.name}: MPI call {name} still blocked after {now - started:.1f} s "
                        "(deadline): killing this rank so that ULFM sees an ordinary death")
        elif self.progress is not None and not self._paused \
                and now - self._beat > self.progress.seconds:
            return (f"{self.name}: no progress (heartbeat) for {now - self._beat:.1f} s > "
                    f"{self.progress.describe()}: killing this hung rank so that ULFM sees an "
                    "ordinary death")
        return None

    def _watch(self) -> None:
        poll = self.deadlines.effective_poll_s
        while not self._stop.wait(poll):
            now = time.monotonic()
            call = self._call
            if call is not None and now - call[1] > poll and self.on_blocked is not None:
                try:
                    self.on_blocked(now)
                except Exception as err:  # noqa: BLE001 - a sweep; the deadline still holds
                    log_line(f"on_blocked failed: {err!r}")
            reason = self.verdict(now)
            if reason is not None:
                if self.on_hung is not None:
                    try:
                        self.on_hung(reason)
                    except Exception as err:  # noqa: BLE001 - a report; the kill comes first
                        log_line(f"on_hung failed: {err!r}")
                die(reason)
