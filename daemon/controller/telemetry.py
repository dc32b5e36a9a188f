"""Telemetry: what the controller predicted against what executors measured, as histograms.

Per request: latency, slack left at the finish (negative = missed), cold starts. Per action:
the executor's start lateness (how long after it could start, given its window and its lane,
it did start: thread wake-ups, the GIL), the start prediction error (actual start minus the
planned one) and the duration prediction error (measured over expected, minus one). All are
log-bucketed histograms, cheap to update on the loop and mergeable; `summary()` reads their
percentiles. Optionally every event also goes to a JSON-lines trace (`controller.trace_path`),
written by a thread of its own so the loop never does file I/O.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from daemon.actions import ActionKind, Result
from daemon.request import InferenceRequest, RequestStatus

log = logging.getLogger("escapement.controller")


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
        self.count += 1
        self.total += x
        self.min = min(self.min, x)
        self.max = max(self.max, x)
        if abs(x) < self.LOW:
            self.zero += 1
        elif x > 0:
            b = self._bucket(x)
            self.pos[b] = self.pos.get(b, 0) + 1
        else:
            b = self._bucket(-x)
            self.neg[b] = self.neg.get(b, 0) + 1

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


class TraceWriter:
    """JSON lines to a file from a thread of its own; a bounded queue, dropping when full."""

    def __init__(self, path: str | Path, max_pending: int = 100_000) -> None:
        self.path = Path(path)
        self._q: queue.Queue[bytes | None] = queue.Queue(max_pending)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    def write(self, event: dict[str, Any]) -> None:
        try:
            self._q.put_nowait(orjson.dumps(event) + b"\n")
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        try:
            with self.path.open("ab") as f:
                while (line := self._q.get()) is not None:
                    f.write(line)
                    if self._q.empty():
                        f.flush()
        except OSError as e:
            log.error("trace %s cannot be written: %s", self.path, e)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(10)


class Telemetry:
    def __init__(self, trace: TraceWriter | None = None) -> None:
        self.latency = Histogram()  # seconds, successful requests
        self.slack = Histogram()  # deadline - finish, every finished request (negative = missed)
        self.queue_time = Histogram()  # arrival -> dispatch
        self.lateness = Histogram()  # executor: start - when it could start
        self.start_error = Histogram()  # actual start - planned start
        self.duration_error = Histogram()  # measured / expected - 1, INFER with an estimate
        self.load_time = Histogram()
        self.decode_time = Histogram()  # ParM reconstructions
        self.trace = trace

    def request(self, req: InferenceRequest) -> None:
        if req.status == RequestStatus.CANCELLED:
            return
        self.slack.add(req.deadline - req.finished_at)
        if req.status == RequestStatus.SUCCEEDED:
            self.latency.add(req.finished_at - req.arrival)
            if req.dispatched_at:
                self.queue_time.add(req.dispatched_at - req.arrival)
        if self.trace is not None:
            self.trace.write({"ev": "request", "id": req.id, "model": req.model.key, "samples": req.samples,
                              "arrival": req.arrival, "deadline": req.deadline, "finish": req.finished_at,
                              "status": req.status.name, "met": req.ok and req.finished_at <= req.deadline,
                              "cold": req.cold_start, "error": req.error.status if req.error else None})

    def action(self, result: Result) -> None:
        a = result.action
        started = result.status.name in ("OK", "FAILED")
        if started and result.ready_at:
            self.lateness.add(result.begin - result.ready_at)
        if started and a.expected_start:
            self.start_error.add(result.begin - a.expected_start)
        if result.ok and a.kind == ActionKind.INFER and a.expected_duration > 0:
            self.duration_error.add((result.end - result.begin) / a.expected_duration - 1.0)
        if result.ok and a.kind == ActionKind.LOAD:
            self.load_time.add(result.end - result.begin)
        if self.trace is not None:
            self.trace.write({"ev": "action", "id": a.id, "kind": a.kind.name, "model": a.model.key,
                              "device": a.device, "batch": a.batch_size, "samples": a.samples,
                              "earliest": a.earliest, "latest": a.latest, "planned_start": a.expected_start,
                              "expected": a.expected_duration, "received": result.received,
                              "ready": result.ready_at, "begin": result.begin, "end": result.end,
                              "status": result.status.name, "error": result.error or None})

    def summary(self) -> dict[str, Any]:
        ms = 1e3
        return {
            "request_latency_ms": self.latency.summary(ms),
            "request_slack_ms": self.slack.summary(ms, (0.1, 1, 50)),
            "queue_time_ms": self.queue_time.summary(ms),
            "executor_lateness_ms": self.lateness.summary(ms),
            "start_error_ms": self.start_error.summary(ms, (1, 50, 99)),
            "duration_error": self.duration_error.summary(1.0, (1, 50, 99)),
            "load_time_ms": self.load_time.summary(ms),
            "decode_time_ms": self.decode_time.summary(ms),
            "trace_dropped": self.trace.dropped if self.trace else 0,
        }
