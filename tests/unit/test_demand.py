"""DeviceDemand: a device's rates x costs kept incrementally equal the sum made from scratch."""

from __future__ import annotations

import math
import random

import pytest

from daemon.controller.demand import REBASE_AFTER, DeviceDemand
from daemon.controller.estimates import RateMeter

TAU = 1.0


def _direct(meters: dict[str, RateMeter], placed: dict[str, dict[str, float]], device: str, now: float) -> float:
    return sum(meters[k].value(now) * w for k, w in placed.get(device, {}).items() if k in meters)


def test_random_arrivals_placements_and_rebuilds_match_the_direct_sum() -> None:
    rng = random.Random(7)
    demand = DeviceDemand(TAU, rebuild_every=2.0)
    meters: dict[str, RateMeter] = {}
    placed: dict[str, dict[str, float]] = {"d0": {}, "d1": {}, "d2": {}}
    models = [f"m{i}" for i in range(40)]
    now = 0.0
    # Long enough that the origin moves several times (REBASE_AFTER time constants each).
    for _ in range(20_000):
        now += rng.expovariate(200.0)
        op = rng.random()
        k = rng.choice(models)
        d = rng.choice(sorted(placed))
        if op < 0.8:
            m = meters.setdefault(k, RateMeter())
            m.add(rng.randint(1, 8), now)
            demand.arrived(k, m.rate, now)
        elif op < 0.9:
            w = rng.uniform(1e-4, 1e-2)
            placed[d][k] = w
            demand.place(k, d, w, 1.0)
        elif op < 0.97:
            placed[d].pop(k, None)
            demand.remove(k, d)
        else:  # the device's weights made again, as the policy does when they are stale
            placed[d] = {m: rng.uniform(1e-4, 1e-2) for m in rng.sample(models, 10)}
            demand.rebuild(d, dict(placed[d]), dict.fromkeys(placed[d], 1.0), now)
        for dev in placed:
            assert demand.total(dev, now) == pytest.approx(_direct(meters, placed, dev, now), rel=1e-9, abs=1e-12)
    assert demand.origin > 2 * REBASE_AFTER * TAU  # it was rebased along the way, more than once
    for dev, per in placed.items():
        for k in per:
            want = meters[k].value(now) * per[k] if k in meters else 0.0
            assert demand.part(k, dev, now) == pytest.approx(want, rel=1e-9, abs=1e-15)
            # its cold cost: the same rate times a LOAD's time (the one it was placed with, or given)
            rate = meters[k].value(now) if k in meters else 0.0
            assert demand.cold_cost(k, now) == pytest.approx(rate * 1.0, rel=1e-9, abs=1e-15)
            assert demand.cold_cost(k, now, 0.25) == pytest.approx(rate * 0.25, rel=1e-9, abs=1e-15)
    assert demand.cold_cost("never-placed", now) == -1.0


def test_demand_decays_between_arrivals_and_leaves_with_the_model() -> None:
    demand = DeviceDemand(TAU, rebuild_every=2.0)
    m = RateMeter()
    m.add(10, 0.0)
    demand.arrived("a", m.rate, 0.0)
    demand.place("a", "d", 0.5, 1.0)
    assert demand.total("d", 0.0) == pytest.approx(10 / TAU * 0.5)
    assert demand.total("d", 1.0) == pytest.approx(10 / TAU * 0.5 * math.exp(-1.0))
    assert demand.total("other", 1.0) == 0.0
    demand.remove("a", "d")
    assert demand.total("d", 1.0) == pytest.approx(0.0, abs=1e-15)
    assert demand.part("a", "d", 1.0) == 0.0


def test_a_rebuild_is_due_when_never_made_or_older_than_its_period() -> None:
    demand = DeviceDemand(TAU, rebuild_every=2.0)
    assert demand.stale("d", 0.0)
    demand.rebuild("d", {"a": 1.0}, {"a": 1.0}, 0.0)
    assert not demand.stale("d", 2.0)
    assert demand.stale("d", 2.5)


