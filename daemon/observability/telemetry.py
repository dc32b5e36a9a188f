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
    LATENESS_BOUNDS,
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
_CLASS_NAMES: Final = {k: k.name.lower() for k in RequestClass}
# (class, outcome) keys of ModelStats.classes for the outcomes of every answered request, made once
# (a tuple built per request, hashed and compared, was ~300 instructions)
_ON_TIME: Final = {k: (n, "on_time") for k, n in _CLASS_NAMES.items()}
_LATE: Final = {k: (n, "late") for k, n in _CLASS_NAMES.items()}


FLUSH_AT: Final = 2048  # finished requests or results held before they are counted (bounded memory)

# What `request` and `action` record, typed: compiled, a flush then reads each field as what it is,
# where fields of `Any` made every compare, subtraction and attribute read a generic call.
_Finished = tuple[ModelSpec, str, RequestClass, RequestStatus, EscapementError | None, float, float, float, float,
                  int, bool]  # spec, key, class, status, error, arrival, finished, deadline, dispatched, samples, late
_Done = tuple[Action, ResultStatus, float, float, float, float, int]  # status, ready, begin, end, duration, running


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
        self._load_copy = Histogram()
        self.decode_time = Histogram()  # ParM reconstructions
        self._models: dict[str, ModelStats] = {}  # model key -> its statistics, kept after it is removed
        self._devices: dict[str, DeviceStats] = {}
        self.trace = trace
        self._reqs: list[_Finished] = []
        self._acts: list[_Done] = []

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
        self._reqs.append((req.model, req.key, req.klass, req.status, req.error, req.arrival, req.finished_at,
                           req.deadline, req.dispatched_at, req.samples, req.late))
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
                              "duration": result.duration,  # the device's own time (CUDA events), if measured
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

    def _count_requests(self, reqs: list[_Finished]) -> None:
        slack: list[float] = []
        latency: list[float] = []
        queued_all: list[float] = []
        models = self._models
        cancelled, succeeded = RequestStatus.CANCELLED, RequestStatus.SUCCEEDED
        for spec, key, klass, status, error, arrival, finished, deadline, dispatched, samples, late in reqs:
            # (by the request's key: compiled, `spec.key` is a generic read of an interpreted class;
            # looked up here: a bound method held and called is a generic call)
            m = models.get(key)
            if m is None:
                m = self.model(spec)
            if finished > m.last_inference:
                m.last_inference = finished
            took = finished - arrival
            if status == succeeded:
                on_time = finished <= deadline
                m.classes[_ON_TIME[klass] if on_time else _LATE[klass]] += 1
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
        self._slack.add_many(floats(slack))
        self._latency.add_many(floats(latency))
        self._queue_time.add_many(floats(queued_all))

    def _count_actions(self, acts: list[_Done]) -> None:
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
                    if duration > 0:  # the weight copy's own device time (CUDA events), within the LOAD
                        self._load_copy.add(duration)
                    dev.load_time.add(end - begin)
                    self.model(a.model).loads[a.device] += 1
                else:
                    self.model(a.model).load_failures[a.device] += 1
            elif ok and kind == unload:
                self.model(a.model).unloads[a.device] += 1
        self._lateness.add_many(floats(lateness))
        self._start_error.add_many(floats(start_error))
        self._duration_error.add_many(floats(duration_error))
        for k, v in prediction.items():
            self._prediction_error[k].add_many(floats(v))

    def _executed(self, a: Action, begin: float, end: float, infer_s: float, n: int) -> None:
        """An INFER that ran: one execution of its batch size, and its times for each of the `n`
        requests it answered."""
        m = self.model(a.model)
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
