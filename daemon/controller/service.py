"""The controller's asyncio glue: carries decisions between the scheduler, executors and frontends.

Everything here runs on the event loop. Executor threads hand results in through
`post_result` (thread-safe). Arrivals and results only mark the scheduler dirty; one
`schedule()` call per loop iteration then decides for all of them, so a burst of requests is
batched together and the decision logic is never re-entered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from daemon.actions import Action, Result
from daemon.clock import Clock
from daemon.controller import forecast
from daemon.controller.driver import Driver
from daemon.controller.latency import LatencyPath
from daemon.controller.scheduler import Decision, Scheduler
from daemon.errors import Unavailable
from daemon.model import ModelSpec
from daemon.request import InferenceRequest

log = logging.getLogger("escapement.controller")


def _result_failed(result: Result, e: Exception) -> None:
    log.error("applying the result of %r failed", result.action, exc_info=e)


class Flag:
    """A flag coroutines can wait for: asyncio.Event's use here, compiled. The service sets and
    clears two of them once per busy spell, which at light load is once per request, and Event's
    `set` and `clear` are interpreted (~1k instructions each, four a lone request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, value: bool = False) -> None:
        self.loop = loop
        self.value = value
        self._waiters: list[asyncio.Future[None]] = []

    def is_set(self) -> bool:
        return self.value

    def set(self) -> None:
        if self.value:
            return
        self.value = True
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def clear(self) -> None:
        self.value = False

    async def wait(self) -> None:
        if self.value:
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:  # (cancelled, or timed out: not left behind for the next set)
            if fut in self._waiters:
                self._waiters.remove(fut)


class AnswerBatch(Protocol):
    """Told when a step starts and ends answering its finished requests (frontend workers gather a
    step's answers to each worker into one write, made at the end, not a loop turn later)."""

    def answers_begin(self) -> None: ...

    def answers_end(self) -> None: ...


class ActionSink(Protocol):
    def submit(self, action: Action) -> None: ...


class RunsHere(Protocol):
    """An executor that can run an INFER on the calling thread (the latency path); None: submit it."""

    def run_here(self, action: Action) -> Result | None: ...


