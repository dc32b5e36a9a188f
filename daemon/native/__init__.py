"""The controller compiled to C with mypyc: the same typed source, less CPU per decision.

The decision loop is plain synchronous Python on one core; its speed sets how many requests a
node can schedule (issue 12). mypyc compiles those modules (`MODULES`) into C extensions that
run the same code: one `Scheduler`, one policy, the same decisions in the same order, about
half the CPU per request (bench/results/native-issue12.md). Nothing else changes: a module with
no extension built beside it runs from its source.

    python -m daemon.native build     compile in place (`make` does it when it can; __main__.py)
    python -m daemon.native status    what this interpreter imports, and why
    python -m daemon.native clean     remove the extensions

An extension beside its source is what Python imports first, so two guards keep a build from
running code that is not on disk:
- at `import daemon`, the sources of `MODULES` are compared with those the build compiled (a
  digest recorded last, in `_native.json`); on any difference, or with ESCAPEMENT_NATIVE=0,
  every compiled module is imported from its source instead. All or none: compiled modules call
  each other directly, so one edited module among compiled ones would still run its old code.
- an interpreter the build was not for finds no extension (their file names carry the ABI).
A machine without a C compiler or mypyc keeps the source; `build` says so and succeeds.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# The decision loop's modules: everything a request's submit, step and result runs in the
# controller; and the controller process's glue around it that every request crosses with
# frontend workers on (the link's records, the gateway, the asyncio controller service, the
# clock): interpreted, those calls cost the loop more than the compiled controller's own work
# (issue 15: 283k -> 220k instructions a request on the loop, `python -m bench.ingest_instructions`);
# and the executors' lanes, which every INFER crosses twice (handed over, its result posted back:
# 258k -> 244k instructions a request over the whole process); and the frontend workers' protocol
# path (the HTTP server and KServe handlers, the codec, request budgets, the remote gateway, shared
# slots and regions, the gRPC handlers): ~0.73x of a worker's CPU a request over HTTP binary
# (bench/results/ingest-ab-issue15-*). The msgpack socket frontend (api/uds.py) stays Python.
MODULES: tuple[str, ...] = (
    "daemon.actions",
    "daemon.request",
    "daemon.controller.classes",
    "daemon.controller.decisions",
    "daemon.controller.demand",
    "daemon.controller.due",
    "daemon.controller.driver",
    "daemon.controller.estimates",
    "daemon.controller.floats",
    "daemon.controller.forecast",
    "daemon.controller.latency",
    "daemon.controller.memory",
    "daemon.controller.policy",
    "daemon.controller.queues",
    "daemon.controller.scheduler",
    "daemon.controller.sharing",
    "daemon.controller.state",
    "daemon.controller.timeline",
    "daemon.controller.view",
    "daemon.controller.policies.aimd",
    "daemon.controller.policies.clockwork",
    "daemon.controller.policies.dynamic",
    "daemon.observability.stats",
    "daemon.observability.telemetry",
    "daemon.parity.groups",
    "daemon.parity.planner",
    "daemon.clock",
    "daemon.controller.service",
    "daemon.gateway",
    "daemon.frontends",
    "daemon.api.link",
    "daemon.runtime.executor",
    "daemon.api.httpserver",
    "daemon.api.http",
    "daemon.api.codec",
    "daemon.api.budget",
    "daemon.api.remote",
    "daemon.api.slots",
    "daemon.api.sharedmem",
    "daemon.api.grpc_v2",
)
GROUP = "daemon._native"  # the shared library of the group: daemon/_native__mypyc<suffix>
ENV = "ESCAPEMENT_NATIVE"  # "0": import the source even where a current build exists
PACKAGE = Path(__file__).resolve().parent.parent  # daemon/


@dataclass(frozen=True)
class NativeState:
    compiled: bool
    why: str  # "compiled", or why the source runs

    def __str__(self) -> str:
        return "compiled (mypyc)" if self.compiled else f"source ({self.why})"


def source_of(module: str, package: Path = PACKAGE) -> Path:
    return package.parent.joinpath(*module.split(".")).with_suffix(".py")


def suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def extension_of(module: str, package: Path = PACKAGE) -> Path:
    return package.parent.joinpath(*module.split(".")).with_name(module.rsplit(".", 1)[1] + suffix())


def group_library(package: Path = PACKAGE) -> Path:
    return package / (GROUP.rsplit(".", 1)[1] + "__mypyc" + suffix())


def manifest(package: Path = PACKAGE) -> Path:
    """The build's record, one per interpreter ABI (as the extensions' names are)."""
    return package / ("_native" + suffix().removesuffix(".so") + ".json")


def digest(package: Path = PACKAGE, modules: Sequence[str] = MODULES) -> str:
    h = hashlib.sha256()
    for m in modules:
        h.update(m.encode() + b"\0" + source_of(m, package).read_bytes() + b"\0")
    return h.hexdigest()


def record(package: Path = PACKAGE, modules: Sequence[str] = MODULES) -> dict[str, object]:
    """What a build records of the sources it compiled (taken before it reads them)."""
    stats = {}
    for m in modules:
        st = source_of(m, package).stat()
        stats[m] = [st.st_size, st.st_mtime_ns]
    return {"modules": list(modules), "digest": digest(package, modules), "stats": stats,
            "python": sys.version.split()[0]}


def _recorded(package: Path) -> dict[str, object] | None:
    try:
        data = json.loads(manifest(package).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _sources_current(package: Path, record: dict[str, object], modules: Sequence[str]) -> bool:
    """The sources are those compiled: each file's size and mtime as recorded (cheap: 23 stats at
    every start), else the digest of their contents (a checkout rewrites mtimes, not contents)."""
    stats = record.get("stats")
    try:
        if isinstance(stats, dict) and all(
                stats.get(m) == [(st := source_of(m, package).stat()).st_size, st.st_mtime_ns] for m in modules):
            return True
        return record.get("digest") == digest(package, modules)
    except OSError:
        return False


def inspect(package: Path = PACKAGE, modules: Sequence[str] = MODULES,
            env: dict[str, str] | os._Environ[str] = os.environ) -> NativeState:
    """Whether this interpreter should import the compiled modules, and why not."""
    if not group_library(package).exists():
        return NativeState(False, "not built for this interpreter: make, or python -m daemon.native build")
    if env.get(ENV, "") == "0":
        return NativeState(False, f"{ENV}=0")
    record = _recorded(package)
    if record is None or record.get("modules") != list(modules):
        return NativeState(False, "the build's record is missing or for other modules: rebuild")
    if not _sources_current(package, record, modules):
        return NativeState(False, "stale: the sources changed since the build; make rebuilds")
    if any(not extension_of(m, package).exists() for m in modules):
        return NativeState(False, "the build is incomplete: rebuild")
    return NativeState(True, "compiled")


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Imports the compiled modules from their source files, ahead of the path finder (which
    prefers an extension beside a source)."""

    def __init__(self, package: Path, modules: Sequence[str]) -> None:
        self.package = package
        self.modules = frozenset(modules)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, source_of(fullname, self.package))


STATE = NativeState(False, "not inspected")


def select() -> NativeState:
    """Called once by `daemon/__init__.py`, before any of `MODULES` is imported."""
    global STATE
    if any(m in sys.modules for m in MODULES):
        return STATE  # imported already (this module reloaded): too late to choose
    STATE = inspect()
    if not STATE.compiled and group_library().exists():
        sys.meta_path.insert(0, _SourceFirst(PACKAGE, MODULES))
    return STATE


def imported_compiled() -> bool:
    """Whether the modules imported so far are the extensions (what tests check `STATE` by)."""
    loaded = [sys.modules[m] for m in MODULES if m in sys.modules]
    return bool(loaded) and all(str(getattr(m, "__file__", "")).endswith(suffix()) for m in loaded)
