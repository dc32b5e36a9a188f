"""Telemetry records requests on the hot path and counts them in bulk: what it reports must be
what per-request counting gave, and what it holds uncounted stays bounded."""

from __future__ import annotations

import math

import numpy as np

from daemon.errors import DeadlineExceeded
from daemon.observability import telemetry as tm
from daemon.observability.stats import Histogram
from daemon.observability.telemetry import Telemetry
from daemon.request import InferenceRequest, RequestStatus
from daemon.sim import sim_spec


def finished(spec: object, i: int) -> InferenceRequest:
    req = InferenceRequest(spec, (np.zeros((1, 1), np.float32),), 1, float(i), float(i) + 0.1)  # type: ignore[arg-type]
    req.dispatched_at = i + 0.01
    if i % 5 == 4:  # one in five misses its deadline: 504
        req.status, req.error, req.finished_at = RequestStatus.FAILED, DeadlineExceeded("late"), i + 0.1
    else:
        req.status, req.finished_at = RequestStatus.SUCCEEDED, i + 0.02 + (i % 3) * 0.1
    return req


def test_bulk_counting_reports_what_per_request_counting_did() -> None:
    spec = sim_spec("m")
    tel = Telemetry()
    reqs = [finished(spec, i) for i in range(tm.FLUSH_AT * 2 + 37)]
    for r in reqs:
        tel.request(r)
        assert tel.pending < tm.FLUSH_AT  # bounded: never more than FLUSH_AT uncounted
    m = tel.models[spec.key]
    ok = [r for r in reqs if r.status == RequestStatus.SUCCEEDED]
    on_time = [r for r in ok if r.finished_at <= r.deadline]
    assert m.success.count == len(ok)
    assert math.isclose(m.success.seconds, sum(r.finished_at - r.arrival for r in ok))
    assert m.slo_met == len(on_time)
    assert m.slo_missed == len(reqs) - len(on_time)
    assert m.classes[("hard", "on_time")] == len(on_time)
    assert m.classes[("hard", "late")] == len(ok) - len(on_time)
    assert m.classes[("hard", "dropped")] == len(reqs) - len(ok)
    assert m.failures["DEADLINE"] == len(reqs) - len(ok)
    assert m.queue.count == len(ok)
    # The global histograms equal one filled value by value.
    want = Histogram()
    for r in ok:
        want.add(r.finished_at - r.arrival)
    got = tel.latency
    assert (got.count, got.pos, got.neg, got.zero) == (want.count, want.pos, want.neg, want.zero)
    assert math.isclose(got.total, want.total) and got.max == want.max and got.min == want.min
    slack = Histogram()
    for r in reqs:
        slack.add(r.deadline - r.finished_at)
    assert (tel.slack.pos, tel.slack.neg, tel.slack.zero) == (slack.pos, slack.neg, slack.zero)


def test_add_many_equals_add_on_signed_values() -> None:
    xs = np.array([-3.0, -1e-3, -1e-9, 0.0, 1e-9, 2e-7, 1e-3, 0.5, 7.0])
    a, b = Histogram(), Histogram()
    for x in xs:
        a.add(float(x))
    b.add_many(xs)
    assert (a.count, a.pos, a.neg, a.zero, a.min, a.max) == (b.count, b.pos, b.neg, b.zero, b.min, b.max)
    b.add_many(np.array([]))
    assert b.count == a.count
