"""ControllerService.expected_finish: the read-only forecast applications use to leave out models
that cannot make a deadline (daemon/apps/router.py)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest

from daemon.controller.service import ControllerService
from tests.unit.harness import MS, Harness, make_spec


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_forecast_follows_the_device_holding_the_model(loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(devices=2)
    spec = h.add(make_spec("m"), b1=1 * MS, bmax=8 * MS)
    svc = ControllerService(h.sched, {}, h.clock, loop)
    # not loaded anywhere: a LOAD (none measured yet) and the profile
    assert svc.expected_finish(spec, 1) == pytest.approx(h.now + 1 * MS)
    h.preload(spec, 1)
    assert svc.expected_finish(spec, 1) == pytest.approx(h.now + 1 * MS)
    # its device turns slow: the forecast follows that device's runs, not the kind's profile
    req = h.request(spec, timeout=1.0)
    (infer,) = h.step()
    h.result(infer, duration=50 * MS)
    assert req.ok
    assert svc.expected_finish(spec, 1) == pytest.approx(h.now + 50 * MS)
    # requests queued ahead wait for whole batches before it
    for _ in range(3):
        h.request(spec, timeout=1.0)
    ahead = svc.expected_finish(spec, 1) - h.now
    assert ahead > 50 * MS
    # the slow runs age out (a second): the profile again
    h.clock.advance(2.0)
    h.step()  # the queued requests are past their deadlines: answered, gone
    assert h.sched.models[spec.key].queue.samples == 0
    assert svc.expected_finish(spec, 1) == pytest.approx(h.now + 1 * MS)
    assert svc.expected_finish(make_spec("unknown"), 1) == math.inf