def test_the_models_cheaper_to_keep_cold_than_a_bound_are_all_found() -> None:
    """`cheaper` answers a superset of the models whose rate x LOAD time is under the bound now,
    through arrivals, placements, lowered LOAD times and rebases since its ranking was made."""
    rng = random.Random(11)
    demand = DeviceDemand(TAU, rebuild_every=2.0)
    meters: dict[str, RateMeter] = {}
    loads = {f"m{i}": rng.uniform(0.001, 0.1) for i in range(300)}
    on: set[str] = set(rng.sample(sorted(loads), 200))
    demand.rebuild("d", dict.fromkeys(on, 1e-3), {k: loads[k] for k in on}, 0.0)
    now, asked, narrowed = 0.0, 0, 0
    for step in range(20_000):
        now += rng.expovariate(500.0)
        k = rng.choice(sorted(loads))
        op = rng.random()
        if op < 0.85:
            m = meters.setdefault(k, RateMeter())
            m.add(1, now)
            demand.arrived(k, m.rate, now)
        elif op < 0.9 and k not in on:
            on.add(k)
            demand.place(k, "d", 1e-3, loads[k])
        elif op < 0.95 and k in on:
            on.discard(k)
            demand.remove(k, "d")
        else:
            loads[k] *= rng.choice([0.5, 2.0])  # a LOAD of it was measured
            demand.reloaded(k, loads[k])
        if step % 4000 == 3999:
            demand.rebuild("d", dict.fromkeys(on, 1e-3), {m: loads[m] for m in on}, now)
        if step % 10 == 0:
            cost = {m: (meters[m].value(now) if m in meters else 0.0) * loads[m] for m in on}
            bound = sorted(cost.values())[rng.randrange(len(cost))]
            got = demand.cheaper("d", bound, now, limit=10**9)
            assert got is not None
            assert {m for m, c in cost.items() if c <= bound} <= set(got) <= on
            assert len(got) == len(set(got))
            asked += 1
            narrowed += len(got) < len(on)
    assert demand.origin > 0.0 and asked == 2000 and narrowed > asked // 4
    assert demand.cheaper("d", math.inf, now, limit=5) is None  # past the limit: walk instead


def test_the_ranking_is_made_again_when_placements_since_outgrow_the_limit() -> None:
    """Every LOAD evicting (thrash): models placed since the ranking would all be candidates, more
    than the limit within a second, and every search would walk the whole device. The device is
    ranked again instead, and the answer stays a superset of the cheap models."""
    rng = random.Random(3)
    demand = DeviceDemand(TAU, rebuild_every=2.0)
    meters: dict[str, RateMeter] = {}
    on: set[str] = {f"m{i}" for i in range(16)}
    demand.rebuild("d", dict.fromkeys(on, 1e-3), dict.fromkeys(on, 0.01), 0.0)
    now, answered = 0.0, 0
    for _ in range(3000):
        now += 1e-4
        k = f"m{rng.randrange(400)}"
        m = meters.setdefault(k, RateMeter())
        m.add(1, now)
        demand.arrived(k, m.rate, now)
        if k not in on:  # a LOAD of it, evicting another
            out = rng.choice(sorted(on))
            on.discard(out)
            demand.remove(out, "d")
            on.add(k)
            demand.place(k, "d", 1e-3, 0.01)
        cost = {m: (meters[m].value(now) if m in meters else 0.0) * 0.01 for m in on}
        bound = sorted(cost.values())[len(cost) // 4]
        got = demand.cheaper("d", bound, now, limit=24)
        if got is not None:
            answered += 1
            assert {m for m, c in cost.items() if c <= bound} <= set(got) <= on
    assert not demand.stale("d", now)  # (no rebuild in between: the ranking was made again by `cheaper`)
    assert answered > 2500
