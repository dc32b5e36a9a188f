"""Simulated devices (`sim:N`): the real scheduler and policy, driven in virtual time.

A `Simulation` runs the same `Scheduler`, policy and control step (`Driver`) the daemon runs,
against simulated executors (runtime/simdevice.py) whose actions take the durations of latency
profiles (with optional noise and injected slowdowns) in virtual time. Thousands of models on
many devices run faster than real time, and a run is deterministic for a given seed.

The default profiles are Clockwork's published V100 figures (`reference/clockwork.md`):
ResNet18, ResNet50, ResNet152 and SE-ResNeXt101. `load_profiles` reads profiles measured on a
real GPU by `python -m bench.gpu.profiles` (its profiles.json) instead.
"""

from __future__ import annotations

import functools
import gc
import heapq
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from daemon.actions import Result
from daemon.clock import VirtualClock
from daemon.config import ControllerSettings
from daemon.controller.driver import Driver
from daemon.controller.policy import Policy
from daemon.controller.scheduler import Decision, Scheduler
from daemon.datatypes import BY_NAME
from daemon.model import ModelSpec, TensorSpec
from daemon.request import InferenceRequest, RequestClass, RequestStatus
from daemon.runtime.devices import Device
from daemon.runtime.simdevice import SimExecutor, SimProfile, Slowdown

MB = 1e6


def _ms(d: dict[int, float]) -> dict[int, float]:
    return {b: v / 1e3 for b, v in d.items()}


# Clockwork's V100 profiles (weights, LOAD, INFER per batch size), missing sizes interpolated.
CLOCKWORK_V100 = {
    "resnet18": SimProfile(int(46.7 * MB), 3.81e-3, _ms({1: 1.32, 16: 7.12})),
    "resnet50": SimProfile(int(102.2 * MB), 8.35e-3, _ms({1: 2.73, 2: 4.05, 4: 5.88, 8: 9.93, 16: 17.33})),
    "resnet152": SimProfile(int(240.6 * MB), 19.56e-3, _ms({1: 8.21, 16: 48.54})),
    "se_resnext101": SimProfile(int(352.5 * MB), 28.75e-3, _ms({1: 8.18, 16: 66.44})),
}


PROFILES_FORMAT = "escapement.sim-profiles/1"  # what bench/gpu/profiles.py writes


