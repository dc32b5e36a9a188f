"""Executors: the hands. One per device; they run actions exactly as told and decide nothing.

Each executor has two lanes, each a thread with a queue ordered by `earliest`: one runs INFER
on the device's exec stream, the other LOAD and UNLOAD on its copy stream. A lane takes an
action only once its `earliest` has come, and refuses it without doing any work if its
`latest` has passed. Every result carries measured timings and goes back through `post`
(thread-safe; the daemon hands it to the event loop), or to the action's own `reply` (warm-ups
run on the serving executor this way, beside the controller's work). A failed action says why
(`Failure`): a model error, no memory, or a lost device; once the backend reports its device
lost, every later action fails at once.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping

import torch

from daemon.actions import LOAD_FLOOR_BPS, Action, ActionKind, Failure, Result, ResultStatus
from daemon.clock import Clock
from daemon.request import InferenceRequest
from daemon.runtime.backend import Backend, IOBuffers, NoMemory, Resident
from daemon.runtime.devapi import DeviceFault
from daemon.runtime.devices import Device
from daemon.runtime.faults import Faults
from daemon.runtime.program import Chain, Program

log = logging.getLogger("escapement.executor")

Post = Callable[[Result], None]


class _Wakeup:
    """A condition with one waiter, the lane's own thread, over C locks. `threading.Condition` is
    written in Python: its enter, exit, notify and wait cost ~2.5k instructions on the controller's
    loop and ~5k in all an INFER handed to a lane (bench/results/ingest-instructions-issue15.md).
    Every other thread only takes `lock` and calls `notify`; `wait` is called by the lane's
    thread alone."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._signal = threading.Lock()  # held while no notify is pending: the waiter blocks on it
        self._signal.acquire()
        self._waiting = False

    def notify(self) -> None:
        """Wake the waiter if it waits (called with `lock` held)."""
        if self._waiting:
            self._waiting = False
            self._signal.release()

    def wait(self, timeout: float | None = None) -> None:
        """Release `lock`, block until notified (or `timeout` s), take `lock` again."""
        self._waiting = True
        self.lock.release()
        try:
            if timeout is None:
                self._signal.acquire()
            else:
                self._signal.acquire(timeout=timeout)
        finally:
            self.lock.acquire()
            self._settle()

    def _settle(self) -> None:
        """After a wait, `lock` taken back: a notify that came after the wait had timed out (before
        it took the lock) left the signal released; it is taken back, or the next wait would return
        at once."""
        if self._waiting:  # timed out, never notified
            self._waiting = False
        else:  # notified (a no-op where the wait itself took the signal)
            self._signal.acquire(blocking=False)


