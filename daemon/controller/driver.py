"""The one control step, shared by the daemon's asyncio service, the simulator and the tests.

A step takes the results that came back since the last one, applies them, then lets the
scheduler decide: one `Decision` (actions to send, requests finished). `next_wakeup` says
when to step again if nothing arrives. Plain synchronous code: the caller owns the clock and
the delivery of decisions (an event loop, a discrete-event simulation, a test).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from daemon.actions import Result
from daemon.controller.scheduler import Scheduler
from daemon.controller.state import Decision
from daemon.request import InferenceRequest


class Driver:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def submit(self, req: InferenceRequest, now: float) -> None:
        """Admit a request (raises the error to answer with if refused); the next step plans it."""
        self.scheduler.submit(req, now)

    def cancel(self, req: InferenceRequest, now: float) -> Decision:
        return self.scheduler.cancel(req, now)

    def step(self, now: float, results: Iterable[Result] = (),
             on_error: Callable[[Result, Exception], None] | None = None) -> Decision:
        """Apply `results`, then schedule; everything decided, in order. A result whose handling
        raises goes to `on_error` (if given; else the exception propagates) and the others still
        apply: one bad result must not strand the rest."""
        sched = self.scheduler
        out: Decision | None = None
        for r in results:
            try:
                out = _merge(out, sched.on_result(r, now))
            except Exception as e:
                if on_error is None:
                    raise
                on_error(r, e)
        return _merge(out, sched.schedule(now))

    def next_wakeup(self, now: float) -> float | None:
        return self.scheduler.next_wakeup(now)


def _merge(into: Decision | None, d: Decision) -> Decision:
    # An empty decision may be the scheduler's own, still filling: never extend that one.
    if into is None or into is d or not (into.actions or into.finished):
        return d
    into.actions.extend(d.actions)
    into.finished.extend(d.finished)
    return into
