from __future__ import annotations

import math
import random

import pytest

from daemon.controller.estimates import Estimator, SlidingWindow
from daemon.controller.memory import CallableRules, DeviceMemory, Residency


def test_window_percentile_is_near_max_and_slides() -> None:
    w = SlidingWindow(10)
    for x in range(1, 11):
        w.add(float(x))
    assert w.percentile(0.99) == pytest.approx(9.91)
    assert w.percentile(0.5) == pytest.approx(5.5)
    for _ in range(10):
        w.add(2.0)  # the old samples slide out
    assert w.percentile(0.99) == 2.0


def test_window_keeps_its_samples_in_order_as_they_come_and_go() -> None:
    """The window keeps its samples sorted as they are added, slide out and age out: every
    percentile read equals the one of the samples left, sorted afresh (ties and repeats too)."""
    rng = random.Random(7)
    for size in (1, 2, 3, 10):
        w = SlidingWindow(size, max_age=0.5)
        kept: list[tuple[float, float]] = []  # (time, value), oldest first
        t = 0.0
        for _ in range(3000):
            t += rng.choice((0.0, 0.01, 0.2, 0.7))
            if rng.random() < 0.7:
                x = float(rng.randint(0, 6)) if rng.random() < 0.5 else rng.random()
                w.add(x, t)
                kept = [*kept, (t, x)][-size:]
            else:
                got = w.current(t, q := rng.choice((0.5, 0.9, 0.99)))
                kept = [(at, x) for at, x in kept if t - at <= 0.5] if kept and t - kept[-1][0] <= 0.5 else kept
                if not kept or t - kept[-1][0] > 0.5:
                    assert got is None
                    continue
                s = sorted(x for _, x in kept)
                pos = q * (len(s) - 1)
                lo = math.floor(pos)
                hi = min(lo + 1, len(s) - 1)
                assert got == (s[lo] + (s[hi] - s[lo]) * (pos - lo), kept[0][0])
    w = SlidingWindow(3)
    w.add(math.nan)  # measures nothing
    assert len(w) == 0


def test_estimator_seeds_interpolate_then_observations_win() -> None:
    e = Estimator()
    e.seed_infer("m", "cpu", {1: 1.0, 8: 8.0}, (1, 2, 4, 8, 16))
    assert e.infer("m", 4, "cpu") == pytest.approx(4.0)
    assert e.infer("m", 16, "cpu") == pytest.approx(16.0)  # beyond the largest: scaled
    assert e.infer("m", 4, "cuda") is None
    e.observe_infer("m", 4, "cpu", 0.5)
    assert e.infer("m", 4, "cpu") == 0.5
    assert e.load("m", "cpu") is None
    e.observe_load("m", "cpu", 0.01)
    assert e.load("m", "cpu") == 0.01
    e.forget("m")
    assert e.infer("m", 4, "cpu") is None


def test_a_new_sample_moves_the_version_only_when_it_moves_the_estimate() -> None:
    """What callers keep from a model's estimates is keyed by its version: a run that lands on the
    same estimate leaves it (and the estimate's time of validity only grows); one that moves it
    moves the version, and the estimate asked next is the new one."""
    e = Estimator(window=4, percentile=0.5)
    e.now = 1.0
    e.observe_infer("m", 1, "cpu", 0.010, "d0")
    e.observe_infer("m", 1, "cpu", 0.010, "d0")
    est, until = e.infer_until("m", 1, "cpu", "d0")
    assert est == pytest.approx(0.010)
    v = e.version("m")
    e.now = 1.5
    e.observe_infer("m", 1, "cpu", 0.010, "d0")  # the median stands
    assert e.version("m") == v
    est2, until2 = e.infer_until("m", 1, "cpu", "d0")
    assert est2 == est and until2 >= until
    e.observe_infer("m", 1, "cpu", 0.050, "d0")
    e.observe_infer("m", 1, "cpu", 0.050, "d0")  # the median moves
    assert e.version("m") > v
    assert e.infer("m", 1, "cpu", "d0") == pytest.approx(0.030)
    fresh = Estimator(window=4, percentile=0.5)  # the same samples, never memoised: the same answer
    fresh.now = 1.0
    for t in (0.010, 0.010):
        fresh.observe_infer("m", 1, "cpu", t, "d0")
    fresh.now = 1.5
    for t in (0.010, 0.050, 0.050):
        fresh.observe_infer("m", 1, "cpu", t, "d0")
    assert fresh.infer_until("m", 1, "cpu", "d0") == e.infer_until("m", 1, "cpu", "d0")


