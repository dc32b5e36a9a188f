"""What the controller's hot paths read in place of a ModelSpec's, and the telemetry's counting
helpers, give exactly the answers of what they stand for."""

from __future__ import annotations

import bisect
import math
import random

import numpy as np
import pytest

from daemon.controller.floats import bisect_left
from daemon.controller.policies.clockwork import ClockworkPolicy, _tenths
from daemon.controller.state import ModelEntry
from daemon.observability.stats import DURATION_ERROR_BOUNDS, LATENCY_BOUNDS, Buckets, Histogram, floats
from daemon.request import InferenceRequest
from tests.unit.harness import MS, Harness, make_spec


@pytest.mark.parametrize("max_batch", [0, 1, 5, 8, 48])
def test_an_entry_answers_batch_sizes_as_its_spec_does(max_batch: int) -> None:
    spec = make_spec(max_batch=max_batch)
    entry = ModelEntry(spec, 100)
    assert entry.key == spec.key and entry.max_batch_size == max_batch and not entry.protected
    for n in range(0, max_batch + 1):
        assert entry.batch_size_for(n) == spec.batch_size_for(n), n
    with pytest.raises(ValueError):
        entry.batch_size_for(max_batch + 1)


def test_a_request_carries_its_models_key() -> None:
    spec = make_spec("other")
    req = InferenceRequest(spec, (np.zeros((1, 2), np.float32),), 1, 0.0, 1.0)
    assert req.key == spec.key == "other:1"


@pytest.mark.parametrize("bounds", [LATENCY_BOUNDS, DURATION_ERROR_BOUNDS])
def test_buckets_count_each_value_under_the_first_bound_at_or_above_it(bounds: tuple[float, ...]) -> None:
    rng = random.Random(7)
    values = [rng.uniform(-1.0, 12.0) for _ in range(2000)] + [*bounds, -math.inf, math.inf, 0.0]
    b = Buckets(bounds)
    expected = [0] * (len(bounds) + 1)
    for x in values:
        b.add(x)
        expected[bisect.bisect_left(bounds, x)] += 1
    assert b.counts == expected and b.count == len(values)


def test_add_many_counts_as_add_does_one_by_one() -> None:
    rng = np.random.default_rng(3)
    xs = np.concatenate([rng.lognormal(-6, 2, 3000), -rng.lognormal(-6, 2, 500), [0.0, 1e-9, -1e-9, 1e300]])
    one, many = Histogram(), Histogram()
    for x in xs.tolist():
        one.add(x)
    many.add_many(floats(xs.tolist()))
    assert (one.pos, one.neg, one.zero, one.count) == (many.pos, many.neg, many.zero, many.count)
    assert one.min == many.min and one.max == many.max and math.isclose(one.total, many.total)


def test_add_many_takes_an_infinite_value_into_its_last_bucket() -> None:
    h = Histogram()
    h.add_many(floats([0.5, math.inf]))
    assert h.count == 2 and sum(h.pos.values()) == 2 and max(h.pos) == 3200


def test_tenths_rounds_as_round_does_halves_to_even() -> None:
    rng = random.Random(3)
    xs = [i / 20 for i in range(-400, 400)] + [rng.uniform(-100.0, 100.0) for _ in range(20000)]
    xs += [0.0, -0.0, 0.05, 0.25, 0.35, 1e-300, 2.5e14]
    for x in xs:
        assert _tenths(x) == round(x * 10), x


def test_an_estimate_on_a_device_that_never_ran_the_model_is_its_kinds_profile() -> None:
    """What a LOAD's placement reads without a memo entry per device (`_est_unrun`) is what the
    estimate on that device (`_est_on`) gives, before and after the model ran on another device."""
    h = Harness(devices=3, budget=1000, policy=ClockworkPolicy())
    spec = h.add(make_spec("m", max_batch=8), b1=1 * MS, bmax=5 * MS)
    entry = h.sched.models[spec.key]
    devs = list(h.sched.devices.values())

    def check(unrun: list[str]) -> None:
        for dev in devs:
            ran = h.sched.estimator.ran_on(spec.key, dev.name)
            assert ran == (dev.name not in unrun), dev.name
            if not ran:
                for n in (1, 3, 8):
                    profiled = ClockworkPolicy._est_unrun(h.sched, entry, n, dev)  # noqa: SLF001 (what is tested)
                    assert profiled == ClockworkPolicy._est_on(h.sched, spec.key, n, dev)  # noqa: SLF001

    check([d.name for d in devs])
    h.use(spec)  # it loads and runs on one device: that one has runs of it, the others only the profile
    ran = [d.name for d in devs if h.sched.estimator.ran_on(spec.key, d.name)]
    assert len(ran) == 1
    check([d.name for d in devs if d.name not in ran])


def test_bisect_left_finds_what_the_standard_librarys_does() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        a = sorted(rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(rng.randint(0, 40)))
        for x in (-1.0, 0.0, 0.5, 1.0, 2.0, rng.random(), *a[:3]):
            assert bisect_left(a, x) == bisect.bisect_left(a, x), (a, x)
