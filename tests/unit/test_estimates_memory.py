from __future__ import annotations

import pytest

from daemon.controller.estimates import Estimator, SlidingWindow
from daemon.controller.memory import DeviceMemory, Residency


def test_window_percentile_is_near_max_and_slides() -> None:
    w = SlidingWindow(10)
    for x in range(1, 11):
        w.add(float(x))
    assert w.percentile(0.99) == pytest.approx(9.91)
    assert w.percentile(0.5) == pytest.approx(5.5)
    for _ in range(10):
        w.add(2.0)  # the old samples slide out
    assert w.percentile(0.99) == 2.0


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


def test_memory_accounting_and_lru_victims() -> None:
    m = DeviceMemory(100)
    for k in ("a", "b", "c"):
        m.reserve(k, 30)
        m.loaded(k)
    assert m.free == 10
    with pytest.raises(ValueError, match="needs 30 bytes"):
        m.reserve("d", 30)
    m.touch("a")  # LRU order is now b, c, a
    assert m.victims(30, evictable=lambda k: True, wanted=lambda k: False) == ["b"]
    # b is wanted (requests queued): idle models go first even if used more recently
    assert m.victims(30, evictable=lambda k: True, wanted=lambda k: k == "b") == ["c"]
    assert m.victims(60, evictable=lambda k: k != "c", wanted=lambda k: False) == ["b", "a"]
    assert m.victims(200, evictable=lambda k: True, wanted=lambda k: False) is None  # over budget
    assert m.victims(95, evictable=lambda k: k == "a", wanted=lambda k: False) is None
    assert m.release("b") == 30
    assert m.free == 40
    m.reserve("d", 30)
    assert m.state("d") == Residency.LOADING
    assert not m.is_ready("d")
    assert m.victims(10, evictable=lambda k: True, wanted=lambda k: False) == []
