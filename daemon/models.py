"""The model manager: which model versions the daemon serves, and changing that without dropping a request.

It owns the repository scans and the served versions (`ModelCatalog` says what frontends see;
`ModelManager` decides it). A new version is read, warmed up on a serving device and profiled
before it is admitted (daemon/preparation.py); a version leaving is refused new requests at once
and unloaded once its accepted ones are answered. SIGHUP reloads (`reload_repository`), and the
repository extension's load and unload (`load_model`, `unload_model`) apply a scan the same
way, one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from daemon.catalog import ModelCatalog, ModelState
from daemon.clock import Clock
from daemon.config import Settings
from daemon.controller.scheduler import Scheduler
from daemon.controller.service import ControllerService
from daemon.errors import BadRequest, ConfigError, Forbidden, ModelError, NotFound, Unavailable
from daemon.lifecycle import State
from daemon.model import ModelSpec
from daemon.notify import Notifier
from daemon.preparation import Prepared, Preparer
from daemon.repository import ScanResult, Stamp, scan, stamp
from daemon.runtime import shared_prefix
from daemon.runtime.cuda import shared_blocks
from daemon.runtime.devices import Device
from daemon.runtime.executor import Executor
from daemon.runtime.hostmem import HostPins
from daemon.runtime.program import Program

log = logging.getLogger("escapement.server")

Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]


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


def _scan(root: Path, default_slo_ms: float) -> tuple[ScanResult, dict[str, Stamp]]:
    """The repository's entries and their files' stamps (file I/O: run it in a thread)."""
    result = scan(root, default_slo_ms)
    return result, {m.key: stamp(m) for m in result.models}


def _busy(sched: Scheduler, keys: Sequence[str]) -> bool:
    return any(d.busy.get(k, 0) for d in sched.devices.values() for k in keys)  # (a read that adds no key)


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


class ModelManager:
    """Serves the repository's models: reads, warms up, installs, reloads and retires versions."""

    def __init__(self, settings: Settings, catalog: ModelCatalog, controller: ControllerService,
                 executors: dict[str, Executor], devices: Sequence[Device], programs: dict[str, Program],
                 host_pins: HostPins, notifier: Notifier, clock: Clock, *, spawn: Spawn,
                 phase: Callable[[], State], status_line: Callable[[], str],
                 catalog_seen: Callable[[], Awaitable[None]] | None = None) -> None:
        self.settings = settings
        self.catalog = catalog
        self.controller = controller
        self.executors = executors
        self.devices = devices
        self.programs = programs  # version key -> program; the executors read it (LOADs)
        self.host_pins = host_pins
        self.notifier = notifier
        self.clock = clock
        self._spawn = spawn  # a task the daemon tracks: cancelled on shutdown, its failure logged
        self._phase = phase
        self._status_line = status_line  # systemd's READY=1 status after a reload
        self._catalog_seen = catalog_seen  # awaited before it: every frontend answers from the new catalog
        self._served: dict[str, Served] = {}  # version key -> what the scheduler serves under it
        self._unloaded: set[str] = set()  # model names unloaded through the API: reloads leave them out
        self.lock = asyncio.Lock()  # reloads, loads and unloads run one at a time
        self._reload_pending = False
        self.reloader: asyncio.Task[None] | None = None
        self.preparer = Preparer(settings, controller, executors, devices, notifier, clock, phase)
        self.warming = self.preparer.warming  # warm-ups running in a worker thread (shutdown waits)
        # called when a version stops being admitted: the prediction cache drops its answers then
        self.on_retire: Callable[[ModelSpec], object] = lambda spec: None

    @property
    def state(self) -> State:
        return self._phase()

    def serving(self) -> int:
        """How many model versions are READY."""
        return sum(1 for m in self.catalog.index() if m["state"] == "READY")

    async def load_repository(self) -> None:
        """Serve every model of the repository: read each (in a worker thread), warm it up and
        preload it where its config asks; returns once each is ready or reported not served."""
        async with self.lock:
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
        if self.state == State.RUNNING and (self.reloader is None or self.reloader.done()):
            self.reloader = self._spawn(self._reload_loop(), "reload")

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
        async with self.lock:
            self.notifier.reloading("reloading the model repository")
            log.info("reload: rescanning %s", self.settings.models.repository)
            try:
                changes = await self._sync(None)
            except ConfigError as e:
                changes = Changes(failed={"repository": str(e)})
            finally:
                if self.state == State.RUNNING:  # never READY=1 after STOPPING=1
                    line = self._status_line()
                    if self._catalog_seen is not None:
                        await self._catalog_seen()
                    if self.state == State.RUNNING:
                        self.notifier.ready(line)
        for key, why in changes.failed.items():
            log.error("reload: %s: %s", key, why)
        log.info("reload done: %s", changes.summary())
        return changes.as_json()

    async def load_model(self, name: str) -> dict[str, Any]:
        """(Re)read one model's entry from the repository and serve what it holds now (the
        repository extension's load). NotFound if the repository has no such model; BadRequest
        if its entry or a version of it cannot be served (what it served is then kept)."""
        self._check_running()
        async with self.lock:
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

    async def unload_model(self, name: str, *, only_if_gone: bool = False) -> dict[str, Any]:
        """Stop serving every version of a model (the repository extension's unload): new requests
        are refused at once, accepted ones answered, then its weights unloaded. It stays listed as
        UNAVAILABLE ("unloaded"), and reloads leave it so until `load_model`. NotFound if unknown;
        with `only_if_gone` (a caller without the token), Forbidden while its directory is there."""
        self._check_running()
        if name not in self.catalog.names():
            raise NotFound(f"unknown model {name!r}")
        if only_if_gone and await asyncio.to_thread(os.path.lexists, Path(self.settings.models.repository) / name):
            raise Forbidden(f"model {name}: without the admin token, a model is unloaded only once its directory "
                            "is gone from the model repository (as KServe's model agent does)")
        async with self.lock:
            self._unloaded.add(name)
            keys = sorted(k for k, v in self._served.items() if v.spec.name == name and not v.retiring)
            changes = await self._retire_all(keys, "unloading", self._mark_unloaded)
            for entry in self.catalog.versions(name).values():
                if entry.spec.key not in self._served:  # a version that had failed to load, say
                    self.catalog.set_state(entry.spec, ModelState.UNAVAILABLE, "unloaded")
        log.info("unload %s: %s", name, changes.summary())
        return changes.as_json()

    def _check_running(self) -> None:
        if self.state != State.RUNNING:
            raise Unavailable("the daemon is starting or shutting down; retry once it is running")

    def _mark_unloaded(self, spec: ModelSpec) -> None:
        self.catalog.set_state(spec, ModelState.UNAVAILABLE, "unloaded")

    def _forget_version(self, spec: ModelSpec) -> None:
        self.catalog.remove(spec.name, spec.version)

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
        for name in self.catalog.names():
            if mine(name) and name not in broken:
                self.catalog.remove(name)  # its broken entry, if it had one
        for name, why in broken.items():
            self.catalog.set_broken(name, why)
        # 2. Versions gone from the repository: refused from now on, unloaded once answered.
        gone = sorted(k for k, v in self._served.items() if mine(v.spec.name) and k not in wanted
                      and not v.retiring and v.spec.name not in broken and v.spec.name not in skip)
        if gone:
            self.notifier.status(f"unloading {len(gone)} model version(s)")
        changes = await self._retire_all(gone, "unloading: gone from the repository", self._forget_version)
        changes.broken = broken
        # 3. Entries nothing stands behind any more (a failed version since deleted, say).
        for name in [n for n in self.catalog.names() if mine(n)]:
            for version, entry in list(self.catalog.versions(name).items()):
                key = entry.spec.key
                if key not in self._served and key not in wanted and not (name in skip and key in in_repo):
                    self.catalog.remove(name, version)
        self._unloaded &= {m.name for m in result.models} | set(result.broken)
        # 4. New versions, and versions whose files changed (removed, then added).
        todo = sorted(k for k, m in wanted.items()
                      if k not in self._served or self._served[k].spec != m or self._served[k].stamp != stamps[k])
        for key in todo:
            if key not in self._served:
                self.catalog.add(wanted[key], ModelState.LOADING)
        runtime = self.settings.runtime
        if runtime.detect_shared_prefix and runtime.share_weights and todo:
            # every new single-program model read before any loads (the load reuses the read): a prefix
            # it shares with another is found from the first, and later scans find this one's
            await asyncio.to_thread(shared_prefix.INDEX.read_ahead, [wanted[k] for k in todo])
        for i, key in enumerate(todo, 1):
            if self.state > State.RUNNING:
                raise Unavailable("the daemon is shutting down")
            self.notifier.status(f"loading model {i}/{len(todo)}: {key}")
            replacing = key in self._served
            failed = await self._bring_up(wanted[key], stamps[key])
            if failed is not None:
                changes.failed[key] = failed
            else:
                (changes.reloaded if replacing else changes.loaded).append(key)
        if runtime.detect_shared_prefix and runtime.share_weights and (changes.loaded or changes.reloaded):
            await self._split_earlier([*changes.loaded, *changes.reloaded], changes)
        return changes

    async def _split_earlier(self, new: Sequence[str], changes: Changes) -> None:
        """Served models read whole, before anything shared their prefix, that share one with a model
        just loaded: read again and served as plans of stages, so that they batch with it (the
        version read before serves until its successor is warm, as in a reload)."""
        index = shared_prefix.INDEX
        sharers: set[str] = set()
        for key in new:
            program = self.programs.get(key)
            if program is not None and program.prefix:
                sharers |= index.owners(program.prefix)
        earlier = []
        for key in sorted(sharers - set(new)):
            served = self._served.get(key)
            program = self.programs.get(key)
            if served is None or served.retiring or program is None or program.prefix or program.stages \
                    or served.spec.stages or served.spec.format != "pt2":
                continue
            earlier.append(served)
        if not earlier:
            return
        await asyncio.to_thread(index.read_ahead, [s.spec for s in earlier])
        for served in earlier:
            if self.state > State.RUNNING:
                return
            key = served.spec.key
            self.notifier.status(f"splitting {key} at the prefix it shares")
            failed = await self._bring_up(served.spec, served.stamp, "reloading: it shares a prefix with a model "
                                          "loaded since, and is read again as a plan of stages")
            if failed is None:
                log.info("model %s: read again as a plan of stages, sharing its prefix with models loaded since",
                         key)
                changes.reloaded.append(key)
            else:  # still served whole: its answers are the same, it only misses cross-model batches
                log.warning("model %s: not split at the prefix it shares: %s", key, failed)

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

    async def _bring_up(self, spec: ModelSpec, stamp: Stamp,
                        why: str = "reloading: its files changed") -> str | None:
        """Serve a new version, or replace a served one whose files changed; None if it is now
        ready, else why not. A replaced version serves until its successor is read and warm."""
        old = self._served.get(spec.key)
        if old is not None and old.retiring:
            return "its previous copy is still unloading; reload again once it is gone"
        try:
            prepared = await self.preparer.prepare(spec, stamp)
        except ModelError as e:
            if old is not None:
                return f"{e} (the version read before is still served)"
            self.catalog.set_state(spec, ModelState.UNAVAILABLE, str(e))
            return str(e)
        if old is not None:
            self._stop_admitting(spec.key, ModelState.LOADING, why)
            ok = await self._retire(spec.key, lambda s: self.catalog.set_state(
                s, ModelState.UNAVAILABLE, "unloaded for a reload that could not finish (a device did not "
                "return); reload again"))
            if not ok:
                return "the version read before is still running on a device; reload again once it is unloaded"
            self.catalog.add(spec, ModelState.LOADING)
        await self._install(prepared)
        return None

    async def _install(self, p: Prepared) -> None:
        """Hand a prepared version to the scheduler, preload it where asked (waiting for the LOADs
        to come back) and admit requests for it."""
        sched = self.controller.scheduler
        spec = p.spec
        for item in (p, p.parity):
            if item is None:
                continue
            self.programs[item.spec.key] = item.program
            # its weights by content: devices that share blocks hold a backbone its variants share once
            # (runtime.share_weights off: every model charged in full, as black-box serving)
            shared = self.settings.runtime.share_weights
            blocks = item.program.blocks if shared else ()
            # (a CUDA device holds a plan's shared leading stage once, as one block, and its static
            # inputs as another: runtime/cuda.py)
            stages = shared_blocks(item.program) if shared else ()
            sched.add_model(item.spec, self.preparer.footprint(item.program), blocks=blocks,
                            prefix=item.program.prefix if shared else "", stage_blocks=stages)
            for kind, (infer, load, share) in item.seeds.items():
                sched.seed(item.spec.key, kind, infer, load, share)
            if item.program.prefix and shared:  # per-stage estimates (cross-model batches), from the host's runs
                for kind in {d.kind for d in self.devices}:  # (CUDA runs them too: runtime/cuda.py)
                    sched.seed_stages(item.spec.key, kind, item.program.stage_timings)
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
        self.catalog.set_state(spec, ModelState.READY, p.notes)
        log.info("model %s ready (%s, %.1f MiB of weights)%s", spec.key, spec.format, p.program.weight_bytes / 2**20,
                 f"; {p.notes}" if p.notes else "")

    def _stop_admitting(self, key: str, state: ModelState, reason: str) -> None:
        """New requests for a served version are refused from now on (its accepted ones are not)."""
        served = self._served[key]
        served.retiring = True
        self.catalog.set_state(served.spec, state, reason)
        self.on_retire(served.spec)

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
            if program is not None and program.packed is not None:
                self.host_pins.forget(program.packed)  # no device loads it again
        del self._served[served.spec.key]
        log.info("model %s unloaded", served.spec.key)
