"""The Daemon: the lifecycle owner. It owns the event loop's work, wires the parts, and starts and stops them.

The parts it wires: the controller (daemon/controller/), one executor per device
(daemon/runtime/), the model manager (daemon/models.py: what is served), the gateway
(daemon/gateway.py: the one interface of the frontends) and the frontends (daemon/api/).

Start-up: devices -> executors -> controller -> model programs (read off the loop, in a
thread, warmed up, and preloaded where their config asks) -> listeners -> READY=1 to systemd.
Shutdown, in a fixed order: STOPPING=1 -> cancel a reload in progress -> stop accepting
connections and requests -> drain accepted requests (bounded by `server.drain_timeout_s`) ->
stop executors -> close connections -> stop the watchdog. SIGTERM and SIGINT start a shutdown;
a second SIGINT forces the exit.

SIGHUP reloads the model repository (`ModelManager.reload_repository`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from daemon.api.budget import RequestMemory
from daemon.api.grpc_v2 import GrpcFrontend
from daemon.api.http import HttpFrontend
from daemon.api.uds import SocketFrontend
from daemon.catalog import ModelCatalog
from daemon.clock import Clock, MonotonicClock
from daemon.config import Settings, parse_hostport
from daemon.controller.policy import make_policy
from daemon.controller.scheduler import Scheduler
from daemon.controller.service import ControllerService
from daemon.errors import ConfigError
from daemon.frontends import FrontendWorkers, default_workers
from daemon.gateway import Gateway, Health
from daemon.lifecycle import State
from daemon.models import ModelManager
from daemon.notify import Notifier, keep_alive
from daemon.observability.telemetry import Telemetry
from daemon.observability.trace import TraceWriter
from daemon.overload import LagTracker, LoopMonitor
from daemon.runtime.devices import Device, plan_cores, resolve_devices
from daemon.runtime.executor import Executor, default_pinned_budget, make_backend
from daemon.runtime.hostmem import HostPins
from daemon.runtime.program import Program
from daemon.runtime.workers import WorkerPool

__all__ = ["Daemon", "State", "read_admin_token"]

log = logging.getLogger("escapement.server")

EXECUTOR_STOP_S = 5.0  # at shutdown, how long executors may take to finish their running actions, together
WORKER_STOP_S = 5.0  # and the worker threads (model reads, warm-ups) their jobs
CATALOG_SEEN_S = 2.0  # after a reload, how long READY=1 waits for every frontend worker to take the new catalog


def read_admin_token(inline: str, path: str) -> str:
    """The management token: from `path`, else systemd's credential `admin-token`, else the TOML."""
    candidates = [Path(path)] if path else []
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds:
        candidates.append(Path(creds) / "admin-token")
    for p in candidates:
        try:
            token = p.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            if p == Path(path):
                raise ConfigError(f"server.admin_token_file: {path} does not exist") from None
            continue
        except OSError as e:
            raise ConfigError(f"server.admin_token_file: cannot read {p}: {e.strerror}") from None
        if len(token) < 16:
            raise ConfigError(f"the admin token in {p} is shorter than 16 characters; make one with "
                              "`openssl rand -hex 32`")
        return token
    return inline


