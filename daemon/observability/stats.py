"""Statistics records: log-bucketed histograms, Prometheus-shaped buckets, Triton's duration spans.

`Histogram` keeps percentiles of anything (latency, slack, prediction errors) in log-spaced
buckets, cheap to update on the loop and mergeable. `Buckets` are fixed-bound histograms that map
one to one onto Prometheus histograms, and `Span` is Triton's `$duration_stat` (a count and a
total). `ModelStats` and `DeviceStats` gather them per model version and per device: what the
statistics extension and /metrics report. The controller's recorder (`telemetry.py`) updates them;
the readers (`metrics.py`, the gateway's statistics) turn them into their formats when asked.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Final

import numpy as np

from daemon.errors import Cancelled, DeadlineExceeded, EscapementError, InternalError, Overloaded, Unavailable
from daemon.model import ModelSpec
from daemon.request import RequestClass

_log10 = math.log10
_INV_LOW: Final = 1e7  # 1 / Histogram.LOW
_MAX_BUCKET: Final = 3200  # above the bucket of the largest double (1.8e308 / 1e-7: 3,152)


# What became of a request, by its class (ModelStats.outcomes): on_time, late (answered after its
# deadline), refused (at arrival), dropped (504: it could not make its hard deadline), expired
# (504: it waited the longest a best-effort request may), failed, cancelled.
OUTCOMES: Final = ("on_time", "late", "refused", "dropped", "expired", "failed", "cancelled")
ON_TIME: Final = 0
LATE: Final = 1
REFUSED: Final = 2
DROPPED: Final = 3
EXPIRED: Final = 4
FAILED: Final = 5
CANCELLED: Final = 6
N_OUTCOMES: Final = 7
CLASS_NAMES: Final = tuple(k.name.lower() for k in RequestClass)  # by RequestClass value


def floats(xs: list[float]) -> np.ndarray:
    """A list of floats as an array: `np.array` of a list finds each item's type and shape first
    (~60 ns an item), `fromiter` with the dtype given only unboxes it (~35)."""
    return np.fromiter(xs, np.float64, len(xs))


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
                # bucket numbers are small (< 3,200 for any finite double; inf is clipped to the
                # last): counted by bincount, not sorted by unique (a fifth of the time per flush)
                bs = np.minimum(np.log10(sign * vals * _INV_LOW) * 10, _MAX_BUCKET).astype(np.int64)
                ns = np.bincount(bs)
                found = np.flatnonzero(ns)
                for b, n in zip(found.tolist(), ns[found].tolist(), strict=True):
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


# Upper bounds of the Prometheus histograms. Seconds for latencies: 100 µs (a small model's run on
# a GPU) to 10 s; for executor lateness, 10 µs to 100 ms. (Not Final: mypyc leaves a final tuple of
# floats unset, "value for final name ... was not set"; each is read once per histogram made.)
LATENCY_BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0, 10.0)
LATENESS_BOUNDS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                   0.05, 0.1)
# measured / expected - 1
DURATION_ERROR_BOUNDS = (-0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


class Buckets:
    """A Prometheus-shaped histogram: counts of values at or under fixed upper bounds, exact at them."""

    __slots__ = ("_last", "bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.count = 0
        self.total = 0.0
        self._last = 0  # the last value's bucket

    def add(self, x: float) -> None:
        # the first bound >= x (Prometheus's `le`, as bisect_left finds it), by a walk from the
        # last value's bucket: a histogram's values cluster (a model's latencies), so it is a
        # compare or two where a scan from the lowest bound took five to eight (~700
        # instructions an add, two adds a request: issue 12's callgrind), and a binary search's
        # index arithmetic or `bisect_left`'s generic argument parsing cost more still. (NaN
        # compares false: above every bound, as the scan put it.)
        bounds = self.bounds
        i = self._last
        if i > 0 and x <= bounds[i - 1]:
            i -= 1
            while i > 0 and x <= bounds[i - 1]:
                i -= 1
        else:
            n = len(bounds)
            while i < n and not x <= bounds[i]:
                i += 1
        self._last = i
        counts = self.counts
        counts[i] = counts[i] + 1  # (not `+=`: compiled, that is a generic in-place add)
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

    __slots__ = ("batches", "compute_infer", "compute_input", "compute_output", "compute_time",
                 "execution_count",
                 "fail", "failures", "inference_count", "last_inference", "latency", "load_failures", "loads",
                 "outcomes", "queue", "queue_time", "slo_met", "slo_missed", "spec", "success", "unloads")

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.success = Span()  # arrival -> answer, successful requests
        self.fail = Span()  # arrival -> answer, failed and cancelled requests
        self.queue = Span()  # arrival -> dispatch, successful requests
        # Per successful request answered by an execution: that execution's times (Triton's way).
        self.compute_input = Span()  # always 0 ns: input copies are measured with the output's
        self.compute_infer = Span()
        self.compute_output = Span()
        # (defaultdicts, not Counters: counted per request, see Scheduler.counters)
        self.failures: defaultdict[str, int] = defaultdict(int)  # failure_reason -> requests
        self.inference_count = 0  # samples of successful requests
        self.execution_count = 0  # INFER actions that ran to completion
        self.batches: dict[int, BatchStats] = {}  # samples run -> executions
        self.last_inference = 0.0  # clock time of the last request answered or refused; 0: none yet
        self.slo_met = 0  # answered successfully by the deadline
        self.slo_missed = 0  # answered late, failed or refused (cancelled requests are neither)
        self.latency = Buckets(LATENCY_BOUNDS)  # as `success`
        self.queue_time = Buckets(LATENCY_BOUNDS)  # as `queue`
        self.compute_time = Buckets(LATENCY_BOUNDS)  # model run time per execution
        # device -> completed LOADs, failed LOADs, UNLOADs. Plain dicts counted with get: compiled,
        # a defaultdict's item is a generic call (~1k instructions an UNLOAD or a LOAD, one each per
        # cold start at 10,000 models)
        self.loads: dict[str, int] = {}
        self.load_failures: dict[str, int] = {}
        self.unloads: dict[str, int] = {}
        # Requests by class and outcome (OUTCOMES), at [class * len(OUTCOMES) + outcome]: a list of
        # counts, not a dict keyed by (class, outcome) tuples (~1k instructions a request compiled)
        self.outcomes = [0] * (len(CLASS_NAMES) * len(OUTCOMES))

    def counted(self, klass: int, outcome: int) -> None:
        """One more request of class `klass` (a RequestClass) ended with `outcome` (an OUTCOMES index)."""
        i = klass * N_OUTCOMES + outcome
        counts = self.outcomes
        counts[i] = counts[i] + 1  # (not `+=`: compiled, that is a generic in-place add)

    @property
    def classes(self) -> defaultdict[tuple[str, str], int]:
        """(request class, outcome) -> requests, for those that happened."""
        out: defaultdict[tuple[str, str], int] = defaultdict(int)
        for i, n in enumerate(self.outcomes):
            if n:
                out[(CLASS_NAMES[i // N_OUTCOMES], OUTCOMES[i % N_OUTCOMES])] = n
        return out


class DeviceStats:
    __slots__ = ("duration_error", "lateness", "load_time")

    def __init__(self) -> None:
        self.lateness: dict[str, Buckets] = {}  # action kind -> executor start lateness (s)
        self.duration_error = Buckets(DURATION_ERROR_BOUNDS)  # INFER: measured / expected - 1
        self.load_time = Buckets(LATENCY_BOUNDS)

