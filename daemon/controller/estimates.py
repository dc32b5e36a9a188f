"""Latency estimates: a sliding window per (model, rows, device), read at a high percentile, so
predictions are conservative and follow each device as it drifts; seeded per device kind from
the model's profile.

`rows` is what the device runs: the batch size on devices that pad to fixed batch sizes (CUDA
graphs), the number of samples on devices that run exactly the filled rows (CPU, simulated).
Until a row count has been measured, it is interpolated from the profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

EXACT_ROW_KINDS: Final = frozenset({"cpu", "sim"})  # devices that run exactly the filled rows of a batch
DEFAULT_WINDOW: Final = 10
DEFAULT_PERCENTILE: Final = 0.99
DEFAULT_MAX_AGE: Final = 1.0  # seconds: older samples no longer count (a transient slowdown is forgotten)
RATE_TAU: Final = 1.0  # seconds: the time constant of the arrival-rate estimate


class SlidingWindow:
    __slots__ = ("_head", "_n", "_q", "_q_value", "_samples", "_size", "_sorted", "_times", "max_age")

    def __init__(self, size: int = DEFAULT_WINDOW, max_age: float = DEFAULT_MAX_AGE) -> None:
        # The last `size` samples and when each was taken, oldest at `_head`, in two rings of
        # lists: compiled, a deque's append, popleft and index are generic method calls (~250
        # instructions each, several per result), a list's item is read and written directly.
        size = max(size, 1)
        self._samples: list[float] = [0.0] * size
        self._times: list[float] = [0.0] * size
        self._head = 0
        self._n = 0
        # The same samples in ascending order, kept as they come and go: a percentile is read after
        # every new sample (once per result), where sorting the window each time cost ~1k
        # instructions of the ~4k an estimate took.
        self._sorted: list[float] = []
        self._size = size
        self._q = -1.0  # the quantile read last since the samples changed (-1: none), and its value
        self._q_value = 0.0
        self.max_age = max_age

    def add(self, x: float, t: float = 0.0) -> None:
        if x != x:
            return  # a NaN measures nothing (and would leave the order undefined)
        samples, n, size = self._samples, self._n, self._size
        if n == size:  # full: the oldest makes room
            head = self._head
            self._unsort(samples[head])
            samples[head] = x
            self._times[head] = t
            head += 1
            self._head = 0 if head == size else head
        else:
            i = self._head + n
            if i >= size:
                i -= size
            samples[i] = x
            self._times[i] = t
            self._n = n + 1
        s = self._sorted
        i = len(s)
        while i > 0 and s[i - 1] > x:
            i -= 1
        s.insert(i, x)
        self._q = -1.0

    def _unsort(self, x: float) -> None:
        """`x` left the window: out of the sorted samples too."""
        s = self._sorted
        for i in range(len(s)):
            if s[i] == x:
                s.pop(i)  # (not `del s[i]`: compiled, pop is a direct call, del a generic one)
                return

    def _newest_time(self) -> float:
        i = self._head + self._n - 1
        return self._times[i - self._size if i >= self._size else i]

    def __len__(self) -> int:
        return self._n

    @property
    def oldest(self) -> float:
        if not self._n:
            raise IndexError("an empty window has no oldest sample")
        return self._times[self._head]

    def fresh(self, now: float) -> bool:
        """Whether any sample is recent enough to count."""
        return self._n > 0 and now - self._newest_time() <= self.max_age

    def expire(self, now: float) -> None:
        times, size = self._times, self._size
        while self._n and now - times[self._head] > self.max_age:
            head = self._head
            self._unsort(self._samples[head])
            head += 1
            self._head = 0 if head == size else head
            self._n -= 1
            self._q = -1.0

    def current(self, now: float, q: float) -> tuple[float, float] | None:
        """The q-quantile of the samples recent enough to count at `now`, and when the oldest of them
        was taken; None when no sample is recent. (fresh, expire, percentile and oldest in one call:
        once per result.)"""
        if not self._n or now - self._newest_time() > self.max_age:
            return None
        if now - self._times[self._head] > self.max_age:
            self.expire(now)
        return self.percentile(q), self._times[self._head]

    def current_value(self, now: float, q: float) -> float:
        """`current`'s quantile alone, NaN when no sample is recent: no tuple to build (an object made
        per result also costs its share of the collector's passes)."""
        if not self._n or now - self._newest_time() > self.max_age:
            return math.nan
        if now - self._times[self._head] > self.max_age:
            self.expire(now)
        return self.percentile(q)

    def percentile(self, q: float) -> float:
        """The interpolated q-quantile; with 10 samples, q=0.99 is nearly the max."""
        if q == self._q:
            return self._q_value
        s = self._sorted
        pos = q * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        value = s[lo] + (s[hi] - s[lo]) * (pos - lo)
        self._q, self._q_value = q, value
        return value


