"""What a node's controller predicts, read-only: when a request would be answered.

Two readers: applications leave out members that cannot make a deadline
(`expected_finish`, daemon/apps/router.py), and a cluster router picks the node that answers
first (`node_forecast`, the socket's `forecast` op, daemon/routing.py). Pure functions of the
scheduler's state and `now`; nothing here changes that state.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any, Final

from daemon.controller.estimates import EXACT_ROW_KINDS
from daemon.controller.policies.clockwork import LOAD_BANDWIDTH_GUESS
from daemon.model import ModelSpec

if TYPE_CHECKING:
    from daemon.controller.scheduler import Scheduler

COLD_UNKNOWN_S: Final = 1e9  # no live device: a node that cannot run anything is never the earliest


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


def predicted_finish(sched: Scheduler, spec: ModelSpec, now: float) -> float:
    """When this node would finish one more request of `spec` sent at `now`: the earliest any
    live device holding it (or loading it, or able to load it) could run it, by its timelines,
    plus the work queued for it spread over the devices holding it. Unlike `expected_finish`, it
    sees the other models' work on each device (the timelines), which a router needs."""
    key = spec.key
    est = sched.estimator
    entry = sched.models[key]
    best = math.inf
    for dev in sched.devices.values():
        if dev.failed:
            continue
        run = est.infer(key, 1 if dev.kind in EXACT_ROW_KINDS else spec.batch_size_for(1), dev.kind, dev.name) or 0.0
        tl = dev.timeline
        if dev.memory.is_ready(key):
            start = tl.exec.free_at(now)
        elif dev.memory.state(key) is not None:  # loading
            start = max(tl.copy.free_at(now), tl.exec.free_at(now))
        else:
            load = est.load(key, dev.kind) or entry.weight_bytes / LOAD_BANDWIDTH_GUESS
            start = max(tl.copy.free_at(now) + load, tl.exec.free_at(now))
        best = min(best, start + run)
    queued = entry.queue.samples
    if queued:
        best += queued * row_seconds(sched, spec)
    return best


def row_seconds(sched: Scheduler, spec: ModelSpec) -> float:
    """Device seconds one more row of `spec` adds on this node: a full batch's run per row, over
    the devices holding it (one where none does)."""
    holders = sched.ready_on.get(spec.key, ())
    b = spec.max_batch_size
    per = min((sched.estimate(spec.key, b, sched.devices[d]) for d in holders), default=None)
    if per is None:
        per = min((sched.estimate(spec.key, b, k) for k in sched.kinds), default=0.0)
    return per / b / max(1, len(holders))


def node_forecast(sched: Scheduler, now: float, limit: int) -> dict[str, Any]:
    """The node as a cluster router sees it (daemon/routing.py NodeForecast, less its time stamp):
    for each model held or loading on a device (at most `limit`, the most queued first), seconds
    until a request of it sent at `now` would be answered (`predicted_finish`), its SLO, and the
    seconds each more request of it adds (`row_seconds`); seconds for a model held nowhere (the
    earliest device free, a typical LOAD, a typical run) and the part of it that is the LOAD and
    the run; the typical seconds a request adds; and the requests held."""
    held: list[tuple[int, str, float, float, float]] = []
    rows: list[float] = []
    loads: list[float] = []
    for key, devs in sched.placed_on.items():
        entry = sched.models.get(key)
        if not devs or entry is None:
            continue
        spec = entry.spec
        row = row_seconds(sched, spec)
        held.append((entry.queue.samples, spec.name, predicted_finish(sched, spec, now) - now, spec.slo_s, row))
        rows.append(row)
        loads += [e for k in sched.kinds if (e := sched.estimator.load(key, k)) is not None]
    held.sort(key=lambda h: -h[0])
    models: dict[str, list[float]] = {}
    for _, name, finish, slo, row in held[:max(limit, 0)]:
        if name not in models or finish < models[name][0]:  # several versions: the earliest
            models[name] = [finish, slo, row]
    live = [d for d in sched.devices.values() if not d.failed]
    typical_row = statistics.median(rows) if rows else 0.0
    typical_load = statistics.median(loads) if loads else 0.0
    load = typical_load + typical_row
    # a LOAD waits for the copy lane, the run for the exec lane: the device where both free first
    cold = min((max(d.timeline.copy.free_at(now) + typical_load, d.timeline.exec.free_at(now)) for d in live),
               default=math.inf) - now + typical_row
    return {"models": models, "cold_s": cold if math.isfinite(cold) else COLD_UNKNOWN_S, "load_s": load,
            "devices": len(live), "per_request_s": typical_row, "pending": sched.pending}