def load_profiles(path: str | Path, stat: str = "infer_s") -> dict[str, SimProfile]:
    """Profiles measured by `python -m bench.gpu.profiles` (its profiles.json), by model name.
    `stat` picks the INFER figure: "infer_s" (median device time) or "infer_p99_s"."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if doc.get("format") != PROFILES_FORMAT:
        raise ValueError(f"{path}: not a profiles file (format {doc.get('format')!r}, expected {PROFILES_FORMAT!r})")
    out = {}
    for name, p in doc["profiles"].items():
        infer = {int(b): float(s) for b, s in p[stat].items()}
        if not infer:
            raise ValueError(f"{path}: {name} has no {stat}")
        out[name] = SimProfile(int(p["weight_bytes"]), float(p["load_s"]), infer)
    return out


def sim_spec(name: str, max_batch: int = 16, slo_s: float = 0.1) -> ModelSpec:
    fp32 = BY_NAME["FP32"]
    return ModelSpec(name, 1, Path(f"/sim/{name}"), "pt2", (TensorSpec("x", fp32, (-1, 1)),),
                     (TensorSpec("y", fp32, (-1, 1)),), max_batch, slo_s)


@dataclass
class SimRecords:
    arrival: np.ndarray
    deadline: np.ndarray
    finish: np.ndarray = field(init=False)
    status: np.ndarray = field(init=False)  # 200 ok, else the error's status
    cold: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.arrival)
        self.finish = np.full(n, np.nan)
        self.status = np.zeros(n, dtype=np.int32)
        self.cold = np.zeros(n, dtype=bool)

    @property
    def met(self) -> np.ndarray:
        return (self.status == 200) & (self.finish <= self.deadline + 1e-12)


@dataclass
class SimResult:
    records: SimRecords
    duration: float
    controller_s: float  # CPU seconds spent in the scheduler and policy
    wall_s: float
    scheduler: Scheduler
    device_busy: dict[str, float]
    # INFER seconds per device of actions started between `count_from` and the last arrival
    counted_busy: dict[str, float] = field(default_factory=dict)

    @property
    def slo_attainment(self) -> float:
        return float(self.records.met.mean()) if len(self.records.arrival) else float("nan")


class Simulation:
    """Discrete-event simulation of the controller with simulated devices."""

    def __init__(self, models: Sequence[tuple[ModelSpec, SimProfile]], devices: int, policy: Policy,
                 settings: ControllerSettings | None = None, weight_budget: int = int(21.5 * 2**30),
                 noise: float = 0.0, slowdowns: Sequence[Slowdown] = (), seed: int = 0,
                 step_quantum: float = 0.0) -> None:
        self.clock = VirtualClock(0.0)
        # A real event loop steps the controller once for everything that came in while it was busy
        # (frames read together, a worker's batch of SUBMIT records, results posted meanwhile). With a
        # quantum, events within that many seconds of the first the controller hears of are handled in
        # one step, at the last one's time (deterministic: a fixed model of the loop, not its measured
        # speed); 0: one step per instant, every Poisson arrival its own step.
        self.step_quantum = step_quantum
        self.rng = np.random.default_rng(seed)
        self.noise = noise
        self.slowdowns = list(slowdowns)
        # (time, order, what happens, whether the controller hears of it: arrivals and wake-ups;
        # an executor starting an action is its own business, as on a real device)
        self.events: list[tuple[float, int, Callable[[], None], bool]] = []
        self._seq = itertools.count()
        self.devices = [Device(f"sim:{i}", "sim", i, weight_budget) for i in range(devices)]
        self.scheduler = Scheduler(self.devices, policy, settings or ControllerSettings(max_pending=10**9,
                                                                                       max_pending_per_model=10**9))
        self.executors = {d.name: SimExecutor(d, self) for d in self.devices}
        self.specs = {spec.key: spec for spec, _ in models}
        self.profiles = {spec.key: prof for spec, prof in models}
        for spec, prof in models:
            self.scheduler.add_model(spec, prof.weight_bytes, {b: prof.infer(b) for b in spec.batch_sizes}, "sim")
            self.scheduler.estimator.observe_load(spec.key, "sim", prof.load_s)
        self.zeros = np.zeros((max(s.max_batch_size for s in self.specs.values()), 1), np.float32)
        self._pending_results: list[Result] = []
        self._cpu = 0.0
        self._count_from = 0.0  # controller CPU before this virtual time is not counted (a warm-up)
        self._wake_at: float | None = None
        self.driver = Driver(self.scheduler)

    def place(self, key: str, devices: Sequence[str]) -> None:
        """Put a model's weights on devices before the run (as a preload would)."""
        prof = self.profiles[key]
        sched = self.scheduler
        for name in devices:
            dev = sched.devices[name]
            dev.memory.reserve(key, prof.weight_bytes)
            dev.memory.loaded(key)
            sched.mark_ready(key, name)
            sched.mark_placed(sched.models[key], name)
            ex = self.executors[name]
            ex.resident.add(key)
            ex.used += prof.weight_bytes

    # ---------------------------------------------------------------- events

    def at(self, t: float, fn: Callable[[], None], controller: bool = True) -> None:
        """Run `fn` at `t`; a controller event (not an executor's own) is followed by a scheduling
        step. A result an event posts always is."""
        heapq.heappush(self.events, (t, next(self._seq), fn, controller))

    def post(self, result: Result) -> None:
        self._pending_results.append(result)

    def _apply(self, d: Decision, records: SimRecords, index: dict[int, int]) -> None:
        for a in d.actions:
            self.executors[a.device].submit(a)
        for r in d.finished:
            i = index.pop(r.id, None)
            if i is None:
                continue
            records.finish[i] = self.clock.now()
            records.status[i] = 200 if r.status == RequestStatus.SUCCEEDED else (r.error.status if r.error else 499)
            records.cold[i] = r.cold_start

    # ---------------------------------------------------------------- running

    def run(self, times: np.ndarray, targets: np.ndarray, keys: Sequence[str], drain_s: float = 5.0,
            classes: np.ndarray | None = None, max_wait_s: float = 30.0, count_from: float = 0.0) -> SimResult:
        """Offer requests at `times` (seconds) for the models `keys[targets[i]]`; run until all are answered.
        `classes[i]` (a RequestClass value; default all HARD) says what each one's deadline means; a
        request that is not hard gives up after `max_wait_s`. `controller_s` counts the controller's
        CPU from virtual time `count_from` on: what went before warmed it up (every model seen, its
        estimates and statistics made), as a daemon that has run a while is."""
        self._count_from = count_from
        for ex in self.executors.values():
            ex.counted_from = count_from
            ex.counted_until = float(times[-1]) if len(times) else count_from
        records, index = self._arrivals(times, targets, keys, classes, max_wait_s)
        end = (float(times[-1]) if len(times) else 0.0) + drain_s
        # As the daemon does once started: what the set-up made (and the simulator's own queue of
        # every arrival to come, which no daemon holds) leaves the collector's generations, so no
        # collection in the middle of the run scans it, charged to whichever controller call
        # happened to allocate then (a full one takes 100-200 ms at 1,000 models).
        gc.collect()
        gc.freeze()
        try:
            return self._loop(records, index, end)
        finally:
            gc.unfreeze()

    def _arrivals(self, times: np.ndarray, targets: np.ndarray, keys: Sequence[str], classes: np.ndarray | None,
                  max_wait_s: float) -> tuple[SimRecords, dict[int, int]]:
        """The records of the run and an event per arrival (each submits its request when it comes)."""
        specs = [self.specs[k] for k in keys]
        n = len(times)
        deadlines = np.array([times[i] + specs[targets[i]].slo_s for i in range(n)])
        records = SimRecords(np.asarray(times, dtype=float), deadlines)
        index: dict[int, int] = {}
        x = np.zeros((1, 1), np.float32)
        driver = self.driver

        def arrive(i: int) -> None:
            now = self.clock.now()
            spec = specs[targets[i]]
            klass = RequestClass(int(classes[i])) if classes is not None else RequestClass.HARD
            req = InferenceRequest(spec, (x,), 1, now, now + spec.slo_s, klass=klass,
                                   give_up_at=now + max_wait_s if klass != RequestClass.HARD else math.inf)
            index[req.id] = i
            t0 = time.perf_counter()
            try:
                driver.submit(req, now)
            except Exception as e:  # refused at admission
                index.pop(req.id, None)
                records.finish[i] = now
                records.status[i] = getattr(e, "status", 500)
            finally:
                if now >= self._count_from:
                    self._cpu += time.perf_counter() - t0

        for i in range(n):
            self.at(float(times[i]), functools.partial(arrive, i))
        return records, index

    def _loop(self, records: SimRecords, index: dict[int, int], end: float) -> SimResult:
        driver = self.driver
        wall0 = time.perf_counter()
        heard = False  # whether anything at this instant concerns the controller
        window = -math.inf  # events up to this time join the coming step (step_quantum)
        while self.events:
            t, _, fn, controller = heapq.heappop(self.events)
            if t > end:
                break
            self.clock.set(max(t, self.clock.now()))
            fn()
            if window == -math.inf and (controller or self._pending_results):
                window = t + self.step_quantum  # (the first event the controller hears of opens it)
            heard = heard or controller
            if self.events and self.events[0][0] <= max(t, window):
                continue  # coalesce everything at this instant (and within the quantum) into one step
            if not (heard or self._pending_results):
                continue  # an executor started an action: the real controller is not woken for that
            heard = False
            window = -math.inf
            results, self._pending_results = self._pending_results, []
            now = self.clock.now()
            t0 = time.perf_counter()
            decision = driver.step(now, results)
            wake = driver.next_wakeup(now)  # when to step next is the controller's work too
            if now >= self._count_from:
                self._cpu += time.perf_counter() - t0
            self._apply(decision, records, index)
            if wake is not None and wake != self._wake_at:
                self._wake_at = wake
                self.at(max(wake, now), _nothing)
        return SimResult(records, end, self._cpu, time.perf_counter() - wall0, self.scheduler,
                         {k: e.busy_s for k, e in self.executors.items()},
                         {k: e.counted_busy_s for k, e in self.executors.items()})