_NO_RUNS: Final[dict[str, dict[int, SlidingWindow]]] = {}  # `ran_where` of a model never measured (kept empty)


class _Rows:
    """A memo of one model on one device (or kind), by row count: the estimate (None: none known)
    and the time until which it holds (-inf: none kept). Two lists, not a tuple per entry: floats
    are not tracked by the collector, and at 10,000 models, with models placed anew on devices
    all the time, the tuples kept here set off most of its young-generation passes (issue 12's
    callgrind). The estimates stay objects (`float | None`): a hit hands out the one kept, where
    a list of plain floats made a new one per hit."""

    __slots__ = ("est", "until")

    def __init__(self) -> None:
        self.est: list[float | None] = []
        self.until: list[float] = []


class ModelEstimates:
    """Everything the estimator keeps of one model, reached by one look-up of its name: at 10,000
    models a request's model, used seconds ago, is a cache miss in each dict keyed by name that
    holds it (four of them here before: the memo, the version, the runs, the profile), where one
    record's fields are read together (issue 12: bench/results/scale-callgrind-issue12.md)."""

    __slots__ = ("infer", "load", "memo", "partial_load", "seeds", "setup_load", "version")

    def __init__(self) -> None:
        # A scheduling pass asks for the same few estimates dozens of times (every batch size of
        # a model, per dispatch), and every arrival asks again. An estimate changes only with a
        # new observation (which clears this) or when a sample ages out (each entry keeps the
        # time until which it holds). Device or kind -> by row count.
        self.memo: dict[str, _Rows] = {}
        self.version = 0  # changes whenever one of its estimates may have
        self.infer: dict[str, dict[int, SlidingWindow]] = {}  # device (or kind) -> row count -> its window
        self.seeds: dict[str, dict[int, float]] = {}  # kind -> row count -> seconds
        self.load: dict[str, SlidingWindow] = {}  # kind -> its whole LOADs
        # LOADs that found part of the model's blocks on the device already (their time is mostly
        # the fixed cost of binding, not copying): kept apart from full LOADs
        self.partial_load: dict[str, SlidingWindow] = {}
        self.setup_load: dict[str, SlidingWindow] = {}  # LOADs that also captured graphs


