"""Simulated devices (`sim:N`): executors in virtual time, for the simulator (daemon/sim.py).

A `SimExecutor` keeps the executor contract: its lanes run actions in order of `earliest`,
refuse those that cannot start by `latest`, enforce the weight budget, and report timings;
actions take the durations of a `SimProfile` (with optional noise and injected slowdowns) in
the virtual time of the `EventSource` that owns it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.clock import VirtualClock
from daemon.runtime.devices import Device


class EventSource(Protocol):
    """What a simulated executor needs from its simulation."""

    clock: VirtualClock
    profiles: dict[str, SimProfile]
    slowdowns: list[Slowdown]
    noise: float
    rng: np.random.Generator
    zeros: np.ndarray

    def at(self, t: float, fn: Callable[[], None], controller: bool = True) -> None: ...

    def post(self, result: Result) -> None: ...


@dataclass(frozen=True)
class SimProfile:
    """What a model costs on a simulated device: LOAD seconds, INFER seconds per batch size."""

    weight_bytes: int
    load_s: float
    infer_s: dict[int, float]

    def infer(self, batch: int) -> float:
        if batch in self.infer_s:
            return self.infer_s[batch]
        sizes = sorted(self.infer_s)
        lo = max((b for b in sizes if b <= batch), default=sizes[0])
        hi = min((b for b in sizes if b >= batch), default=sizes[-1])
        if lo == hi:
            return self.infer_s[lo] * batch / lo
        return self.infer_s[lo] + (self.infer_s[hi] - self.infer_s[lo]) * (batch - lo) / (hi - lo)


@dataclass
class Slowdown:
    """Makes a device slower: `factor` x durations, plus `add_s`, during [start, end)."""

    device: str
    factor: float = 1.0
    add_s: float = 0.0
    start: float = 0.0
    end: float = math.inf

    def applies(self, device: str, t: float) -> bool:
        return device == self.device and self.start <= t < self.end


class _SimLane:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Action, float]] = []
        self.busy_until = 0.0
        self.free_since = 0.0
        self.check_at: float | None = None


class SimExecutor:
    """An executor in virtual time."""

    def __init__(self, device: Device, sim: EventSource) -> None:
        self.device = device
        self.sim = sim
        self.lanes = {"infer": _SimLane(), "load": _SimLane()}
        self.resident: set[str] = set()
        self.used = 0
        self.busy_s = 0.0
        # INFER seconds of actions started in [counted_from, counted_until): a run's measured window
        # (its warm-up and drain left out)
        self.counted_from = 0.0
        self.counted_until = math.inf
        self.counted_busy_s = 0.0

    def submit(self, action: Action) -> None:
        lane = self.lanes["infer" if action.kind == ActionKind.INFER else "load"]
        now = self.sim.clock.now()
        heapq.heappush(lane.heap, (action.earliest, action.id, action, now))
        self._arm(lane, now)

    def _arm(self, lane: _SimLane, now: float) -> None:
        if not lane.heap:
            return
        at = max(now, lane.busy_until, lane.heap[0][0])
        if lane.check_at is None or at < lane.check_at:
            lane.check_at = at
            self.sim.at(at, lambda: self._start(lane), controller=False)

    def _duration(self, base: float, t: float) -> float:
        d = base
        for s in self.sim.slowdowns:
            if s.applies(self.device.name, t):
                d = d * s.factor + s.add_s
        if self.sim.noise > 0:
            d *= float(self.sim.rng.lognormal(0.0, self.sim.noise))
        return d

    def _start(self, lane: _SimLane) -> None:
        now = self.sim.clock.now()
        if lane.check_at is not None and now < lane.check_at:
            return  # superseded by an earlier check
        lane.check_at = None
        if not lane.heap or now < lane.busy_until or lane.heap[0][0] > now:
            self._arm(lane, now)
            return
        _, _, action, received = heapq.heappop(lane.heap)
        ready = max(action.earliest, received, lane.free_since)
        if now > action.latest:
            self.sim.post(Result(action, ResultStatus.TOO_LATE, received, now, now, ready_at=ready,
                                 error="could not start by latest"))
            self._arm(lane, now)
            return
        status, error, d, outputs, nbytes = self._work(action, now)
        lane.busy_until = now + d
        if action.kind == ActionKind.INFER:
            self.busy_s += d
            if self.counted_from <= now < self.counted_until:
                self.counted_busy_s += d

        def finish() -> None:
            end = self.sim.clock.now()
            lane.free_since = end
            if action.kind == ActionKind.UNLOAD and status == ResultStatus.OK:
                self.resident.discard(action.model.key)
                self.used -= nbytes
            if action.kind == ActionKind.LOAD and status == ResultStatus.OK:
                self.resident.add(action.model.key)
            self.sim.post(Result(action, status, received, now, end, d, outputs, error, nbytes, ready_at=ready))
            self._arm(lane, end)

        self.sim.at(now + d, finish, controller=False)  # its result wakes the controller

    def _work(self, action: Action, now: float) -> tuple[ResultStatus, str, float, tuple[np.ndarray, ...] | None, int]:
        key = action.model.key
        prof = self.sim.profiles[key]
        if action.kind == ActionKind.INFER:
            if key not in self.resident:
                return ResultStatus.FAILED, f"weights of {key} are not on {self.device.name}", 0.0, None, 0
            rows = action.samples  # simulated devices run exactly the filled rows, like CPU ones
            return ResultStatus.OK, "", self._duration(prof.infer(rows), now), (self.sim.zeros[:rows],), 0
        if action.kind == ActionKind.LOAD:
            if key in self.resident:
                return ResultStatus.FAILED, "already loaded", 0.0, None, 0
            if self.used + prof.weight_bytes > self.device.weight_budget:
                return ResultStatus.FAILED, "insufficient weight memory", 0.0, None, 0
            self.used += prof.weight_bytes  # reserved from the start, as real executors do
            return ResultStatus.OK, "", self._duration(prof.load_s, now), None, prof.weight_bytes
        if key not in self.resident:
            return ResultStatus.FAILED, "not loaded", 0.0, None, 0
        return ResultStatus.OK, "", 1e-6, None, prof.weight_bytes


