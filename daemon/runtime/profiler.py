"""Latency profiles: LOAD time and INFER time per batch size, measured on a real executor.

`escapement profile` measures every model in a repository on one device and stores the result
beside the model file as `profile.json`, keyed by device kind and hardware model (see
`profile_key`), so that one repository can hold the profiles of several device models:

    {"format": 2,
     "cpu:Intel(R) Xeon(R) Platinum 8480+": {"device": "cpu:0", "model": "Intel(R) Xeon(R) ...",
             "measured": "2026-11-21T00:00:00+00:00", "reps": 20, "percentile": 99,
             "load_ms": 1.9, "load_first_ms": 9.5,
             "infer_ms": {"1": 0.31, "2": 0.36, ...}, "infer_median_ms": {...}},
     "cuda:NVIDIA H100 80GB HBM3": {...}}

`load_ms` is for a block the device has held before (reused memory); `load_first_ms` is the
first LOAD onto fresh memory. `load_share`, when present (below 1), says the measured LOADs copied
only that share of the model's bytes: the device held some of its weights already (a backbone
another resident variant shares), so `load_ms` is a partial LOAD's time and seeds the estimates
as one (`Estimator.observe_load`), never as a full LOAD's.

At start-up the daemon seeds its estimates from these; a model with no profile for the device
kind and model it will run on is measured the same way on first load (warm-up) before it is
reported ready, and the result is written back when the repository is writable.

Callers that key estimates by device kind alone may pass a bare kind ("cpu") instead of a
key: it stands for this host's model of that kind (`devices.host_model`). read_profile lists
the entry of that model under the kind as well, and write_profile stores an entry given
under a kind by the model it was measured on.

A stored profile is a cache of measurements, so anything wrong with it costs a measurement,
never the model: the file is read only if it is a regular file of at most `MAX_PROFILE_BYTES`,
and every entry is checked (types, finite, positive, bounded, an INFER time for every batch
size the model runs at, the model its key names); a bad file or entry is ignored with one
WARNING and measured again.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import queue
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from daemon.actions import WARMUP_IDS, Action, ActionKind, Result
from daemon.clock import Clock
from daemon.files import read_regular
from daemon.model import ModelSpec
from daemon.model_config import MAX_BATCH_SIZE
from daemon.request import InferenceRequest
from daemon.runtime.backend import Backend
from daemon.runtime.devices import MAX_MODEL_CHARS, Device, host_model
from daemon.runtime.executor import Executor
from daemon.runtime.program import Program

log = logging.getLogger("escapement.profile")

PROFILE_FILE = "profile.json"
# Format 1 (no "format" field) keyed entries by device kind alone ("cuda"), with no word of
# the model they were measured on: an A100's profile seeded an H100. Such entries are not
# matched by kind (that is the bug) but measured again, once per model version and device
# model, and stored by kind and model; measuring costs seconds at start-up, a wrong seed costs
# refused or late requests until the online estimates have corrected it.
PROFILE_FORMAT = 2
PERCENTILE = 99
MAX_PROFILE_BYTES = 1 << 20  # a profile is a few kB per device model; this only stops a runaway file
MAX_DURATION_MS = 3_600_000.0  # an hour: no LOAD or INFER the daemon schedules takes longer
KINDS = ("cpu", "cuda", "emucuda", "sim")
_KEY_RE = re.compile(rf"({'|'.join(KINDS)}):([^\x00-\x1f\x7f]{{1,{MAX_MODEL_CHARS}}})")
_BATCH_RE = re.compile(r"[1-9][0-9]{0,3}")  # canonical: "01" would be a second key for batch size 1


class ProfileError(ValueError):
    """A stored profile entry that cannot be used; the message says why."""


def profile_key(device: Device) -> str | None:
    """What a device's profiles are stored under: "kind:model" ("cuda:NVIDIA H100 80GB HBM3").
    None for a device of unknown model: its profiles are neither reused nor stored."""
    return f"{device.kind}:{device.model}" if device.model else None


def profile_path(spec: ModelSpec) -> Path:
    """`profile.json` beside model.pt2 / model.ts; `<stem>.profile.json` beside other files
    (a parity model shares its model's version directory)."""
    if spec.path.stem == "model":
        return spec.path.parent / PROFILE_FILE
    return spec.path.parent / f"{spec.path.stem}.{PROFILE_FILE}"


# ---------------------------------------------------------------- checking stored entries


def _show(v: Any) -> str:
    """A value for a message, cut short (a bad entry may hold anything)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _duration(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and 0 < v <= MAX_DURATION_MS):
        raise ProfileError(f"{what} = {_show(v)}: expected milliseconds in (0, {MAX_DURATION_MS:.0f}]")
    return float(v)


def _batch_times(v: Any, what: str) -> dict[str, float]:
    if not isinstance(v, dict) or not v:
        raise ProfileError(f"{what} = {_show(v)}: expected an object of batch size -> milliseconds")
    out: dict[str, float] = {}
    for b, ms in v.items():
        if not isinstance(b, str) or not _BATCH_RE.fullmatch(b) or int(b) > MAX_BATCH_SIZE:
            raise ProfileError(f"{what}: batch size {_show(b)} is not an integer in 1..{MAX_BATCH_SIZE}")
        out[b] = _duration(ms, f"{what}[{b}]")
    return out


def _share(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and 0 < v <= 1):
        raise ProfileError(f"{what} = {_show(v)}: expected a share in (0, 1]")
    return float(v)


def _count(lo: int, hi: int) -> Callable[[Any, str], int]:
    def check(v: Any, what: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ProfileError(f"{what} = {_show(v)}: expected an integer in {lo}..{hi}")
        return v

    return check


def _text(limit: int) -> Callable[[Any, str], str]:
    def check(v: Any, what: str) -> str:
        if not isinstance(v, str) or len(v) > limit:
            raise ProfileError(f"{what} = {_show(v)}: expected a string of at most {limit} characters")
        return v

    return check


def _percentile(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and 0 < v <= 100):
        raise ProfileError(f"{what} = {_show(v)}: expected a percentile in (0, 100]")
    return v


_REQUIRED: dict[str, Callable[[Any, str], Any]] = {
    "device": _text(64),
    "load_ms": _duration,
    "infer_ms": _batch_times,
}
_OPTIONAL: dict[str, Callable[[Any, str], Any]] = {
    "model": _text(MAX_MODEL_CHARS),
    "measured": _text(64),
    "reps": _count(1, 1_000_000),
    "percentile": _percentile,
    "load_first_ms": _duration,
    "load_share": _share,
    "infer_median_ms": _batch_times,
    "device_bytes": _count(0, 1 << 60),
    "notes": _text(4096),
}


def split_key(key: Any) -> tuple[str, str]:
    """(kind, model) of a stored profile's key; ProfileError if it is not "kind:model"."""
    m = _KEY_RE.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        raise ProfileError(f"key {_show(key)} is not 'kind:model' (kind: {', '.join(KINDS)})")
    return m[1], m[2]


def check_entry(raw: Any, batch_sizes: tuple[int, ...], model: str) -> dict[str, Any]:
    """A profile entry of a device `model`, checked; ProfileError if a field has the wrong type
    or an insane value, if it says it was measured on another model, or if it lacks an INFER
    time for a batch size the model runs at (it was measured for another max_batch_size).
    Unknown fields are dropped, not refused: a later release may add some without a new format,
    and what is handed back (and written again) holds only checked values."""
    if not isinstance(raw, dict):
        raise ProfileError(f"expected an object, not {type(raw).__name__}")
    entry: dict[str, Any] = {}
    for name, check in _REQUIRED.items():
        if name not in raw:
            raise ProfileError(f"{name} is missing")
        entry[name] = check(raw[name], name)
    for name, check in _OPTIONAL.items():
        if name in raw:
            entry[name] = check(raw[name], name)
    if entry.setdefault("model", model) != model:
        raise ProfileError(f"model = {_show(entry['model'])}, but it is stored for {_show(model)}")
    missing = [b for b in batch_sizes if str(b) not in entry["infer_ms"]]
    if missing:
        raise ProfileError(f"infer_ms has no time for batch sizes {missing} (measured for another max_batch_size)")
    return entry


# ---------------------------------------------------------------- the file


def _load(spec: ModelSpec, quiet: bool) -> dict[str, Any]:
    """The stored profile file's top-level object ({} if there is none we can use)."""
    p = profile_path(spec)
    warn = log.debug if quiet else log.warning
    try:
        data = json.loads(read_regular(p, MAX_PROFILE_BYTES))
    except FileNotFoundError:
        return {}
    except OSError as e:  # not a regular file, too large, unreadable, a symlink loop
        warn("%s: ignoring %s (measured again): %s", spec.key, p, e.strerror or e)
        return {}
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep, an integer too long
        warn("%s: ignoring %s (measured again): not valid JSON: %s", spec.key, p, _show(str(e)))
        return {}
    if not isinstance(data, dict):
        warn("%s: ignoring %s (measured again): expected an object, not %s", spec.key, p, type(data).__name__)
        return {}
    fmt = data.get("format")
    if fmt is None:  # outdated, not broken
        (log.debug if quiet else log.info)("%s: %s is of format 1 (keyed by device kind only): measured again",
                                           spec.key, p)
        return {}
    if isinstance(fmt, bool) or fmt != PROFILE_FORMAT:
        warn("%s: ignoring %s (measured again): format %s is not %d", spec.key, p, _show(fmt), PROFILE_FORMAT)
        return {}
    return data


def _read(spec: ModelSpec, quiet: bool) -> dict[str, dict[str, Any]]:
    """The usable entries of the stored profile, by "kind:model" key."""
    out: dict[str, dict[str, Any]] = {}
    for key, raw in _load(spec, quiet).items():
        if key == "format":
            continue
        try:
            out[key] = check_entry(raw, spec.batch_sizes, split_key(key)[1])
        except ProfileError as e:
            if not quiet:
                log.warning("%s: ignoring the stored profile %s (measured again): %s", spec.key, _show(key), e)
    return out


def read_profile(spec: ModelSpec) -> dict[str, dict[str, Any]]:
    """The usable entries of a model version's stored profile ({} if none), by "kind:model"
    key, and by bare kind as well for the entry of this host's model of that kind (see
    devices.host_model). Whatever the file holds, this neither raises nor hands back an
    unchecked entry; each entry unused for that costs one WARNING."""
    entries = _read(spec, quiet=False)
    for kind in {split_key(key)[0] for key in entries}:
        local = host_model(kind)
        if local and f"{kind}:{local}" in entries:
            entries[kind] = entries[f"{kind}:{local}"]
    return entries


def seeds(entry: dict[str, Any]) -> tuple[dict[int, float], float | None, float]:
    """(batch size -> seconds, LOAD seconds, the share of the model's bytes that LOAD copied) from
    one checked profile entry."""
    infer = {int(b): float(ms) / 1e3 for b, ms in entry.get("infer_ms", {}).items()}
    load = entry.get("load_ms")
    return infer, (float(load) / 1e3 if load is not None else None), float(entry.get("load_share", 1.0))


def _qualified(key: str, entry: dict[str, Any]) -> str:
    """`key` as "kind:model": a bare kind takes the model the entry was measured on, else this
    host's model of that kind; ProfileError when neither is known."""
    if key not in KINDS:
        return key
    model = entry.get("model") if isinstance(entry, dict) else None
    model = model if isinstance(model, str) and model else host_model(key)
    if not model:
        raise ProfileError(f"the model of the {key} device it was measured on is unknown")
    return f"{key}:{model}"


def write_profile(spec: ModelSpec, key: str, entry: dict[str, Any]) -> bool:
    """Merge one entry into the stored profile under `key` ("kind:model", see profile_key; a
    bare kind is qualified by the entry's model); False if it was not stored (a read-only
    repository, a device of unknown model, an entry a later read would refuse)."""
    try:
        key = _qualified(key, entry)
        entry = check_entry(entry, spec.batch_sizes, split_key(key)[1])
    except ProfileError as e:
        log.warning("%s: profile not stored: %s", spec.key, e)
        return False
    p = profile_path(spec)
    data: dict[str, Any] = {"format": PROFILE_FORMAT, **_read(spec, quiet=True)}  # the other usable entries
    data[key] = entry
    try:
        _replace(p, (json.dumps(data, indent=2, allow_nan=False) + "\n").encode())
        return True
    except OSError as e:
        log.info("%s: profile not stored (%s)", spec.key, e.strerror or e)
        return False


def _replace(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all, through a temporary file of a fresh name beside it (two
    writers never share one, and nothing left under an old name, a FIFO say, is opened)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # a cache anyone who may read the model may read
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
                      reply=results.post, id=next(WARMUP_IDS), **kw)

    infer: dict[int, list[float]] = {}
    rng = np.random.default_rng(0)
    loads = []
    copied = []  # bytes each LOAD charged: less than the footprint where the device held some already
    for _ in range(max(3, reps // 3)):  # LOAD, then UNLOAD again, a few times
        r = run(act(ActionKind.LOAD))
        loads.append(r.end - r.begin)
        copied.append(r.weight_bytes)
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
    share = float(np.median(copied[1:])) / entry["device_bytes"] if entry["device_bytes"] else 1.0
    if share < 1.0:
        entry["load_share"] = round(max(share, 1e-6), 6)
    if executor.device.model:
        entry["model"] = executor.device.model
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
