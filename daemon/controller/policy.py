"""The policy interface: a policy reads the scheduler's state and issues actions through it.

A policy is plain synchronous code: `schedule(state, now)` is called after every change
(a request arrived, a result came back, a wake-up time passed) and issues LOAD, INFER and
UNLOAD actions with the scheduler's `issue_*` helpers; `next_wakeup` says when it next wants
to be called even if nothing else happens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from daemon.actions import Action, Result
from daemon.config import ControllerSettings
from daemon.request import InferenceRequest

if TYPE_CHECKING:
    from daemon.controller.scheduler import Scheduler
    from daemon.controller.state import ModelEntry


class Policy(Protocol):
    name: str

    def schedule(self, state: Scheduler, now: float) -> None: ...

    def next_wakeup(self, state: Scheduler, now: float) -> float | None: ...

    def on_submit(self, state: Scheduler, req: InferenceRequest, now: float) -> None:
        """A request was admitted (after it joined its queue)."""
        ...

    def on_queued(self, state: Scheduler, entry: ModelEntry, now: float) -> None:
        """A model gained queued work other than by an arrival: requests returned to its queue, or
        its weights left the last device holding them while it has work."""
        ...

    def on_result(self, state: Scheduler, result: Result, now: float) -> None:
        """An action's result came back (after the scheduler applied it)."""
        ...

    def on_extra(self, state: Scheduler, action: Action, now: float) -> None:
        """The scheduler issued an action the policy did not plan (a parity batch, a replica)."""
        ...


def make_policy(settings: ControllerSettings) -> Policy:
    if settings.policy == "dynamic":
        from daemon.controller.policies.dynamic import DynamicBatchingPolicy

        return DynamicBatchingPolicy(max_queue_delay=settings.max_queue_delay_ms / 1000.0)
    if settings.policy == "clockwork":
        from daemon.controller.policies.clockwork import ClockworkPolicy

        return ClockworkPolicy(schedule_ahead=settings.schedule_ahead_ms / 1000.0,
                               batch_wait=settings.batch_wait_ms / 1000.0)
    raise ValueError(f"unknown policy {settings.policy!r}")
