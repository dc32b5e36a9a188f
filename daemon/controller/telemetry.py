"""Telemetry: what the controller predicted against what executors measured, as histograms.

Per request: latency, slack left at the finish (negative = missed), cold starts. Per action:
the executor's start lateness (how long after it could start, given its window and its lane,
it did start: thread wake-ups, the GIL), the start prediction error (actual start minus the
planned one) and the duration prediction error (measured over expected, minus one). All are
log-bucketed histograms, cheap to update on the loop and mergeable; `summary()` reads their
percentiles. Optionally every event also goes to a JSON-lines trace (`controller.trace_path`),
written by a thread of its own so the loop never does file I/O.

Per model (`ModelStats`) and per device (`DeviceStats`) it also keeps what the statistics
extension and /metrics report: Triton's counts and cumulative durations, failures by reason,
deadlines met and missed, and fixed-bound histograms (`Buckets`) that map one to one onto
Prometheus histograms. Updating them is a few integer additions and a bisect per event; the
readers (daemon/metrics.py, daemon/api/observe.py) turn them into their formats when asked.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from daemon.actions import ActionKind, Result, ResultStatus
from daemon.errors import Cancelled, DeadlineExceeded, EscapementError, InternalError, Overloaded, Unavailable
from daemon.repository import ModelSpec
from daemon.request import InferenceRequest, RequestClass, RequestStatus

log = logging.getLogger("escapement.controller")


_log10 = math.log10
TRACE_RETRY_S = 5.0  # after a failed trace write, how long lines are dropped before the next try
_INV_LOW = 1e7  # 1 / Histogram.LOW
# (an enum's `.name` is a descriptor call: read once per action it costs more than the histogram)
_KIND_NAMES = {k: k.name for k in ActionKind}
_STARTED = frozenset({ResultStatus.OK, ResultStatus.FAILED})  # results of actions that ran


class Histogram:
    """Counts of values in log-spaced buckets (10 per decade) from 1e-7 up; signed values kept apart."""

    PER_DECADE = 10
    LOW = 1e-7

    __slots__ = ("count", "max", "min", "neg", "pos", "total", "zero")

    def __init__(self) -> None:
        self.neg: dict[int, int] = {}
        self.pos: dict[int, int] = {}
        self.zero = 0
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def _bucket(self, x: float) -> int:
        return max(0, math.floor(math.log10(x / self.LOW) * self.PER_DECADE))

    def add(self, x: float) -> None:
        # on every request's path (several per request): plain comparisons, one log
        self.count += 1
        self.total += x
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x
        if x >= self.LOW:
            b = int(_log10(x * _INV_LOW) * 10)  # >= 0 here, so int() is floor()
            pos = self.pos
            pos[b] = pos.get(b, 0) + 1
        elif x <= -self.LOW:
            b = int(_log10(-x * _INV_LOW) * 10)
            neg = self.neg
            neg[b] = neg.get(b, 0) + 1
        else:
            self.zero += 1

    def _edge(self, b: int) -> float:
        return self.LOW * 10 ** ((b + 1) / self.PER_DECADE)  # upper edge: percentiles err high

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100), accurate to a bucket (~26%), never above max."""
        if not self.count:
            return math.nan
        rank = q / 100.0 * self.count
        seen = 0
        for b in sorted(self.neg, reverse=True):
            seen += self.neg[b]
            if seen >= rank:
                return max(self.min, -self.LOW * 10 ** (b / self.PER_DECADE))
        seen += self.zero
        if seen >= rank:
            return 0.0
        for b in sorted(self.pos):
            seen += self.pos[b]
            if seen >= rank:
                return min(self.max, self._edge(b))
        return self.max

    def merge(self, other: Histogram) -> None:
        for mine, theirs in ((self.neg, other.neg), (self.pos, other.pos)):
            for b, n in theirs.items():
                mine[b] = mine.get(b, 0) + n
        self.zero += other.zero
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def summary(self, scale: float = 1.0, qs: Iterable[float] = (50, 90, 99, 99.9)) -> dict[str, float]:
        if not self.count:
            return {"count": 0}
        out: dict[str, float] = {"count": self.count, "mean": self.total / self.count * scale}
        for q in qs:
            out[f"p{q:g}"] = self.percentile(q) * scale
        out["max"] = self.max * scale
        return out


# Upper bounds of the Prometheus histograms. Seconds for latencies: 100 µs (a small model's
# batch) to 10 s (past any sensible SLO); start lateness is finer (thread wake-ups, the GIL).
LATENCY_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0)
LATENESS_BOUNDS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1)
DURATION_ERROR_BOUNDS = (-0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)  # measured/expected - 1


