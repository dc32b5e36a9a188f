"""Telemetry: what the controller predicted against what executors measured, as histograms.

Per request: latency, slack left at the finish (negative = missed), cold starts. Per action:
the executor's start lateness (how long after it could start, given its window and its lane,
it did start: thread wake-ups, the GIL), the start prediction error (actual start minus the
planned one) and the duration prediction error (measured over expected, minus one). All are
log-bucketed histograms, cheap to update on the loop and mergeable; `summary()` reads their
percentiles. Optionally every event also goes to a JSON-lines trace (`controller.trace_path`,
trace.py), written by a thread of its own so the loop never does file I/O.

Per model (`ModelStats`) and per device (`DeviceStats`, both in stats.py) it also keeps what the statistics
extension and /metrics report: Triton's counts and cumulative durations, failures by reason,
deadlines met and missed, and fixed-bound histograms (`Buckets`) that map one to one onto
Prometheus histograms. Updating them is a few integer additions and a bisect per event; the
readers (metrics.py: /metrics and the statistics extension) turn them into their formats when asked.
"""

from __future__ import annotations

from typing import Any, Final

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.errors import DeadlineExceeded, EscapementError
from daemon.model import ModelSpec
from daemon.observability.stats import (
    CANCELLED,
    DROPPED,
    EXPIRED,
    FAILED,
    LATE,
    LATENESS_BOUNDS,
    ON_TIME,
    REFUSED,
    BatchStats,
    Buckets,
    DeviceStats,
    Histogram,
    ModelStats,
    failure_reason,
    floats,
)
from daemon.observability.trace import TraceWriter
from daemon.request import InferenceRequest, RequestClass, RequestStatus

# (an enum's `.name` is a descriptor call: read once per action it costs more than the histogram)
_KIND_NAMES: Final = {k: k.name for k in ActionKind}
_STARTED: Final = frozenset({ResultStatus.OK, ResultStatus.FAILED})  # results of actions that ran
# a request class's number (compiled, `int()` of an enum is a generic call, ~450 instructions)
_CLASS_NUMBER: Final = {k: int(k) for k in RequestClass}


FLUSH_AT: Final = 2048  # finished requests or results held before they are counted (bounded memory)


