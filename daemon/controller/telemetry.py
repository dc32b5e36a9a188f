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

import numpy as np
import orjson

from daemon.actions import Action, ActionKind, Result, ResultStatus
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

    def add_many(self, xs: np.ndarray) -> None:
        """`add` for every value of `xs` at once (the deferred path: one numpy pass per flush)."""
        if not xs.size:
            return
        self.count += int(xs.size)
        self.total += float(xs.sum())
        lo, hi = float(xs.min()), float(xs.max())
        if lo < self.min:
            self.min = lo
        if hi > self.max:
            self.max = hi
        for mask, sign, into in ((xs >= self.LOW, 1.0, self.pos), (xs <= -self.LOW, -1.0, self.neg)):
            vals = xs[mask]
            if vals.size:
                bs, ns = np.unique((np.log10(sign * vals * _INV_LOW) * 10).astype(np.int64), return_counts=True)
                for b, n in zip(bs.tolist(), ns.tolist(), strict=True):
                    into[b] = into.get(b, 0) + n
        self.zero += int(((xs < self.LOW) & (xs > -self.LOW)).sum())

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
                self._discard(f)
                f = None
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


FLUSH_AT = 2048  # finished requests or results held before they are counted (bounded memory)


class Telemetry:
    """The controller's histograms and per-model/per-device statistics.

    `request` and `action` are on every request's path, so they only record the few numbers
    that matter in a tuple; `flush` counts what is pending in one pass (numpy for the global
    histograms), and runs before anything is read and whenever FLUSH_AT tuples are waiting.
    Per-request cost fell from ~11 µs to ~3 µs in the simulator (bench.scale_ab).
    """

    def __init__(self, trace: TraceWriter | None = None) -> None:
        self._latency = Histogram()  # seconds, successful requests
        self._slack = Histogram()  # deadline - finish, every finished request (negative = missed)
        self._queue_time = Histogram()  # arrival -> dispatch
        self._lateness = Histogram()  # executor: start - when it could start
        self._start_error = Histogram()  # actual start - planned start
        self._duration_error = Histogram()  # measured / expected - 1, INFER with an estimate
        # |measured - expected| seconds per kind (INFER, LOAD): the error in time, which is what a
        # deadline feels (a ratio hides that 10% of a LOAD is many INFERs)
        self._prediction_error: dict[str, Histogram] = {"INFER": Histogram(), "LOAD": Histogram()}
        self._load_time = Histogram()
        self.decode_time = Histogram()  # ParM reconstructions
        self._models: dict[str, ModelStats] = {}  # model key -> its statistics, kept after it is removed
        self._devices: dict[str, DeviceStats] = {}
        self.trace = trace
        self._reqs: list[tuple[Any, ...]] = []
        self._acts: list[tuple[Any, ...]] = []

    @property
    def pending(self) -> int:
        """Requests and results recorded but not yet counted (at most FLUSH_AT of each)."""
        return len(self._reqs) + len(self._acts)

    # Readers see everything recorded so far.
    @property
    def models(self) -> dict[str, ModelStats]:
        self.flush()
        return self._models

    @property
    def devices(self) -> dict[str, DeviceStats]:
        self.flush()
        return self._devices

    @property
    def latency(self) -> Histogram:
        self.flush()
        return self._latency

    @property
    def slack(self) -> Histogram:
        self.flush()
        return self._slack

    @property
    def queue_time(self) -> Histogram:
        self.flush()
        return self._queue_time

    @property
    def lateness(self) -> Histogram:
        self.flush()
        return self._lateness

    @property
    def start_error(self) -> Histogram:
        self.flush()
        return self._start_error

    @property
    def duration_error(self) -> Histogram:
        self.flush()
        return self._duration_error

    @property
    def prediction_error(self) -> dict[str, Histogram]:
        self.flush()
        return self._prediction_error

    @property
    def load_time(self) -> Histogram:
        self.flush()
        return self._load_time

    def model(self, spec: ModelSpec) -> ModelStats:
        m = self._models.get(spec.key)
        if m is None:
            m = self._models[spec.key] = ModelStats(spec)
        return m

    def device(self, name: str) -> DeviceStats:
        d = self._devices.get(name)
        if d is None:
            d = self._devices[name] = DeviceStats()
        return d

    def request(self, req: InferenceRequest) -> None:
        """A request finished (answered, failed or cancelled)."""
        self._reqs.append((req.model, req.klass, req.status, req.error, req.arrival, req.finished_at, req.deadline,
                           req.dispatched_at, req.samples, req.late))
        if self.trace is not None:
            self.trace.write({"ev": "request", "id": req.id, "model": req.model.key, "samples": req.samples,
                              "arrival": req.arrival, "deadline": req.deadline, "finish": req.finished_at,
                              "status": req.status.name, "met": req.ok and req.finished_at <= req.deadline,
                              "cold": req.cold_start, "error": req.error.status if req.error else None})
        if len(self._reqs) >= FLUSH_AT:
            self.flush()

    def refused(self, req: InferenceRequest, error: EscapementError, now: float) -> EscapementError:
        """A request refused at admission (a full queue, a deadline out of reach): a failure of its
        model, as Triton counts a request its scheduler rejects. Returns `error`, for `raise`."""
        m = self.model(req.model)
        m.last_inference = max(m.last_inference, now)
        m.classes[(_CLASS_NAMES[req.klass], "refused")] += 1
        m.fail.add(now - req.arrival)
        m.failures[failure_reason(error)] += 1
        m.slo_missed += 1
        return error

    def action(self, result: Result) -> None:
        """An action's result, before the controller acts on it."""
        a = result.action
        running = 0
        if a.kind == ActionKind.INFER and result.ok:
            # the requests this result answers: still RUNNING now (not cancelled, not answered by a
            # reconstruction); after this call the controller finishes them
            st = RequestStatus.RUNNING
            for r in a.requests:
                if r.status == st:
                    running += 1
        self._acts.append((a, result.status, result.ready_at, result.begin, result.end, result.duration, running))
        if self.trace is not None:
            self.trace.write({"ev": "action", "id": a.id, "kind": a.kind.name, "model": a.model.key,
                              "device": a.device, "batch": a.batch_size, "samples": a.samples,
                              "earliest": a.earliest, "latest": a.latest, "planned_start": a.expected_start,
                              "expected": a.expected_duration, "received": result.received,
                              "ready": result.ready_at, "begin": result.begin, "end": result.end,
                              "status": result.status.name, "error": result.error or None})
        if len(self._acts) >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        """Count every request and result recorded since the last flush."""
        if self._reqs:
            reqs, self._reqs = self._reqs, []
            self._count_requests(reqs)
        if self._acts:
            acts, self._acts = self._acts, []
            self._count_actions(acts)

    def _count_requests(self, reqs: list[tuple[Any, ...]]) -> None:
        slack: list[float] = []
        latency: list[float] = []
        queued_all: list[float] = []
        model = self.model
        cancelled, succeeded = RequestStatus.CANCELLED, RequestStatus.SUCCEEDED
        for spec, klass, status, error, arrival, finished, deadline, dispatched, samples, late in reqs:
            m = model(spec)
            if finished > m.last_inference:
                m.last_inference = finished
            took = finished - arrival
            if status == succeeded:
                on_time = finished <= deadline
                m.classes[(_CLASS_NAMES[klass], "on_time" if on_time else "late")] += 1
                slack.append(deadline - finished)
                latency.append(took)
                sp = m.success
                sp.count += 1
                sp.seconds += took
                m.latency.add(took)
                m.inference_count += samples
                if on_time:
                    m.slo_met += 1
                else:
                    m.slo_missed += 1
                if dispatched:
                    queued = dispatched - arrival
                    queued_all.append(queued)
                    sp = m.queue
                    sp.count += 1
                    sp.seconds += queued
                    m.queue_time.add(queued)
                continue
            sp = m.fail
            sp.count += 1
            sp.seconds += took
            if status == cancelled:
                m.classes[(_CLASS_NAMES[klass], "cancelled")] += 1
                m.failures["CANCELED"] += 1
                continue
            what = ("expired" if late else "dropped") if isinstance(error, DeadlineExceeded) else "failed"
            m.classes[(_CLASS_NAMES[klass], what)] += 1
            slack.append(deadline - finished)
            m.failures[failure_reason(error)] += 1
            m.slo_missed += 1
        self._slack.add_many(np.array(slack))
        self._latency.add_many(np.array(latency))
        self._queue_time.add_many(np.array(queued_all))

    def _count_actions(self, acts: list[tuple[Any, ...]]) -> None:
        lateness: list[float] = []
        start_error: list[float] = []
        duration_error: list[float] = []
        prediction: dict[str, list[float]] = {"INFER": [], "LOAD": []}
        infer, load, unload = ActionKind.INFER, ActionKind.LOAD, ActionKind.UNLOAD
        ok_status = ResultStatus.OK
        for a, status, ready_at, begin, end, duration, running in acts:
            dev = self._devices.get(a.device) or self.device(a.device)
            kind = a.kind
            if status in _STARTED:
                if ready_at:
                    late = begin - ready_at
                    lateness.append(late)
                    name = _KIND_NAMES[kind]
                    lane = dev.lateness.get(name)
                    if lane is None:
                        lane = dev.lateness[name] = Buckets(LATENESS_BOUNDS)
                    lane.add(late)
                if a.expected_start:
                    start_error.append(begin - a.expected_start)
            ok = status == ok_status
            if kind == infer:
                if ok:
                    if a.expected_duration > 0:
                        prediction["INFER"].append(abs(end - begin - a.expected_duration))
                        err = (end - begin) / a.expected_duration - 1.0
                        duration_error.append(err)
                        dev.duration_error.add(err)
                    self._executed(a, begin, end, duration, running)
            elif kind == load:
                if ok:
                    if a.expected_duration > 0:
                        prediction["LOAD"].append(abs(end - begin - a.expected_duration))
                    self._load_time.add(end - begin)
                    dev.load_time.add(end - begin)
                    self.model(a.model).loads[a.device] += 1
                else:
                    self.model(a.model).load_failures[a.device] += 1
            elif ok and kind == unload:
                self.model(a.model).unloads[a.device] += 1
        self._lateness.add_many(np.array(lateness))
        self._start_error.add_many(np.array(start_error))
        self._duration_error.add_many(np.array(duration_error))
        for k, v in prediction.items():
            self._prediction_error[k].add_many(np.array(v))

    def _executed(self, a: Action, begin: float, end: float, infer_s: float, n: int) -> None:
        """An INFER that ran: one execution of its batch size, and its times for each of the `n`
        requests it answered."""
        m = self.model(a.model)
        other_s = max(0.0, end - begin - infer_s)  # input and output copies, host work
        m.execution_count += 1
        m.compute_time.add(infer_s)
        b = m.batches.get(a.samples)
        if b is None:
            b = m.batches[a.samples] = BatchStats()
        b.count += 1
        b.infer_s += infer_s
        b.other_s += other_s
        if n:  # (the same times for each request it answers: one update, not three per request)
            m.compute_input.count += n
            m.compute_infer.count += n
            m.compute_infer.seconds += n * infer_s
            m.compute_output.count += n
            m.compute_output.seconds += n * other_s

    def summary(self) -> dict[str, Any]:
        self.flush()
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
