"""The policy interface: a policy reads the controller's view and returns decisions.

A policy is plain synchronous code in the vLLM v1 shape: `schedule(view, now)` is called
after every change (a request arrived, a result came back, a wake-up time passed) and yields
INFER / LOAD / UNLOAD / drop decisions (`decisions.py`) that the scheduler applies one by one
(each is applied before the next is asked for, so the view is current); the `on_*` hooks tell
it what changed (`update_from_output`), and `next_wakeup` says when it next wants to be called
even if nothing else happens. It never changes the state it reads.
"""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from daemon.actions import Result
from daemon.config import ControllerSettings
from daemon.controller.decisions import Pass, Planned, Steps
from daemon.controller.state import ModelEntry
from daemon.controller.view import ControllerView
from daemon.request import InferenceRequest


# A base class, not a Protocol: compiled, the scheduler then calls its hooks through a table
# rather than as generic method calls (~400 instructions each, ~6 a request; see view.py). A
# policy written in plain Python (a test's) subclasses it too.
@mypyc_attr(allow_interpreted_subclasses=True)
class Policy:
    name: str = ""

    def schedule(self, view: ControllerView, now: float) -> Steps | Pass | Planned | tuple[()]:
        """The decisions of one pass; `()` when there is nothing to decide (cheaper than a generator),
        a list when they are known before the first is applied (`Planned`); a pass may end with
        `yield None` (`Pass`)."""
        raise NotImplementedError

    def next_wakeup(self, view: ControllerView, now: float) -> float | None:
        raise NotImplementedError

    def on_submit(self, view: ControllerView, entry: ModelEntry, req: InferenceRequest, now: float) -> None:
        """A request was admitted (after it joined its model's queue, `entry.queue`)."""

    def on_queued(self, view: ControllerView, entry: ModelEntry, now: float) -> None:
        """A model gained queued work other than by an arrival: requests returned to its queue, or
        its weights left the last device holding them while it has work."""

    def on_result(self, view: ControllerView, result: Result, now: float) -> None:
        """An action's result came back (after the scheduler applied it)."""

    def on_late(self, view: ControllerView, entry: ModelEntry, now: float) -> None:
        """A request joined its model's best-effort lane (`entry.late`): to be served, oldest first, in
        device time no on-time work needs, with `Infer(..., best_effort=True)`."""


def make_policy(settings: ControllerSettings) -> Policy:
    if settings.policy == "dynamic":
        from daemon.controller.policies.dynamic import DynamicBatchingPolicy

        return DynamicBatchingPolicy(max_queue_delay=settings.max_queue_delay_ms / 1000.0,
                                     cross_model=settings.cross_model_batching)
    if settings.policy == "aimd":
        from daemon.controller.policies.aimd import AimdPolicy

        return AimdPolicy(step=settings.aimd_step, backoff=settings.aimd_backoff,
                          cross_model=settings.cross_model_batching)
    if settings.policy == "clockwork":
        from daemon.controller.policies.clockwork import ClockworkPolicy

        return ClockworkPolicy(schedule_ahead=settings.schedule_ahead_ms / 1000.0,
                               batch_wait=settings.batch_wait_ms / 1000.0,
                               cross_model=settings.cross_model_batching)
    raise ValueError(f"unknown policy {settings.policy!r}")