class Lane:
    """A thread running actions in order of `earliest`, each only inside its window."""

    def __init__(self, name: str, run: Callable[[Action, float], Result], clock: Clock, post: Post,
                 setup: Callable[[], None], lost: Callable[[], str] = lambda: "") -> None:
        self.name = name
        self._run = run
        self._clock = clock
        self._post = post
        self._setup = setup
        self._lost = lost  # why the device is lost ("" while it is not)
        self._heap: list[tuple[float, int, Action, float]] = []
        self._cond = _Wakeup()
        self._stopping = False
        self._worker = threading.Thread(target=self._loop, name=name, daemon=True)  # (C has `__thread`)
        self.busy = False
        self._here = False  # an action runs on a caller's thread (run_here): the lane's thread waits
        self._free_since = 0.0  # when the lane finished its last action

    def start(self) -> None:
        self._worker.start()

    def submit(self, action: Action) -> None:
        received = self._clock.now()
        with self._cond.lock:
            if self._stopping:
                (action.reply or self._post)(_refused(action, ResultStatus.CANCELLED, received,
                                                      "executor is stopping"))
                return
            heapq.heappush(self._heap, (action.earliest, action.id, action, received))
            if self._heap[0][2] is action:  # a new head may start sooner than the one waited for
                self._cond.notify()

    def pending(self) -> int:
        return len(self._heap)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what has not started, let the running action finish, join the thread."""
        self.begin_stop()
        self.join(time.monotonic() + timeout)

    def begin_stop(self) -> None:
        """Cancel what has not started; the thread ends after the action it runs, if any."""
        with self._cond.lock:
            self._stopping = True
            cancelled = [entry for entry in self._heap]
            self._heap.clear()
            self._cond.notify()  # (its one waiter)
        now = self._clock.now()
        for _, _, action, received in cancelled:
            (action.reply or self._post)(_refused(action, ResultStatus.CANCELLED, received, "executor stopped", now))

    @property
    def alive(self) -> bool:
        return self._worker.is_alive()

    def join(self, deadline: float) -> bool:
        """Wait (until `deadline`, time.monotonic) for the thread to end; False if it is still in an
        action then (a hung device: it is left behind, a daemon thread)."""
        if self._worker.is_alive():
            self._worker.join(max(0.0, deadline - time.monotonic()))
        return not self._worker.is_alive()

    def _next(self) -> tuple[Action, float] | None:
        with self._cond.lock:
            while True:
                if self._stopping:
                    return None
                if not self._heap or self._here:
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
            result = self._execute(action, received)
            (action.reply or self._post)(result)

    def run_here(self, action: Action) -> Result | None:
        """Run `action` on the calling thread now and return its result (not posted), if the lane is
        idle with nothing queued; else None and nothing done (the caller submits it instead). The
        lane's thread takes nothing meanwhile: one action at a time per lane, wherever it runs."""
        received = self._clock.now()
        if not self._hold():
            return None
        try:
            return self._execute(action, received)
        finally:
            self._let_go()

    def touch_here(self, run: Callable[[], None]) -> bool:
        """Call `run` on the calling thread if the lane is idle with nothing queued, holding the lane
        as `run_here` does (work outside the schedule: keeping a model warm); whether it ran."""
        if not self._hold():
            return False
        try:
            run()
        finally:
            self._let_go()
        return True

    def _hold(self) -> bool:
        """Take the idle lane for the calling thread (its own thread waits meanwhile); False if it
        is busy, has work queued or is stopping."""
        with self._cond.lock:
            if self._stopping or self.busy or self._here or self._heap:
                return False
            self._here = True
            self.busy = True
        return True

    def _let_go(self) -> None:
        with self._cond.lock:
            self.busy = False
            self._here = False
            if self._heap or self._stopping:  # queued meanwhile (from another thread): the lane's turn
                self._cond.notify()

    def _execute(self, action: Action, received: float) -> Result:
        """Run one taken action inside its window (the lane is marked busy); its result."""
        now = self._clock.now()
        ready = max(action.earliest, received, self._free_since)
        lost = self._lost()
        if lost:
            result = Result(action, ResultStatus.FAILED, received, now, now, error=lost, failure=Failure.DEVICE)
        elif now > action.latest:
            result = _refused(action, ResultStatus.TOO_LATE, received,
                              f"could not start by latest (late by {(now - action.latest) * 1e3:.3f} ms)",
                              now)
        elif now < action.earliest:
            result = _refused(action, ResultStatus.TOO_EARLY, received, "started before earliest", now)
        else:
            try:
                result = self._run(action, received)
            except Exception as e:  # a failed action is a result, never a dead thread
                failure = _failure(e)
                if failure == Failure.ERROR:
                    log.exception("%s: %r failed", self.name, action)
                end = self._clock.now()
                result = Result(action, ResultStatus.FAILED, received, now, end,
                                error=f"{type(e).__name__}: {e}", failure=failure)
        result.ready_at = ready
        self.busy = False
        self._free_since = self._clock.now()
        return result


def _one_row(io: IOBuffers) -> int:
    """A fill that copies nothing in: one row of whatever the buffers hold (a keep-warm run)."""
    return 1


def _failure(e: BaseException) -> Failure:
    if isinstance(e, DeviceFault):
        return Failure.DEVICE
    if isinstance(e, NoMemory | torch.OutOfMemoryError):
        return Failure.NO_MEMORY
    return Failure.ERROR


def _refused(action: Action, status: ResultStatus, received: float, why: str,
             now: float | None = None) -> Result:
    t = received if now is None else now
    return Result(action, status, received, t, t, error=why)


