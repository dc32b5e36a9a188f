"""The Daemon: owns the event loop's work, wires the parts, and runs the lifecycle.

Start-up: devices -> executors -> controller -> model programs (read off the loop, in a
thread) -> listeners. Shutdown, in a fixed order: stop accepting connections and requests ->
drain accepted requests (bounded by `server.drain_timeout_s`) -> stop executors -> close
connections. SIGTERM and SIGINT start a shutdown; a second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from daemon.api.http import HttpFrontend
from daemon.api.uds import SocketFrontend
from daemon.clock import Clock, MonotonicClock
from daemon.coding import codes
from daemon.config import Settings, parse_hostport
from daemon.controller.core import Scheduler
from daemon.controller.policy import make_policy
from daemon.controller.service import ControllerService
from daemon.controller.telemetry import Telemetry, TraceWriter
from daemon.errors import BadRequest, ConfigError, Overloaded
from daemon.overload import LagTracker, LoopMonitor
from daemon.registry import ModelRegistry, ModelState
from daemon.repository import ModelSpec, parity_key, parity_model, scan
from daemon.request import InferenceRequest
from daemon.runtime.devices import Device, plan_cores, resolve_devices
from daemon.runtime.executor import Executor, make_backend
from daemon.runtime.profiler import profile_program, read_profile, seeds, write_profile
from daemon.runtime.program import Program, ProgramError, load_program

log = logging.getLogger("escapement.server")

MAX_TIMEOUT_US = 3_600_000_000


class State(enum.IntEnum):
    STARTING = 0
    RUNNING = 1
    DRAINING = 2
    STOPPING = 3
    STOPPED = 4


class Daemon:
    def __init__(self, settings: Settings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or MonotonicClock()
        self.state = State.STARTING
        self.registry = ModelRegistry()
        self.programs: dict[str, Program] = {}
        self.devices: list[Device] = []
        self.executors: dict[str, Executor] = {}
        self.http: HttpFrontend | None = None
        self.socket: SocketFrontend | None = None
        self.http_port: int | None = None
        self._controller: ControllerService | None = None
        self._trace: TraceWriter | None = None
        self._cores: dict[str, int] = {}
        self.overload = LagTracker(settings.server.shed_lag_ms / 1000.0)
        self._monitor: LoopMonitor | None = None
        self._stop = asyncio.Event()
        self._signals = 0

    @property
    def controller(self) -> ControllerService:
        assert self._controller is not None, "the daemon is not started"
        return self._controller

    # ---------------------------------------------------------------- requests (frontends)

    def is_ready(self) -> bool:
        return self.state == State.RUNNING

    def statistics(self) -> dict[str, Any]:
        """The controller's statistics plus the event loop's lag and the requests shed for it."""
        o = self.overload
        return {**self.controller.scheduler.statistics(),
                "loop": {"lag_ms": o.lag_s * 1e3, "max_lag_ms": o.max_s * 1e3, "shed": o.shed}}

    def check_overload(self) -> None:
        """Refuse new inference at once while the loop is too far behind (see overload.py)."""
        if self.overload.overloaded:
            self.overload.shed += 1
            raise Overloaded(f"the daemon is overloaded: its event loop is {self.overload.lag_s * 1e3:.0f} ms "
                             "behind; retry later", retry_after_s=1.0)

    def new_request(self, spec: ModelSpec, arrays: tuple[np.ndarray, ...], samples: int, timeout_us: Any,
                    priority: Any, client_id: str) -> InferenceRequest:
        now = self.clock.now()
        if timeout_us is None:
            deadline = now + spec.slo_s
        else:
            if isinstance(timeout_us, bool) or not isinstance(timeout_us, int) or not 0 <= timeout_us <= MAX_TIMEOUT_US:
                raise BadRequest(f"timeout must be an integer number of microseconds in 0..{MAX_TIMEOUT_US}, "
                                 f"got {timeout_us!r}")
            deadline = now + timeout_us * 1e-6
        if priority is None:
            priority = 0
        elif isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
            raise BadRequest(f"priority must be a non-negative integer, got {priority!r}")
        rank = priority or self.settings.controller.default_priority
        return InferenceRequest(spec, arrays, samples, now, deadline, priority, rank, client_id)

    async def run_request(self, req: InferenceRequest) -> InferenceRequest:
        """Submit and wait for the answer; raises the request's error. Cancelling cancels the request."""
        fut: asyncio.Future[InferenceRequest] = asyncio.get_running_loop().create_future()

        def done(r: InferenceRequest) -> None:
            if not fut.done():
                fut.set_result(r)

        req.on_finish = done
        self.controller.submit(req)
        try:
            await fut
        except asyncio.CancelledError:
            self.controller.cancel(req)
            raise
        if req.error is not None:
            raise req.error
        return req

    # ---------------------------------------------------------------- start-up

    async def start(self) -> None:
        s = self.settings
        sys.setswitchinterval(s.runtime.gil_switch_interval_us * 1e-6)
        loop = asyncio.get_running_loop()
        self.devices = resolve_devices(s.runtime.devices, s.runtime.weight_budget)
        self._trace = TraceWriter(s.controller.trace_path) if s.controller.trace_path else None
        scheduler = Scheduler(self.devices, make_policy(s.controller), s.controller,
                              telemetry=Telemetry(self._trace))
        self._controller = ControllerService(scheduler, self.executors, self.clock, loop)
        plan, rest = plan_cores(self.devices, os.sched_getaffinity(0), s.runtime.pin_threads)
        self._cores = plan
        if rest is not None:
            # The loop thread (and threads it starts later, such as the load lanes) keep off the
            # cores given to devices; each INFER thread pins itself to its own core.
            os.sched_setaffinity(0, rest)
            log.info("cores: %s; event loop and other threads on %s",
                     ", ".join(f"{n} on {c}" for n, c in plan.items()), sorted(rest))
        for d in self.devices:
            ex = Executor(d, make_backend(d, s.runtime.cpu_threads, plan.get(d.name)), self.clock,
                          self._controller.post_result, self.programs)
            ex.start()
            self.executors[d.name] = ex
        for f in s.faults:
            if f.device not in self.executors:
                raise ConfigError(f"faults: device {f.device} is not one of {sorted(self.executors)}")
            self.executors[f.device].faults.set(f.spec())
            log.warning("fault injected on %s: %s", f.device, f.spec())
        log.info("devices: %s", ", ".join(f"{d.name} ({d.weight_budget / 2**20:.0f} MiB for weights)"
                                          for d in self.devices))
        await self.load_repository()
        # torch and the models leave ~10^5 long-lived objects; a full cyclic GC pass over them
        # stops the loop for ~100 ms. Freezing them keeps later passes to what serving allocates.
        gc.collect()
        gc.freeze()
        if s.server.http:
            host, port = parse_hostport(s.server.http, "server.http")
            self.http = HttpFrontend(self)
            self.http_port = await self.http.start(host, port)
            log.info("HTTP listening on %s:%d", host, self.http_port)
        if s.server.socket:
            self.socket = SocketFrontend(self)
            await self.socket.start(s.server.socket)
            log.info("socket listening on %s", s.server.socket)
        self._monitor = LoopMonitor(self.overload, clock=time.monotonic)
        self._monitor.start()
        self.state = State.RUNNING
        log.info("ready: %d model version(s) serving", sum(1 for m in self.registry.index() if m["state"] == "READY"))

    async def load_repository(self) -> None:
        """Scan the repository and read every model into host memory (in a worker thread)."""
        s = self.settings
        root = Path(s.models.repository)
        if not root.is_dir():  # noqa: ASYNC240 - start-up, before any request
            raise ConfigError(f"models.repository: {root} is not a directory (build the demo models with "
                              f"`escapement demo --out {root}`)")
        result = await asyncio.to_thread(scan, root, s.models.default_slo_ms)
        for name, why in result.broken.items():
            self.registry.set_broken(name, why)
        pin = any(d.kind == "cuda" for d in self.devices)
        largest = max(d.weight_budget for d in self.devices)
        for spec in result.models:
            self.registry.add(spec, ModelState.LOADING)
        for spec in result.models:
            try:
                program = await asyncio.to_thread(load_program, spec, pin)
            except ProgramError as e:
                self.registry.set_state(spec, ModelState.UNAVAILABLE, str(e))
                log.error("model %s is not served: %s", spec.key, e)
                continue
            if program.weight_bytes > largest:
                why = (f"its weights ({program.weight_bytes} bytes) exceed every device's weight budget "
                       f"({largest} bytes; runtime.weight_budget)")
                self.registry.set_state(spec, ModelState.UNAVAILABLE, why)
                log.error("model %s is not served: %s", spec.key, why)
                continue
            self.programs[spec.key] = program
            self.controller.scheduler.add_model(spec, program.weight_bytes)
            try:
                await self._profile(spec, program)
            except Exception as e:  # a model that cannot even be warmed up is not served
                self.registry.set_state(spec, ModelState.UNAVAILABLE, f"warm-up failed: {e}")
                self._forget(spec)
                log.error("model %s is not served: warm-up failed: %s", spec.key, e)
                continue
            if spec.parity is not None:
                await self._load_parity(spec, pin)
            if spec.preload_replicas:
                placed = self.controller.preload(spec.key, spec.preload_replicas)
                pkey = parity_key(spec)
                if pkey in self.controller.scheduler.models:
                    self.controller.preload(pkey, 1, avoid=set(placed))
            self.registry.set_state(spec, ModelState.READY)
            log.info("model %s ready (%s, %.1f MiB of weights)", spec.key, spec.format,
                     program.weight_bytes / 2**20)

    async def _load_parity(self, spec: ModelSpec, pin: bool) -> None:
        """Load a model's parity model; a problem with it disables parity, not the model."""
        assert spec.parity is not None
        pspec = parity_model(spec)
        try:
            if len(spec.inputs) != 1 or len(spec.outputs) != 1:
                raise ValueError("parity needs a model with one input and one output")
            codes.check(spec.parity.encoder, spec.parity.k, spec.inputs[0].sample_shape)
            program = await asyncio.to_thread(load_program, pspec, pin)
            self.programs[pspec.key] = program
            self.controller.scheduler.add_model(pspec, program.weight_bytes)
            await self._profile(pspec, program)
        except (ValueError, ProgramError, RuntimeError) as e:
            self.programs.pop(pspec.key, None)
            self.controller.scheduler.models.pop(pspec.key, None)
            log.warning("model %s is served without parity: %s", spec.key, e)
            return
        log.info("model %s: parity k=%d (%s) with %s", spec.key, spec.parity.k, spec.parity.encoder, pspec.path.name)

    async def _profile(self, spec: ModelSpec, program: Program) -> None:
        """Seed estimates from the stored profile, measuring (and storing) what is missing."""
        stored = await asyncio.to_thread(read_profile, spec)
        sched = self.controller.scheduler
        for kind in sorted({d.kind for d in self.devices}):
            entry = stored.get(kind)
            if entry is None:
                dev = next(d for d in self.devices if d.kind == kind)
                backend = make_backend(dev, self.settings.runtime.cpu_threads, self._cores.get(dev.name))
                entry = await asyncio.to_thread(profile_program, program, dev, backend, self.clock,
                                                self.settings.runtime.warmup_reps)
                stored_ok = await asyncio.to_thread(write_profile, spec, kind, entry)
                log.info("model %s: profiled on %s in its warm-up%s", spec.key, dev.name,
                         "" if stored_ok else " (repository read-only: not stored)")
            infer, load = seeds(entry)
            sched.seed(spec.key, kind, infer, load)

    def _forget(self, spec: ModelSpec) -> None:
        self.programs.pop(spec.key, None)
        self.controller.scheduler.models.pop(spec.key, None)

    # ---------------------------------------------------------------- shutdown

    def request_stop(self, force: bool = False) -> None:
        if force:
            log.warning("[shutdown] forced")
            self._forced = True
        self._stop.set()

    _forced = False

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals > 1 and sig == signal.SIGINT:
            log.warning("[shutdown] second interrupt: exiting at once, without draining")
            logging.shutdown()
            os._exit(130)
        log.info("[shutdown] %s received", sig.name)
        self.request_stop()

    async def stop(self) -> None:
        if self.state >= State.STOPPING:
            return
        self.state = State.DRAINING
        log.info("[shutdown] closing listeners")
        for fe in (self.http, self.socket):
            if fe is not None:
                await fe.stop_listening()
        if self._controller is not None:
            timeout = 0.0 if self._forced else self.settings.server.drain_timeout_s
            drained = await self._controller.drain(timeout)
            if drained:
                log.info("[shutdown] drained")
            else:
                log.warning("[shutdown] drain timed out; answering %d request(s) with 503",
                            self._controller.scheduler.pending)
                self._controller.abort_all("the daemon shut down before this request could run")
        self.state = State.STOPPING
        if self._monitor is not None:
            self._monitor.stop()
        log.info("[shutdown] stopping executors")
        await asyncio.to_thread(self._stop_executors)
        if self._controller is not None:
            self._controller.close()
        if self._trace is not None:
            self._trace.close()
        for fe in (self.http, self.socket):
            if fe is not None:
                await fe.close()
        self.state = State.STOPPED
        log.info("[shutdown] done")

    def _stop_executors(self) -> None:
        for ex in self.executors.values():
            ex.stop()

    async def serve(self) -> None:
        """Run until SIGTERM / SIGINT (or `request_stop`), then shut down in order."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.stop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