def _nothing() -> None:
    """A wake-up: the step after it is what matters."""


def random_bursts(devices: Sequence[str], seconds: float, share: float, mean_s: float, factor: float,
                  seed: int = 0) -> list[Slowdown]:
    """Each device slowed `factor`x in bursts of mean length `mean_s` for about `share` of the time
    (exponential gaps and lengths): load imbalance from background work, as ParM's shuffles make."""
    rng = np.random.default_rng(seed)
    out: list[Slowdown] = []
    gap = mean_s * (1 - share) / max(share, 1e-9)
    for d in devices:
        t = float(rng.exponential(gap))
        while t < seconds:
            length = float(rng.exponential(mean_s))
            out.append(Slowdown(d, factor=factor, start=t, end=t + length))
            t += length + float(rng.exponential(gap))
    return out


def clockwork_models(n: int, slo_s: float = 0.1, max_batch: int = 16,
                     profiles: dict[str, SimProfile] | None = None) -> list[tuple[ModelSpec, SimProfile]]:
    """n models cycling through Clockwork's four V100 profiles (or through `profiles`, e.g. from
    load_profiles)."""
    profiles = profiles or CLOCKWORK_V100
    names = list(profiles)
    out = []
    for i in range(n):
        base = names[i % len(names)]
        out.append((sim_spec(f"{base}-{i:04d}", max_batch, slo_s), profiles[base]))
    return out
