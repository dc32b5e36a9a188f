"""How busy each device's resident models keep it: seconds of work per second, kept as they change.

A device's demand is the sum, over the models placed on it, of each model's arrival rate times
its cost per sample there (shared among its replicas: the `weight`). A LOAD is placed on the
device with the least demand, so it is asked for every device each time a LOAD is planned.

Arrival rates decay exponentially with one time constant for every model (estimates.RateMeter),
so a rate that last changed at `at` is `rate * exp(-(now - at) / tau)`. Written against a
common origin, `rate * exp((at - origin) / tau) * exp(-(now - origin) / tau)`, the first part
(a model's `factor`) changes only when the model's rate does (an arrival) and the second is the
same for all of them. So a device keeps the sum of factor x weight over its models: an arrival
changes one term on each device the model is on, and a device's demand at any time is that sum
times one exponential. This replaces a walk over every model on the device (hundreds at 10,000
models), once per 50 ms per device, that made the cost of placing a LOAD grow with the models.

Weights (estimates) are set when a model is placed, and made again from the estimates for all
models of a device when its sum is older than `rebuild_every` (the sum's rounding error is
reset then too). The origin moves forward when it falls `REBASE_AFTER` behind an arrival, before
the factors could overflow.

The same factors rank a device's models by cold cost (arrival rate x LOAD time: the copy work
their cold starts would make). A LOAD under copy pressure may evict only models cheaper to keep
cold than the one it loads; asked of every model on the device in LRU order, that rule made
each LOAD walk all of them (O(models) per device, the controller's growth from 1,000 to 10,000
models). In log form, `log(factor x load) + origin / tau` does not change with time (every rate
decays alike) and only grows with arrivals, so a ranking made at a rebuild stays a lower bound:
the models it puts under a bound, with those placed since, include every model under it now.
The ranking is made at a rebuild, and again once a quarter of the device's models were placed
since (with every LOAD evicting, those recent models otherwise outgrew the search's limit within
a second, and each failed search walked the whole device).

Plain synchronous code with no I/O; the policy (policies/clockwork.py) feeds it.
"""

from __future__ import annotations

import bisect
import math
from typing import Final

from daemon.controller.estimates import RateMeter

REBASE_AFTER: Final = 30.0  # time constants: factors grow as exp(elapsed / tau), ~1e13 at 30
RERANK_SHARE: Final = 4  # a device's ranking is made again once a quarter of its models are recent
ROUNDING: Final = 1e-9  # slack on a log-cost bound: the ranking and the policy's own test round differently


def _log(x: float) -> float:
    return math.log(x) if x > 0.0 else -math.inf


class _Device:
    """A device's models with their weights there, and the sum of factor x weight over them. (An
    object the models' lists hold, not names: an arrival updates each of its devices' sums with
    one look-up, where a dict of sums and one of weights by name took four and a generic add.)"""

    __slots__ = ("name", "sum", "weights")

    def __init__(self, name: str) -> None:
        self.name = name
        self.sum = 0.0
        self.weights: dict[str, float] = {}  # model -> weight


class ModelDemand:
    """A model's factor (rate * exp((at - origin) / tau), 0.0 before its first arrival), the
    seconds a LOAD of it takes (-1.0: none known yet) and the devices it has a weight on. One
    object, not a dict of each: a victim search asks the first two of every model it meets, and
    every arrival sets the factor and reads the devices (at 10,000 models each look-up of a name
    used seconds ago is a cache miss)."""

    __slots__ = ("factor", "load_s", "meter", "on")

    def __init__(self, factor: float = 0.0, load_s: float = -1.0) -> None:
        self.factor = factor
        self.load_s = load_s
        self.on: list[_Device] = []
        self.meter: RateMeter | None = None  # its arrivals (samples) a second, from its first