def test_a_load_that_captured_graphs_counts_only_until_one_that_did_not() -> None:
    e = Estimator()
    e.observe_load("m", "cuda", 0.040, set_up=True)  # warm-ups and captures: the first LOAD
    assert e.load("m", "cuda") == 0.040  # all there is
    e.observe_load("m", "cuda", 0.002)  # replayed parked graphs: what LOADs take from now on
    assert e.load("m", "cuda") == 0.002
    e.observe_load("m", "cuda", 0.045, set_up=True)  # a rare capture: not the next LOAD's time
    assert e.load("m", "cuda") == 0.002
    e.forget("m")
    assert e.load("m", "cuda") is None


def test_memory_accounting_and_lru_victims() -> None:
    m = DeviceMemory(100)
    for k in ("a", "b", "c"):
        m.reserve(k, 30)
        m.loaded(k)
    assert m.free == 10
    with pytest.raises(ValueError, match="needs 30 bytes"):
        m.reserve("d", 30)
    m.touch("a")  # LRU order is now b, c, a
    assert m.victims(30, CallableRules(lambda k: True, lambda k: False)) == ["b"]
    # b is wanted (requests queued): idle models go first even if used more recently
    assert m.victims(30, CallableRules(lambda k: True, lambda k: k == "b")) == ["c"]
    assert m.victims(60, CallableRules(lambda k: k != "c", lambda k: False)) == ["b", "a"]
    assert m.victims(200, CallableRules(lambda k: True, lambda k: False)) is None  # over budget
    assert m.victims(95, CallableRules(lambda k: k == "a", lambda k: False)) is None
    assert m.release("b") == 30
    assert m.free == 40
    m.reserve("d", 30)
    assert m.state("d") == Residency.LOADING
    assert not m.is_ready("d")
    assert m.victims(10, CallableRules(lambda k: True, lambda k: False)) == []


def _victims_by_full_walk(m: DeviceMemory, nbytes: int, evictable, wanted) -> list[str] | None:  # noqa: ANN001
    """The rule `victims` implements, as a plain walk over every model in LRU order."""
    if nbytes > m.budget:
        return None
    need = nbytes - m.free
    if need <= 0:
        return []
    idle, in_demand = [], []
    for k in m.models():
        if not m.is_ready(k) or not evictable(k):
            continue
        if wanted(k):
            in_demand.append(k)
        elif m.size(k) >= need:
            return [k]
        else:
            idle.append(k)
    chosen = []
    for k in idle + in_demand:
        chosen.append(k)
        need -= m.size(k)
        if need <= 0:
            return chosen
    return None


def test_victims_from_size_classes_match_a_walk_over_every_model() -> None:
    """The per-size LRU classes find the same victims as walking every resident model, through
    loads, touches, releases and loads still in flight, for many random histories."""
    import random

    for seed in range(40):
        rng = random.Random(seed)
        m = DeviceMemory(10_000)
        keys = [f"m{i}" for i in range(60)]
        for _ in range(400):
            op = rng.random()
            placed = m.models()
            if op < 0.35:
                k = rng.choice(keys)
                n = rng.choice([40, 90, 300, 700, 1500, rng.randint(1, 2500)])
                if m.state(k) is None and n <= m.free:
                    m.reserve(k, n)
                    if rng.random() < 0.9:
                        m.loaded(k)
            elif op < 0.45 and placed:
                k = rng.choice(placed)
                if m.state(k) == Residency.LOADING:
                    m.loaded(k)
            elif op < 0.75 and placed:
                m.touch(rng.choice(placed))
            elif op < 0.85 and placed:
                m.release(rng.choice(placed))
            else:
                busy = set(rng.sample(keys, 10))
                hot = set(rng.sample(keys, 15))
                nbytes = rng.randint(1, 6000)
                got = m.victims(nbytes, CallableRules(lambda k, b=busy: k not in b, lambda k, h=hot: k in h))
                assert got == _victims_by_full_walk(m, nbytes, lambda k, b=busy: k not in b,
                                                    lambda k, h=hot: k in h), (seed, nbytes)
                # told which models it may take (any superset of those evictable), the same answer
                among = [k for k in keys if k not in busy or rng.random() < 0.3]
                assert m.victims(nbytes, CallableRules(lambda k, b=busy: k not in b, lambda k, h=hot: k in h),
                                 among=rng.sample(among, len(among))) == got, (seed, nbytes)
