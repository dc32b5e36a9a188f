"""Latency profiles: LOAD time and INFER time per batch size, measured on a real executor.

`escapement profile` measures every model in a repository on one device and stores the result
beside the model file as `profile.json`, keyed by device kind:

    {"cpu": {"device": "cpu:0", "measured": "2026-11-21T00:00:00+00:00", "reps": 20,
             "percentile": 99, "load_ms": 1.9, "load_first_ms": 9.5,
             "infer_ms": {"1": 0.31, "2": 0.36, ...}, "infer_median_ms": {...}}}

`load_ms` is for a block the device has held before (reused memory); `load_first_ms` is the
first LOAD onto fresh memory.

At start-up the daemon seeds its estimates from these; a model with no profile for a device
kind it will run on is measured the same way on first load (warm-up) before it is reported
ready, and the result is written back when the repository is writable.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import queue
from pathlib import Path
from typing import Any

import numpy as np

from daemon.actions import Action, ActionKind, Result
from daemon.clock import Clock
from daemon.repository import ModelSpec
from daemon.request import InferenceRequest
from daemon.runtime.backend import Backend
from daemon.runtime.devices import Device
from daemon.runtime.executor import Executor
from daemon.runtime.program import Program

log = logging.getLogger("escapement.profile")

PROFILE_FILE = "profile.json"
PERCENTILE = 99


def profile_path(spec: ModelSpec) -> Path:
    """`profile.json` beside model.pt2 / model.ts; `<stem>.profile.json` beside other files
    (a parity model shares its model's version directory)."""
    if spec.path.stem == "model":
        return spec.path.parent / PROFILE_FILE
    return spec.path.parent / f"{spec.path.stem}.{PROFILE_FILE}"


def read_profile(spec: ModelSpec) -> dict[str, dict[str, Any]]:
    """The stored profile of a model version, by device kind ({} if none or unreadable)."""
    p = profile_path(spec)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("%s: ignoring unreadable %s: %s", spec.key, p, e)
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and "infer_ms" in v}


def seeds(entry: dict[str, Any]) -> tuple[dict[int, float], float | None]:
    """(batch size -> seconds, LOAD seconds) from one device kind's profile entry."""
    infer = {int(b): float(ms) / 1e3 for b, ms in entry.get("infer_ms", {}).items()}
    load = entry.get("load_ms")
    return infer, (float(load) / 1e3 if load is not None else None)


def write_profile(spec: ModelSpec, kind: str, entry: dict[str, Any]) -> bool:
    """Merge one device kind's entry into the stored profile; False if the repository is read-only."""
    p = profile_path(spec)
    data = read_profile(spec)
    data[kind] = entry
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(p)
        return True
    except OSError as e:
        log.info("%s: profile not stored (%s)", spec.key, e.strerror)
        return False


class ResultQueue:
    def __init__(self) -> None:
        self.q: queue.Queue[Result] = queue.Queue()

    def post(self, r: Result) -> None:
        self.q.put(r)

    def get(self) -> Result:
        return self.q.get(timeout=600)


def measure(executor: Executor, program: Program, clock: Clock, reps: int = 10, warmup: int = 2,
            holder: str = "") -> dict[str, Any]:
    """LOAD the model, run every batch size `warmup + reps` times, UNLOAD; the profile entry.

    The actions go straight to the executor (which may be serving the controller's work at the
    same time) and come back here; the weights are held under `holder` (default: the model's key).
    """
    spec = program.spec
    results = ResultQueue()

    def run(action: Action) -> Result:
        executor.submit(action)
        r = results.get()
        if not r.ok:
            raise RuntimeError(f"profiling {spec.key} on {executor.device.name}: {action.kind.name} failed: {r.error}")
        return r

    def act(kind: ActionKind, **kw: Any) -> Action:
        now = clock.now()
        return Action(kind, spec, executor.device.name, now, now + 600, program=program, resident=holder,
                      reply=results.post, **kw)

    infer: dict[int, list[float]] = {}
    rng = np.random.default_rng(0)
    loads = []
    for _ in range(max(3, reps // 3)):  # LOAD, then UNLOAD again, a few times
        r = run(act(ActionKind.LOAD))
        loads.append(r.end - r.begin)
        run(act(ActionKind.UNLOAD))
    # The first LOAD lands on fresh memory (page faults); later ones reuse a freed block, as
    # loads of a model the device has held before do.
    run(act(ActionKind.LOAD))
    notes = executor.resident[holder or spec.key].notes
    try:
        for b in spec.batch_sizes:
            xs = tuple((rng.random((b, *t.sample_shape)) if t.datatype.numpy.kind == "f"
                        else np.zeros((b, *t.sample_shape))).astype(t.datatype.numpy) for t in spec.inputs)
            req = InferenceRequest(spec, xs, b, 0.0, 0.0)
            times = []
            for k in range(warmup + reps):
                r = run(act(ActionKind.INFER, batch_size=b, requests=[req]))
                if k >= warmup:
                    times.append(r.end - r.begin)
            infer[b] = times
    finally:
        run(act(ActionKind.UNLOAD))
    entry: dict[str, Any] = {
        "device": executor.device.name,
        "measured": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "reps": reps,
        "percentile": PERCENTILE,
        "load_ms": float(np.percentile(loads[1:], PERCENTILE)) * 1e3,
        "load_first_ms": loads[0] * 1e3,
        "infer_ms": {str(b): float(np.percentile(t, PERCENTILE)) * 1e3 for b, t in infer.items()},
        "infer_median_ms": {str(b): float(np.median(t)) * 1e3 for b, t in infer.items()},
        "device_bytes": executor.footprint(program),
    }
    if notes:
        entry["notes"] = notes
    return entry


def profile_program(program: Program, device: Device, backend: Backend, clock: Clock, reps: int) -> dict[str, Any]:
    """Measure one program on `device` with an executor of its own, started and stopped here
    (`escapement profile`: no daemon serves on the device meanwhile)."""
    ex = Executor(device, backend, clock, lambda r: None, {program.spec.key: program})
    ex.start()
    try:
        return measure(ex, program, clock, reps=reps, warmup=2)
    finally:
        ex.stop()