class Executor:
    def __init__(self, device: Device, backend: Backend, clock: Clock, post: Post,
                 programs: Mapping[str, Program], hang_timeout_s: float = 2.0) -> None:
        self.device = device
        self.backend = backend
        self.clock = clock
        self.programs = programs
        self.hang_timeout_s = hang_timeout_s
        self.resident: dict[str, Resident] = {}
        self.faults = Faults()
        self.infer_lane = Lane(f"{device.name}/infer", self._infer, clock, post,
                               lambda: backend.thread_setup("infer"), lambda: backend.failed)
        self.load_lane = Lane(f"{device.name}/load", self._load_or_unload, clock, post,
                              lambda: backend.thread_setup("load"), lambda: backend.failed)
        self._here_threads: set[int] = set()  # threads set up to run actions here (run_here)

    @property
    def used_bytes(self) -> int:
        """Device bytes charged now (resident models, and the workspace reserve on CUDA)."""
        return self.backend.charged

    @property
    def failed(self) -> str:
        return self.backend.failed

    def footprint(self, program: Program) -> int:
        return self.backend.footprint(program)

    def start(self) -> None:
        self.infer_lane.start()
        self.load_lane.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.begin_stop()
        self.finish_stop(time.monotonic() + timeout)

    def begin_stop(self) -> None:
        """Refuse new actions and cancel queued ones; running ones finish (see finish_stop)."""
        self.faults.release()  # a hung lane must not keep the daemon from stopping
        self.load_lane.begin_stop()
        self.infer_lane.begin_stop()

    def finish_stop(self, deadline: float) -> bool:
        """Wait for both lanes until `deadline` (time.monotonic), then release the device. A lane
        still inside an action by then (a hung device) is left behind, and the device is not
        closed under it: freeing memory a kernel still uses is worse than a leak at exit."""
        if not (self.load_lane.join(deadline) & self.infer_lane.join(deadline)):
            log.warning("%s: a thread is still inside an action at shutdown (a hung device); left behind, "
                        "the device not closed", self.device.name)
            return False
        try:
            self.backend.close()
        except Exception:
            log.exception("%s: closing the device failed", self.device.name)
        return True

    def submit(self, action: Action) -> None:
        if action.device != self.device.name:
            raise ValueError(f"{action!r} sent to {self.device.name}")
        (self.infer_lane if action.kind == ActionKind.INFER else self.load_lane).submit(action)

    def run_here(self, action: Action) -> Result | None:
        """The controller's latency path (daemon/controller/latency.py): run an INFER on the calling
        thread, skipping the hand-offs to the lane's thread and back; its result, or None when it
        cannot run here (then nothing was done: submit it). Only on a CPU device (a CUDA device's
        streams belong to its lane's thread), and never under an injected fault (a hang or slowdown
        must not hold the caller)."""
        if action.kind != ActionKind.INFER or not self._runs_here():
            return None
        return self.infer_lane.run_here(action)

    def _runs_here(self) -> bool:
        """Whether work may run on the calling thread (a CPU device, no fault injected); sets the
        thread up for it once."""
        if self.device.kind != "cpu" or self.faults.spec is not None:
            return False
        if threading.get_ident() not in self._here_threads:
            # intra-op threads are per calling thread under OpenMP (the lane's own set-up does the
            # same); no core pinning: the caller keeps its cores
            self.backend.thread_setup("here")
            self._here_threads.add(threading.get_ident())
        return True

    def keep_warm(self, holder: str) -> bool:
        """Run `holder`'s model once on one row of its scratch inputs on the calling thread, its
        output dropped, if the INFER lane is idle (the controller's keep-warm, ControllerService):
        its code and weights stay in the caches for the next request. Only where `run_here` runs
        (a CPU device, no fault injected); whether it ran."""
        res = self.resident.get(holder)
        if res is None or not res.io or not self._runs_here():
            return False
        io = res.io[min(res.io)]

        def run() -> None:
            self.backend.infer(res, io, _one_row, math.inf)  # (a plan of stages runs through as one chain)
        return self.infer_lane.touch_here(run)

    # ---------------------------------------------------------------- lanes

    def _infer(self, action: Action, received: float) -> Result:
        begin = self.clock.now()
        res = self.resident.get(action.holder)
        if res is None:
            return Result(action, ResultStatus.FAILED, received, begin, begin, failure=Failure.ERROR,
                          error=f"weights of {action.model.key} are not on {self.device.name}")
        io = res.io.get(action.batch_size)
        if io is None or action.samples > action.batch_size:
            return Result(action, ResultStatus.FAILED, received, begin, begin, failure=Failure.ERROR,
                          error=f"invalid batch: {action.samples} samples at batch size {action.batch_size}")
        faults = self.faults
        if faults.active:
            faults.before()
        staged = getattr(self.backend, "infer_staged", None)
        if action.group or (staged is not None and isinstance(res.runner, Chain) and action.coded is None):
            return self._infer_staged(action, received, begin, res, io)
        coded, encoder, requests = action.coded, action.encoder, action.requests

        def fill(io: IOBuffers) -> int:
            return io.fill_coded(coded, encoder) if coded is not None else io.fill(requests)
        deadline = begin + self.hang_timeout_s + 10 * action.expected_duration
        outputs, duration = self.backend.infer(res, io, fill, deadline)
        extra = faults.extra(self.clock.now() - begin, begin) if faults.active else 0.0
        if extra > 0:
            time.sleep(extra)  # an injected slowdown holds the device, as a slow device would
        return Result(action, ResultStatus.OK, received, begin, self.clock.now(), duration, outputs)

    def _infer_staged(self, action: Action, received: float, begin: float, lead: Resident, io: IOBuffers) -> Result:
        """A plan of stages on a backend that runs them one by one (CPU): alone, or a cross-model
        batch whose members share the first stage (it runs once; the prefix cache may serve it)."""
        staged = getattr(self.backend, "infer_staged", None)
        if staged is None:
            return Result(action, ResultStatus.FAILED, received, begin, begin, failure=Failure.ERROR,
                          error=f"{self.device.name} does not run cross-model batches")
        members: list[tuple[Resident, list[InferenceRequest]]] = []
        at = 0
        for spec, count in action.group or ((action.model, len(action.requests)),):
            res = lead if spec.key == action.model.key else self.resident.get(spec.key)
            if res is None or not isinstance(res.runner, Chain) or \
                    res.program.prefix != lead.program.prefix:
                return Result(action, ResultStatus.FAILED, received, begin, begin, failure=Failure.ERROR,
                              error=f"{spec.key} is not on {self.device.name} with the batch's shared stage")
            members.append((res, action.requests[at : at + count]))
            at += count
        parts, duration, stage_runs = staged(members, io)
        extra = self.faults.extra(self.clock.now() - begin, begin)
        if extra > 0:
            time.sleep(extra)
        return Result(action, ResultStatus.OK, received, begin, self.clock.now(), duration, parts[0],
                      parts=tuple(parts) if action.group else None, stage_runs=stage_runs)

    def _load_or_unload(self, action: Action, received: float) -> Result:
        return self._load(action, received) if action.kind == ActionKind.LOAD else self._unload(action, received)

    def _load(self, action: Action, received: float) -> Result:
        begin = self.clock.now()
        key = action.holder
        program = action.program or self.programs.get(action.model.key)
        if program is None:
            return Result(action, ResultStatus.FAILED, received, begin, begin, failure=Failure.ERROR,
                          error=f"unknown model {key}")
        if key in self.resident:
            return Result(action, ResultStatus.FAILED, received, begin, begin, failure=Failure.ERROR,
                          error=f"{key} is already on {self.device.name}")
        self.faults.before_load()
        deadline = begin + self.hang_timeout_s + program.weight_bytes / LOAD_FLOOR_BPS + 10 * action.expected_duration
        res, duration = self.backend.load(key, program, deadline)
        self.resident[key] = res
        return Result(action, ResultStatus.OK, received, begin, self.clock.now(), duration, weight_bytes=res.charged,
                      set_up=res.set_up)

    def _unload(self, action: Action, received: float) -> Result:
        begin = self.clock.now()
        res = self.resident.pop(action.holder, None)
        if res is None:
            return Result(action, ResultStatus.FAILED, received, begin, begin, failure=Failure.ERROR,
                          error=f"{action.holder} is not on {self.device.name}")
        self.backend.unload(res)
        return Result(action, ResultStatus.OK, received, begin, self.clock.now(), weight_bytes=res.charged)


