"""A scheduler, a fake clock and hand-made results: what every controller test drives."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from daemon.actions import Action, ActionKind, Failure, Result, ResultStatus
from daemon.clock import FakeClock
from daemon.config import ControllerSettings
from daemon.controller.driver import Driver
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.policy import Policy
from daemon.controller.scheduler import Decision, Scheduler
from daemon.datatypes import BY_NAME
from daemon.model import ModelSpec, TensorSpec
from daemon.request import InferenceRequest, RequestClass
from daemon.runtime.devices import Device

MS = 1e-3


def make_spec(name: str = "m", max_batch: int = 8, slo: float = 0.1) -> ModelSpec:
    fp32 = BY_NAME["FP32"]
    return ModelSpec(name, 1, Path(f"/nowhere/{name}"), "pt2", (TensorSpec("x", fp32, (-1, 2)),),
                     (TensorSpec("y", fp32, (-1, 1)),), max_batch, slo)


class Harness:
    """A scheduler with its policy, a fake clock, and the decisions it made, as a test reads them."""

    def __init__(self, devices: int = 1, budget: int = 1000, delay: float = 0.0, policy: Policy | None = None,
                 **limits: int) -> None:
        self.clock = FakeClock()
        settings = ControllerSettings(max_queue_delay_ms=delay / MS, **limits)
        self.sched = Scheduler([Device(f"cpu:{i}", "cpu", i, budget) for i in range(devices)],
                               policy or DynamicBatchingPolicy(delay), settings)
        self.driver = Driver(self.sched)
        self.actions: list[Action] = []
        self.finished: list[InferenceRequest] = []

    @property
    def now(self) -> float:
        return self.clock.now()

    def add(self, spec: ModelSpec, nbytes: int = 100, b1: float = 1 * MS, bmax: float = 8 * MS) -> ModelSpec:
        self.sched.add_model(spec, nbytes, {1: b1, spec.max_batch_size: bmax}, "cpu")
        return spec

    def request(self, spec: ModelSpec, samples: int = 1, timeout: float | None = None,
                rank: int = 0, klass: RequestClass = RequestClass.HARD, max_wait: float = 30.0) -> InferenceRequest:
        x = np.full((samples, 2), float(len(self.finished) + len(self.actions)), dtype=np.float32)
        deadline = self.now + (timeout if timeout is not None else spec.slo_s)
        give_up = self.now + max_wait if klass != RequestClass.HARD else float("inf")
        req = InferenceRequest(spec, (x,), samples, self.now, deadline, rank=rank, klass=klass, give_up_at=give_up)
        self.sched.submit(req, self.now)
        return req

    def collect(self, d: Decision) -> list[Action]:
        """Keep what a decision holds (its actions and finished requests); its actions."""
        self.actions.extend(d.actions)
        self.finished.extend(d.finished)
        return d.actions

    def step(self) -> list[Action]:
        return self.collect(self.driver.step(self.now))

    def result(self, action: Action, status: ResultStatus = ResultStatus.OK, duration: float | None = None,
               error: str = "", outputs: tuple[np.ndarray, ...] | None = None,
               failure: Failure = Failure.NONE) -> list[Action]:
        """Complete `action` after `duration` (default: as long as the scheduler expected)."""
        if duration is None:
            duration = action.expected_duration if action.kind == ActionKind.INFER else 1 * MS
        begin = self.now
        self.clock.advance(duration)
        if outputs is None and action.kind == ActionKind.INFER and status == ResultStatus.OK:
            outputs = (np.arange(action.samples, dtype=np.float32).reshape(-1, 1),)
        if status == ResultStatus.FAILED and failure == Failure.NONE:
            failure = Failure.ERROR
        r = Result(action, status, begin, begin, self.now, duration, outputs, error, failure=failure)
        self.collect(self.sched.on_result(r, self.now))
        return self.step()

    def preload(self, spec: ModelSpec, replicas: int) -> None:
        """Load `spec` onto `replicas` devices and complete the loads."""
        self.sched.preload(spec.key, replicas, self.now)
        for load in self.step():  # a step hands out what the preload decided too
            self.result(load)

    def use(self, spec: ModelSpec) -> InferenceRequest:
        """Serve one request of `spec` to the end, loading it if needed, completing actions in order."""
        req = self.request(spec, timeout=1.0)
        self.run_until(req)
        assert req.ok
        return req

    def run_until(self, req: InferenceRequest) -> None:
        """Step, complete actions in order and follow wake-ups until `req` is finished."""
        todo = self.step()
        while not req.status.finished:
            if todo:
                todo = todo[1:] + self.result(todo[0])
            else:
                wake = self.sched.next_wakeup(self.now)
                assert wake is not None, "stuck: nothing to run and nothing to wait for"
                self.clock.set(max(wake, self.now))
                todo = self.step()


def kinds(actions: list[Action]) -> list[str]:
    return [a.kind.name for a in actions]