class Estimator:
    """INFER and LOAD duration estimates in seconds. Unknown until seeded or observed.

    Observed INFER samples count for `max_age` seconds (`now` is set by the scheduler at each
    step): after a transient slowdown the estimate returns to recent results or the profile,
    instead of keeping a model off a device forever (no result would ever correct it).
    """

    def __init__(self, window: int = DEFAULT_WINDOW, percentile: float = DEFAULT_PERCENTILE,
                 max_age: float = DEFAULT_MAX_AGE) -> None:
        self.window = window
        self.percentile = percentile
        self.max_age = max_age
        self.now = 0.0  # set by the scheduler at each step (a plain attribute: set several times per request)
        self._models: dict[str, ModelEstimates] = {}

    def of(self, model: str) -> ModelEstimates:
        """`model`'s record, made at the first ask and kept for good (`forget` empties it): the
        scheduler keeps it on the model's entry and asks `infer_until_of` and its `version`
        without a look-up of the name."""
        rec = self._models.get(model)
        if rec is None:
            rec = self._models[model] = ModelEstimates()
        return rec

    def version(self, model: str) -> int:
        """Changes whenever an estimate of `model` may have: lets callers keep values derived from them."""
        rec = self._models.get(model)
        return rec.version if rec is not None else 0

    def _invalidate(self, rec: ModelEstimates, where: str | None = None, batch: int = -1) -> None:
        if where is not None:
            rows = rec.memo.get(where)
            if rows is not None and 0 <= batch < len(rows.until):
                rows.until[batch] = -math.inf
        else:
            rec.memo = {}
        rec.version += 1

    def seed_infer(self, model: str, kind: str, timings: dict[int, float], batch_sizes: tuple[int, ...]) -> None:
        """Seed every row count up to the largest batch size from a few measured ones, linearly."""
        known = sorted(timings.items())
        if not known:
            return
        rec = self.of(model)
        seeds = rec.seeds.get(kind)
        if seeds is None:
            seeds = rec.seeds[kind] = {}
        for b in range(1, max(batch_sizes) + 1):
            lower = [(k, v) for k, v in known if k <= b]
            upper = [(k, v) for k, v in known if k >= b]
            if lower and upper:
                (k0, v0), (k1, v1) = lower[-1], upper[0]
                v = v0 if k1 == k0 else v0 + (v1 - v0) * (b - k0) / (k1 - k0)
            elif lower:  # beyond the largest measured size: scale by samples
                k0, v0 = lower[-1]
                v = v0 * b / k0
            else:
                v = upper[0][1]
            seeds[b] = v
        self._invalidate(rec)

    def observe_infer(self, model: str, batch: int, kind: str, seconds: float, device: str | None = None) -> None:
        """A measured run, kept per device (a straggling device must not make its peers look slow)."""
        where = device or kind
        rec = self.of(model)
        rows = rec.infer.get(where)
        if rows is None:
            rows = rec.infer[where] = {}
        w = rows.get(batch)
        if w is None:
            w = rows[batch] = SlidingWindow(self.window, self.max_age)
        w.add(seconds, self.now)
        self._observed(rec, batch, where, w)

    def _observed(self, rec: ModelEstimates, batch: int, where: str, w: SlidingWindow) -> None:
        """Row `batch` of `where` has a new sample: its memo entry, if it has one, is made again
        now, and the model's version moves only if the estimate did, or the time it holds shrank.
        (Under load every result of a model moved it, and with it everything kept from its
        estimates, though a run's time mostly lands on the same estimate: a percentile of a few
        recent samples, which holds until the oldest of them ages out, later with each sample.)"""
        rows = rec.memo.get(where)
        if rows is not None and 0 <= batch < len(rows.until):
            old_until = rows.until[batch]
            if self.now <= old_until:
                value = w.current_value(self.now, self.percentile)  # (as `_infer_now` finds it)
                if value == value:
                    until = w.oldest + self.max_age
                    old = rows.est[batch]  # (tested for None first: then a compare of two floats, not a generic one)
                    if old is not None and value == old and until >= old_until:
                        return  # the entry stands (valid a little less long than it could be)
                    # a new estimate, or a profile's (valid for ever) that a first sample of the
                    # same value replaced
                    rows.est[batch] = value
                    rows.until[batch] = until
                    rec.version += 1
                    return
        self._invalidate(rec, where, batch)  # only this window changed

    def observe_load(self, model: str, kind: str, seconds: float, share: float = 1.0, set_up: bool = False) -> None:
        """A LOAD that copied `share` of the model's bytes (the rest was on the device already);
        `set_up`: it also did one-time work (graph captures) that the next LOAD of the model will
        most likely skip, so it is kept apart and counts only until a LOAD without it is seen."""
        rec = self.of(model)
        windows = rec.setup_load if set_up else rec.load if share >= 1.0 else rec.partial_load
        w = windows.get(kind)
        if w is None:
            w = windows[kind] = SlidingWindow(self.window)
        w.add(seconds)

    def infer(self, model: str, batch: int, kind: str, device: str | None = None) -> float | None:
        """The device's recent runs if it has any, else the profile of its kind."""
        return self.infer_until(model, batch, kind, device)[0]

    def infer_until(self, model: str, batch: int, kind: str, device: str | None = None
                    ) -> tuple[float | None, float]:
        """The estimate and the time until which it holds if nothing new is observed."""
        return self.infer_until_of(self.of(model), batch, kind, device)

    def infer_until_of(self, rec: ModelEstimates, batch: int, kind: str, device: str | None = None
                       ) -> tuple[float | None, float]:
        """`infer_until` of the model whose record (`of`) is `rec`."""
        where = device or kind
        if batch < 0:  # (no row to keep it in; never asked in practice)
            return self._infer_now(rec, batch, kind, where)
        memo = rec.memo
        rows = memo.get(where)
        if rows is None:
            rows = memo[where] = _Rows()
        untils = rows.until
        if batch < len(untils):
            until = untils[batch]
            if self.now <= until:
                return rows.est[batch], until
        else:
            grow = batch + 1 - len(untils)
            untils.extend([-math.inf] * grow)
            rows.est.extend([None] * grow)
        est, until = self._infer_now(rec, batch, kind, where)
        rows.est[batch] = est
        untils[batch] = until
        return est, until

    def _infer_now(self, rec: ModelEstimates, batch: int, kind: str, where: str) -> tuple[float | None, float]:
        w: SlidingWindow | None = None
        windows = rec.infer.get(where)
        if windows is not None:
            w = windows.get(batch)
        if w is not None and len(w):
            hit = w.current(self.now, self.percentile)
            if hit is not None:
                return hit[0], hit[1] + self.max_age  # until a sample ages out
            seed = _seed(rec, kind, batch)
            if seed is not None:  # nothing recent: the profile, not a stale slow sample
                return seed, math.inf
            return w.percentile(self.percentile), math.inf
        return _seed(rec, kind, batch), math.inf

    def ran_on(self, model: str, device: str) -> bool:
        """Whether runs of `model` on `device` were measured: if not, its estimates there are its
        kind's profile (`profile`), the same on every such device."""
        rec = self._models.get(model)
        return rec is not None and device in rec.infer

    def ran_where(self, model: str) -> dict[str, dict[int, SlidingWindow]]:
        """Where runs of `model` were measured (devices, or kinds), as `ran_on` asks one at a time: a
        LOAD's placement asks it of every device, with one look-up. Read it, never change it."""
        rec = self._models.get(model)
        return rec.infer if rec is not None else _NO_RUNS

    def profile(self, model: str, batch: int, kind: str) -> float | None:
        """The profile's time for `batch` rows of `model` on a device of `kind` (None: unprofiled)."""
        rec = self._models.get(model)
        return _seed(rec, kind, batch) if rec is not None else None

    def load(self, model: str, kind: str, share: float = 1.0) -> float | None:
        """A LOAD copying `share` of the model's bytes: a full LOAD's time scaled to the share (the
        copy scales with the bytes), but never under what such partial LOADs took (binding)."""
        rec = self._models.get(model)
        if rec is None:
            return None
        w = rec.load.get(kind)
        if w is None or not len(w):
            w = rec.setup_load.get(kind)  # only LOADs that set up so far: their time is all there is
        full = w.percentile(self.percentile) if w is not None and len(w) else None
        if share >= 1.0:
            return full
        p = rec.partial_load.get(kind)
        part = p.percentile(self.percentile) if p is not None and len(p) else None
        scaled = full * share if full is not None else None
        if scaled is None or part is None:
            return scaled if part is None else part
        return max(scaled, part)

    def forget(self, model: str) -> None:
        """Drop what was measured and seeded of `model` (its version keeps counting: a value kept
        from its old estimates must not pass for current)."""
        rec = self.of(model)
        rec.memo, rec.infer, rec.seeds = {}, {}, {}
        rec.load, rec.partial_load, rec.setup_load = {}, {}, {}
        rec.version += 1


def _seed(rec: ModelEstimates, kind: str, batch: int) -> float | None:
    seeds = rec.seeds.get(kind)
    return seeds.get(batch) if seeds is not None else None


@dataclass(slots=True)
class RateMeter:
    """An exponentially decaying estimate of samples per second."""

    rate: float = 0.0
    at: float = 0.0

    def __init__(self, rate: float = 0.0, at: float = 0.0) -> None:  # (compiled, as Action's)
        self.rate = rate
        self.at = at

    def add(self, amount: float, now: float) -> None:
        rate = self.rate  # (as value(now), inline: once per arrival)
        if rate:
            rate *= math.exp(-(now - self.at) / RATE_TAU)
        self.rate = rate + amount / RATE_TAU
        self.at = now

    def value(self, now: float) -> float:
        return self.rate * math.exp(-(now - self.at) / RATE_TAU) if self.rate else 0.0