class Buckets:
    """A Prometheus-shaped histogram: counts of values at or under fixed upper bounds, exact at them."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.count = 0
        self.total = 0.0

    def add(self, x: float) -> None:
        self.counts[bisect_left(self.bounds, x)] += 1  # the first bound >= x: Prometheus's `le`
        self.count += 1
        self.total += x

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, count of values at or under it), ending with (inf, count)."""
        out: list[tuple[float, int]] = []
        seen = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            seen += n
            out.append((bound, seen))
        return out


class Span:
    """A count and a total duration: Triton's `$duration_stat`."""

    __slots__ = ("count", "seconds")

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds

    def as_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": round(self.seconds * 1e9)}


class BatchStats:
    """Executions of one batch size: model run time, and the copies and host work around it."""

    __slots__ = ("count", "infer_s", "other_s")

    def __init__(self) -> None:
        self.count = 0
        self.infer_s = 0.0
        self.other_s = 0.0


def failure_reason(error: EscapementError | None) -> str:
    """The `reason` label of a failed request: Triton's names where they fit, two of escapement's."""
    if isinstance(error, Overloaded):
        return "REJECTED"  # a bounded queue was full (Triton's reason for the same refusal)
    if isinstance(error, DeadlineExceeded):
        return "DEADLINE"
    if error is None or isinstance(error, Cancelled):
        return "CANCELED"
    if isinstance(error, InternalError):
        return "BACKEND"
    if isinstance(error, Unavailable):
        return "UNAVAILABLE"  # its model failed to load or was unloaded, or the daemon shut down
    return "OTHER"


class ModelStats:
    """One model version's cumulative statistics, as Triton's statistics extension counts them.

    Requests count when they reach the controller: answered, failed, cancelled, or refused at
    admission. Requests refused earlier (malformed, unknown model, event loop overloaded) do not.
    """

    __slots__ = ("batches", "classes", "compute_infer", "compute_input", "compute_output", "compute_time",
                 "execution_count",
                 "fail", "failures", "inference_count", "last_inference", "latency", "load_failures", "loads",
                 "queue", "queue_time", "slo_met", "slo_missed", "spec", "success", "unloads")

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.success = Span()  # arrival -> answer, successful requests
        self.fail = Span()  # arrival -> answer, failed and cancelled requests
        self.queue = Span()  # arrival -> dispatch, successful requests
        # Per successful request answered by an execution: that execution's times (Triton's way).
        self.compute_input = Span()  # always 0 ns: input copies are measured with the output's
        self.compute_infer = Span()
        self.compute_output = Span()
        self.failures: Counter[str] = Counter()  # failure_reason -> requests
        self.inference_count = 0  # samples of successful requests
        self.execution_count = 0  # INFER actions that ran to completion
        self.batches: dict[int, BatchStats] = {}  # samples run -> executions
        self.last_inference = 0.0  # clock time of the last request answered or refused; 0: none yet
        self.slo_met = 0  # answered successfully by the deadline
        self.slo_missed = 0  # answered late, failed or refused (cancelled requests are neither)
        self.latency = Buckets(LATENCY_BOUNDS)  # as `success`
        self.queue_time = Buckets(LATENCY_BOUNDS)  # as `queue`
        self.compute_time = Buckets(LATENCY_BOUNDS)  # model run time per execution
        self.loads: Counter[str] = Counter()  # device -> completed LOADs
        self.load_failures: Counter[str] = Counter()
        self.unloads: Counter[str] = Counter()
        # (request class, outcome) -> requests: on_time, late (answered after its deadline), refused
        # (at arrival), dropped (504: it could not make its hard deadline), expired (504: it waited
        # the longest a best-effort request may), failed, cancelled
        self.classes: Counter[tuple[str, str]] = Counter()


_CLASS_NAMES = {k: k.name.lower() for k in RequestClass}


def outcome(req: InferenceRequest) -> str:
    """What became of a finished request, for the per-class counts."""
    if req.status == RequestStatus.SUCCEEDED:
        return "on_time" if req.finished_at <= req.deadline else "late"
    if req.status == RequestStatus.CANCELLED:
        return "cancelled"
    if isinstance(req.error, DeadlineExceeded):
        return "expired" if req.late else "dropped"
    return "failed"


class DeviceStats:
    __slots__ = ("duration_error", "lateness", "load_time")

    def __init__(self) -> None:
        self.lateness: dict[str, Buckets] = {}  # action kind -> executor start lateness (s)
        self.duration_error = Buckets(DURATION_ERROR_BOUNDS)  # INFER: measured / expected - 1
        self.load_time = Buckets(LATENCY_BOUNDS)