def make_backend(device: Device, cpu_threads: int, core: int | None = None, *, host: object | None = None,
                 graphs: bool = True, hang_timeout_s: float = 2.0, emucuda: object | None = None,
                 prefix_cache: tuple[int, int] = (0, 0), share_weights: bool = True) -> Backend:
    """The backend of a device; CUDA and stand-in devices share `host` (the process's pinned memory).
    `prefix_cache`: (entries, bytes) of a device's cache of shared stages' outputs (on CUDA, at most
    a quarter of its workspace);
    `share_weights` off: a device keeps every model's weights apart (on a CPU, blocks shared by
    content; on CUDA, plans' shared leading stages)."""
    if device.kind in ("cuda", "emucuda"):
        from daemon.runtime.cuda import CudaBackend
        from daemon.runtime.hostmem import HostPins

        api: object
        if device.kind == "cuda":
            from daemon.runtime.torchcuda import TorchCuda

            api = TorchCuda.get(device.index)
        else:
            from daemon.runtime import emucuda as emu

            api = emu.device(device.index, emu.settings_from(emucuda))
        from daemon.runtime.prefixcache import PrefixCache

        pins = host if isinstance(host, HostPins) else HostPins(default_pinned_budget())
        return CudaBackend(device, api, pins, graphs=graphs, hang_timeout_s=hang_timeout_s,  # type: ignore[arg-type]
                           prefix_cache=PrefixCache(*prefix_cache), shares=share_weights)
    if device.kind == "cpu":
        from daemon.runtime.backend import CpuBackend
        from daemon.runtime.prefixcache import PrefixCache

        return CpuBackend(device, cpu_threads, core, PrefixCache(*prefix_cache), shares=share_weights)
    raise ValueError(f"no backend for {device.kind} devices in a real executor")


def default_pinned_budget() -> int:
    """Half of the host's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
