"""The Daemon: owns the event loop's work, wires the parts, and runs the lifecycle.

Start-up: devices -> executors -> controller -> model programs (read off the loop, in a
thread, warmed up, and preloaded where their config asks) -> listeners -> READY=1 to systemd.
Shutdown, in a fixed order: STOPPING=1 -> cancel a reload in progress -> stop accepting
connections and requests -> drain accepted requests (bounded by `server.drain_timeout_s`) ->
stop executors -> close connections -> stop the watchdog. SIGTERM and SIGINT start a shutdown;
a second SIGINT forces the exit.

SIGHUP reloads the model repository (`reload_repository`); the HTTP repository extension loads
and unloads one model (`load_model`, `unload_model`). All three apply a repository scan the
same way, one at a time: a new version is read and warmed up before it is admitted; a version
leaving is refused new requests at once and unloaded once its accepted ones are answered.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from daemon.api.budget import RequestMemory
from daemon.api.http import HttpFrontend
from daemon.api.throttle import RenderBudget
from daemon.api.uds import SocketFrontend
from daemon.clock import Clock, MonotonicClock
from daemon.coding import codes
from daemon.config import Settings, parse_hostport
from daemon.controller.policy import make_policy
from daemon.controller.scheduler import Scheduler
from daemon.controller.service import ControllerService
from daemon.controller.telemetry import Telemetry, TraceWriter
from daemon.errors import BadRequest, ConfigError, NotFound, Overloaded, Unavailable
from daemon.notify import Notifier, keep_alive
from daemon.overload import LagTracker, LoopMonitor
from daemon.registry import ModelRegistry, ModelState
from daemon.repository import ModelSpec, ScanResult, parity_model, scan
from daemon.request import InferenceRequest
from daemon.runtime.devices import Device, plan_cores, resolve_devices
from daemon.runtime.executor import Executor, default_pinned_budget, make_backend
from daemon.runtime.hostmem import HostPins
from daemon.runtime.profiler import measure, read_profile, seeds, write_profile
from daemon.runtime.program import Program, ProgramError, load_program
from daemon.runtime.workers import WorkerPool

log = logging.getLogger("escapement.server")

MAX_TIMEOUT_US = 3_600_000_000
EXECUTOR_STOP_S = 5.0  # at shutdown, how long executors may take to finish their running actions, together
WORKER_STOP_S = 5.0  # and the worker threads (model reads, warm-ups) their jobs

Stamp = tuple[tuple[int, int], ...]  # (mtime_ns, size) of a version's files: a change is a new version
Seeds = dict[str, tuple[dict[int, float], float | None]]  # device kind -> INFER and LOAD estimates


class State(enum.IntEnum):
    STARTING = 0
    RUNNING = 1
    DRAINING = 2
    STOPPING = 3
    STOPPED = 4


@dataclass(slots=True)
class Prepared:
    """A model version read into host memory and profiled, not yet known to the scheduler."""

    spec: ModelSpec
    stamp: Stamp
    program: Program
    seeds: Seeds
    parity: Prepared | None = None  # its parity model, when it has one that loads
    notes: str = ""  # what a device cannot do for it (e.g. why it runs without CUDA graphs)


@dataclass(slots=True)
class Served:
    """A model version the scheduler knows (admitted requests, or about to)."""

    spec: ModelSpec
    stamp: Stamp
    parity_key: str | None = None
    retiring: bool = False  # refused new requests, waiting for its accepted ones

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.spec.key, self.parity_key) if self.parity_key else (self.spec.key,)


@dataclass(slots=True)
class Changes:
    """What a reload, load or unload did, by version key ("name:version")."""

    loaded: list[str] = field(default_factory=list)
    reloaded: list[str] = field(default_factory=list)  # its files changed: replaced
    unloaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # key -> why it is not (newly) served
    broken: dict[str, str] = field(default_factory=dict)  # model name -> why its entry cannot be read

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        parts = [f"{len(v)} {k}" for k, v in asdict(self).items() if v]
        return ", ".join(parts) or "nothing changed"


class _NotServed(Exception):
    """A model version cannot be served; the message says why."""


def _stamp(spec: ModelSpec) -> Stamp:
    files = [spec.path.parent.parent / "config.toml", spec.path]
    if spec.parity is not None:
        files.append(spec.path.parent / spec.parity.file)
    out: list[tuple[int, int]] = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            out.append((0, 0))
        else:
            out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)


def _scan(root: Path, default_slo_ms: float) -> tuple[ScanResult, dict[str, Stamp]]:
    """The repository's entries and their files' stamps (file I/O: run it in a thread)."""
    result = scan(root, default_slo_ms)
    return result, {m.key: _stamp(m) for m in result.models}


def _busy(sched: Scheduler, keys: Sequence[str]) -> bool:
    return any(d.busy[k] for d in sched.devices.values() for k in keys)


def _quiet(sched: Scheduler, keys: Sequence[str]) -> bool:
    """No request of these models is queued, running or held for a reconstruction, and no action
    of theirs is in flight: they can leave the scheduler without failing anything."""
    for key in keys:
        entry = sched.models.get(key)
        if entry is not None and entry.queue.requests:
            return False
    if _busy(sched, keys):
        return False
    return not any(g.spec.key in keys for g in sched.coding.groups.values())


def _landed(sched: Scheduler, keys: Sequence[str]) -> bool:
    """Every LOAD of these models has come back (loaded, or failed)."""
    return all(sched.placed_on.get(k, set()) <= sched.ready_on.get(k, set()) for k in keys)


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
        self.request_memory = RequestMemory(settings.server.request_memory_bytes, settings.server.connection_share)
        self._monitor: LoopMonitor | None = None
        self._stop = asyncio.Event()
        self._signals = 0
        self._tasks: set[asyncio.Task[Any]] = set()  # every background task, cancelled on shutdown
        self._watchdog: asyncio.Task[None] | None = None
        self._served: dict[str, Served] = {}  # version key -> what the scheduler serves under it
        self._unloaded: set[str] = set()  # model names unloaded through the API: reloads leave them out
        self._repo_lock = asyncio.Lock()  # reloads, loads and unloads run one at a time
        self._reload_pending = False
        self._reloader: asyncio.Task[None] | None = None
        self._start_error = ""
        self.host_pins = HostPins(settings.runtime.host_pinned_budget or default_pinned_budget())
        self.admin_token = ""  # read at start-up (admin_token_file, a systemd credential, or the TOML)
        self.exit_code = 0  # 1 once every device is lost: systemd restarts the service
        # the loop's default executor: daemon threads, a bounded wait at exit (see workers.py)
        self.workers = WorkerPool(max_workers=min(32, (os.cpu_count() or 1) + 4), name="escapement-worker",
                                  timeout_s=WORKER_STOP_S)
        self._warming: set[threading.Event] = set()  # warm-ups running in a worker thread
        self._statistics = RenderBudget(self._render_statistics)

    @property
    def controller(self) -> ControllerService:
        assert self._controller is not None, "the daemon is not started"
        return self._controller

    # ---------------------------------------------------------------- requests (frontends)

    def is_ready(self) -> bool:
        return self.state == State.RUNNING and (self._controller is None or
                                                self._controller.scheduler.lost < len(self.devices))

    def lost_devices(self) -> dict[str, str]:
        """Devices lost to a sticky error or a hang, and why."""
        if self._controller is None:
            return {}
        return {n: d.failed for n, d in self._controller.scheduler.devices.items() if d.failed}

    def statistics(self) -> dict[str, Any]:
        """The controller's statistics plus the event loop's lag and the requests shed for it
        (within a budget of loop time: a flood of requests for them gets the last ones)."""
        return self._statistics.get()

    def _render_statistics(self) -> dict[str, Any]:
        o = self.overload
        m = self.request_memory
        return {**self.controller.scheduler.statistics(),
                "loop": {"lag_ms": o.lag_s * 1e3, "max_lag_ms": o.max_s * 1e3, "shed": o.shed},
                "request_memory": {"held_bytes": m.held, "peak_bytes": m.peak, "limit_bytes": m.limit,
                                   "refused": m.refused}}

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
        ctl = self.settings.controller
        rank = priority or ctl.default_priority
        if not ctl.client_priorities:  # a client may lower its own priority, not jump everyone else's
            rank = max(rank, ctl.default_priority)
        return InferenceRequest(spec, arrays, samples, now, deadline, priority, rank, client_id)

    async def run_request(self, req: InferenceRequest) -> InferenceRequest:
        """Submit and wait for the answer; raises the request's error. Cancelling cancels the request."""
        spec = req.model
        # The frontend resolved the model before it read the body; it may have left meanwhile.
        if self.registry.resolve(spec.name, spec.version) is not spec:
            raise Unavailable(f"model {spec.name} version {spec.version} was reloaded while the request was "
                              "read; retry")
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
        plan, rest = plan_cores(self.devices, os.sched_getaffinity(0), s.runtime.pin_threads)
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
                                   emucuda=s.runtime.emucuda)
            ex = Executor(d, backend, self.clock, self._controller.post_result, self.programs,
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
        self._spawn(self._watch_devices(), "device watch")
        self.notifier.status(f"starting: devices {', '.join(d.name for d in self.devices)}; reading models")
        await self.load_repository()
        # torch and the models leave ~10^5 long-lived objects; a full cyclic GC pass over them
        # stops the loop for ~100 ms. Freezing them keeps later passes to what serving allocates.
        gc.collect()
        gc.freeze()
        self.notifier.status("starting: listeners")
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
        log.info("ready: %d model version(s) serving", self._serving())
        self.notifier.ready(self._status_line())
        if self._reload_pending:  # a SIGHUP during start-up
            self.request_reload()

    def _trouble(self) -> str | None:
        """Why the daemon cannot go on as it is and wants systemd to restart it; None if it can."""
        if self._controller is None or not self.settings.runtime.restart_on_hang:
            return None
        hung = self._controller.scheduler.hung
        if not hung:
            return None
        return "; ".join(f"{dev}: {why}" for dev, why in sorted(hung.items()))

    def _serving(self) -> int:
        return sum(1 for m in self.registry.index() if m["state"] == "READY")

    def _status_line(self) -> str:
        where = [f"HTTP {parse_hostport(self.settings.server.http, 'server.http')[0]}:{self.http_port}"
                 if self.http is not None else "", f"socket {self.settings.server.socket}" if self.socket else ""]
        return "; ".join([f"ready: {self._serving()} model version(s) serving", *filter(None, where)])

    async def load_repository(self) -> None:
        """Serve every model of the repository: read each (in a worker thread), warm it up and
        preload it where its config asks; returns once each is ready or reported not served."""
        async with self._repo_lock:
            changes = await self._sync(None)
        for key, why in changes.failed.items():
            log.error("model %s is not served: %s", key, why)

    # ---------------------------------------------------------------- reload, load, unload

    def request_reload(self) -> None:
        """SIGHUP: reload the repository in the background; a request during a reload runs one
        more after it (requests coalesce: the next reload sees every change made meanwhile)."""
        if self.state > State.RUNNING:
            return
        self._reload_pending = True
        if self.state == State.RUNNING and (self._reloader is None or self._reloader.done()):
            self._reloader = self._spawn(self._reload_loop(), "reload")

    async def _reload_loop(self) -> None:
        while self._reload_pending and self.state == State.RUNNING:
            self._reload_pending = False
            try:
                await self.reload_repository()
            except Exception:  # one failed reload must not stop the next
                log.exception("reload failed")

    async def reload_repository(self) -> dict[str, Any]:
        """Rescan the repository and apply what changed, without dropping a request.

        New models and versions are loaded and admitted once warm; versions gone from the
        repository are refused new requests and unloaded once their accepted ones are answered;
        a version whose files changed is replaced (removed, then added: the old one serves until
        the new one is read and warm); broken entries are reported, and a model whose entry broke
        keeps serving what it served. Models unloaded through the API stay unloaded. systemd sees
        RELOADING=1 now and READY=1 when done, whatever happened. Returns what changed.
        """
        async with self._repo_lock:
            self.notifier.reloading("reloading the model repository")
            log.info("reload: rescanning %s", self.settings.models.repository)
            try:
                changes = await self._sync(None)
            except ConfigError as e:
                changes = Changes(failed={"repository": str(e)})
            finally:
                if self.state == State.RUNNING:  # never READY=1 after STOPPING=1
                    self.notifier.ready(self._status_line())
        for key, why in changes.failed.items():
            log.error("reload: %s: %s", key, why)
        log.info("reload done: %s", changes.summary())
        return changes.as_json()

    async def load_model(self, name: str) -> dict[str, Any]:
        """(Re)read one model's entry from the repository and serve what it holds now (the
        repository extension's load). NotFound if the repository has no such model; BadRequest
        if its entry or a version of it cannot be served (what it served is then kept)."""
        self._check_running()
        async with self._repo_lock:
            try:
                result, stamps = await self._scan()
            except ConfigError as e:
                raise Unavailable(str(e)) from None
            if name not in result.broken and all(m.name != name for m in result.models):
                raise NotFound(f"model {name!r} is not in the model repository")
            self._unloaded.discard(name)
            changes = await self._apply(result, stamps, {name})
        log.info("load %s: %s", name, changes.summary())
        problems = [*changes.broken.values(), *(f"{k}: {why}" for k, why in changes.failed.items())]
        if problems:
            raise BadRequest(f"failed to load model {name}: " + "; ".join(problems))
        return changes.as_json()

    async def unload_model(self, name: str) -> dict[str, Any]:
        """Stop serving every version of a model (the repository extension's unload): new requests
        are refused at once, accepted ones answered, then its weights unloaded. It stays listed as
        UNAVAILABLE ("unloaded"), and reloads leave it so until `load_model`. NotFound if unknown."""
        self._check_running()
        if name not in self.registry.names():
            raise NotFound(f"unknown model {name!r}")
        async with self._repo_lock:
            self._unloaded.add(name)
            keys = sorted(k for k, v in self._served.items() if v.spec.name == name and not v.retiring)
            changes = await self._retire_all(keys, "unloading", self._mark_unloaded)
            for entry in self.registry.versions(name).values():
                if entry.spec.key not in self._served:  # a version that had failed to load, say
                    self.registry.set_state(entry.spec, ModelState.UNAVAILABLE, "unloaded")
        log.info("unload %s: %s", name, changes.summary())
        return changes.as_json()

    def _check_running(self) -> None:
        if self.state != State.RUNNING:
            raise Unavailable("the daemon is starting or shutting down; retry once it is running")

    def _mark_unloaded(self, spec: ModelSpec) -> None:
        self.registry.set_state(spec, ModelState.UNAVAILABLE, "unloaded")

    def _forget_version(self, spec: ModelSpec) -> None:
        self.registry.remove(spec.name, spec.version)

    async def _scan(self) -> tuple[ScanResult, dict[str, Stamp]]:
        root = Path(self.settings.models.repository)
        try:
            return await asyncio.to_thread(_scan, root, self.settings.models.default_slo_ms)
        except FileNotFoundError:
            raise ConfigError(f"models.repository: {root} is not a directory (build the demo models with "
                              f"`escapement demo --out {root}`)") from None

    async def _sync(self, names: set[str] | None) -> Changes:
        result, stamps = await self._scan()
        return await self._apply(result, stamps, names)

    async def _apply(self, result: ScanResult, stamps: dict[str, Stamp], names: set[str] | None) -> Changes:
        """Make what is served match a repository scan, for the models in `names` (None: all)."""
        def mine(name: str) -> bool:
            return names is None or name in names

        skip = self._unloaded if names is None else set()  # a reload leaves API-unloaded models alone
        wanted = {m.key: m for m in result.models if mine(m.name) and m.name not in skip}
        in_repo = {m.key for m in result.models}
        # 1. Broken entries are reported; a model whose entry broke keeps what it serves.
        broken = {n: why for n, why in result.broken.items() if mine(n)}
        for name in self.registry.names():
            if mine(name) and name not in broken:
                self.registry.remove(name)  # its broken entry, if it had one
        for name, why in broken.items():
            self.registry.set_broken(name, why)
        # 2. Versions gone from the repository: refused from now on, unloaded once answered.
        gone = sorted(k for k, v in self._served.items() if mine(v.spec.name) and k not in wanted
                      and not v.retiring and v.spec.name not in broken and v.spec.name not in skip)
        if gone:
            self.notifier.status(f"unloading {len(gone)} model version(s)")
        changes = await self._retire_all(gone, "unloading: gone from the repository", self._forget_version)
        changes.broken = broken
        # 3. Entries nothing stands behind any more (a failed version since deleted, say).
        for name in [n for n in self.registry.names() if mine(n)]:
            for version, entry in list(self.registry.versions(name).items()):
                key = entry.spec.key
                if key not in self._served and key not in wanted and not (name in skip and key in in_repo):
                    self.registry.remove(name, version)
        self._unloaded &= {m.name for m in result.models} | set(result.broken)
        # 4. New versions, and versions whose files changed (removed, then added).
        todo = sorted(k for k, m in wanted.items()
                      if k not in self._served or self._served[k].spec != m or self._served[k].stamp != stamps[k])
        for key in todo:
            if key not in self._served:
                self.registry.add(wanted[key], ModelState.LOADING)
        for i, key in enumerate(todo, 1):
            if self.state > State.RUNNING:
                raise Unavailable("the daemon is shutting down")
            self.notifier.status(f"loading model {i}/{len(todo)}: {key}")
            replacing = key in self._served
            why = await self._bring_up(wanted[key], stamps[key])
            if why is not None:
                changes.failed[key] = why
            else:
                (changes.reloaded if replacing else changes.loaded).append(key)
        return changes

    async def _retire_all(self, keys: Sequence[str], reason: str, after: Callable[[ModelSpec], None]) -> Changes:
        changes = Changes()
        for k in keys:  # all refused at once, before any wait
            self._stop_admitting(k, ModelState.UNAVAILABLE, reason)
        done = await asyncio.gather(*(self._retire(k, after) for k in keys))
        for key, ok in zip(keys, done, strict=True):
            if ok:
                changes.unloaded.append(key)
            else:
                changes.failed[key] = "still running on a device: it is unloaded once that returns"
        return changes

    async def _bring_up(self, spec: ModelSpec, stamp: Stamp) -> str | None:
        """Serve a new version, or replace a served one whose files changed; None if it is now
        ready, else why not. A replaced version serves until its successor is read and warm."""
        old = self._served.get(spec.key)
        if old is not None and old.retiring:
            return "its previous copy is still unloading; reload again once it is gone"
        try:
            prepared = await self._prepare(spec, stamp)
        except _NotServed as e:
            if old is not None:
                return f"{e} (the version read before is still served)"
            self.registry.set_state(spec, ModelState.UNAVAILABLE, str(e))
            return str(e)
        if old is not None:
            self._stop_admitting(spec.key, ModelState.LOADING, "reloading: its files changed")
            ok = await self._retire(spec.key, lambda s: self.registry.set_state(
                s, ModelState.UNAVAILABLE, "unloaded for a reload that could not finish (a device did not "
                "return); reload again"))
            if not ok:
                return "the version read before is still running on a device; reload again once it is unloaded"
            self.registry.add(spec, ModelState.LOADING)
        await self._install(prepared)
        return None

    async def _prepare(self, spec: ModelSpec, stamp: Stamp) -> Prepared:
        """Read a version into host memory and profile it (both in threads); raises _NotServed."""
        try:
            program = await asyncio.to_thread(load_program, spec)
        except ProgramError as e:
            raise _NotServed(str(e)) from None
        need = self._footprint(program)
        largest = max(d.model_budget for d in self.devices)
        if need > largest:
            raise _NotServed(f"it needs {need} bytes on a device (weights and IO buffers), more than any device's "
                             f"budget leaves for models ({largest} bytes; runtime.weight_budget)")
        notes: list[str] = []
        try:
            model_seeds = await self._profile(spec, program, notes)
        except Exception as e:  # a model that cannot even be warmed up is not served
            raise _NotServed(f"warm-up failed: {e}") from e
        parity = await self._prepare_parity(spec, stamp) if spec.parity is not None else None
        return Prepared(spec, stamp, program, model_seeds, parity, "; ".join(notes))

    def _footprint(self, program: Program) -> int:
        """Device bytes a LOAD of `program` charges: the most any device's backend charges."""
        return max(ex.footprint(program) for ex in self.executors.values())

    async def _prepare_parity(self, spec: ModelSpec, stamp: Stamp) -> Prepared | None:
        """A model's parity model; a problem with it disables parity, not the model."""
        assert spec.parity is not None
        pspec = parity_model(spec)
        try:
            if len(spec.inputs) != 1 or len(spec.outputs) != 1:
                raise ValueError("parity needs a model with one input and one output")
            codes.check(spec.parity.encoder, spec.parity.k, spec.inputs[0].sample_shape)
            program = await asyncio.to_thread(load_program, pspec)
            parity_seeds = await self._profile(pspec, program)
        except (ValueError, ProgramError, RuntimeError) as e:
            log.warning("model %s is served without parity: %s", spec.key, e)
            return None
        log.info("model %s: parity k=%d (%s) with %s", spec.key, spec.parity.k, spec.parity.encoder, pspec.path.name)
        return Prepared(pspec, stamp, program, parity_seeds)

    async def _profile(self, spec: ModelSpec, program: Program, notes: list[str] | None = None) -> Seeds:
        """Estimates per device kind from the stored profile, measuring (and storing) what is missing;
        what a device kind cannot do for the model goes to `notes`."""
        stored = await asyncio.to_thread(read_profile, spec)
        out: Seeds = {}
        for kind in sorted({d.kind for d in self.devices}):
            entry = stored.get(kind)
            if entry is None:
                entry = await self._warm_up(spec, program, kind)
                stored_ok = await asyncio.to_thread(write_profile, spec, kind, entry)
                log.info("model %s: profiled on %s in its warm-up%s", spec.key, entry["device"],
                         "" if stored_ok else " (repository read-only: not stored)")
            out[kind] = seeds(entry)
            if entry.get("notes") and notes is not None:
                notes.append(f"on {kind}: {entry['notes']}")
        return out

    async def _warm_up(self, spec: ModelSpec, program: Program, kind: str) -> dict[str, Any]:
        """Measure a version on a serving device of `kind`: the controller makes room for it (as for
        any LOAD: evicting idle models) and keeps the bytes reserved until it is done."""
        holder = f"warmup:{spec.key}"
        need = self._footprint(program)
        timeout = self.settings.server.drain_timeout_s
        device = await self.controller.reserve(holder, need, kind, timeout)
        if device is None:
            raise RuntimeError(f"no {kind} device had room for it within {timeout:.0f} s")
        self.notifier.status(f"warming {spec.key} on {device}")
        done = threading.Event()  # set when the thread is out of the device (shutdown waits for it)

        def run() -> dict[str, Any]:
            try:
                return measure(self.executors[device], program, self.clock, self.settings.runtime.warmup_reps, 2,
                               holder)
            finally:
                done.set()

        self._warming.add(done)
        job = asyncio.get_running_loop().run_in_executor(None, run)
        limit = self.settings.runtime.warmup_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(job), limit)
        except TimeoutError:
            why = f"the warm-up of {spec.key} has not returned for {limit:.0f} s (runtime.warmup_timeout_s)"
            self.controller.declare_hung(device, why)
            raise RuntimeError(why) from None
        finally:
            if done.is_set():
                self._warming.discard(done)
                self.controller.unreserve(holder, device)
            else:  # still on the device (stuck, or a stop cancelled the wait): keep its bytes until it returns
                def release(f: asyncio.Future[dict[str, Any]]) -> None:
                    if not f.cancelled():
                        f.exception()  # nobody waits for it any more: its failure (a stop) is not news
                    self._warming.discard(done)
                    if self._controller is not None and self.state < State.STOPPING:
                        self.controller.unreserve(holder, device)
                job.add_done_callback(release)

    async def _watch_devices(self) -> None:
        """Once every device is lost, stop with status 1: systemd restarts the service (a lost CUDA
        context comes back only in a new process)."""
        ctl = self.controller
        await ctl.until(lambda s: s.lost == len(s.devices))
        log.critical("every device is lost (%s); stopping so that the service is restarted",
                     "; ".join(f"{n}: {why}" for n, why in self.lost_devices().items()))
        self.exit_code = 1
        self.request_stop()

    async def _install(self, p: Prepared) -> None:
        """Hand a prepared version to the scheduler, preload it where asked (waiting for the LOADs
        to come back) and admit requests for it."""
        sched = self.controller.scheduler
        spec = p.spec
        for item in (p, p.parity):
            if item is None:
                continue
            self.programs[item.spec.key] = item.program
            sched.add_model(item.spec, self._footprint(item.program))
            for kind, (infer, load) in item.seeds.items():
                sched.seed(item.spec.key, kind, infer, load)
        served = Served(spec, p.stamp, p.parity.spec.key if p.parity is not None else None)
        self._served[spec.key] = served
        if spec.preload_replicas:
            self.notifier.status(f"preloading {spec.key} onto {spec.preload_replicas} device(s)")
            placed = self.controller.preload(spec.key, spec.preload_replicas)
            if served.parity_key is not None:
                self.controller.preload(served.parity_key, 1, avoid=set(placed))
            await self.controller.until(lambda s: _landed(s, served.keys))
            if not sched.ready_on.get(spec.key):
                log.warning("model %s: preloading failed; it is loaded when requests come", spec.key)
        self.registry.set_state(spec, ModelState.READY, p.notes)
        log.info("model %s ready (%s, %.1f MiB of weights)%s", spec.key, spec.format, p.program.weight_bytes / 2**20,
                 f"; {p.notes}" if p.notes else "")

    def _stop_admitting(self, key: str, state: ModelState, reason: str) -> None:
        """New requests for a served version are refused from now on (its accepted ones are not)."""
        served = self._served[key]
        served.retiring = True
        self.registry.set_state(served.spec, state, reason)

    async def _retire(self, key: str, after: Callable[[ModelSpec], None]) -> bool:
        """Wait until a version no longer admitted has answered its accepted requests (at most
        `server.drain_timeout_s`), then take it out of the scheduler, which unloads it everywhere,
        and call `after`. False if a device still runs an action of it by then: it is then taken
        out in the background once the device returns."""
        served = self._served[key]
        assert served.retiring, "_stop_admitting first"
        ctl = self.controller
        timeout = self.settings.server.drain_timeout_s
        try:
            await asyncio.wait_for(ctl.until(lambda s: _quiet(s, served.keys)), timeout)
        except TimeoutError:
            if _busy(ctl.scheduler, served.keys):
                log.warning("model %s: still running on a device after %.1f s (server.drain_timeout_s); "
                            "it is unloaded once that returns", key, timeout)
                self._spawn(self._retire_later(served, after), f"unload {key}")
                return False
            log.warning("model %s: requests still queued after %.1f s (server.drain_timeout_s) are "
                        "answered with 503", key, timeout)
        self._remove(served)
        after(served.spec)
        return True

    async def _retire_later(self, served: Served, after: Callable[[ModelSpec], None]) -> None:
        await self.controller.until(lambda s: not _busy(s, served.keys))
        self._remove(served)
        after(served.spec)

    def _remove(self, served: Served) -> None:
        """Take a version (and its parity model) out of the scheduler; it fails what is still
        queued (nothing, once quiet) and unloads the weights from every device."""
        ctl = self.controller
        now = self.clock.now()
        for k in served.keys:
            ctl.apply(ctl.scheduler.remove_model(k, now))
            ctl.scheduler.estimator.forget(k)  # a replacement must not inherit its timings
            program = self.programs.pop(k, None)  # pending UNLOADs hold the program they unload
            if program is not None:
                self.host_pins.forget(program.host_block)  # no device loads it again
        del self._served[served.spec.key]
        log.info("model %s unloaded", served.spec.key)

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
        for fe in (self.http, self.socket):
            if fe is not None:
                await fe.stop_listening()
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
            await asyncio.to_thread(self._trace.close)
        for fe in (self.http, self.socket):
            if fe is not None:
                await fe.close()
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
        for done in list(self._warming):
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
        the model repository."""
        loop = asyncio.get_running_loop()
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
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
