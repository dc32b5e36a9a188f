"""Request classes: what a request's deadline means, decided once at arrival. Pure code.

- HARD: a timeout whose action is `reject` (the client's, or the daemon's default): refused at
  arrival when it cannot be met, answered 504 as soon as it cannot (Clockwork's rule).
- TARGET: no timeout (Triton's default), or one whose action is `delay`: the deadline (the
  model's SLO, or the timeout) is a target. It is scheduled exactly like a hard one while it can
  make it; when it cannot, it moves to the model's best-effort lane and is answered late.
- BEST_EFFORT: a best-effort priority level: in the lane from the start.

Lane requests run only in device time no on-time work needs, oldest first, and wait at most
`best_effort_max_wait_s` (then 504). Clients that set no timeout (tritonclient, a KServe
transformer, a batch job) are served late rather than lost, as Triton, TorchServe and Ray Serve do.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemon.config import ControllerSettings
from daemon.repository import ModelSpec
from daemon.request import RequestClass


@dataclass(frozen=True, slots=True)
class Admission:
    deadline: float  # absolute: hard for HARD, a target otherwise
    klass: RequestClass
    give_up_at: float  # when a lane request is answered 504 (inf for HARD)


def classify(spec: ModelSpec, now: float, timeout_us: int | None, rank: int,
             settings: ControllerSettings) -> Admission:
    """The class and deadline of a request arriving `now` with the client's `timeout_us` (None: it
    gave none) and priority `rank`, under the daemon's queue policy."""
    timeout_s: float | None = None
    if timeout_us is not None and settings.allow_timeout_override:
        timeout_s = timeout_us * 1e-6
    elif settings.default_timeout_ms > 0:
        timeout_s = settings.default_timeout_ms / 1000.0
    deadline = now + (spec.slo_s if timeout_s is None else timeout_s)
    give_up = now + settings.best_effort_max_wait_s
    if settings.best_effort_priority and rank >= settings.best_effort_priority:
        return Admission(deadline, RequestClass.BEST_EFFORT, give_up)
    if timeout_s is not None and settings.timeout_action == "reject":
        return Admission(deadline, RequestClass.HARD, float("inf"))
    return Admission(deadline, RequestClass.TARGET, give_up)
