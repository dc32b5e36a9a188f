"""Executors: the hands. One per device; they run actions exactly as told and decide nothing.

Each executor has two lanes, each a thread with a queue ordered by `earliest`: one runs INFER
on the device's exec stream, the other LOAD and UNLOAD on its copy stream. A lane takes an
action only once its `earliest` has come, and refuses it without doing any work if its
`latest` has passed. Every result carries measured timings and goes back through `post`
(thread-safe; the daemon hands it to the event loop).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.clock import Clock
from daemon.runtime.backend import Backend, IOBuffers
from daemon.runtime.devices import Device
from daemon.runtime.faults import Faults
from daemon.runtime.program import Program, Runner

log = logging.getLogger("escapement.executor")

Post = Callable[[Result], None]


class Lane:
    """A thread running actions in order of `earliest`, each only inside its window."""

    def __init__(self, name: str, run: Callable[[Action, float], Result], clock: Clock, post: Post,
                 setup: Callable[[], None]) -> None:
        self.name = name
        self._run = run
        self._clock = clock
        self._post = post
        self._setup = setup
        self._heap: list[tuple[float, int, Action, float]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.busy = False
        self._free_since = 0.0  # when the lane finished its last action

    def start(self) -> None:
        self._thread.start()

    def submit(self, action: Action) -> None:
        received = self._clock.now()
        with self._cond:
            if self._stopping:
                self._post(_refused(action, ResultStatus.CANCELLED, received, "executor is stopping"))
                return
            heapq.heappush(self._heap, (action.earliest, action.id, action, received))
            if self._heap[0][2] is action:  # a new head may start sooner than the one waited for
                self._cond.notify()

    def pending(self) -> int:
        return len(self._heap)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what has not started, let the running action finish, join the thread."""
        with self._cond:
            self._stopping = True
            cancelled = [entry for entry in self._heap]
            self._heap.clear()
            self._cond.notify_all()
        now = self._clock.now()
        for _, _, action, received in cancelled:
            self._post(_refused(action, ResultStatus.CANCELLED, received, "executor stopped", now))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _next(self) -> tuple[Action, float] | None:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                if not self._heap:
                    self._cond.wait()
                    continue
                earliest, _, action, received = self._heap[0]
                wait = earliest - self._clock.now()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                self.busy = True
                return action, received

    def _loop(self) -> None:
        try:
            self._setup()
        except Exception:
            log.exception("%s: thread set-up failed", self.name)
        while (item := self._next()) is not None:
            action, received = item
            now = self._clock.now()
            ready = max(action.earliest, received, self._free_since)
            if now > action.latest:
                result = _refused(action, ResultStatus.TOO_LATE, received,
                                  f"could not start by latest (late by {(now - action.latest) * 1e3:.3f} ms)",
                                  now)
            elif now < action.earliest:
                result = _refused(action, ResultStatus.TOO_EARLY, received, "started before earliest", now)
            else:
                try:
                    result = self._run(action, received)
                except Exception as e:  # a failed action is a result, never a dead thread
                    log.exception("%s: %r failed", self.name, action)
                    end = self._clock.now()
                    result = Result(action, ResultStatus.FAILED, received, now, end,
                                    error=f"{type(e).__name__}: {e}")
            result.ready_at = ready
            self.busy = False
            self._free_since = self._clock.now()
            self._post(result)


def _refused(action: Action, status: ResultStatus, received: float, why: str,
             now: float | None = None) -> Result:
    t = received if now is None else now
    return Result(action, status, received, t, t, error=why)


@dataclass(slots=True, eq=False)
class Resident:
    """A model's weights on a device, with its bound runner and IO buffers per batch size."""

    program: Program
    block: torch.Tensor
    runner: Runner
    io: dict[int, IOBuffers] = field(default_factory=dict)