class TraceWriter:
    """JSON lines to a file from a thread of its own; a bounded queue, dropping when full."""

    def __init__(self, path: str | Path, max_pending: int = 100_000) -> None:
        self.path = Path(path)
        self._q: queue.Queue[bytes | None] = queue.Queue(max_pending)
        self.dropped = 0
        self.failures = 0  # writes that failed
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    def write(self, event: dict[str, Any]) -> None:
        try:
            self._q.put_nowait(orjson.dumps(event) + b"\n")
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        # A write that fails (a full disk, a removed mount) drops lines, counted, and never stops
        # the thread: the queue keeps draining, so neither the loop nor a shutdown waits on it.
        f: BinaryIO | None = None
        retry_at = 0.0
        while (line := self._q.get()) is not None:
            if f is None and time.monotonic() >= retry_at:
                try:
                    f = self.path.open("ab")
                except OSError as e:
                    self._failed(e)
                    retry_at = time.monotonic() + TRACE_RETRY_S
            if f is None:
                self.dropped += 1
                continue
            try:
                f.write(line)
                if self._q.empty():
                    f.flush()
            except OSError as e:
                self.dropped += 1
                self._failed(e)
                f = self._discard(f)
                retry_at = time.monotonic() + TRACE_RETRY_S
        if f is not None:
            self._discard(f, flush=True)

    def _failed(self, e: OSError) -> None:
        self.failures += 1
        if self.failures == 1:  # once: a full disk must not also fill the journal
            log.error("trace %s cannot be written: %s; lines are dropped (retrying every %.0f s)",
                      self.path, e.strerror or e, TRACE_RETRY_S)

    def _discard(self, f: BinaryIO, flush: bool = False) -> None:
        try:
            if flush:
                f.flush()
        except OSError as e:
            self._failed(e)
        try:
            f.close()
        except OSError:
            pass  # its buffer could not be written: those lines are lost, and said so above
        return None

    def close(self, timeout: float = 5.0) -> None:
        """End the writer: what is queued is written (or dropped) within `timeout` s at most."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:  # the thread is stuck in a write (a hung mount): leave it
            log.warning("trace %s: the writer is stuck; %d line(s) left unwritten", self.path, self._q.qsize())
            return
        self._thread.join(timeout)


class Telemetry:
    def __init__(self, trace: TraceWriter | None = None) -> None:
        self.latency = Histogram()  # seconds, successful requests
        self.slack = Histogram()  # deadline - finish, every finished request (negative = missed)
        self.queue_time = Histogram()  # arrival -> dispatch
        self.lateness = Histogram()  # executor: start - when it could start
        self.start_error = Histogram()  # actual start - planned start
        self.duration_error = Histogram()  # measured / expected - 1, INFER with an estimate
        # |measured - expected| seconds per kind (INFER, LOAD): the error in time, which is what a
        # deadline feels (a ratio hides that 10% of a LOAD is many INFERs)
        self.prediction_error: dict[str, Histogram] = {"INFER": Histogram(), "LOAD": Histogram()}
        self.load_time = Histogram()
        self.decode_time = Histogram()  # ParM reconstructions
        self.models: dict[str, ModelStats] = {}  # model key -> its statistics, kept after it is removed
        self.devices: dict[str, DeviceStats] = {}
        self.trace = trace

    def model(self, spec: ModelSpec) -> ModelStats:
        m = self.models.get(spec.key)
        if m is None:
            m = self.models[spec.key] = ModelStats(spec)
        return m

    def device(self, name: str) -> DeviceStats:
        d = self.devices.get(name)
        if d is None:
            d = self.devices[name] = DeviceStats()
        return d

    def request(self, req: InferenceRequest) -> None:
        """A request finished (answered, failed or cancelled)."""
        m = self.model(req.model)
        m.last_inference = req.finished_at
        m.classes[(_CLASS_NAMES[req.klass], outcome(req))] += 1
        took = req.finished_at - req.arrival
        if req.status == RequestStatus.CANCELLED:
            m.fail.add(took)
            m.failures["CANCELED"] += 1
            return
        self.slack.add(req.deadline - req.finished_at)
        if req.status == RequestStatus.SUCCEEDED:
            self.latency.add(took)
            m.success.add(took)
            m.latency.add(took)
            m.inference_count += req.samples
            if req.finished_at <= req.deadline:
                m.slo_met += 1
            else:
                m.slo_missed += 1
            if req.dispatched_at:
                queued = req.dispatched_at - req.arrival
                self.queue_time.add(queued)
                m.queue.add(queued)
                m.queue_time.add(queued)
        else:
            m.fail.add(took)
            m.failures[failure_reason(req.error)] += 1
            m.slo_missed += 1
        if self.trace is not None:
            self.trace.write({"ev": "request", "id": req.id, "model": req.model.key, "samples": req.samples,
                              "arrival": req.arrival, "deadline": req.deadline, "finish": req.finished_at,
                              "status": req.status.name, "met": req.ok and req.finished_at <= req.deadline,
                              "cold": req.cold_start, "error": req.error.status if req.error else None})

    def refused(self, req: InferenceRequest, error: EscapementError, now: float) -> EscapementError:
        """A request refused at admission (a full queue, a deadline out of reach): a failure of its
        model, as Triton counts a request its scheduler rejects. Returns `error`, for `raise`."""
        m = self.model(req.model)
        m.last_inference = now
        m.classes[(_CLASS_NAMES[req.klass], "refused")] += 1
        m.fail.add(now - req.arrival)
        m.failures[failure_reason(error)] += 1
        m.slo_missed += 1
        return error

    def action(self, result: Result) -> None:
        """An action's result, before the controller acts on it."""
        a = result.action
        dev = self.devices.get(a.device) or self.device(a.device)
        started = result.status in _STARTED
        if started and result.ready_at:
            late = result.begin - result.ready_at
            self.lateness.add(late)
            kind = _KIND_NAMES[a.kind]
            lane = dev.lateness.get(kind)
            if lane is None:
                lane = dev.lateness[kind] = Buckets(LATENESS_BOUNDS)
            lane.add(late)
        if started and a.expected_start:
            self.start_error.add(result.begin - a.expected_start)
        if result.ok and a.expected_duration > 0 and a.kind != ActionKind.UNLOAD:
            self.prediction_error[_KIND_NAMES[a.kind]].add(abs(result.end - result.begin - a.expected_duration))
        if a.kind == ActionKind.INFER:
            if result.ok:
                if a.expected_duration > 0:
                    err = (result.end - result.begin) / a.expected_duration - 1.0
                    self.duration_error.add(err)
                    dev.duration_error.add(err)
                self._executed(result)
        elif a.kind == ActionKind.LOAD:
            if result.ok:
                self.load_time.add(result.end - result.begin)
                dev.load_time.add(result.end - result.begin)
                self.model(a.model).loads[a.device] += 1
            else:
                self.model(a.model).load_failures[a.device] += 1
        elif result.ok:
            self.model(a.model).unloads[a.device] += 1
        if self.trace is not None:
            self.trace.write({"ev": "action", "id": a.id, "kind": a.kind.name, "model": a.model.key,
                              "device": a.device, "batch": a.batch_size, "samples": a.samples,
                              "earliest": a.earliest, "latest": a.latest, "planned_start": a.expected_start,
                              "expected": a.expected_duration, "received": result.received,
                              "ready": result.ready_at, "begin": result.begin, "end": result.end,
                              "status": result.status.name, "error": result.error or None})

    def _executed(self, result: Result) -> None:
        """An INFER that ran: one execution of its batch size, and its times for each request it
        answers. Called before the controller splits the outputs, so the requests still RUNNING
        are exactly those this result answers (not cancelled, not answered by a reconstruction)."""
        a = result.action
        m = self.model(a.model)
        infer_s = result.duration
        other_s = max(0.0, result.end - result.begin - infer_s)  # input and output copies, host work
        m.execution_count += 1
        m.compute_time.add(infer_s)
        b = m.batches.get(a.samples)
        if b is None:
            b = m.batches[a.samples] = BatchStats()
        b.count += 1
        b.infer_s += infer_s
        b.other_s += other_s
        running = RequestStatus.RUNNING
        n = sum(1 for r in a.requests if r.status == running)
        if n:  # (the same times for each request it answers: one update, not three per request)
            m.compute_input.count += n
            m.compute_infer.count += n
            m.compute_infer.seconds += n * infer_s
            m.compute_output.count += n
            m.compute_output.seconds += n * other_s

    def summary(self) -> dict[str, Any]:
        ms = 1e3
        return {
            "request_latency_ms": self.latency.summary(ms),
            "request_slack_ms": self.slack.summary(ms, (0.1, 1, 50)),
            "queue_time_ms": self.queue_time.summary(ms),
            "executor_lateness_ms": self.lateness.summary(ms),
            "start_error_ms": self.start_error.summary(ms, (1, 50, 99)),
            "duration_error": self.duration_error.summary(1.0, (1, 50, 99)),
            "prediction_error_ms": {k: h.summary(ms, (50, 99)) for k, h in self.prediction_error.items()},
            "load_time_ms": self.load_time.summary(ms),
            "decode_time_ms": self.decode_time.summary(ms),
            "trace_dropped": self.trace.dropped if self.trace else 0,
        }