class Daemon:
    def __init__(self, settings: Settings, clock: Clock | None = None, notifier: Notifier | None = None) -> None:
        self.settings = settings
        self.clock = clock or MonotonicClock()
        self.notifier = notifier if notifier is not None else Notifier.from_env()
        self.state = State.STARTING
        self.catalog = ModelCatalog()
        self.programs: dict[str, Program] = {}
        self.devices: list[Device] = []
        self.executors: dict[str, Executor] = {}
        self.http: HttpFrontend | None = None
        self.socket: SocketFrontend | None = None
        self.http_port: int | None = None
        self.grpc: GrpcFrontend | None = None
        self.grpc_port: int | None = None
        self.frontends: FrontendWorkers | None = None  # worker processes own HTTP and the socket
        self._all_cores: set[int] = set()
        self._controller: ControllerService | None = None
        self._models: ModelManager | None = None
        self._gateway: Gateway | None = None
        self._trace: TraceWriter | None = None
        self._cores: dict[str, int] = {}
        self.overload = LagTracker(settings.server.shed_lag_ms / 1000.0)
        self.request_memory = RequestMemory(settings.server.request_memory_bytes, settings.server.connection_share)
        self._monitor: LoopMonitor | None = None
        self._stop = asyncio.Event()
        self.started = asyncio.Event()  # set once start() is done and the daemon RUNNING (a harness waits on it)
        self._signals = 0
        self._tasks: set[asyncio.Task[Any]] = set()  # every background task, cancelled on shutdown
        self._watchdog: asyncio.Task[None] | None = None
        self._reload_pending = False  # a SIGHUP before the model manager exists
        self._start_error = ""
        self.host_pins = HostPins(settings.runtime.host_pinned_budget or default_pinned_budget())
        self.admin_token = ""  # read at start-up (admin_token_file, a systemd credential, or the TOML)
        self.exit_code = 0  # 1 once every device is lost: systemd restarts the service
        # the loop's default executor: daemon threads, a bounded wait at exit (see workers.py)
        self.workers = WorkerPool(max_workers=min(32, (os.cpu_count() or 1) + 4), name="escapement-worker",
                                  timeout_s=WORKER_STOP_S)

    @property
    def controller(self) -> ControllerService:
        assert self._controller is not None, "the daemon is not started"
        return self._controller

    @property
    def models(self) -> ModelManager:
        assert self._models is not None, "the daemon is not started"
        return self._models

    @property
    def gateway(self) -> Gateway:
        assert self._gateway is not None, "the daemon is not started"
        return self._gateway

    def health(self) -> Health:
        ctl = self._controller
        ready = self.state == State.RUNNING and (ctl is None or ctl.scheduler.lost < len(self.devices))
        lost = {} if ctl is None else {n: d.failed for n, d in ctl.scheduler.devices.items() if d.failed}
        return Health(ready, lost)

    # ---------------------------------------------------------------- tasks

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start a tracked background task: cancelled on shutdown, its failure logged."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("task %s failed", task.get_name(), exc_info=exc)

    @staticmethod
    async def _cancel(tasks: Sequence[asyncio.Task[Any]]) -> None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---------------------------------------------------------------- start-up

    async def start(self) -> None:
        s = self.settings
        # The watchdog first: a start-up that wedges the loop is caught as well.
        if self.notifier.watchdog_s is not None and self._watchdog is None:
            self._watchdog = self._spawn(keep_alive(self.notifier, self.notifier.watchdog_s, self._trouble),
                                         "watchdog")
            log.info("systemd watchdog: a keep-alive every %.3g s", self.notifier.watchdog_s)
        self.admin_token = read_admin_token(s.server.admin_token, s.server.admin_token_file)
        self.notifier.status("starting: devices")
        sys.setswitchinterval(s.runtime.gil_switch_interval_us * 1e-6)
        loop = asyncio.get_running_loop()
        loop.set_default_executor(self.workers)
        self.devices = resolve_devices(s.runtime.devices, s.runtime.weight_budget, s.runtime.device_workspace,
                                       s.runtime.emucuda)
        self._trace = TraceWriter(s.controller.trace_path) if s.controller.trace_path else None
        scheduler = Scheduler(self.devices, make_policy(s.controller), s.controller,
                              telemetry=Telemetry(self._trace), hung_after_s=s.runtime.hung_action_s)
        self._controller = ControllerService(scheduler, self.executors, self.clock, loop)
        self._all_cores = os.sched_getaffinity(0)
        plan, rest = plan_cores(self.devices, self._all_cores, s.runtime.pin_threads)
        self._cores = plan
        if rest is not None:
            # The loop thread (and threads it starts later, such as the load lanes) keep off the
            # cores given to devices; each INFER thread pins itself to its own core.
            os.sched_setaffinity(0, rest)
            log.info("cores: %s; event loop and other threads on %s",
                     ", ".join(f"{n} on {c}" for n, c in plan.items()), sorted(rest))
        for d in self.devices:
            backend = make_backend(d, s.runtime.cpu_threads, plan.get(d.name), host=self.host_pins,
                                   graphs=s.runtime.cuda_graphs, hang_timeout_s=s.runtime.hang_timeout_s,
                                   emucuda=s.runtime.emucuda,
                                   prefix_cache=(s.runtime.prefix_cache_entries, s.runtime.prefix_cache_bytes),
                                   share_weights=s.runtime.share_weights)
            ex = Executor(d, backend, self.clock, self.controller.post_result, self.programs,
                          hang_timeout_s=s.runtime.hang_timeout_s)
            ex.start()
            self.executors[d.name] = ex
        for f in s.faults:
            if f.device not in self.executors:
                raise ConfigError(f"faults: device {f.device} is not one of {sorted(self.executors)}")
            self.executors[f.device].faults.set(f.spec())
            log.warning("fault injected on %s: %s", f.device, f.spec())
        log.info("devices: %s", ", ".join(
            f"{d.name} ({d.weight_budget / 2**20:.0f} MiB budget"
            + (f", {d.workspace / 2**20:.0f} MiB of it workspace)" if d.workspace else ")") for d in self.devices))
        self._models = ModelManager(s, self.catalog, self.controller, self.executors, self.devices, self.programs,
                                    self.host_pins, self.notifier, self.clock, spawn=self._spawn,
                                    phase=lambda: self.state, status_line=self._status_line,
                                    catalog_seen=self._catalog_seen)
        self._gateway = Gateway(s, self.catalog, self.controller, clock=self.clock, overload=self.overload,
                                request_memory=self.request_memory, models=self._models, executors=self.executors,
                                health=self.health, admin_token=self.admin_token)
        self._models.on_retire = self._gateway.cache.drop
        self._spawn(self._watch_devices(), "device watch")
        self.notifier.status(f"starting: devices {', '.join(d.name for d in self.devices)}; reading models")
        await self._models.load_repository()
        await self._gateway.load_applications()  # over the models just loaded (docs/applications.md)
        # torch and the models leave ~10^5 long-lived objects; a full cyclic GC pass over them
        # stops the loop for ~100 ms. Freezing them keeps later passes to what serving allocates.
        gc.collect()
        gc.freeze()
        self.notifier.status("starting: listeners")
        workers = s.server.frontend_workers
        if workers < 0:
            workers = default_workers(len(self._all_cores))
        if workers and (s.server.http or s.server.socket or s.server.grpc):
            self.frontends = FrontendWorkers(s, self.gateway, workers, on_fatal=self._frontends_failed,
                                             cores=self._all_cores)
            if self._controller is not None:
                self._controller.answers = self.frontends  # (a step's answers in one write per worker)
            await self.frontends.start()
            self.http_port = self.frontends.http_port if s.server.http else None
            if self.http_port:
                log.info("HTTP listening on %s:%d", self.frontends.http_host, self.http_port)
            if s.server.grpc:
                self.grpc_port = self.frontends.grpc_port
                log.info("gRPC listening on %s:%d", self.frontends.grpc_host, self.grpc_port)
            log.info("%d frontend worker process(es) own the listeners (HTTP %s, gRPC %s, socket %s)", workers,
                     f"{self.frontends.http_host}:{self.http_port}" if s.server.http else "off",
                     f"{self.frontends.grpc_host}:{self.grpc_port}" if s.server.grpc else "off",
                     s.server.socket or "off")
        elif s.server.http:
            host, port = parse_hostport(s.server.http, "server.http")
            self.http = HttpFrontend(self.gateway)
            self.http_port = await self.http.start(host, port)
            log.info("HTTP listening on %s:%d", host, self.http_port)
        if s.server.grpc and self.frontends is None:
            host, port = parse_hostport(s.server.grpc, "server.grpc")
            self.grpc = GrpcFrontend(self.gateway)
            self.grpc_port = await self.grpc.start(host, port)
            log.info("gRPC listening on %s:%d", host, self.grpc_port)
        if s.server.socket and self.frontends is None:
            self.socket = SocketFrontend(self.gateway)
            await self.socket.start(s.server.socket)
            if s.controller.keep_warm_ms > 0 and s.controller.keep_warm_path and self._controller is not None:
                self.socket.rehearsal.enabled = True
                self._controller.on_touch.append(self.socket.rehearsal.replay)
            log.info("socket listening on %s", s.server.socket)
        self._monitor = LoopMonitor(self.overload, clock=time.monotonic)
        self._monitor.start()
        self.state = State.RUNNING
        self.started.set()
        log.info("ready: %d model version(s) serving", self._models.serving())
        self.notifier.ready(self._status_line())
        if self._reload_pending:  # a SIGHUP during start-up
            self._reload_pending = False
            self.request_reload()

    def _trouble(self) -> str | None:
        """Why the daemon cannot go on as it is and wants systemd to restart it; None if it can."""
        if self._controller is None or not self.settings.runtime.restart_on_hang:
            return None
        hung = self._controller.scheduler.hung
        if not hung:
            return None
        return "; ".join(f"{dev}: {why}" for dev, why in sorted(hung.items()))

    async def _catalog_seen(self) -> None:
        """Every frontend worker answers from the catalog as it is now (before READY=1 of a reload)."""
        if self.frontends is not None and not await self.frontends.catalog_seen(CATALOG_SEEN_S):
            log.warning("a frontend worker did not confirm the new model catalog within %.1f s", CATALOG_SEEN_S)

    def _status_line(self) -> str:
        """systemd's STATUS= with READY=1; the frontend workers get the catalog it announces first."""
        if self.frontends is not None:
            self.frontends.sync_catalog()
        s = self.settings.server
        where = [f"HTTP {parse_hostport(s.http, 'server.http')[0]}:{self.http_port}" if self.http_port else "",
                 f"gRPC {parse_hostport(s.grpc, 'server.grpc')[0]}:{self.grpc_port}" if self.grpc_port else "",
                 f"socket {s.socket}" if self.socket or (self.frontends and s.socket) else ""]
        return "; ".join([f"ready: {self.models.serving()} model version(s) serving", *filter(None, where)])

    def request_reload(self) -> None:
        """SIGHUP: reload the model repository in the background (once running: one asked for during
        start-up runs when it is done)."""
        if self.state > State.RUNNING:
            return
        if self.state < State.RUNNING or self._models is None:
            self._reload_pending = True  # start() runs it once it is done
            return
        self._models.request_reload()

    async def _watch_devices(self) -> None:
        """Once every device is lost, stop with status 1: systemd restarts the service (a lost CUDA
        context comes back only in a new process)."""
        await self.controller.all_lost.wait()
        log.critical("every device is lost (%s); stopping so that the service is restarted",
                     "; ".join(f"{n}: {why}" for n, why in self.health().lost_devices.items()))
        self.exit_code = 1
        self.request_stop()

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

    def _frontends_failed(self) -> None:
        """A frontend worker cannot start: stop with status 1 (systemd restarts the service)."""
        self.exit_code = 1
        self.request_stop()

    def _on_sighup(self) -> None:
        log.info("SIGHUP received: reloading the model repository")
        self.request_reload()

    async def stop(self) -> None:
        if self.state >= State.STOPPING:
            return
        self.state = State.DRAINING
        self.notifier.stopping("stopping: closing listeners")
        # A reload or unload half done must not load models into a daemon that is draining.
        await self._cancel([t for t in self._tasks if t is not self._watchdog])
        log.info("[shutdown] closing listeners")
        for fe in (self.http, self.socket, self.frontends):
            if fe is not None:
                await fe.stop_listening()
        if self.grpc is not None:  # RPCs running are answered by the drain (or cancelled at close)
            await self.grpc.stop_listening(self.settings.server.drain_timeout_s)
        if self._controller is not None:
            await self._drain(self._controller)
        self.state = State.STOPPING
        if self._monitor is not None:
            self._monitor.stop()
        log.info("[shutdown] stopping executors")
        self.notifier.status("stopping: executors")
        await asyncio.to_thread(self._stop_executors)
        if self._controller is not None:
            self._controller.close()
        if self._trace is not None:
            await self._trace.aclose()
        for closer in (self.http, self.grpc, self.socket, self.frontends):
            if closer is not None:
                await closer.close()
        if self._gateway is not None:
            self._gateway.shared_memory.close()  # the regions' descriptors (the frontends are closed)
            # users' weights: what feedback queued is committed (acknowledged feedback already is)
            await asyncio.to_thread(self._gateway.personal.close)
            await asyncio.to_thread(self._gateway.apps.close)  # applications' policy state, likewise
        # Last: systemd keeps watching the loop until everything above is done.
        await self._cancel(list(self._tasks))
        self._watchdog = None
        # the last STATUS= stays in `systemctl status`: a failed start-up says why
        self.notifier.status(f"start-up failed: {self._start_error}" if self._start_error else "stopped")
        self.notifier.close()
        self.workers.shutdown(wait=False)  # idle worker threads end now; one stuck in a job is left behind
        self.state = State.STOPPED
        log.info("[shutdown] done")

    async def _drain(self, ctl: ControllerService) -> None:
        """Wait for accepted requests (at most `server.drain_timeout_s`), telling systemd how many
        are left every second; answer the rest with 503."""
        deadline = time.monotonic() + (0.0 if self._forced else self.settings.server.drain_timeout_s)
        while True:
            pending = ctl.scheduler.pending
            if pending:
                self.notifier.status(f"stopping: draining {pending} request(s)")
            left = deadline - time.monotonic()
            if await ctl.drain(max(0.0, min(1.0, left))):
                log.info("[shutdown] drained")
                return
            if left <= 1.0:
                break
        log.warning("[shutdown] drain timed out; answering %d request(s) with 503", ctl.scheduler.pending)
        ctl.abort_all("the daemon shut down before this request could run")

    def left_behind(self) -> list[str]:
        """Threads still inside a job or an action after the shutdown (hung devices, a dead disk)."""
        lanes = [lane.name for ex in self.executors.values() for lane in (ex.infer_lane, ex.load_lane) if lane.alive]
        self.workers.join(1.0)  # idle ones are just ending
        return lanes + self.workers.stuck

    def _stop_executors(self) -> None:
        """Stop every executor together within EXECUTOR_STOP_S (a warm-up still on a device first
        gets the same time): a hung device costs the shutdown that bound once, not once per device."""
        deadline = time.monotonic() + EXECUTOR_STOP_S
        for ex in self.executors.values():
            ex.begin_stop()
        for done in list(self._models.warming if self._models is not None else ()):
            if not done.wait(max(0.0, deadline - time.monotonic())):
                log.warning("[shutdown] a warm-up is still running on a device")
        closers = [threading.Thread(target=ex.finish_stop, args=(deadline,), name=f"stop {name}", daemon=True)
                   for name, ex in self.executors.items()]
        for t in closers:
            t.start()
        for t in closers:
            t.join(max(0.0, deadline - time.monotonic()) + 1.0)  # closing a device once its lanes ended

    async def serve(self) -> None:
        """Run until SIGTERM / SIGINT (or `request_stop`), then shut down in order. SIGHUP reloads
        the model repository. Signals are the process's: a daemon served on another thread than the
        main one (a test harness) takes none, and stops by `request_stop` (as uvicorn does)."""
        loop = asyncio.get_running_loop()
        signals = threading.current_thread() is threading.main_thread()
        if signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
            # Before start-up: SIGHUP's default action would kill the daemon.
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        try:
            # A stop asked for during start-up (a warm-up or a preload can take minutes, or hang)
            # ends the start-up: systemd's stop timeout must hold from any state.
            starting = loop.create_task(self.start(), name="start-up")
            stopping = loop.create_task(self._stop.wait(), name="stop wait")
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                log.info("[shutdown] stop asked for during start-up: start-up abandoned")
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            else:
                try:
                    starting.result()
                except Exception as e:
                    stopping.cancel()
                    self._start_error = str(e)
                    raise
                await stopping
        finally:
            await self.stop()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if signals else ():
                loop.remove_signal_handler(sig)
