"""ControllerService's one timer: armed for the scheduler's next wake-up, and kept while it fires
no later than that (the step it kicks arms the next), so that a step whose wake-up only moved on
costs no call_at and cancel (daemon/controller/service.py `_arm`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from daemon.actions import Result, ResultStatus
from daemon.controller.service import ControllerService
from daemon.model import ModelSpec
from tests.unit.harness import MS, Harness, make_spec


class RecordingLoop(asyncio.SelectorEventLoop):
    """An event loop that records when it was asked to call back (never run here)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: list[float] = []

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        self.armed.append(when)
        return super().call_at(when, callback, *args, context=context)


@pytest.fixture
def loop() -> Iterator[RecordingLoop]:
    lp = RecordingLoop()
    yield lp
    lp.close()


def _two_models(devices: int, loop: asyncio.AbstractEventLoop) -> tuple[Harness, ModelSpec, ModelSpec,
                                                                        ControllerService]:
    """Two models loaded on `devices` devices, and a service over their scheduler on `loop`."""
    h = Harness(devices=devices)
    a = h.add(make_spec("a"), b1=1 * MS, bmax=8 * MS)
    b = h.add(make_spec("b"), b1=1 * MS, bmax=8 * MS)
    h.preload(a, 1)
    h.preload(b, 1)
    return h, a, b, ControllerService(h.sched, {}, h.clock, loop)


def test_the_timer_is_kept_while_it_fires_no_later_than_needed(loop: RecordingLoop) -> None:
    h, a, b, svc = _two_models(1, loop)
    h.request(a, timeout=0.5)
    first = h.sched.next_wakeup(h.now)
    assert first is not None
    svc._arm(h.now)  # noqa: SLF001
    assert loop.armed == [first]
    (infer,) = h.step()  # its INFER is out: the next wake-up (its watch) comes later
    later = h.sched.next_wakeup(h.now)
    assert later is not None and later > first
    svc._arm(h.now)  # noqa: SLF001
    assert loop.armed == [first]  # kept: it fires first, and that step arms the next
    h.request(b, timeout=0.1)  # needed sooner than the timer fires: armed again, earlier
    sooner = h.sched.next_wakeup(h.now)
    assert sooner is not None and sooner < first
    svc._arm(h.now)  # noqa: SLF001
    assert loop.armed == [first, sooner]
    svc._on_timer()  # noqa: SLF001  (it fired: the step it kicks arms whatever is next)
    svc._arm(h.now)  # noqa: SLF001
    assert loop.armed == [first, sooner, h.sched.next_wakeup(h.now)]
    h.result(infer)


def test_results_posted_together_share_one_wake_up_and_are_applied_in_one_step() -> None:
    class CountingLoop(asyncio.SelectorEventLoop):
        def __init__(self) -> None:
            super().__init__()
            self.wakes = 0

        def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> asyncio.Handle:
            self.wakes += 1
            return super().call_soon_threadsafe(callback, *args, context=context)

    loop = CountingLoop()
    try:
        h, a, b, svc = _two_models(2, loop)
        h.request(a, timeout=0.5)
        h.request(b, timeout=0.5)
        infers = h.step()
        assert len(infers) == 2 and len(h.sched.inflight) == 2
        begin = h.now
        h.clock.advance(1 * MS)
        out = (np.zeros((1, 1), np.float32),)
        # posted from two lanes' threads before the loop takes either: one wake-up between them
        threads = [threading.Thread(target=svc.post_result, args=(Result(x, ResultStatus.OK, begin, begin, h.now,
                                                                          1 * MS, out),)) for x in infers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert loop.wakes == 1

        class Batches:  # each step that answers requests opens one batch of answers
            def __init__(self) -> None:
                self.opened = 0

            def answers_begin(self) -> None:
                self.opened += 1

            def answers_end(self) -> None:
                pass

        svc.answers = batches = Batches()
        loop.run_until_complete(asyncio.sleep(0))  # the wake-up runs: both applied by one step there
        assert not h.sched.inflight and h.sched.pending == 0
        assert batches.opened == 1
    finally:
        loop.close()