class Telemetry:
    """The controller's histograms and per-model/per-device statistics.

    `request` and `action` are on every request's path. They count into the model's and the
    device's statistics at once (compiled: a few additions and a short scan each) and keep the
    few values the global, log-bucketed histograms need in lists; `flush` counts those in one
    numpy pass, before any histogram is read and whenever FLUSH_AT requests or results are held.
    (Earlier every finished request and result was kept as a tuple of its fields for the flush:
    building, unpacking and freeing those cost more than counting them at once: issue 12.)
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
        self._load_copy = Histogram()
        self.decode_time = Histogram()  # ParM reconstructions
        self._models: dict[str, ModelStats] = {}  # model key -> its statistics, kept after it is removed
        self._devices: dict[str, DeviceStats] = {}
        self.trace = trace
        # values for the global histograms, held until the next flush
        self._slack_s: list[float] = []
        self._latency_s: list[float] = []
        self._queued_s: list[float] = []
        self._lateness_s: list[float] = []
        self._start_error_s: list[float] = []
        self._duration_error_s: list[float] = []
        self._infer_error_s: list[float] = []
        self._load_error_s: list[float] = []
        self._held_requests = 0  # requests and results recorded since the last flush
        self._held_results = 0

    @property
    def pending(self) -> int:
        """Requests and results recorded whose values the global histograms have not yet counted
        (at most FLUSH_AT of each)."""
        return self._held_requests + self._held_results

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
        # (by the request's key: compiled, `spec.key` is a generic read of an interpreted class)
        m = self._models.get(req.key)
        if m is None:
            m = self.model(req.model)
        finished = req.finished_at
        if finished > m.last_inference:
            m.last_inference = finished
        took = finished - req.arrival
        status = req.status
        klass = _CLASS_NUMBER[req.klass]
        if status == RequestStatus.SUCCEEDED:
            deadline = req.deadline
            if finished <= deadline:
                m.counted(klass, ON_TIME)
                m.slo_met += 1
            else:
                m.counted(klass, LATE)
                m.slo_missed += 1
            self._slack_s.append(deadline - finished)
            self._latency_s.append(took)
            sp = m.success
            sp.count += 1
            sp.seconds += took
            m.latency.add(took)
            m.inference_count += req.samples
            dispatched = req.dispatched_at
            if dispatched:
                queued = dispatched - req.arrival
                self._queued_s.append(queued)
                sp = m.queue
                sp.count += 1
                sp.seconds += queued
                m.queue_time.add(queued)
        else:
            sp = m.fail
            sp.count += 1
            sp.seconds += took
            if status == RequestStatus.CANCELLED:
                m.counted(klass, CANCELLED)
                m.failures["CANCELED"] += 1
            else:
                error = req.error
                m.counted(klass, (EXPIRED if req.late else DROPPED) if isinstance(error, DeadlineExceeded)
                          else FAILED)
                self._slack_s.append(req.deadline - finished)
                m.failures[failure_reason(error)] += 1
                m.slo_missed += 1
        if self.trace is not None:
            self.trace.write({"ev": "request", "id": req.id, "model": req.model.key, "samples": req.samples,
                              "arrival": req.arrival, "deadline": req.deadline, "finish": req.finished_at,
                              "status": req.status.name, "met": req.ok and req.finished_at <= req.deadline,
                              "cold": req.cold_start, "error": req.error.status if req.error else None})
        self._held_requests += 1
        if self._held_requests >= FLUSH_AT:
            self.flush()

    def refused(self, req: InferenceRequest, error: EscapementError, now: float) -> EscapementError:
        """A request refused at admission (a full queue, a deadline out of reach): a failure of its
        model, as Triton counts a request its scheduler rejects. Returns `error`, for `raise`."""
        m = self.model(req.model)
        m.last_inference = max(m.last_inference, now)
        m.counted(_CLASS_NUMBER[req.klass], REFUSED)
        m.fail.add(now - req.arrival)
        m.failures[failure_reason(error)] += 1
        m.slo_missed += 1
        return error

    def action(self, result: Result) -> None:
        """An action's result, before the controller acts on it."""
        a = result.action
        status = result.status
        dev = self._devices.get(a.device)
        if dev is None:
            dev = self.device(a.device)
        kind = a.kind
        begin = result.begin
        if status in _STARTED:
            ready_at = result.ready_at
            if ready_at:
                late = begin - ready_at
                self._lateness_s.append(late)
                name = _KIND_NAMES[kind]
                lane = dev.lateness.get(name)
                if lane is None:
                    lane = dev.lateness[name] = Buckets(LATENESS_BOUNDS)
                lane.add(late)
            if a.expected_start:
                self._start_error_s.append(begin - a.expected_start)
        ok = status == ResultStatus.OK
        if kind == ActionKind.INFER:
            if ok:
                end = result.end
                if a.expected_duration > 0:
                    self._infer_error_s.append(abs(end - begin - a.expected_duration))
                    err = (end - begin) / a.expected_duration - 1.0
                    self._duration_error_s.append(err)
                    dev.duration_error.add(err)
                # the requests this result answers: still RUNNING now (not cancelled, not answered
                # by a reconstruction); after this call the controller finishes them
                running = 0
                st = RequestStatus.RUNNING
                for r in a.requests:
                    if r.status == st:
                        running += 1
                self._executed(a, begin, end, result.duration, running)
        elif kind == ActionKind.LOAD:
            if ok:
                end = result.end
                if a.expected_duration > 0:
                    self._load_error_s.append(abs(end - begin - a.expected_duration))
                self._load_time.add(end - begin)
                if result.duration > 0:  # the weight copy's own device time (CUDA events), within the LOAD
                    self._load_copy.add(result.duration)
                dev.load_time.add(end - begin)
                counts = self._model_of(a).loads
                counts[a.device] = counts.get(a.device, 0) + 1
            else:
                counts = self._model_of(a).load_failures
                counts[a.device] = counts.get(a.device, 0) + 1
        elif ok and kind == ActionKind.UNLOAD:
            counts = self._model_of(a).unloads
            counts[a.device] = counts.get(a.device, 0) + 1
        if self.trace is not None:
            self.trace.write({"ev": "action", "id": a.id, "kind": a.kind.name, "model": a.model.key,
                              "device": a.device, "batch": a.batch_size, "samples": a.samples,
                              "earliest": a.earliest, "latest": a.latest, "planned_start": a.expected_start,
                              "expected": a.expected_duration, "received": result.received,
                              "ready": result.ready_at, "begin": result.begin, "end": result.end,
                              "duration": result.duration,  # the device's own time (CUDA events), if measured
                              "status": result.status.name, "error": result.error or None})
        self._held_results += 1
        if self._held_results >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        """Count in the global histograms every request and result recorded since the last flush."""
        if self._held_requests:
            self._held_requests = 0
            for into, xs in ((self._slack, self._slack_s), (self._latency, self._latency_s),
                             (self._queue_time, self._queued_s)):
                if xs:
                    into.add_many(floats(xs))
            self._slack_s, self._latency_s, self._queued_s = [], [], []
        if self._held_results:
            self._held_results = 0
            for into, xs in ((self._lateness, self._lateness_s), (self._start_error, self._start_error_s),
                             (self._duration_error, self._duration_error_s),
                             (self._prediction_error["INFER"], self._infer_error_s),
                             (self._prediction_error["LOAD"], self._load_error_s)):
                if xs:
                    into.add_many(floats(xs))
            self._lateness_s, self._start_error_s, self._duration_error_s = [], [], []
            self._infer_error_s, self._load_error_s = [], []

    def _model_of(self, a: Action) -> ModelStats:
        m = self._models.get(a.key)
        if m is None:
            m = self.model(a.model)
        return m

    def _executed(self, a: Action, begin: float, end: float, infer_s: float, n: int) -> None:
        """An INFER that ran: one execution of its batch size, and its times for each of the `n`
        requests it answered."""
        m = self._model_of(a)
        other_s = end - begin - infer_s  # input and output copies, host work
        if other_s < 0.0:  # (a compare, not max(): compiled, the builtin is a generic call)
            other_s = 0.0
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
            "load_copy_ms": self._load_copy.summary(ms),
            "decode_time_ms": self.decode_time.summary(ms),
            "trace_dropped": self.trace.dropped if self.trace else 0,
        }
