"""The gateway: the one narrow interface every frontend (HTTP, gRPC, the unix socket) uses.

A frontend decodes the wire into an `InferenceRequest` and hands it over here; it never sees
the daemon, the scheduler or the executors. What it may ask:

- requests: `admit` (overload check + model resolution, before decoding), `new_request`
  (deadline and priority), `submit` / `cancel` (the one submission path), and `infer` for
  frontends that await an answer (it wraps `submit` in a future);
- models: `model`, `versions`, `index`, and the repository's `load_model` / `unload_model`;
- health and observability: `health`, `statistics`, `model_statistics`, `metrics`;
- management: the fault-injection hooks (`faults`, `set_fault`, `clear_fault`);
- shared memory: `shared_memory`, the registered regions (daemon/api/sharedmem.py);
- personalized models: `feedback` and `user` (daemon/apps/personal.py); a request naming a
  user (`InferenceRequest.user`) gets its personalized output through `submit`;
- applications (daemon/apps/router.py): `apps` answers their queries and feedback, sending its
  members' requests back through `submit`; `load_applications` serves the declared ones.

Tests build a `Gateway` over a fake controller to drive a frontend without a daemon.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from mypy_extensions import mypyc_attr

from daemon.api.budget import RequestMemory
from daemon.api.sharedmem import SharedMemoryRegions
from daemon.api.throttle import RenderBudget
from daemon.apps.appdb import AppDB
from daemon.apps.application import AppDefinition
from daemon.apps.cache import PredictionCache
from daemon.apps.personal import Personalizer, default_db_path
from daemon.apps.router import Applications, default_app_db_path
from daemon.apps.userdb import UserDB
from daemon.catalog import ModelCatalog, ModelState, VersionEntry
from daemon.clock import Clock, MonotonicClock
from daemon.config import ApplicationSettings, Settings, application_from_dict
from daemon.controller.classes import classify, priority_rank
from daemon.errors import BadRequest, ConfigError, DeadlineExceeded, NotFound, Overloaded, Unavailable
from daemon.model import ModelSpec
from daemon.observability import metrics
from daemon.observability.stats import ModelStats, Span
from daemon.observability.threads import thread_cpu
from daemon.overload import LagTracker
from daemon.request import InferenceRequest, RequestStatus

log = logging.getLogger("escapement.gateway")

MAX_FORECAST_MODELS = 4096  # a forecast is built on the loop: bounded like every answer
RESOLVED_MAX = 1024  # (name, version) spellings Gateway.resolve remembers per catalog generation

if TYPE_CHECKING:
    from daemon.controller.scheduler import Scheduler
    from daemon.runtime.executor import Executor
    from daemon.runtime.faults import FaultSpec
    from daemon.runtime.prefixcache import PrefixCache, PrefixCacheStats


class Controller(Protocol):
    """What the gateway needs of the controller (daemon/controller/service.py ControllerService)."""

    def submit(self, req: InferenceRequest) -> None: ...

    def cancel(self, req: InferenceRequest) -> None: ...


class RepositoryControl(Protocol):
    """The repository extension's load and unload (daemon/models.py ModelManager)."""

    def load_model(self, name: str) -> Awaitable[dict[str, Any]]: ...

    def unload_model(self, name: str, *, only_if_gone: bool = False) -> Awaitable[dict[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class Health:
    ready: bool
    lost_devices: dict[str, str] = field(default_factory=dict)  # device -> why (a sticky error, a hang)


def _always_ready() -> Health:
    return Health(True)


# Compiled with the controller (daemon/native); the worker's RemoteGateway and tests' fakes subclass it.
@mypyc_attr(allow_interpreted_subclasses=True)
class Gateway:
    def __init__(self, settings: Settings, catalog: ModelCatalog, controller: Controller, *,
                 clock: Clock | None = None, overload: LagTracker | None = None,
                 request_memory: RequestMemory | None = None, models: RepositoryControl | None = None,
                 executors: Mapping[str, Executor] | None = None, health: Callable[[], Health] = _always_ready,
                 admin_token: str = "", cache: PredictionCache | None = None,
                 personal: Personalizer | None = None, apps: Applications | None = None) -> None:
        s = settings.server
        self.settings = settings
        self.catalog = catalog
        self.controller = controller
        self.clock = clock or MonotonicClock()
        self.overload = overload or LagTracker(s.shed_lag_ms / 1000.0)
        self.request_memory = request_memory or RequestMemory(s.request_memory_bytes, s.connection_share)
        self.admin_token = admin_token  # management endpoints need it ("" = see server.admin_open_loopback)
        self._models = models
        self._executors: Mapping[str, Executor] = executors or {}
        self._health = health
        c = settings.cache
        self.cache = cache or PredictionCache(c.bytes, c.entries, c.max_entry_bytes)
        p = settings.personalization
        # its database is opened on first use (a user named, feedback): none is created otherwise
        self.personal = personal or Personalizer(
            UserDB(p.db_path or default_db_path()), max_users=p.users_in_memory, max_user_bytes=p.user_memory_bytes,
            max_queries=p.queries, max_query_bytes=p.query_memory_bytes, query_ttl_s=p.query_ttl_s, clock=self.clock)
        a = settings.apps
        self.apps = apps or Applications(
            AppDB(a.db_path or default_app_db_path()),
            max_queries=a.queries, max_query_bytes=a.query_memory_bytes, query_ttl_s=a.query_ttl_s, clock=self.clock)
        self.apps.members = self
        # the controller's read-only forecast of when a member would finish (ControllerService)
        self.apps.forecast = getattr(controller, "expected_finish", None)
        # Shared-memory regions (Triton's extension): one registry, in the controller process (a
        # frontend worker forwards what names a region).
        self.shared_memory = SharedMemoryRegions(settings.shared_memory)
        self._statistics = RenderBudget(self._render_statistics)
        # resolve(): specs by (name, version) for one catalog object at one generation
        self._resolved: dict[tuple[str, str | int | None], ModelSpec] = {}
        self._resolved_of: tuple[ModelCatalog | None, int] = (None, -1)
        self._metrics: RenderBudget[bytes] | None = None

    # ---------------------------------------------------------------- requests

    def admit(self, name: str, version: str | int | None) -> ModelSpec:
        """The model a new inference request is for; refuses it at once (before its body is decoded,
        so refusing costs little) while the loop is overloaded. NotFound, Unavailable, Overloaded."""
        if self.overload.overloaded:
            self.overload.shed += 1
            raise Overloaded(f"the daemon is overloaded: its event loop is {self.overload.lag_s * 1e3:.0f} ms "
                             "behind; retry later", retry_after_s=1.0)
        return self.resolve(name, version)

    def resolve(self, name: str, version: str | int | None) -> ModelSpec:
        """`catalog.resolve`, remembered until the catalog changes: a request resolves its model two or
        three times (admit, submit, a worker's SUBMIT), each ~1-2 µs of dict walks. The key is the
        catalog object and its generation (a worker replaces its replica whole); at most
        RESOLVED_MAX names are kept (clients choose the spellings: "1", "01", ...)."""
        catalog = self.catalog
        if self._resolved_of[0] is not catalog or self._resolved_of[1] != catalog.generation:
            self._resolved.clear()
            self._resolved_of = (catalog, catalog.generation)
        key = (name, version)
        spec = self._resolved.get(key)
        if spec is None:
            spec = catalog.resolve(name, version)  # raises NotFound / Unavailable: never remembered
            if len(self._resolved) < RESOLVED_MAX:
                self._resolved[key] = spec
        return spec

    def new_request(self, spec: ModelSpec, arrays: tuple[np.ndarray, ...], samples: int, timeout_us: int | None,
                    priority: int | None, client_id: str) -> InferenceRequest:
        """A request arriving now; `timeout_us` and `priority` as checked by api/codec.py
        (request_options). Its deadline and class follow the queue policy (controller/classes.py): a
        client timeout is a hard deadline; without one, the model's SLO is a target."""
        now = self.clock.now()
        priority = priority or 0
        ctl = self.settings.controller
        rank = priority_rank(spec, priority, ctl)
        adm = classify(spec, now, timeout_us, rank, ctl)
        return InferenceRequest(spec, arrays, samples, now, adm.deadline, priority, rank, client_id, klass=adm.klass,
                                give_up_at=adm.give_up_at)

    def submit(self, req: InferenceRequest, current: bool = False) -> None:
        """Hand a request to the controller; `req.on_finish` is called once it is answered (success,
        failure or cancellation). Raises the refusal (Unavailable, Overloaded, DeadlineExceeded).
        `current`: its model was resolved in this same call, with no await since (a worker's
        SUBMIT), so the catalog cannot have moved and is not asked again."""
        spec = req.model
        # A version being unloaded or replaced stays in the scheduler until its accepted requests
        # are answered: only the catalog says it admits no more (a request built before that).
        if not current and self.resolve(spec.name, spec.version) is not spec:
            raise Unavailable(f"model {spec.name} version {spec.version} was reloaded while the request was "
                              "read; retry")
        if req.user and spec.personalization is not None:  # first: a cached answer is personalized too
            self.personal.attach(req)
        if spec.default_output:  # inside the cache's hook: a default answer is never cached
            self._default_when_late(req)
        # Inputs over max_entry_bytes are not hashed: hashing holds the loop (~2 ms per MiB).
        cache = self.cache
        if spec.response_cache and cache.enabled and req.nbytes <= cache.max_entry_bytes and \
                self._answer_from_cache(req):
            return
        try:
            self.controller.submit(req)
        except DeadlineExceeded:
            if not spec.default_output:
                raise
            _answer_default(req, self.clock.now())  # refused at once as hopeless: the default, now
            if req.on_finish is not None:
                req.on_finish(req)

    def _default_when_late(self, req: InferenceRequest) -> None:
        """A request of a model with a default_output that misses its deadline is answered with it."""
        answer = req.on_finish
        clock = self.clock

        def finish(r: InferenceRequest) -> None:
            if isinstance(r.error, DeadlineExceeded):
                _answer_default(r, clock.now())
            if answer is not None:
                answer(r)

        req.on_finish = finish

    def _answer_from_cache(self, req: InferenceRequest) -> bool:
        """Answer a request from the prediction cache (True; the controller never sees it), or set it
        up so that its answer is stored when it succeeds (False)."""
        began = time.perf_counter_ns()
        cache, spec = self.cache, req.model
        digest = cache.key(spec, req.inputs)
        outputs = cache.get(spec, digest, began)
        if outputs is not None:
            req.outputs = outputs
            req.cached = True
            req.status = RequestStatus.SUCCEEDED
            req.finished_at = self.clock.now()
            if req.on_finish is not None:
                req.on_finish(req)
            return True
        answer = req.on_finish

        def store(r: InferenceRequest) -> None:
            # a ParM reconstruction is an approximation of the model's answer: never kept
            if r.ok and not r.reconstructed and r.outputs is not None:
                cache.put(spec, digest, r.outputs)
            if answer is not None:
                answer(r)

        req.on_finish = store
        return False

    def cancel(self, req: InferenceRequest) -> None:
        """The client went away: the request is dropped wherever it is (its on_finish still runs)."""
        self.controller.cancel(req)

    async def infer(self, req: InferenceRequest) -> InferenceRequest:
        """Submit and wait for the answer; raises the request's error. Cancelling the caller (a client
        gone, a gRPC deadline) cancels the request."""
        fut: asyncio.Future[InferenceRequest] = asyncio.get_running_loop().create_future()

        def done(r: InferenceRequest) -> None:
            if not fut.done():
                fut.set_result(r)

        req.on_finish = done
        self.submit(req)
        try:
            await fut
        except asyncio.CancelledError:
            self.cancel(req)
            raise
        if req.error is not None:
            raise req.error
        return req

    # ---------------------------------------------------------------- personalized models

    async def feedback(self, name: str, version: str | int | None, query_id: Any, label: Any) -> dict[str, Any]:
        """The true label(s) of a personalized answer: its user's weights are updated, and the answer
        comes once that is committed. NotFound (model, query), BadRequest (label, not personalized)."""
        return await self.personal.feedback(self.catalog.resolve(name, version), query_id, label)

    async def user(self, name: str, version: str | int | None, user: Any) -> dict[str, Any]:
        """A personalized model's user: updates so far and the last one's time; NotFound if none."""
        return await self.personal.user_status(self.catalog.resolve(name, version), user)

    # ---------------------------------------------------------------- applications

    def admit_app(self, name: str) -> list[ModelSpec]:
        """An application query's members, refused at once while the loop is overloaded (as `admit`);
        NotFound, Unavailable, Overloaded."""
        if self.overload.overloaded:
            self.overload.shed += 1
            raise Overloaded(f"the daemon is overloaded: its event loop is {self.overload.lag_s * 1e3:.0f} ms "
                             "behind; retry later", retry_after_s=1.0)
        return self.apps.resolve(name)

    def resolve_member(self, name: str) -> ModelSpec:
        """An application's member: the model's newest ready version (NotFound, Unavailable)."""
        return self.catalog.resolve(name, None)

    async def load_applications(self) -> list[str]:
        """Serve the applications declared in the config and in the repository's applications.toml
        (start-up: one whose models do not fit is served, answering 503 saying why)."""
        loaded: list[str] = []
        try:
            declared = await asyncio.to_thread(self._declared_applications)
        except ConfigError as e:
            log.error("applications are not served: %s", e)
            return loaded
        for source, d in declared:
            await self.apps.define(d, source, strict=False)
            loaded.append(d.name)
        return loaded

    def _declared_applications(self) -> list[tuple[str, AppDefinition]]:
        """(source, definition) of every declared application; the config's win over the repository's."""
        out: dict[str, tuple[str, AppDefinition]] = {}
        for a in repository_applications(self.settings.models.repository):
            out[a.name] = ("repository", a.definition())
        for a in self.settings.applications:
            out[a.name] = ("config", a.definition())
        return list(out.values())

    async def load_application(self, name: str, config: Any = None) -> dict[str, Any]:
        """The repository API's load of an application: from `config` (an object with the keys of an
        [[applications]] table) when given, else (re)read from the config and applications.toml.
        Its models must be served and fit together (BadRequest, NotFound otherwise)."""
        if config is not None:
            if not isinstance(config, dict):
                raise BadRequest("parameters.config must be an object with the keys of an [[applications]] table")
            try:
                d = application_from_dict({**config, "name": config.get("name", name)}, "config").definition()
            except (ConfigError, ValueError) as e:
                raise BadRequest(f"application {name}: {e}") from None
            if d.name != name:
                raise BadRequest(f"config.name {d.name!r} differs from the application in the path {name!r}")
            return await self.apps.define(d, "api", strict=True)
        for source, d in await asyncio.to_thread(self._declared_applications):
            if d.name == name:
                return await self.apps.define(d, source, strict=True)
        raise NotFound(f"application {name!r} is declared neither in the config nor in "
                       f"{self.settings.models.repository}/applications.toml; give its config to add it")

    # ---------------------------------------------------------------- models

    def model(self, name: str, version: str | int | None = None) -> VersionEntry:
        """A model version (None: the newest that serves) whatever its state; NotFound, Unavailable."""
        return self.catalog.entry(name, version)

    def versions(self, name: str) -> list[int]:
        return sorted(self.catalog.versions(name))

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """The repository index: one entry per version (and per broken entry), Triton's shape."""
        return self.catalog.index(ready_only)

    async def load_model(self, name: str) -> dict[str, Any]:
        return await self._repository().load_model(name)

    async def unload_model(self, name: str, *, only_if_gone: bool = False) -> dict[str, Any]:
        """Stop serving a model; with `only_if_gone`, only once its directory has left the repository
        (Forbidden before: a caller without the admin token may only follow the files)."""
        return await self._repository().unload_model(name, only_if_gone=only_if_gone)

    def _repository(self) -> RepositoryControl:
        if self._models is None:
            raise NotFound("this daemon has no model repository to load from")
        return self._models

    # ---------------------------------------------------------------- health and observability

    def health(self) -> Health:
        return self._health()

    def statistics(self) -> dict[str, Any]:
        """The controller's statistics plus the event loop's lag and the requests shed for it
        (within a budget of loop time: a flood of requests for them gets the last ones)."""
        return self._statistics.get()

    def _render_statistics(self) -> dict[str, Any]:
        o = self.overload
        m = self.request_memory
        return {**self._scheduler().statistics(),
                "loop": {"lag_ms": o.lag_s * 1e3, "max_lag_ms": o.max_s * 1e3, "shed": o.shed},
                "request_memory": {"held_bytes": m.held, "peak_bytes": m.peak, "limit_bytes": m.limit,
                                   "refused": m.refused},
                "personalization": dataclasses.asdict(self.personal.stats()),
                "applications": {n: self.apps.status(n)["counters"] for n in self.apps.apps},
                "prefix_cache": {n: dataclasses.asdict(st) for n, st in self._prefix_caches().items()},
                "threads_cpu_s": thread_cpu()}

    def _prefix_caches(self) -> dict[str, PrefixCacheStats]:
        """Each CPU device's cache of shared stages' outputs (runtime/prefixcache.py), by device."""
        out = {}
        for name, ex in sorted(self._executors.items()):
            cache: PrefixCache | None = getattr(ex.backend, "prefix_cache", None)
            if cache is not None and cache.enabled:
                out[name] = cache.stats()
        return out

    def model_statistics(self, name: str | None = None, version: str | int | None = None) -> list[dict[str, Any]]:
        """Triton's statistics extension (`model_stats`), for every ready version, one model's ready
        versions, or one version. NotFound for an unknown model or version, Unavailable for one
        with no version ready."""
        catalog = self.catalog
        if name is None:
            specs = [e.spec for n in catalog.names() for _, e in sorted(catalog.versions(n).items())
                     if e.state == ModelState.READY]
        elif version is not None and version != "":
            specs = [catalog.resolve(name, version)]
        else:
            specs = [e.spec for _, e in sorted(catalog.versions(name).items()) if e.state == ModelState.READY]
            if not specs:
                specs = [catalog.resolve(name)]  # raises: unknown, broken, or no version ready
        sched = self._scheduler()
        epoch = time.time() - self.clock.now()  # the daemon's clock is monotonic
        return [model_stats_json(sched, spec, epoch, self.cache) for spec in specs]

    def metrics(self) -> bytes:
        """The Prometheus text exposition, rendered on the loop (the collector reads the controller's
        state) within a budget of loop time: a flood of scrapes gets the last rendering."""
        if self._metrics is None:
            registry = metrics.make_registry(self._scheduler, self.overload, self.cache, self.apps, self.personal,
                                             self._prefix_caches)
            self._metrics = RenderBudget(lambda: metrics.render(registry))
        return self._metrics.get()

    def _scheduler(self) -> Scheduler:
        return self.controller.scheduler  # type: ignore[attr-defined]  # the real service's

    def forecast(self, limit: int) -> dict[str, Any]:
        """When this node would answer a request of each model it holds, for a cluster router
        (daemon/routing.py; the socket's `forecast` op). Read-only; at most `limit` models."""
        fn = getattr(self.controller, "forecast", None)
        if fn is None:
            raise Unavailable("this daemon's controller gives no forecast")
        return fn(max(0, min(limit, MAX_FORECAST_MODELS)))

    # ---------------------------------------------------------------- management (fault injection)

    def faults(self) -> dict[str, Any]:
        return {name: (ex.faults.spec.as_json() if ex.faults.spec else None) for name, ex in self._executors.items()}

    def set_fault(self, device: str, spec: FaultSpec | None) -> None:
        """Inject a fault on a device's executor (None clears it); NotFound for an unknown device."""
        ex = self._executors.get(device)
        if ex is None:
            raise NotFound(f"no such device {device!r}; devices: {sorted(self._executors)}")
        ex.faults.set(spec)


APPLICATIONS_FILE = "applications.toml"


def repository_applications(repository: str) -> list[ApplicationSettings]:
    """The [[applications]] tables of the model repository's applications.toml (none without one).
    ConfigError for a file that is not valid (file I/O: run it in a thread)."""
    import tomllib
    from pathlib import Path

    path = Path(repository) / APPLICATIONS_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    tables = data.get("applications", [])
    if set(data) - {"applications"} or not isinstance(tables, list):
        raise ConfigError(f"{path}: expected only [[applications]] tables")
    return [application_from_dict(t, f"{path}: applications") for t in tables]


def _span(count: int, ns: int) -> dict[str, int]:
    return {"count": count, "ns": ns}


def model_stats_json(sched: Scheduler, spec: ModelSpec, epoch: float, cache: PredictionCache | None = None
                     ) -> dict[str, Any]:
    """One `$model_stat` of Triton's statistics extension; `epoch` turns clock times into Unix times."""
    cached = cache.version_stats(spec) if cache is not None else None
    m = sched.telemetry.models.get(spec.key) or ModelStats(spec)
    entry = sched.models.get(spec.key)
    weights = entry.weight_bytes if entry is not None else 0
    none = Span().as_json()
    last = round((m.last_inference + epoch) * 1000) if m.last_inference else 0
    return {
        "name": spec.name,
        "version": str(spec.version),
        "last_inference": last,
        "inference_count": m.inference_count,
        "execution_count": m.execution_count,
        "inference_stats": {
            "success": m.success.as_json(), "fail": m.fail.as_json(), "queue": m.queue.as_json(),
            "compute_input": m.compute_input.as_json(), "compute_infer": m.compute_infer.as_json(),
            "compute_output": m.compute_output.as_json(),
            "cache_hit": _span(cached.hits, cached.hit_ns) if cached else none,
            "cache_miss": _span(cached.misses, cached.miss_ns) if cached else none,
        },
        "response_stats": {},
        "batch_stats": [
            {"batch_size": size,
             "compute_input": {"count": b.count, "ns": 0},
             "compute_infer": {"count": b.count, "ns": round(b.infer_s * 1e9)},
             "compute_output": {"count": b.count, "ns": round(b.other_s * 1e9)}}
            for size, b in sorted(m.batches.items())
        ],
        "memory_usage": [{"type": "GPU" if d.kind == "cuda" else "CPU", "id": d.device.index, "byte_size": weights}
                         for d in sched.devices.values() if d.memory.is_ready(spec.key)],
        # escapement's own: requests by class and outcome (docs/controller.md, "Request classes")
        "escapement_classes": {klass: {what: n for (k, what), n in sorted(m.classes.items()) if k == klass}
                               for klass in sorted({k for k, _ in m.classes})},
    }


def _answer_default(req: InferenceRequest, now: float) -> None:
    """The model's default_output, one row per sample, as the request's answer (flagged)."""
    req.outputs = (req.model.outputs[0].rows(req.model.default_output, req.samples),)
    req.error = None
    req.status = RequestStatus.SUCCEEDED
    req.defaulted = True
    req.finished_at = now
