"""The latency path (daemon/controller/latency.py): when a step's one INFER runs on the controller's
thread, the lane's `run_here`, and the service's switch between it and the batch engine."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.clock import FakeClock
from daemon.config import ControllerSettings
from daemon.controller.latency import MAX_LOOP_SHARE, LatencyPath, Why
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.scheduler import Scheduler
from daemon.controller.service import ControllerService
from daemon.request import InferenceRequest
from daemon.runtime.devices import Device
from daemon.runtime.executor import Lane
from tests.unit.harness import MS, Harness, make_spec

# ---------------------------------------------------------------- the decision (pure, fake clock)


def _lone(h: Harness, path: LatencyPath, b1: float = 0.2 * MS) -> tuple[Action | None, list[Action]]:
    spec = h.add(make_spec(), b1=b1)
    h.preload(spec, 1)
    h.request(spec)
    d = h.driver.step(h.now)
    return path.pick(h.sched, d, h.now), d.actions


def test_a_lone_cheap_request_on_an_idle_device_takes_the_path() -> None:
    h = Harness()
    path = LatencyPath(True, 1 * MS)
    picked, actions = _lone(h, path)
    assert picked is not None and picked is actions[0] and picked.kind == ActionKind.INFER
    assert path.counts[Why.TAKEN] == 1


def test_off_sends_everything_to_the_batch_engine() -> None:
    h = Harness()
    path = LatencyPath(False, 1 * MS)
    picked, _ = _lone(h, path)
    assert picked is None and path.counts == {Why.OFF: 1}


def test_a_run_estimated_over_the_bound_keeps_the_batch_engine() -> None:
    h = Harness()
    path = LatencyPath(True, 1 * MS)
    picked, actions = _lone(h, path, b1=2 * MS)
    assert picked is None and actions and path.counts == {Why.SLOW: 1}


def test_fast_arrivals_keep_the_batch_engine() -> None:
    """At a rate where runs here would take over MAX_LOOP_SHARE of the loop, they do not run here."""
    h = Harness()
    path = LatencyPath(True, 1 * MS)
    for i in range(10000):  # 10,000 requests/s for 1 s (the meter reads ~6,300/s): 0.2 ms each, over the loop
        path.arrived(h.now - 1.0 + i * 0.0001)
    picked, actions = _lone(h, path)
    assert picked is None and actions and path.counts == {Why.LOADED: 1}


def test_a_moderate_rate_still_takes_the_path() -> None:
    h = Harness()
    path = LatencyPath(True, 1 * MS)
    for i in range(1000):  # 1,000 requests/s for 1 s: 0.2 ms each is ~13% of the loop
        path.arrived(h.now - 1.0 + i * 0.001)
    assert 0.2 * MS * path.arrivals.value(h.now) < MAX_LOOP_SHARE
    picked, _ = _lone(h, path)
    assert picked is not None and path.counts == {Why.TAKEN: 1}


def test_a_window_opening_later_is_not_run_now() -> None:
    h = Harness()
    path = LatencyPath(True, 1 * MS)
    spec = h.add(make_spec(), b1=0.2 * MS)
    h.preload(spec, 1)
    h.request(spec)
    d = h.driver.step(h.now)
    d.actions[0].earliest = h.now + 1 * MS  # (as a policy that holds a batch to fill would issue it)
    assert path.pick(h.sched, d, h.now) is None and path.counts == {Why.NOT_YET: 1}


def test_a_load_is_never_run_here() -> None:
    h = Harness()
    path = LatencyPath(True, 1 * MS)
    spec = h.add(make_spec(), b1=0.2 * MS)
    h.request(spec)  # not resident: the step decides a LOAD
    d = h.driver.step(h.now)
    assert [a.kind for a in d.actions] == [ActionKind.LOAD]
    assert path.pick(h.sched, d, h.now) is None and path.counts == {Why.NOT_ONE_INFER: 1}


def test_work_running_elsewhere_keeps_the_batch_engine() -> None:
    h = Harness(devices=2)
    path = LatencyPath(True, 1 * MS)
    spec = h.add(make_spec(), b1=0.2 * MS)
    h.preload(spec, 2)
    h.request(spec)
    first = h.step()
    assert len(first) == 1  # running, its result not back
    h.request(spec)
    d = h.driver.step(h.now)
    assert len(d.actions) == 1 and d.actions[0].device != first[0].device
    assert path.pick(h.sched, d, h.now) is None and path.counts == {Why.BUSY: 1}


def test_requests_that_arrived_together_run_here_as_one_batch() -> None:
    """What one step finds queued is one batch; run here when nothing else is going on."""
    h = Harness()
    path = LatencyPath(True, 1 * MS)
    spec = h.add(make_spec(), b1=0.2 * MS, bmax=0.5 * MS)
    h.preload(spec, 1)
    h.request(spec)
    h.request(spec)
    d = h.driver.step(h.now)
    picked = path.pick(h.sched, d, h.now)
    assert picked is not None and len(picked.requests) == 2


def test_more_queued_than_one_batch_holds_keeps_the_batch_engine() -> None:
    h = Harness()
    path = LatencyPath(True, 1 * MS)
    spec = h.add(make_spec(max_batch=2), b1=0.2 * MS, bmax=0.3 * MS)
    h.preload(spec, 1)
    for _ in range(3):
        h.request(spec)
    d = h.driver.step(h.now)
    assert path.pick(h.sched, d, h.now) is None and path.counts == {Why.BUSY: 1}


# ---------------------------------------------------------------- the lane: run on the caller's thread


def _infer_action(clock: FakeClock, spec_name: str = "m", earliest: float = 0.0, latest: float = 1.0) -> Action:
    """An INFER whose window is [earliest, latest] s from now."""
    t = clock.now()
    return Action(ActionKind.INFER, make_spec(spec_name), "cpu:0", t + earliest, t + latest, 0.0, 1)


class Recorder:
    def __init__(self, clock: FakeClock, fail: bool = False) -> None:
        self.clock = clock
        self.fail = fail
        self.ran_on: list[int] = []
        self.posted: list[Result] = []

    def run(self, action: Action, received: float) -> Result:
        self.ran_on.append(threading.get_ident())
        if self.fail:
            raise RuntimeError("boom")
        begin = self.clock.now()
        self.clock.advance(0.1 * MS)
        return Result(action, ResultStatus.OK, received, begin, self.clock.now(), 0.1 * MS, ())

    def post(self, result: Result) -> None:
        self.posted.append(result)


def _lane(rec: Recorder) -> Lane:
    return Lane("cpu:0/infer", rec.run, rec.clock, rec.post, lambda: None)


def test_run_here_runs_on_the_calling_thread_and_posts_nothing() -> None:
    clock = FakeClock()
    rec = Recorder(clock)
    lane = _lane(rec)  # its thread never started: nothing else could have run it
    result = lane.run_here(_infer_action(clock))
    assert result is not None and result.ok and result.end - result.begin == pytest.approx(0.1 * MS)
    assert rec.ran_on == [threading.get_ident()] and rec.posted == []
    assert not lane.busy


def test_run_here_declines_when_something_is_queued_or_stopping() -> None:
    clock = FakeClock()
    rec = Recorder(clock)
    lane = _lane(rec)
    lane.submit(_infer_action(clock, earliest=1.0, latest=2.0))  # queued (the thread is not started)
    assert lane.run_here(_infer_action(clock)) is None and rec.ran_on == []
    lane.begin_stop()
    assert lane.run_here(_infer_action(clock)) is None and rec.ran_on == []


@pytest.mark.expect_errors("failed")
def test_run_here_keeps_the_window_and_turns_errors_into_results() -> None:
    clock = FakeClock()
    rec = Recorder(clock, fail=True)
    lane = _lane(rec)
    late = _infer_action(clock, earliest=0.0, latest=1.0)
    clock.advance(5.0)
    late_result = lane.run_here(late)
    assert late_result is not None and late_result.status == ResultStatus.TOO_LATE and rec.ran_on == []
    failed = lane.run_here(_infer_action(clock, earliest=0.0, latest=10.0))
    assert failed is not None and failed.status == ResultStatus.FAILED and "boom" in failed.error
    assert not lane.busy


def test_the_lane_thread_waits_while_an_action_runs_here() -> None:
    """One action at a time per lane: what is submitted during a run here starts after it."""
    clock = FakeClock()
    order: list[str] = []
    queued_done = threading.Event()
    lane: Lane

    def run(action: Action, received: float) -> Result:
        order.append(f"start {action.model.name}")
        if action.model.name == "here":
            lane.submit(_infer_action(clock, "queued"))  # from this thread: the lane's thread is woken
            assert lane.busy and lane.pending() == 1  # and must not take it yet
        order.append(f"end {action.model.name}")
        return Result(action, ResultStatus.OK, received, 0.0, 0.0, 0.0, ())

    def post(result: Result) -> None:
        queued_done.set()

    lane = Lane("cpu:0/infer", run, clock, post, lambda: None)
    lane.start()
    try:
        assert lane.run_here(_infer_action(clock, "here")) is not None
        assert queued_done.wait(10.0)  # the queued one ran on the lane's thread afterwards
        assert order[:2] == ["start here", "end here"] and order[2:] == ["start queued", "end queued"]
    finally:
        lane.stop()


def test_touch_here_runs_on_an_idle_lane_only() -> None:
    """Keep-warm runs (work outside the schedule) hold the lane as a run here does, and never
    while an action is queued or the lane is stopping."""
    clock = FakeClock()
    rec = Recorder(clock)
    lane = _lane(rec)
    ran: list[int] = []
    assert lane.touch_here(lambda: ran.append(threading.get_ident()) or None)
    assert ran == [threading.get_ident()] and not lane.busy and rec.posted == []
    lane.submit(_infer_action(clock, earliest=1.0, latest=2.0))
    assert not lane.touch_here(lambda: ran.append(0) or None) and len(ran) == 1
    lane.begin_stop()
    assert not lane.touch_here(lambda: ran.append(0) or None) and len(ran) == 1


# ---------------------------------------------------------------- the service's switch


class FakeExecutor:
    """Answers an INFER on the caller's thread when `here` allows, else as the batch engine would:
    the result comes back through the service later."""

    def __init__(self, service: list[ControllerService], clock: FakeClock, here: bool) -> None:
        self.service = service
        self.clock = clock
        self.here = here
        self.ran_here: list[Action] = []
        self.submitted: list[Action] = []
        self.warmed: list[tuple[str, float]] = []  # (holder, when) of each keep-warm run

    def _result(self, action: Action) -> Result:
        t = self.clock.now()
        if action.kind != ActionKind.INFER:  # the preload's LOAD
            return Result(action, ResultStatus.OK, t, t, t)
        return Result(action, ResultStatus.OK, t, t, t, 0.0, (np.zeros((action.batch_size, 1), np.float32),))

    def run_here(self, action: Action) -> Result | None:
        if not self.here:
            return None
        self.ran_here.append(action)
        return self._result(action)

    def submit(self, action: Action) -> None:
        self.submitted.append(action)
        self.service[0].post_result(self._result(action))

    def keep_warm(self, holder: str) -> bool:
        self.warmed.append((holder, self.clock.now()))
        return True


def _serve(here: bool, enabled: bool = True, keep_warm_ms: float = 0.0, spin: bool = True,
           after: Callable[[ControllerService, FakeClock], Awaitable[None]] | None = None,
           before: Callable[[ControllerService, FakeClock], None] | None = None,
           ) -> tuple[FakeExecutor, ControllerService, list[int]]:
    """One request through a ControllerService over a fake executor; which way it went. `before`
    runs before it is submitted, `after` once it is answered, before the service closes."""
    clock = FakeClock()
    settings = ControllerSettings(latency_path=enabled, latency_path_max_ms=1.0, keep_warm_ms=keep_warm_ms,
                                  keep_warm_touch_ms=1.0, keep_warm_spin=spin)
    sched = Scheduler([Device("cpu:0", "cpu", 0, 1000)], DynamicBatchingPolicy(0.0), settings)
    spec = make_spec()
    sched.add_model(spec, 100, {1: 0.2 * MS, spec.max_batch_size: 0.5 * MS}, "cpu")
    answered: list[int] = []

    async def main() -> tuple[FakeExecutor, ControllerService]:
        loop = asyncio.get_running_loop()
        holder: list[ControllerService] = []
        ex = FakeExecutor(holder, clock, here)
        svc = ControllerService(sched, {"cpu:0": ex}, clock, loop)
        holder.append(svc)
        svc.preload(spec.key, 1)
        await svc.until(lambda s: bool(s.ready_on.get(spec.key)))
        done: asyncio.Future[None] = loop.create_future()
        x = np.zeros((1, 2), np.float32)
        req = InferenceRequest(spec, (x,), 1, clock.now(), clock.now() + 1.0)

        def finish(r: InferenceRequest) -> None:
            answered.append(r.id)
            done.set_result(None)

        req.on_finish = finish
        if before is not None:
            before(svc, clock)
        svc.submit(req)
        await done
        assert req.ok
        await svc.settled()
        if after is not None:
            await after(svc, clock)
        svc.close()
        return ex, svc

    ex, svc = asyncio.run(main())
    return ex, svc, answered


def test_service_answers_a_lone_request_here_without_the_batch_engine() -> None:
    ex, svc, answered = _serve(here=True)
    assert len(answered) == 1
    assert [a.kind for a in ex.ran_here] == [ActionKind.INFER]
    assert [a.kind for a in ex.submitted] == [ActionKind.LOAD]  # the preload only
    assert svc.latency.statistics() == {"taken": 1}


def test_service_falls_back_when_the_executor_declines() -> None:
    ex, svc, answered = _serve(here=False)
    assert len(answered) == 1 and ex.ran_here == []
    assert [a.kind for a in ex.submitted] == [ActionKind.LOAD, ActionKind.INFER]
    assert svc.latency.statistics() == {"refused": 1}


def test_service_with_the_path_off_never_asks() -> None:
    ex, svc, answered = _serve(here=True, enabled=False)
    assert len(answered) == 1 and ex.ran_here == []
    assert [a.kind for a in ex.submitted] == [ActionKind.LOAD, ActionKind.INFER]
    assert svc.latency.statistics().get("taken", 0) == 0


def test_each_busy_spell_clears_the_idle_events_and_its_end_sets_them_again() -> None:
    # The service clears its idle and settled events at the first arrival of a busy spell only
    # (not at every arrival): a second spell, after the first one's idle step, must clear them too.
    seen: list[tuple[bool, bool]] = []

    def events(svc: ControllerService) -> tuple[bool, bool]:
        return svc._idle.is_set(), svc._settled.is_set()  # noqa: SLF001 (what drain and settled wait on)

    async def after(svc: ControllerService, clock: FakeClock) -> None:
        loop = asyncio.get_running_loop()
        spec = svc.scheduler.models[make_spec().key].spec
        seen.append(events(svc))  # the first spell is over
        done: list[asyncio.Future[None]] = []
        for _ in range(2):  # a second spell of two requests, both submitted before either is answered
            fut: asyncio.Future[None] = loop.create_future()
            req = InferenceRequest(spec, (np.zeros((1, 2), np.float32),), 1, clock.now(), clock.now() + 1.0)
            req.on_finish = lambda r, f=fut: f.set_result(None)
            svc.submit(req)
            seen.append(events(svc))
            done.append(fut)
        await asyncio.gather(*done)
        await asyncio.wait_for(svc.settled(), 5.0)
        seen.append(events(svc))

    _serve(here=False, after=after)
    assert seen == [(True, True), (False, False), (False, False), (True, True)]


async def _idle_for(svc: ControllerService, clock: FakeClock, seconds: float, step: float = 0.25 * MS) -> None:
    """Let the loop turn while the fake clock moves on by `step` a turn, `seconds` in all."""
    end = clock.now() + seconds
    while clock.now() < end:
        clock.advance(step)
        await asyncio.sleep(0)


def test_keep_warm_runs_the_model_between_requests_for_its_window_then_stops() -> None:
    seen: dict[str, Any] = {}

    async def after(svc: ControllerService, clock: FakeClock) -> None:
        seen["spinning"] = svc.keeping_warm
        await _idle_for(svc, clock, 0.010)  # 10 ms of idle loop turns, the window 5 ms
        seen["after"] = svc.keeping_warm

    ex, svc, answered = _serve(here=True, keep_warm_ms=5.0, after=after)
    assert len(answered) == 1 and seen == {"spinning": True, "after": False}
    when = [t for _, t in ex.warmed]
    assert {h for h, _ in ex.warmed} == {ex.ran_here[0].holder}
    assert 4 <= len(when) <= 5  # one a touch period (1 ms) within the 5 ms window, none after it
    assert all(b - a >= 1.0 * MS - 1e-9 for a, b in itertools.pairwise(when))
    assert svc.scheduler.counters["keep_warm_runs"] == len(when)


def test_keep_warm_off_never_spins() -> None:
    seen: dict[str, Any] = {}

    async def after(svc: ControllerService, clock: FakeClock) -> None:
        seen["spinning"] = svc.keeping_warm
        await _idle_for(svc, clock, 0.010)

    ex, _, answered = _serve(here=True, after=after)
    assert len(answered) == 1 and seen == {"spinning": False} and ex.warmed == []


def test_keep_warm_follows_only_runs_on_the_latency_path() -> None:
    """Through the batch engine (the executor declined the path) nothing is kept warm: the load
    is not light, or the device runs its own thread."""
    seen: dict[str, Any] = {}

    async def after(svc: ControllerService, clock: FakeClock) -> None:
        seen["spinning"] = svc.keeping_warm
        await _idle_for(svc, clock, 0.010)

    ex, _, _ = _serve(here=False, keep_warm_ms=5.0, after=after)
    assert seen == {"spinning": False} and ex.warmed == []


def test_keep_warm_stands_aside_while_requests_come_faster_than_its_touches() -> None:
    """Requests more often than once a touch period keep the path hot themselves: no spin, no
    scratch runs (a spinning loop would take CPU from them on a small machine)."""
    seen: dict[str, Any] = {}

    def busy(svc: ControllerService, clock: FakeClock) -> None:  # 1,200 arrivals 0.1 ms apart: ~1,100/s
        for _ in range(1200):
            clock.advance(0.1 * MS)
            svc.latency.arrived(clock.now())

    async def after(svc: ControllerService, clock: FakeClock) -> None:
        seen["spinning"] = svc.keeping_warm
        await _idle_for(svc, clock, 0.010)

    ex, svc, answered = _serve(here=True, keep_warm_ms=5.0, before=busy, after=after)
    assert len(answered) == 1 and len(ex.ran_here) == 1
    assert seen == {"spinning": False} and ex.warmed == []
    assert svc.scheduler.counters["keep_warm_declined"] == 1
