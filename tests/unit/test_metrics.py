"""The metrics collector and the statistics records over a scheduler driven by the fake clock."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.errors import DeadlineExceeded, Overloaded
from daemon.gateway import model_stats_json
from daemon.model import ModelSpec
from daemon.observability.metrics import make_registry
from daemon.observability.stats import DURATION_ERROR_BOUNDS, LATENCY_BOUNDS, Buckets
from tests.unit.harness import Harness, make_spec

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
M = {"model": "m", "version": "1"}


def scrape(h: Harness) -> Samples:
    text = generate_latest(make_registry(lambda: h.sched)).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def infer_of(actions: list[Action]) -> Action:
    (a,) = [x for x in actions if x.kind == ActionKind.INFER]
    return a


def run_late(h: Harness, action: Action, late: float) -> None:
    """Complete `action` as an executor that started it `late` after it could, in its expected time."""
    ready = h.now
    h.clock.advance(late)
    begin = h.now
    h.clock.advance(action.expected_duration)
    outputs = (np.zeros((action.samples, 1), np.float32),)
    h.collect(h.sched.on_result(Result(action, ResultStatus.OK, ready, begin, h.now, action.expected_duration,
                                     outputs, ready_at=ready), h.now))


def serve_mix(h: Harness, spec: ModelSpec) -> float:
    """One success (after a load), one refusal for the deadline, one model failure, one cancellation;
    returns when the cancellation was (the last request event)."""
    h.use(spec)
    with pytest.raises(DeadlineExceeded):
        h.request(spec, timeout=0.0)
    failed = h.request(spec, timeout=1.0)
    acts = h.step()
    while not failed.status.finished:  # retried until it failed too often: one failure of one request
        acts = h.result(infer_of(acts), ResultStatus.FAILED, error="boom")
    cancelled = h.request(spec, timeout=1.0)
    action = infer_of(h.step())
    cancelled_at = h.now
    h.collect(h.sched.cancel(cancelled, h.now))
    run_late(h, action, 0.0003)  # it ran all the same: an execution that answers nobody
    return cancelled_at


@pytest.mark.expect_errors('failed: boom')
def test_collector_counts_each_outcome_once() -> None:
    h = Harness(budget=1000)
    spec = h.add(make_spec())
    serve_mix(h, spec)
    s = scrape(h)
    assert value(s, "nv_inference_request_success", **M) == 1
    failures = {r: value(s, "nv_inference_request_failure", **M, reason=r)
                for r in ("REJECTED", "DEADLINE", "CANCELED", "BACKEND", "UNAVAILABLE", "OTHER")}
    assert failures == {"REJECTED": 0, "DEADLINE": 1, "CANCELED": 1, "BACKEND": 1, "UNAVAILABLE": 0, "OTHER": 0}
    assert value(s, "nv_inference_count", **M) == 1
    assert value(s, "nv_inference_exec_count", **M) == 2  # the failed execution is not one; the cancelled one is
    assert value(s, "escapement_slo_met_total", **M) == 1
    assert value(s, "escapement_slo_missed_total", **M) == 2  # refused and failed; cancelled is neither
    assert value(s, "escapement_request_duration_seconds_count", **M) == 1
    assert value(s, "escapement_compute_duration_seconds_count", **M) == 2
    assert value(s, "escapement_batch_size_bucket", **M, le="1.0") == 2
    assert value(s, "nv_inference_pending_request_count", **M) == 0
    assert value(s, "escapement_model_loads_total", **M, device="cpu:0") == 1
    assert value(s, "escapement_model_resident", **M, device="cpu:0") == 1
    assert value(s, "escapement_device_weight_used_bytes", device="cpu:0") == 100
    assert value(s, "escapement_device_weight_budget_bytes", device="cpu:0") == 1000
    assert value(s, "escapement_controller_events_total", event="admitted") == 3
    # Start lateness: only the hand-made result says when it could start (0.3 ms before it did).
    lateness = {"device": "cpu:0", "kind": "INFER"}
    assert value(s, "escapement_action_start_lateness_seconds_bucket", **lateness, le="0.00025") == 0
    assert value(s, "escapement_action_start_lateness_seconds_bucket", **lateness, le="0.0005") == 1
    # Both executions took what was predicted: a duration error of 0 (up to float rounding).
    err = {"device": "cpu:0"}
    assert value(s, "escapement_infer_duration_error_ratio_bucket", **err, le="-0.05") == 0
    assert value(s, "escapement_infer_duration_error_ratio_bucket", **err, le="0.05") == 2


@pytest.mark.expect_errors("failed: boom")  # (serve_mix fails one execution on purpose)
def test_a_scrape_reads_the_counts_without_adding_to_them() -> None:
    """The controller's counts answer 0 for an event that never happened; a scrape that reads one
    must not add it, or what /metrics and the stats show would depend on who scraped before."""
    h = Harness(budget=1000)
    spec = h.add(make_spec())
    serve_mix(h, spec)
    counters = dict(h.sched.counters)
    failures = {k: dict(m.failures) for k, m in h.sched.telemetry.models.items()}
    def counts(samples: Samples) -> Samples:  # (the threads' CPU seconds move on between two scrapes)
        return {k: v for k, v in samples.items() if k[0] != "escapement_thread_cpu_seconds_total"}

    first = scrape(h)
    assert counts(scrape(h)) == counts(first)
    assert dict(h.sched.counters) == counters
    assert {k: dict(m.failures) for k, m in h.sched.telemetry.models.items()} == failures
    events = {dict(labels)["event"] for name, labels in first if name == "escapement_controller_events_total"}
    assert events == set(counters)


def test_refusals_for_a_full_queue_are_rejected_failures() -> None:
    h = Harness(max_pending_per_model=1)
    spec = h.add(make_spec())
    h.request(spec)
    with pytest.raises(Overloaded):
        h.request(spec)
    s = scrape(h)
    assert value(s, "nv_inference_request_failure", **M, reason="REJECTED") == 1
    assert value(s, "nv_inference_pending_request_count", **M) == 1
    assert value(s, "escapement_pending_requests") == 1


def test_parm_counters_have_their_own_names() -> None:
    h = Harness()
    h.add(make_spec())
    h.sched.counters.update(reconstructions=2, parities_run=3, parities_lost=1, coding_groups=4, replica_answers=5)
    s = scrape(h)
    assert value(s, "escapement_reconstructions_total") == 2
    assert value(s, "escapement_parity_batches_total", outcome="completed") == 3
    assert value(s, "escapement_parity_batches_total", outcome="lost") == 1
    assert value(s, "escapement_coding_groups_total") == 4
    assert value(s, "escapement_replica_answers_total") == 5


@pytest.mark.expect_errors('failed: boom')
def test_statistics_extension_record() -> None:
    h = Harness()
    spec = h.add(make_spec())
    cancelled_at = serve_mix(h, spec)
    st = model_stats_json(h.sched, spec, epoch=0.0)
    assert (st["name"], st["version"], st["inference_count"], st["execution_count"]) == ("m", "1", 1, 2)
    assert st["last_inference"] == round(cancelled_at * 1000)
    inf = st["inference_stats"]
    assert {k: v["count"] for k, v in inf.items()} == {"success": 1, "fail": 3, "queue": 1, "compute_input": 1,
                                                     "compute_infer": 1, "compute_output": 1, "cache_hit": 0,
                                                     "cache_miss": 0}
    # the one success ran one execution of the 1 ms estimate, after a 1 ms load
    assert inf["compute_infer"]["ns"] == pytest.approx(1e6, rel=0.01)
    assert inf["queue"]["ns"] == pytest.approx(1e6, rel=0.01)
    assert inf["success"]["ns"] == pytest.approx(2e6, rel=0.01)
    (batch,) = st["batch_stats"]
    assert batch["batch_size"] == 1 and batch["compute_infer"]["count"] == 2
    assert batch["compute_infer"]["ns"] == pytest.approx(2e6, rel=0.01) and batch["compute_input"]["ns"] == 0
    assert st["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": 100}]
    # a model never asked for reads as zeros
    other = h.add(make_spec("idle"))
    idle = model_stats_json(h.sched, other, epoch=0.0)
    assert idle["last_inference"] == 0 and idle["execution_count"] == 0 and idle["batch_stats"] == []


def test_buckets_count_values_at_their_bound_as_prometheus_le() -> None:
    b = Buckets((1.0, 2.0))
    for x in (0.5, 1.0, 1.5, 2.0, 3.0):
        b.add(x)
    assert b.cumulative() == [(1.0, 2), (2.0, 4), (math.inf, 5)]
    assert b.count == 5 and b.total == 8.0


def test_buckets_place_every_value_where_bisect_left_does() -> None:
    """Buckets searches its bounds itself (compiled, cheaper than calling bisect), from the last
    value's bucket: the same bucket for every value, in any order, bounds and infinities
    included, with any number of bounds."""
    from bisect import bisect_left

    rng = np.random.default_rng(3)
    for bounds in (LATENCY_BOUNDS, DURATION_ERROR_BOUNDS, (1.0,), ()):
        b = Buckets(bounds)
        want = [0] * (len(bounds) + 1)
        for x in [*rng.uniform(-1.0, 12.0, 2000).tolist(), *bounds, math.inf, -math.inf, 0.0]:
            b.add(x)
            want[bisect_left(bounds, x)] += 1
        assert b.counts == want
        b.add(math.nan)  # (no bound holds it: +Inf, wherever the last value was)
        want[-1] += 1
        assert b.counts == want


@pytest.mark.slow  # asserts in wall-clock time
@pytest.mark.expect_errors(r"trace /dev/full cannot be written")
def test_a_trace_on_a_full_disk_drops_lines_and_never_blocks_the_shutdown() -> None:
    from daemon.observability.trace import TraceWriter

    before = set(threading.enumerate())
    w = TraceWriter("/dev/full", max_pending=8)  # every write: ENOSPC
    (writer,) = set(threading.enumerate()) - before  # the thread it writes from
    for i in range(10_000):  # far more than the queue holds: writes never wait
        w.write({"event": "x", "i": i, "pad": "y" * 100})
    t0 = time.monotonic()
    w.close(timeout=2.0)
    assert time.monotonic() - t0 < 3.0
    assert not writer.is_alive()
    assert w.failures >= 1 and w.dropped > 0


def test_prediction_error_is_absolute_seconds_per_kind() -> None:
    """|measured - expected| of INFERs and LOADs with an estimate, in ms, in /v2/controller/stats's summary."""
    from daemon.observability.telemetry import Telemetry

    t = Telemetry()
    spec = make_spec()
    for kind, expected, took in ((ActionKind.INFER, 0.010, 0.012), (ActionKind.INFER, 0.010, 0.009),
                                 (ActionKind.LOAD, 0.020, 0.050), (ActionKind.LOAD, 0.0, 0.050),
                                 (ActionKind.UNLOAD, 0.001, 0.5)):
        a = Action(kind, spec, "cpu:0", 0.0, math.inf, expected, 1 if kind == ActionKind.INFER else 0)
        t.action(Result(a, ResultStatus.OK, 0.0, 1.0, 1.0 + took, took))
    s = t.summary()["prediction_error_ms"]
    assert s["INFER"]["count"] == 2 and s["LOAD"]["count"] == 1  # no estimate, or an UNLOAD: not a prediction
    assert s["INFER"]["max"] == pytest.approx(2.0)
    assert s["LOAD"]["p99"] == pytest.approx(30.0)
