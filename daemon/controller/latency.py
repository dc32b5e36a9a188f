"""The latency path: a lone, cheap, uncontended INFER runs where it was decided, with no hand-off.

Through the batch engine a request crosses threads four times (client -> event loop ->
executor lane -> event loop -> client); each wake-up after an idle gap costs ~0.06-0.13 ms on
two cores (bench/results/overhead.md), which at light load is most of what the daemon adds to
the raw call. When a step decides exactly one INFER, nothing else is queued or running anywhere,
the request's model is resident (an INFER is only issued where it is) and its estimated run
time is at most `max_run_s`, the controller runs it on its own thread instead (the executor's
`run_here`), applies the result and answers in the same step: two wake-ups fewer.

Everything else keeps the batch engine: the moment a second request is queued or an action is
running, a step finds them and batches as before. Running on the controller's thread holds the
loop for the run, so the bound `max_run_s` is also the longest any other connection waits for it.
And never for most of the loop's time: where arrivals come fast enough that runs here would take
more than MAX_LOOP_SHARE of it (requests/s times the run per request), the batch engine runs them
and the loop keeps its time for ingest and decisions (on a many-core node the loop is the bottleneck).
Below that the path pays even at moderate load: at 4,000 req/s of `mlp_784` it finds the daemon
idle between most arrivals, and while it doubles the loop's CPU per request (99 against 58 µs
with a frontend worker), it saves the hand-offs, ~9% of the whole daemon's CPU per request at
1,000 and 2,500 req/s on 2 cores (bench/results/latency-gate-ab.md), which is what bounds
capacity there.

Pure: reads the scheduler's state and the decision, never changes them; the caller runs it.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from typing import TYPE_CHECKING, Final

from daemon.actions import Action, ActionKind
from daemon.controller.estimates import RateMeter

if TYPE_CHECKING:
    from daemon.controller.scheduler import Scheduler
    from daemon.controller.state import Decision


class Why(enum.IntEnum):
    """Why a step's decision took, or did not take, the latency path (counted per step that issued
    actions; reported by lower-case name). An IntEnum: a plain Enum's hash is a Python-level call
    (~900 instructions), paid twice a step to count it."""

    TAKEN = 0
    OFF = 1
    NOT_ONE_INFER = 2  # no INFER, several actions, or a parity/replica/cross-model/lane batch
    NOT_YET = 3  # its window opens later (a batch waiting to fill)
    BUSY = 4  # other requests queued or actions running: the batch engine
    SLOW = 5  # its estimated run time is over the bound
    REFUSED = 6  # the executor could not run it here (its lane busy, a fault injected, a device kind)
    LOADED = 7  # arrivals fast enough that runs here would take over MAX_LOOP_SHARE of the loop


MAX_LOOP_SHARE: Final = 0.5  # of the loop's time, at most, for runs on the latency path (at the arrival rate)


class LatencyPath:
    """Decides, per step, whether its one INFER runs on the controller's thread."""

    def __init__(self, enabled: bool, max_run_s: float) -> None:
        self.enabled = enabled
        self.max_run_s = max_run_s
        self.counts: defaultdict[Why, int] = defaultdict(int)  # (as Scheduler.counters)
        self.arrivals = RateMeter()  # requests per second submitted

    def arrived(self, now: float) -> None:
        """A request was submitted (its rate says whether the load is light)."""
        self.arrivals.add(1.0, now)

    def pick(self, sched: Scheduler, decision: Decision, now: float) -> Action | None:
        """The action of `decision` to run here and now, or None (the batch engine runs it)."""
        why = self._why(sched, decision, now)
        self.counts[why] += 1
        return decision.actions[0] if why is Why.TAKEN else None

    def refused(self) -> None:
        """The executor declined an action `pick` chose: it went to the batch engine."""
        self.counts[Why.TAKEN] -= 1
        self.counts[Why.REFUSED] += 1

    def _why(self, sched: Scheduler, decision: Decision, now: float) -> Why:
        if not self.enabled:
            return Why.OFF
        if len(decision.actions) != 1:
            return Why.NOT_ONE_INFER
        a = decision.actions[0]
        if a.kind != ActionKind.INFER or a.coded is not None or a.group or a.replica_of or a.best_effort \
                or a.reply is not None or a.model.parity is not None:
            return Why.NOT_ONE_INFER
        if a.earliest > now:
            return Why.NOT_YET
        # nothing else accepted and unanswered, nothing else in flight on any device
        if sched.pending != len(a.requests) or len(sched.inflight) != 1 or sched.coding.groups:
            return Why.BUSY
        if a.expected_duration > self.max_run_s:
            return Why.SLOW
        if self.arrivals.value(now) * a.expected_duration / max(len(a.requests), 1) > MAX_LOOP_SHARE:
            return Why.LOADED
        return Why.TAKEN

    def statistics(self) -> dict[str, int]:
        return {w.name.lower(): n for w, n in self.counts.items() if n}
