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
from typing import Any

from daemon.config import ControllerSettings
from daemon.model import ModelSpec
from daemon.request import RequestClass


@dataclass(frozen=True, slots=True)
class Admission:
    deadline: float  # absolute: hard for HARD, a target otherwise
    klass: RequestClass
    give_up_at: float  # when a lane request is answered 504 (inf for HARD)


def classify(spec: ModelSpec, now: float, timeout_us: int | None, rank: int,
             settings: ControllerSettings) -> Admission:
    """The class and deadline of a request arriving `now` with the client's `timeout_us` (None: it
    gave none) and priority `rank`, under the queue policy: its priority level's, then its model's
    (config.toml [queue_policy]), then the daemon's ([controller])."""
    level = model = None
    if spec.queue_policy is not None:
        model = spec.queue_policy.model
        level = spec.queue_policy.for_level(rank)

    def pick(key: str) -> Any:
        for policy in (level, model):
            value = getattr(policy, key) if policy is not None else None
            if value is not None:
                return value
        return getattr(settings, "best_effort_max_wait_s" if key == "max_wait_s" else key)

    timeout_s: float | None = None
    default_ms = pick("default_timeout_ms")
    if timeout_us is not None and pick("allow_timeout_override"):
        timeout_s = timeout_us * 1e-6
    elif default_ms > 0:
        timeout_s = default_ms / 1000.0
    deadline = now + (spec.slo_s if timeout_s is None else timeout_s)
    give_up = now + pick("max_wait_s")
    if (level is not None and level.best_effort) or (
            settings.best_effort_priority and rank >= settings.best_effort_priority):
        return Admission(deadline, RequestClass.BEST_EFFORT, give_up)
    if timeout_s is not None and pick("timeout_action") == "reject":
        return Admission(deadline, RequestClass.HARD, float("inf"))
    return Admission(deadline, RequestClass.TARGET, give_up)


def priority_rank(spec: ModelSpec, priority: int, settings: ControllerSettings) -> int:
    """The level a request's `priority` (0: none given) is queued at, as Triton maps it: the model's
    default level for none, or for one beyond its `priority_levels`; without client_priorities a
    client may lower its own priority, never jump above the default."""
    qp = spec.queue_policy
    default = (qp.default_priority_level if qp is not None and qp.default_priority_level else
               settings.default_priority)
    if priority and qp is not None and qp.priority_levels and priority > qp.priority_levels:
        priority = 0
    rank = priority or default
    return rank if settings.client_priorities else max(rank, default)


def max_queue(spec: ModelSpec, settings: ControllerSettings) -> tuple[int, str]:
    """The most requests one model may hold queued (on time and in its lane), and the key that says so."""
    if spec.queue_policy is not None and spec.queue_policy.model.max_queue_size:
        return spec.queue_policy.model.max_queue_size, f"queue_policy.max_queue_size of model {spec.name}"
    return settings.max_pending_per_model, "controller.max_pending_per_model"