class ControllerService:
    def __init__(self, scheduler: Scheduler, executors: Mapping[str, ActionSink], clock: Clock,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.scheduler = scheduler
        self.driver = Driver(scheduler)
        self.executors = executors
        self.clock = clock
        self.loop = loop
        self.accepting = True
        self._dirty = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._idle = Flag(loop, True)
        self._settled = Flag(loop, True)  # idle, and no coding group left waiting for a flush
        self._quiet = True  # `_idle` is set (and so may `_settled` be): an arrival clears them
        self._waiters: list[tuple[Callable[[Scheduler], bool], asyncio.Future[None]]] = []
        # set once every device is lost (the daemon then stops: a lost CUDA context comes back only
        # in a new process); an event rather than a waiter, which would run a predicate every step
        self.all_lost = asyncio.Event()
        self._results: list[Result] = []  # came back since the last step
        self.answers: AnswerBatch | None = None  # (set by the frontend workers, if any)
        # posted by executor threads, not yet taken by the loop (under `_post_lock`)
        self._posted: list[Result] = []
        self._post_lock = threading.Lock()
        ctl = scheduler.settings
        self.latency = LatencyPath(ctl.latency_path, ctl.latency_path_max_ms / 1000.0)
        # keep-warm (controller.keep_warm_ms): after a run on the latency path the loop spins, and
        # the model runs on scratch rows every touch_s, until warm_until
        self.keep_warm_s = ctl.keep_warm_ms / 1000.0
        self.touch_s = ctl.keep_warm_touch_ms / 1000.0
        self.spin = ctl.keep_warm_spin
        self._warm_target: tuple[str, str] | None = None  # (device, holder)
        self._warm_until = -math.inf
        self._touched = -math.inf
        self._spinning = False
        # called after each keep-warm run: a frontend in this process replays its request path
        # (api/uds.py Rehearsal), True when it did
        self.on_touch: list[Callable[[], bool]] = []

    # ---------------------------------------------------------------- from frontends

    def submit(self, req: InferenceRequest) -> None:
        """Admit a request (raises the error to answer with if refused)."""
        if not self.accepting:
            raise Unavailable("the daemon is shutting down")
        now = self.clock.now()
        self.driver.submit(req, now)
        self.latency.arrived(now)
        if self._quiet:  # (two events cleared once per busy spell, not twice a request)
            self._quiet = False
            self._idle.clear()
            self._settled.clear()
        self._kick()

    def cancel(self, req: InferenceRequest) -> None:
        self._deliver(self.driver.cancel(req, self.clock.now()))
        self._kick()

    def expected_finish(self, spec: ModelSpec, samples: int) -> float:
        """When a request of `samples` samples of `spec` submitted now would be answered at the
        earliest (controller/forecast.py); applications ask it (daemon/apps/router.py)."""
        return forecast.expected_finish(self.scheduler, spec, samples, self.clock.now())

    def forecast(self, limit: int) -> dict[str, Any]:
        """This node as a cluster router sees it (controller/forecast.py; the `forecast` op)."""
        return forecast.node_forecast(self.scheduler, self.clock.now(), limit)

    # ---------------------------------------------------------------- from executors

    def post_result(self, result: Result) -> None:
        """Thread-safe: called on executor threads. Results posted before the loop takes the last
        ones share their one wake-up."""
        lock = self._post_lock
        lock.acquire()
        posted = self._posted
        posted.append(result)
        first = len(posted) == 1
        lock.release()
        if first:
            self.loop.call_soon_threadsafe(self._take_posted)

    def _take_posted(self) -> None:
        lock = self._post_lock
        lock.acquire()
        posted, self._posted = self._posted, []
        lock.release()
        self._results.extend(posted)  # applied by the next step, with everything else that came back
        if not self._dirty:
            # Stepped now, not kicked: the results are why the loop woke, and a step queued behind
            # this callback would take one more turn of the loop (a poll) before the answers go.
            self._step()

    # ---------------------------------------------------------------- the step

    def _kick(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.loop.call_soon(self._step)

    def _step(self) -> None:
        self._dirty = False
        now = self.clock.now()
        results, self._results = self._results, []
        try:
            decision = self.driver.step(now, results, on_error=_result_failed)
            here = self.latency.pick(self.scheduler, decision, now) if decision.actions else None
            if here is None:
                self._deliver(decision)
            else:
                self._run_here(here, decision)
        except Exception:  # a bug in a policy must not stop the controller
            log.exception("scheduling step failed")
        self._arm(now)
        if self.scheduler.pending == 0 and not self.scheduler.inflight:
            self._idle.set()
            self._quiet = True
            if not self.scheduler.coding.groups:
                self._settled.set()
        if self._waiters:
            self._wake_waiters()
        if self.scheduler.lost and self.scheduler.lost == len(self.scheduler.devices):
            self.all_lost.set()

    def _wake_waiters(self) -> None:
        keep: list[tuple[Callable[[Scheduler], bool], asyncio.Future[None]]] = []
        for pred, fut in self._waiters:
            if fut.done():
                continue
            try:
                if pred(self.scheduler):
                    fut.set_result(None)
                    continue
            except Exception as e:
                fut.set_exception(e)
                continue
            keep.append((pred, fut))
        self._waiters = keep

    def _run_here(self, action: Action, decision: Decision) -> None:
        """The latency path: run the step's one INFER on this thread, then apply its result and
        answer in this same step (no hand-off to the lane's thread and back). Falls back to the
        batch engine's delivery if the executor cannot run it here."""
        sink = self.executors[action.device]
        run_here = getattr(sink, "run_here", None)
        t0 = time.thread_time_ns()
        result = run_here(action) if run_here is not None else None
        if result is not None:
            # the loop's CPU spent running models, not deciding (benchmarks of the loop's own cost
            # subtract it; an operator sees how much of the loop the path takes)
            counters = self.scheduler.counters
            counters["latency_path_runs"] += 1
            counters["latency_path_cpu_ns"] += time.thread_time_ns() - t0
        if result is None:
            self.latency.refused()
            self._deliver(decision)
            return
        decision.actions.remove(action)
        self._deliver(decision)  # whatever else the step finished (answers)
        now = self.clock.now()
        self._deliver(self.driver.step(now, (result,), on_error=_result_failed))
        if self.keep_warm_s > 0:
            self._keep_warm(action.device, action.holder, now)

    # ---------------------------------------------------------------- keep-warm

    def _keep_warm(self, device: str, holder: str, now: float) -> None:
        """At light load the machine evicts a model's code and weights from the caches between
        requests (its next run takes 10-20x as long after 10 ms idle on a shared 2-core VM:
        bench/latency_breakdown.py --idle). Until `keep_warm_s` after this run, the model runs on
        scratch rows every `touch_s` while nothing else is queued or running, and between those
        runs the loop spins (`spin`: a ready callback each turn) or sleeps. Only while requests
        arrive less often than once a touch period: faster, they keep the path hot themselves, and
        a spinning loop would only take CPU from the rest of the machine (a window running stops)."""
        if self.latency.arrivals.value(now) * self.touch_s >= 1.0:
            self._warm_until = now
            self.scheduler.counters["keep_warm_declined"] += 1
            return
        self._warm_target = (device, holder)
        self._warm_until = now + self.keep_warm_s
        self._touched = now
        if not self._spinning:
            self._spinning = True
            self.loop.call_soon(self._warm_tick)

    @property
    def keeping_warm(self) -> bool:
        """Whether the keep-warm spin (or its timer) is running."""
        return self._spinning

    def _warm_tick(self) -> None:
        now = self.clock.now()
        if now >= self._warm_until or not self.accepting or self._warm_target is None:
            self._spinning = False
            return
        sched = self.scheduler
        if now - self._touched >= self.touch_s and sched.pending == 0 and not sched.inflight:
            device, holder = self._warm_target
            keep = getattr(self.executors[device], "keep_warm", None)
            t0 = time.thread_time_ns()
            if keep is not None and keep(holder):
                counters = sched.counters
                counters["keep_warm_runs"] += 1
                for replay in self.on_touch:
                    if replay():
                        counters["keep_warm_replays"] += 1
                counters["keep_warm_cpu_ns"] += time.thread_time_ns() - t0
            self._touched = self.clock.now()
        if self.spin:
            self.loop.call_soon(self._warm_tick)
        else:
            self.loop.call_later(self.touch_s, self._warm_tick)

    def _arm(self, now: float) -> None:
        wake = self.scheduler.next_wakeup(now)
        at = self._timer_at
        if wake == at:
            return
        if self._timer is not None and at is not None and (wake is None or at <= wake):
            # A timer that fires no later than needed stays: the step it kicks arms the next one.
            # (Armed again at every step whose wake-up moved, a call_at and a cancel cost ~4.5k
            # instructions a step: most steps under load, where the earliest watch moves on.)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = wake
        if wake is not None:
            self._timer = self.loop.call_at(wake, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._kick()

    def _deliver(self, decision: Decision) -> None:
        for action in decision.actions:
            self.executors[action.device].submit(action)
        finished = decision.finished
        if not finished:
            return
        batch = self.answers
        if batch is not None:
            batch.answers_begin()
        try:
            for req in finished:
                if req.on_finish is not None:
                    try:
                        req.on_finish(req)
                    except Exception:
                        log.exception("answering request %d failed", req.id)
        finally:
            if batch is not None:
                batch.answers_end()

    # ---------------------------------------------------------------- lifecycle

    def preload(self, key: str, replicas: int, avoid: set[str] | None = None) -> list[str]:
        devices = self.scheduler.preload(key, replicas, self.clock.now(), avoid)
        self.apply(self.scheduler._take())
        return devices

    async def reserve(self, key: str, nbytes: int, kind: str, timeout: float) -> str | None:  # noqa: ASYNC109
        """Room for `nbytes` of work outside the scheduler (a warm-up) on a device of `kind`; the
        device, or None if none had room within `timeout` s (devices busy with every model)."""
        deadline = self.clock.now() + timeout
        while True:
            device = self.scheduler.reserve(key, nbytes, kind, self.clock.now())
            self.apply(self.scheduler._take())
            if device is not None or self.clock.now() >= deadline:
                return device
            await asyncio.sleep(0.01)  # until an action in flight frees something

    def declare_hung(self, device: str, why: str) -> None:
        """Work outside the scheduler (a warm-up) never came back from `device`: treat it as hung."""
        self.scheduler.declare_hung(device, why, self.clock.now())
        self.apply(self.scheduler._take())

    def unreserve(self, key: str, device: str) -> None:
        self.scheduler.unreserve(key, device, self.clock.now())
        self._kick()

    def apply(self, decision: Decision) -> None:
        """Carry out a decision made outside a step (model removal, for instance)."""
        self._deliver(decision)
        self._kick()

    async def until(self, predicate: Callable[[Scheduler], bool]) -> None:
        """Wait until `predicate(scheduler)` holds. Every change to the scheduler's state ends in a
        step, so it is checked after each one (it must be cheap); the daemon waits this way for a
        preload to land or for a model to fall quiet before it is removed."""
        if predicate(self.scheduler):
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append((predicate, fut))
        try:
            await fut
        finally:
            fut.cancel()  # a cancelled or timed-out wait is dropped at the next step

    async def settled(self) -> None:
        """Wait until nothing is pending or in flight and every coding group is gone (tests use it
        to check that no state leaks)."""
        await self._settled.wait()

    async def drain(self, timeout: float) -> bool:  # noqa: ASYNC109 - a bound, not a cancel scope
        """Stop admitting and wait until every accepted request is answered; False on timeout."""
        self.accepting = False
        if self.scheduler.pending == 0 and not self.scheduler.inflight:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def abort_all(self, why: str) -> None:
        """Answer every accepted request with 503 now (a drain that ran out of time)."""
        self._deliver(self.scheduler.abort_all(Unavailable(why), self.clock.now()))

    def close(self) -> None:
        self._warm_until = -math.inf  # the keep-warm spin ends at its next turn
        # what the latency path did, for benchmarks reading the log (bench/scenarios/overhead.py)
        log.info("latency path, steps by outcome: %s", json.dumps(self.latency.statistics(), sort_keys=True))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