class Executor:
    def __init__(self, device: Device, backend: Backend, clock: Clock, post: Post,
                 programs: Mapping[str, Program]) -> None:
        self.device = device
        self.backend = backend
        self.clock = clock
        self.programs = programs
        self.resident: dict[str, Resident] = {}
        self.used_bytes = 0
        self.faults = Faults()
        self._lock = threading.Lock()
        self.infer_lane = Lane(f"{device.name}/infer", self._infer, clock, post,
                               lambda: backend.thread_setup("infer"))
        self.load_lane = Lane(f"{device.name}/load", self._load_or_unload, clock, post,
                              lambda: backend.thread_setup("load"))

    def start(self) -> None:
        self.infer_lane.start()
        self.load_lane.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.faults.release()  # a hung lane must not keep the daemon from stopping
        self.load_lane.stop(timeout)
        self.infer_lane.stop(timeout)

    def submit(self, action: Action) -> None:
        if action.device != self.device.name:
            raise ValueError(f"{action!r} sent to {self.device.name}")
        (self.infer_lane if action.kind == ActionKind.INFER else self.load_lane).submit(action)

    # ---------------------------------------------------------------- lanes

    def _infer(self, action: Action, received: float) -> Result:
        begin = self.clock.now()
        res = self.resident.get(action.model.key)
        if res is None:
            return Result(action, ResultStatus.FAILED, received, begin, begin,
                          error=f"weights of {action.model.key} are not on {self.device.name}")
        io = res.io.get(action.batch_size)
        if io is None or action.samples > action.batch_size:
            return Result(action, ResultStatus.FAILED, received, begin, begin,
                          error=f"invalid batch: {action.samples} samples at batch size {action.batch_size}")
        self.faults.before()
        rows = io.fill_coded(action.coded, action.encoder) if action.coded is not None else io.fill(action.requests)
        outputs, duration = self.backend.infer(res.runner, io, rows)
        extra = self.faults.extra(self.clock.now() - begin, begin)
        if extra > 0:
            time.sleep(extra)  # an injected slowdown holds the device, as a slow device would
        return Result(action, ResultStatus.OK, received, begin, self.clock.now(), duration, outputs)

    def _load_or_unload(self, action: Action, received: float) -> Result:
        return self._load(action, received) if action.kind == ActionKind.LOAD else self._unload(action, received)

    def _load(self, action: Action, received: float) -> Result:
        begin = self.clock.now()
        key = action.model.key
        program = self.programs.get(key)
        if program is None:
            return Result(action, ResultStatus.FAILED, received, begin, begin, error=f"unknown model {key}")
        if key in self.resident:
            return Result(action, ResultStatus.FAILED, received, begin, begin,
                          error=f"{key} is already on {self.device.name}")
        nbytes = program.weight_bytes
        with self._lock:
            # kept blocks and live weights together stay within the budget
            self.backend.trim(self.device.weight_budget - self.used_bytes - nbytes)
            if self.used_bytes + nbytes > self.device.weight_budget:
                return Result(action, ResultStatus.FAILED, received, begin, begin,
                              error=f"insufficient weight memory on {self.device.name}: {nbytes} bytes "
                                    f"needed, {self.device.weight_budget - self.used_bytes} free")
            self.used_bytes += nbytes
        try:
            block = self.backend.alloc(program.layout.nbytes)
            duration = self.backend.copy_weights(program.host_block, block)
            runner = program.bind(program.layout.views(block), native=self.device.kind == "cpu",
                                  owner=self.device.name)
            io = {b: self.backend.make_io(program.spec, b) for b in program.spec.batch_sizes}
        except BaseException:
            with self._lock:
                self.used_bytes -= nbytes
            raise
        self.resident[key] = Resident(program, block, runner, io)
        return Result(action, ResultStatus.OK, received, begin, self.clock.now(), duration, weight_bytes=nbytes)

    def _unload(self, action: Action, received: float) -> Result:
        begin = self.clock.now()
        res = self.resident.pop(action.model.key, None)
        if res is None:
            return Result(action, ResultStatus.FAILED, received, begin, begin,
                          error=f"{action.model.key} is not on {self.device.name}")
        res.program.release(self.device.name)
        self.backend.free(res.block)
        nbytes = res.program.weight_bytes
        with self._lock:
            self.used_bytes -= nbytes
        del res
        return Result(action, ResultStatus.OK, received, begin, self.clock.now(), weight_bytes=nbytes)


def make_backend(device: Device, cpu_threads: int, core: int | None = None) -> Backend:
    if device.kind == "cuda":
        from daemon.runtime.cuda import CudaBackend

        return CudaBackend(device)
    if device.kind == "cpu":
        from daemon.runtime.backend import CpuBackend

        return CpuBackend(device, cpu_threads, core)
    raise ValueError(f"no backend for {device.kind} devices in a real executor")