class DeviceDemand:
    def __init__(self, tau: float, rebuild_every: float) -> None:
        self.tau = tau
        self.rebuild_every = rebuild_every
        self.origin = 0.0
        self._models: dict[str, ModelDemand] = {}  # model -> its factor and LOAD time
        self._devices: dict[str, _Device] = {}  # device name -> its weights and sum
        self._built: dict[str, float] = {}  # device -> when its weights were last all made
        # device -> its models by log cold cost at the last rebuild (ascending), and the costs
        self._ranked: dict[str, tuple[list[str], list[float]]] = {}
        self._recent: dict[str, list[str]] = {}  # device -> models placed, or reloaded, since then
        # exp(-(now - origin) / tau) for the last `now` asked: a LOAD's placement asks it for every
        # model a victim search looks at, and every device, all at one `now`
        self._decay_now = math.nan
        self._decay = 1.0
        # device -> LOAD times lowered so far of models on it: a model's cold cost fell there (every
        # other change only raises one)
        self._lowered: dict[str, int] = {}

    def record(self, key: str) -> ModelDemand:
        """`key`'s record, made at the first ask and kept for good: a caller may keep it (the
        policy keeps it on the model's entry) and pass it to `arrival_of`."""
        m = self._models.get(key)
        if m is None:
            m = self._models[key] = ModelDemand()
        return m

    def arrival(self, key: str, samples: int, at: float) -> None:
        """`key` had an arrival of `samples` at `at`: its rate meter (`meter`) takes it, and its
        demand moves to the new rate (one look-up of the model for both)."""
        self.arrival_of(key, self.record(key), samples, at)

    def arrival_of(self, key: str, m: ModelDemand, samples: int, at: float) -> None:
        """`arrival` of the model whose record (`record`) is `m`."""
        if (at - self.origin) / self.tau > REBASE_AFTER:
            self._rebase(at)
        meter = m.meter
        if meter is None:
            meter = m.meter = RateMeter()
        meter.add(samples, at)
        self._set_rate(key, m, meter.rate, at)

    def meter(self, key: str) -> RateMeter | None:
        """`key`'s arrivals a second (None before its first)."""
        m = self._models.get(key)
        return m.meter if m is not None else None

    def arrived(self, key: str, rate: float, at: float) -> None:
        """A model's rate is now `rate` as of `at` (it just had an arrival)."""
        if (at - self.origin) / self.tau > REBASE_AFTER:
            self._rebase(at)
        m = self._models.get(key)
        if m is None:
            m = self._models[key] = ModelDemand()
        self._set_rate(key, m, rate, at)

    def _set_rate(self, key: str, m: ModelDemand, rate: float, at: float) -> None:
        factor = rate * math.exp((at - self.origin) / self.tau)
        old = m.factor
        m.factor = factor
        devices = m.on
        if not devices:
            return
        delta = factor - old
        for d in devices:
            d.sum += delta * d.weights[key]

    def place(self, key: str, device: str, weight: float, load_s: float) -> None:
        """`key` is on `device` with `weight` (seconds of work per sample there, per replica);
        `load_s`: a LOAD of it takes that long."""
        m = self._models.get(key)
        if m is None:
            m = self._models[key] = ModelDemand()
        elif m.load_s >= 0.0 and load_s < m.load_s:  # (as `reloaded`: look at it where it is)
            self._lower(key)
        m.load_s = load_s
        d = self._devices.get(device)
        if d is None:
            d = self._devices[device] = _Device(device)
            self._recent[device] = []
        self._recent[device].append(key)
        per = d.weights
        old = per.get(key)
        if old is None:
            m.on.append(d)
            old = 0.0
        per[key] = weight
        d.sum += m.factor * (weight - old)

    def remove(self, key: str, device: str) -> None:
        """`key` left `device`."""
        d = self._devices.get(device)
        if d is None:
            return
        weight = d.weights.pop(key, None)
        if weight is None:
            return
        m = self._models[key]  # (placed: `place` made it)
        d.sum -= m.factor * weight
        m.on.remove(d)

    def tracks(self, key: str, device: str) -> bool:
        """Whether `key` has a weight on `device`."""
        d = self._devices.get(device)
        return d is not None and key in d.weights

    def load_s(self, key: str) -> float:
        """The LOAD time `key` was last placed or reloaded with; -1.0 if none."""
        m = self._models.get(key)
        return m.load_s if m is not None else -1.0

    def cold_cost(self, key: str, now: float, load_s: float = -1.0) -> float:
        """Copy seconds per second `key` would cost if every request found it cold: its rate at `now`
        times a LOAD's time (`load_s`, or the last one it was placed or reloaded with; -1.0 if it
        has none)."""
        m = self._models.get(key)
        if load_s < 0.0:
            if m is None or m.load_s < 0.0:
                return -1.0
            load_s = m.load_s
        if m is None or m.factor == 0.0:  # (no arrival yet: 0.0, whatever the LOAD time)
            return 0.0
        return m.factor * load_s * self._decay_at(now)

    def lasting_cost(self, key: str, load_s: float) -> float:
        """`key`'s cold cost with `load_s` in the log form that does not change with time (the
        ranking's): only its arrivals, or a dearer LOAD, raise it."""
        m = self._models.get(key)
        return _log((m.factor if m is not None else 0.0) * load_s) + self.origin / self.tau

    def _decay_at(self, now: float) -> float:
        if now != self._decay_now:
            self._decay = math.exp(-(now - self.origin) / self.tau)
            self._decay_now = now
        return self._decay

    def reloaded(self, key: str, load_s: float) -> None:
        """A LOAD of `key` now takes `load_s` (a LOAD of it was measured)."""
        m = self._models.get(key)
        if m is None:
            m = self._models[key] = ModelDemand()
        old = m.load_s
        m.load_s = load_s
        if old >= 0.0 and load_s < old:  # (a lower cost may put it under a bound: look at it)
            self._lower(key)

    def _lower(self, key: str) -> None:
        """`key`'s LOAD time fell: on each device it is on, it is recent, and counted (`lowered`)."""
        lowered = self._lowered
        m = self._models.get(key)
        for d in m.on if m is not None else ():
            self._recent[d.name].append(key)
            lowered[d.name] = lowered.get(d.name, 0) + 1

    def lowered(self, device: str) -> int:
        """LOAD times of models on `device` lowered so far."""
        return self._lowered.get(device, 0)

    def cheaper(self, device: str, bound: float, now: float, limit: int) -> list[str] | None:
        """The models on `device` whose cold cost (rate x LOAD time) may be at most `bound` at
        `now`: every one that is, and some that are not (arrived since the ranking); None when
        there are more than `limit` of them (a walk in LRU order finds one sooner)."""
        d = self._devices.get(device)
        ranked = self._ranked.get(device)
        if d is None or ranked is None:
            return None
        per = d.weights
        keys, costs = ranked
        recent = self._recent[device]
        at = _log(bound) + now / self.tau + ROUNDING
        cut = bisect.bisect_right(costs, at)
        if cut <= limit < cut + len(recent) and len(recent) * RERANK_SHARE > len(per):
            # Models placed since the ranking are all candidates: under thrash (every LOAD
            # evicting, a ranking made every `rebuild_every`) they grew past the limit and each
            # search walked the whole device in LRU order, most of them refused. Ranked again from
            # the current factors, once per 1/RERANK_SHARE of the device's models placed. (Not
            # where the ranking alone passes the limit: its models' costs only grow, so the fresh
            # ranking would too, less those that left; at 10,000 models it did, every time.)
            self._rank(device, per)
            keys, costs = self._ranked[device]
            recent = self._recent[device]
            cut = bisect.bisect_right(costs, at)
        if cut + len(recent) > limit:
            return None
        out: list[str] = []
        seen: set[str] = set()
        for i in range(cut):
            k = keys[i]
            if k in per and k not in seen:
                seen.add(k)
                out.append(k)
        for k in recent:
            if k in per and k not in seen:
                seen.add(k)
                out.append(k)
        return out

    def built_at(self, device: str) -> float:
        """When `device`'s weights were last all made (-inf: never)."""
        return self._built.get(device, -math.inf)

    def stale(self, device: str, now: float) -> bool:
        """Whether `device`'s weights are due to be made again (`rebuild`)."""
        built = self._built.get(device)
        return built is None or now - built > self.rebuild_every

    def rebuild(self, device: str, weights: dict[str, float], loads: dict[str, float], now: float) -> None:
        """`device` holds exactly the models in `weights`, with these weights and LOAD times."""
        had = self._devices.get(device)
        for k in list(had.weights) if had is not None else []:
            if k not in weights:
                self.remove(k, device)
        for k, w in weights.items():
            self.place(k, device, w, loads[k])
        total = 0.0  # (made again from its terms: drops the rounding of many small updates)
        models = self._models
        for k, w in weights.items():
            m = models.get(k)
            if m is not None:
                total += m.factor * w
        self._rank(device, weights)
        d = self._devices.get(device)
        if d is not None:  # (else it holds nothing: its demand is 0 either way)
            d.sum = total
        self._built[device] = now

    def _rank(self, device: str, on: dict[str, float]) -> None:
        """Rank the models `on` the device by cold cost, in the log form that does not change
        with time, from their factors and LOAD times now; none is recent after it."""
        models = self._models
        shift = self.origin / self.tau
        keys = list(on)
        costs: list[float] = []
        for k in keys:
            m = models[k]  # (every model on a device was placed: it has a LOAD time)
            costs.append(_log(m.factor * m.load_s) + shift)
        # Positions sorted by their float cost, not (cost, key) tuples: a tuple per model, hundreds
        # a device, held through the sort, set off a collection of the young generation at most
        # rebuilds, and each compare went through the generic tuple one. Equal costs keep the
        # device's order rather than the keys' (`cheaper` returns every model under a bound either way).
        order = sorted(range(len(keys)), key=costs.__getitem__)
        self._ranked[device] = ([keys[i] for i in order], [costs[i] for i in order])
        self._recent[device] = []

    def total(self, device: str, now: float) -> float:
        """Seconds of work per second `device`'s models bring it at `now`."""
        d = self._devices.get(device)
        if d is None:
            return 0.0
        return d.sum * self._decay_at(now)

    def current_total(self, device: str, now: float) -> float:
        """`total`, or -1.0 where `device`'s weights are due to be made again (`stale`)."""
        return -1.0 if self.stale(device, now) else self.total(device, now)

    def part(self, key: str, device: str, now: float) -> float:
        """One model's share of `total`."""
        d = self._devices.get(device)
        if d is None:
            return 0.0
        w = d.weights.get(key)
        m = self._models.get(key)
        if w is None or m is None:
            return 0.0
        return m.factor * w * self._decay_at(now)

    def _rebase(self, origin: float) -> None:
        scale = math.exp((self.origin - origin) / self.tau)
        self.origin = origin
        self._decay_now = math.nan
        for m in self._models.values():
            m.factor *= scale
        for d in self._devices.values():
            d.sum *= scale
