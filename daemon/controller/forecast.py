"""What a node's controller predicts, read-only: when a request would be answered.

Two readers: applications leave out members that cannot make a deadline
(`expected_finish`, daemon/apps/router.py), and a cluster router picks the node that answers
first (`node_forecast`, the socket's `forecast` op, daemon/routing.py). Pure functions of the
scheduler's state and `now`; nothing here changes that state.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from daemon.model import ModelSpec

if TYPE_CHECKING:
    from daemon.controller.scheduler import Scheduler

COLD_UNKNOWN_S = 1e9  # no live device: a node that cannot run anything is never the earliest


def expected_finish(sched: Scheduler, spec: ModelSpec, samples: int, now: float) -> float:
    """The clock time at which a request of `samples` samples of `spec` submitted at `now` would be
    answered at the earliest; inf when the model is not served. Its run time on the best device
    holding it (that device's recent runs: a slowed device shows), after the samples queued or
    running ahead of it; where no device holds it, a LOAD and the profile."""
    entry = sched.models.get(spec.key)
    if entry is None:
        return math.inf
    ready = sched.ready_on.get(spec.key, ())
    if ready:
        run = min(sched.estimate(spec.key, samples, sched.devices[d]) for d in ready)
    else:
        run = min((sched.estimate(spec.key, samples, k) for k in sched.kinds), default=0.0)
        loads = [e for k in sched.kinds if (e := sched.estimator.load(spec.key, k)) is not None]
        run += min(loads, default=0.0)
    ahead = entry.queue.samples + entry.running
    wait = 0.0
    if ahead:  # the queue runs in whole batches, spread over the devices holding the model
        batch = spec.max_batch_size
        per_batch = min((sched.estimate(spec.key, batch, sched.devices[d]) for d in ready), default=0.0)
        wait = -(-ahead // batch) * per_batch / max(1, len(ready))
    return now + wait + run


def node_forecast(sched: Scheduler, now: float, limit: int) -> dict[str, Any]:
    """The node as a cluster router sees it (daemon/routing.py NodeForecast, less its time stamp):
    for each model held or loading on a device (at most `limit`, the most queued first), seconds
    until a request of it sent at `now` would be answered, and its SLO; seconds for a model held
    nowhere (the earliest device free, a typical LOAD, a typical run); device seconds per request
    (a typical batched run per row over the live devices), which is what each request sent after
    this report adds; and the requests held."""
    held: list[tuple[int, str, float, float]] = []
    per_request: list[float] = []
    loads: list[float] = []
    for key, devs in sched.placed_on.items():
        entry = sched.models.get(key)
        if not devs or entry is None:
            continue
        spec = entry.spec
        held.append((entry.queue.samples, spec.name, expected_finish(sched, spec, 1, now) - now, spec.slo_s))
        batch = spec.max_batch_size
        per_request.append(min(sched.estimate(key, batch, sched.devices[d]) for d in devs) / batch)
        loads += [e for k in sched.kinds if (e := sched.estimator.load(key, k)) is not None]
    held.sort(key=lambda h: -h[0])
    models: dict[str, list[float]] = {}
    for _, name, finish, slo in held[:max(limit, 0)]:
        if name not in models or finish < models[name][0]:  # several versions: the earliest
            models[name] = [finish, slo]
    live = [d for d in sched.devices.values() if not d.failed]
    free = min((d.timeline.exec.free_at(now) for d in live), default=math.inf) - now
    typical_run = statistics.median(per_request) if per_request else 0.0
    cold = max(free, 0.0) + (statistics.median(loads) if loads else 0.0) + typical_run
    return {"models": models, "cold_s": cold if math.isfinite(cold) else COLD_UNKNOWN_S,
            "per_request_s": typical_run / max(len(live), 1), "pending": sched.pending}
