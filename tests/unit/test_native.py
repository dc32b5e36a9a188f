"""The compiled controller's guards (daemon/native): an extension runs only while it was built
from the sources on disk, all modules or none; and compiled or not, the controller decides alike."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon import native

MODS = ("pkg.a", "pkg.sub.b")


def _tree(tmp_path: Path) -> Path:
    """A package with two modules, built: extensions (stand-ins) and a current record."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for m in MODS:
        native.source_of(m, package).write_text(f"NAME = {m!r}\n")
        native.extension_of(m, package).write_bytes(b"not a real extension")
    native.group_library(package).write_bytes(b"not a real library")
    native.manifest(package).write_text(json.dumps(native.record(package, MODS)))
    return package


def test_a_current_build_is_used(tmp_path: Path) -> None:
    package = _tree(tmp_path)
    state = native.inspect(package, MODS, env={})
    assert state.compiled and str(state) == "compiled (mypyc)"


def test_no_build_or_switched_off_means_source(tmp_path: Path) -> None:
    package = _tree(tmp_path)
    assert "ESCAPEMENT_NATIVE=0" in native.inspect(package, MODS, env={"ESCAPEMENT_NATIVE": "0"}).why
    native.group_library(package).unlink()
    state = native.inspect(package, MODS, env={})
    assert not state.compiled and "not built" in state.why


def test_an_edited_source_makes_the_whole_build_stale(tmp_path: Path) -> None:
    package = _tree(tmp_path)
    src = native.source_of("pkg.sub.b", package)
    src.write_text(src.read_text() + "EDITED = True\n")
    state = native.inspect(package, MODS, env={})
    assert not state.compiled and "stale" in state.why


def test_a_rewritten_but_equal_source_is_still_current(tmp_path: Path) -> None:
    """A checkout rewrites files (new mtimes, same bytes): the digest decides, not the mtime."""
    package = _tree(tmp_path)
    src = native.source_of("pkg.a", package)
    text = src.read_text()
    later = time.time_ns() + 10**9
    src.write_text(text)
    os.utime(src, ns=(later, later))
    assert native.inspect(package, MODS, env={}).compiled


def test_a_missing_extension_or_record_is_not_used(tmp_path: Path) -> None:
    package = _tree(tmp_path)
    native.extension_of("pkg.a", package).unlink()
    assert "incomplete" in native.inspect(package, MODS, env={}).why
    package = _tree(tmp_path / "again")
    native.manifest(package).write_text(json.dumps(native.record(package, MODS[:1])))
    assert "record" in native.inspect(package, MODS, env={}).why


def test_the_source_finder_imports_sources_ahead_of_extensions(tmp_path: Path) -> None:
    """Without the finder, the path finder prefers the (here broken) extension beside a source;
    with it, the source is what loads."""
    package = _tree(tmp_path)
    finder = native._SourceFirst(package, MODS)  # noqa: SLF001
    spec = finder.find_spec("pkg.sub.b", None)
    assert spec is not None and spec.origin == str(native.source_of("pkg.sub.b", package))
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    assert module.NAME == "pkg.sub.b"
    assert finder.find_spec("pkg.other", None) is None  # only the compiled set is redirected
    plain = importlib.machinery.PathFinder.find_spec("a", [str(package)])
    assert plain is not None and plain.origin is not None and plain.origin.endswith(native.suffix())


def test_what_was_imported_is_what_the_state_says() -> None:
    import daemon.controller.scheduler  # noqa: F401

    assert native.imported_compiled() == native.STATE.compiled


_DECIDE = """
import hashlib, sys
import numpy as np
from daemon import native
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.sim import Simulation, clockwork_models

ms = clockwork_models(200)
sim = Simulation(ms, 4, ClockworkPolicy(), weight_budget=4 * 2**30, seed=3)
rate, seconds = 6000.0, 0.4
times = np.cumsum(np.random.default_rng(1).exponential(1 / rate, int(rate * seconds)))
targets = np.random.default_rng(2).integers(0, len(ms), len(times))
h = hashlib.sha256()
step = sim.driver.step
class Rec:
    def __init__(self, d): self.d = d
    def submit(self, r, now): self.d.submit(r, now)
    def next_wakeup(self, now): return self.d.next_wakeup(now)
    def step(self, now, results=(), on_error=None):
        d = self.d.step(now, results, on_error)
        for a in d.actions:
            h.update(repr((a.kind.name, a.model.key, a.device, a.earliest, a.latest, a.batch_size,
                           [r.arrival for r in a.requests])).encode())
        for r in d.finished:
            h.update(repr((r.arrival, r.status.name, r.finished_at)).encode())
        return d
sim.driver = Rec(sim.driver)
sim.run(times, targets, [m[0].key for m in ms], drain_s=1.0)
print(native.imported_compiled(), h.hexdigest())
"""


def test_compiled_and_source_controllers_decide_alike() -> None:
    """Every action and answer of a simulation, in order, from the extensions and from the source."""
    if not native.STATE.compiled:
        pytest.skip(f"the controller is not compiled here: {native.STATE}")
    out = {}
    for flag in ("1", "0"):
        env = os.environ | {"ESCAPEMENT_NATIVE": flag}
        res = subprocess.run([sys.executable, "-c", _DECIDE], env=env, capture_output=True, text=True,
                             timeout=300, check=True)
        out[flag] = res.stdout.split()
    assert out["1"][0] == "True" and out["0"][0] == "False"
    assert out["1"][1] == out["0"][1]


def test_a_build_finds_the_extensions_of_modules_it_no_longer_compiles(tmp_path: Path) -> None:
    from daemon.native.__main__ import stale_extensions

    pkg = tmp_path / "daemon"
    (pkg / "api").mkdir(parents=True)
    (pkg / "api" / "old.py").write_text("")
    old = pkg / "api" / "old.cpython-311-x86_64-linux-gnu.so"  # built when MODULES held it
    old.write_bytes(b"")
    (pkg / "api" / "vendored.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # no source: not ours
    (pkg / "_native__mypyc.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # the group library
    kept = native.extension_of(native.MODULES[0], pkg)  # a module still compiled
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(b"")
    native.source_of(native.MODULES[0], pkg).write_text("")
    assert stale_extensions(pkg) == [old]
