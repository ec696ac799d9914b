"""``PhaseHooks``: the one hook through which a rank announces its phases.

See [Note: phases as data] in recover_hsdp/phases.py. Two kinds of announcements:

* ``span(step, phase)``: a phase of the step with a duration (``with`` block). Span openers
  wrap it: the profiler's ``record_function`` label (``phases.profiler_labels``) and the
  :class:`PhaseTimer` (the step's record carries its seconds as ``phase_s``).
* ``point(step, phase, **detail)``: an instant inside a span (a microbatch's forward or
  backward, a bucket's reduce, a stage of the consensus, the optimizer update), or a phase
  outside a step (startup, checkpoint, join, finish). Subscribers are told of points.

A subscriber is any ``fn(step, phase, detail)``; the fault injector (``FaultInjector.on_phase``)
is one. A subscriber may raise (an injected ``mode=raise`` fault) or never return (a kill):
the phase is then left as the step would leave it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

from recover_hsdp.phases import Phase

Subscriber = Callable[[int, Phase, dict], None]
SpanOpener = Callable[[int, Phase], ContextManager[Any]]


class PhaseHooks:
    """The subscribers of one rank's points and the openers of its spans."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._openers: list[SpanOpener] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        """``subscriber(step, phase, detail)`` is told of every point."""
        self._subscribers.append(subscriber)

    def open_spans_with(self, opener: SpanOpener) -> None:
        """``opener(step, phase)`` returns a context manager wrapped around every span."""
        self._openers.append(opener)

    def point(self, step: int, phase: Phase, **detail: Any) -> None:
        for subscriber in self._subscribers:
            subscriber(step, phase, detail)

    @contextlib.contextmanager
    def span(self, step: int, phase: Phase) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for opener in self._openers:
                stack.enter_context(opener(step, phase))
            yield


class PhaseTimer:
    """A span opener: seconds spent in each span since ``new_step`` (the step's ``phase_s``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def new_step(self) -> None:
        self.seconds = {}

    @contextlib.contextmanager
    def __call__(self, step: int, phase: Phase) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase.value] = (self.seconds.get(phase.value, 0.0)
                                         + time.perf_counter() - started)
