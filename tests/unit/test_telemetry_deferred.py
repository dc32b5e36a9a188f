"""Telemetry records requests on the hot path and counts them in bulk: what it reports must be
what per-request counting gave, and what it holds uncounted stays bounded."""

from __future__ import annotations

import math

import numpy as np
import pytest

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


def test_bulk_counting_equals_counting_one_request_at_a_time_over_many_models() -> None:
    """Every per-model figure the request path keeps (counts, seconds, buckets, classes, failures,
    last answer) equals a plain per-request count, across 300 models, with every outcome: on time,
    late, never dispatched, refused by its deadline or given up on in its lane, failed, cancelled;
    and every class."""
    from bisect import bisect_left
    from collections import Counter

    from daemon.errors import InternalError
    from daemon.observability.stats import LATENCY_BOUNDS, failure_reason
    from daemon.request import RequestClass

    rng = np.random.default_rng(7)
    specs = [sim_spec(f"m{i}") for i in range(300)]
    tel = Telemetry()
    reqs: list[InferenceRequest] = []
    for _ in range(3 * tm.FLUSH_AT + 11):
        spec = specs[int(rng.integers(len(specs)))]
        arrival = float(rng.uniform(0, 100))
        klass = RequestClass(int(rng.integers(3)))
        req = InferenceRequest(spec, (np.zeros((2, 1), np.float32),), int(rng.integers(1, 4)), arrival,
                               arrival + 0.05, klass=klass)
        kind = int(rng.integers(10))
        req.finished_at = arrival + float(rng.exponential(0.04))
        if kind < 6:
            req.status = RequestStatus.SUCCEEDED
            req.dispatched_at = 0.0 if kind == 0 else arrival + float(rng.uniform(0, 0.01))
        elif kind == 6:
            req.status, req.error = RequestStatus.CANCELLED, None
        elif kind == 7:
            req.status, req.error = RequestStatus.FAILED, InternalError("boom")
        else:
            req.status, req.error, req.late = RequestStatus.FAILED, DeadlineExceeded("late"), kind == 9
        reqs.append(req)
        tel.request(req)
    for spec in specs:
        mine = [r for r in reqs if r.model is spec]
        ok = [r for r in mine if r.status == RequestStatus.SUCCEEDED]
        m = tel.models.get(spec.key)
        if not mine:
            assert m is None
            continue
        assert m is not None
        assert m.last_inference == max(r.finished_at for r in mine)
        assert m.success.count == len(ok)
        assert math.isclose(m.success.seconds, sum(r.finished_at - r.arrival for r in ok), abs_tol=1e-9)
        assert m.inference_count == sum(r.samples for r in ok)
        on_time = [r for r in ok if r.finished_at <= r.deadline]
        assert m.slo_met == len(on_time)
        assert m.slo_missed == len(mine) - len(on_time) - sum(r.status == RequestStatus.CANCELLED for r in mine)
        buckets = [0] * (len(LATENCY_BOUNDS) + 1)
        for r in ok:
            buckets[bisect_left(LATENCY_BOUNDS, r.finished_at - r.arrival)] += 1
        assert m.latency.counts == buckets and m.latency.count == len(ok)
        queued = [r.dispatched_at - r.arrival for r in ok if r.dispatched_at]
        assert m.queue.count == len(queued) and math.isclose(m.queue.seconds, sum(queued), abs_tol=1e-9)
        qb = [0] * (len(LATENCY_BOUNDS) + 1)
        for q in queued:
            qb[bisect_left(LATENCY_BOUNDS, q)] += 1
        assert m.queue_time.counts == qb
        failed = [r for r in mine if r.status != RequestStatus.SUCCEEDED]
        assert m.fail.count == len(failed)
        want: Counter[tuple[str, str]] = Counter()
        for r in mine:
            name = r.klass.name.lower()
            if r.status == RequestStatus.SUCCEEDED:
                want[(name, "on_time" if r.finished_at <= r.deadline else "late")] += 1
            elif r.status == RequestStatus.CANCELLED:
                want[(name, "cancelled")] += 1
            elif isinstance(r.error, DeadlineExceeded):
                want[(name, "expired" if r.late else "dropped")] += 1
            else:
                want[(name, "failed")] += 1
        assert m.classes == want
        reasons = Counter("CANCELED" if r.status == RequestStatus.CANCELLED else failure_reason(r.error)
                          for r in failed)
        assert m.failures == reasons


def test_a_load_reports_its_whole_time_and_its_weight_copy_apart() -> None:
    """A LOAD's time is the action's (what the controller's copy lane is charged); its weight copy,
    timed by the device, is reported beside it, so that the host's part of a LOAD shows."""
    from daemon.actions import Action, ActionKind, Result, ResultStatus

    spec = sim_spec("m")
    tel = Telemetry()
    for i, (wall, copy) in enumerate(((0.005, 0.001), (0.004, 0.001), (0.006, 0.0))):  # 0: no device time
        a = Action(ActionKind.LOAD, spec, "cuda:0", float(i), float(i) + 1.0, expected_duration=0.003)
        tel.action(Result(a, ResultStatus.OK, float(i), float(i), float(i) + wall, copy))
    s = tel.summary()
    assert s["load_time_ms"]["count"] == 3
    assert s["load_copy_ms"]["count"] == 2
    assert s["load_copy_ms"]["max"] == pytest.approx(1.0) and s["load_time_ms"]["max"] == pytest.approx(6.0)
