"""The model repository: `<repo>/<model>/config.toml` and `<repo>/<model>/<version>/model.pt2|ts`.

`config.toml` of a model::

    description = "MLP trained on scikit-learn digits"
    max_batch_size = 32          # batch sizes run are the powers of two up to this
    slo_ms = 100                 # default SLO; a request may ask for a tighter one
    [[inputs]]
    name = "INPUT__0"
    datatype = "FP32"
    shape = [-1, 64]             # -1 is the batch dimension, and must come first
    [[outputs]]
    name = "OUTPUT__0"
    datatype = "FP32"
    shape = [-1, 10]
    [metadata]                   # free-form facts reported with the model (accuracy, ...)
    test_accuracy = 0.97
    [queue_policy]               # Triton's queue policy (optional; the daemon's [controller] defaults)
    default_timeout_ms = 0       # a request without a timeout gets this one; 0: the SLO is a target
    timeout_action = "delay"     # "reject" or "delay": what a timeout does to a request that cannot make it
    allow_timeout_override = true
    max_queue_size = 0           # queued requests of this model at most (0: controller.max_pending_per_model)
    max_wait_s = 30              # the longest a late or best-effort request waits (then 504)
    priority_levels = 0          # Triton's: priorities 1..N; 0 or above N gets the default level (0: no limit)
    default_priority_level = 0   # the level of a request that gives none (0: controller.default_priority)
    [queue_policy.levels.20]     # one priority level's own policy (Triton's priority_queue_policy)
    best_effort = true           # requests of this level start in the best-effort lane
    [personalization]            # Velox-style per-user weights on a feature output (daemon/apps/personal.py)
    features = "features"        # the output holding each sample's feature vector, shape [-1, d]
    head = "head.npz"            # in each version directory: W (d+1, C), the bias as the last row
    output = "personalized"      # the output added for a request naming a user
    prior = 1.0                  # RLS: P0 = prior * I (how far feedback may move W from the head)
    forgetting = 1.0             # RLS forgetting factor lambda in (0, 1]
    target_scale = 0             # feedback targets are +-s; 0: head.npz's "scale" (else 1.0)

A model may instead be a plan of stages (Pretzel): `stages = ["../../.stages/backbone.pt2",
"head.pt2"]` lists torch.export programs, relative to each version directory, that run in turn
(each takes the previous one's outputs); its version directories then hold no model file.
Stages identical across models (same graph, same weights) are found by content at load.

A model directory may instead hold its file bare, as a storage URI (KServe's storage initializer
or model agent) delivers it: `<repo>/<model>/model.pt2` (or model.ts) is served as version 1, with
a config.toml beside it or, for model.pt2 without one, the config its exported program implies
(daemon/signature.py). A `SUCCESS.<sha256>` file that KServe's model agent left in a model
directory declares the TrainedModel's memory (daemon/kserve.py), which the model must fit in.

Scanning never raises for one bad entry: each broken model is reported with its reason and
the rest are served. The scan never opens what is not a regular file (a FIFO would block it
forever), reads at most `MAX_CONFIG_BYTES` of a config, and takes as versions only directories
named by 1 to `MAX_VERSION_DIGITS` ASCII digits; every entry it skips costs one WARNING line.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daemon import kserve
from daemon.datatypes import KNOWN_UNSUPPORTED, WIRE_ONLY, lookup
from daemon.errors import AgentFileError, ModelConfigError, RefusedFile, SignatureError
from daemon.model import (
    Layout,
    ModelFormat,
    ModelSpec,
    ParitySpec,
    PersonalConfig,
    PersonalSpec,
    QueueLevel,
    QueuePolicy,
    TensorSpec,
)
from daemon.signature import inferred_config

log = logging.getLogger("escapement.repository")

MODEL_FILES: dict[str, ModelFormat] = {"model.pt2": "pt2", "model.ts": "ts"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_KNOWN_KEYS = {"name", "description", "max_batch_size", "slo_ms", "inputs", "outputs", "metadata", "parity",
               "preload_replicas", "queue_policy", "response_cache", "personalization", "stages",
               "default_output"}
MAX_STAGES = 8
STAGED_FILE = "model.stages"  # a staged version's `path`: a name in its directory, never a file
_QUEUE_KEYS = {"default_timeout_ms", "timeout_action", "allow_timeout_override", "max_queue_size", "max_wait_s"}
_PARITY_KEYS = {"k", "encoder", "file", "enabled", "flush_ms", "accuracy"}
_PERSONAL_KEYS = {"features", "head", "output", "prior", "forgetting", "target_scale"}
MAX_HEAD_BYTES = 256 << 20  # a head is (d+1) x C floats; this only stops a runaway file
MAX_BATCH_SIZE = 4096
MAX_CONFIG_BYTES = 1 << 20  # a config.toml is a few hundred bytes; this only stops a runaway file
# Versions travel as int64 (KServe's version strings, msgpack, metrics labels): 18 digits stay
# below 2**63, and int() of a bounded ASCII string can neither refuse it (Python's 4300-digit
# limit) nor read other scripts' digits ("²" passes str.isdigit() and int() refuses it; "٣" is 3).
MAX_VERSION_DIGITS = 18
_VERSION_RE = re.compile(rf"[0-9]{{1,{MAX_VERSION_DIGITS}}}")


def file_type(mode: int) -> str:
    """What a stat mode is, in words (for messages)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "of an unknown type"


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file (symlinks followed) of at most `limit` bytes.

    RefusedFile for anything else, OSError when it cannot be opened (missing, permission, a
    symlink loop). O_NONBLOCK keeps the open of a FIFO from waiting for a writer forever, and
    the type is checked on the open descriptor, so a swap after a check cannot slip through.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(f"{path.name} is {file_type(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise RefusedFile(f"{path.name} is {st.st_size} bytes, more than the {limit} read")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # the file may grow while it is read: never take more than limit + 1
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise RefusedFile(f"{path.name} is more than the {limit} bytes read")
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass(slots=True)
class ScanResult:
    models: list[ModelSpec]
    broken: dict[str, str]  # model name -> reason


def _tensor_specs(raw: Any, what: str, model: str) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ModelConfigError(f"{model}: config.toml needs at least one [[{what}]] table")
    specs: list[TensorSpec] = []
    for i, t in enumerate(raw):
        where = f"{model}: {what}[{i}]"
        if not isinstance(t, dict):
            raise ModelConfigError(f"{where}: expected a table with name, datatype and shape")
        unknown = set(t) - {"name", "datatype", "shape"}
        if unknown:
            raise ModelConfigError(f"{where}: unknown keys {sorted(unknown)}")
        name, dt_name, shape = t.get("name"), t.get("datatype"), t.get("shape")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ModelConfigError(f"{where}: name {name!r} must be 1-128 letters, digits, '_', '.', '-'")
        dt = lookup(dt_name) if isinstance(dt_name, str) else None
        if dt is None:
            hint = " (not supported by torch models here)" if dt_name in KNOWN_UNSUPPORTED else ""
            raise ModelConfigError(f"{where}: datatype {dt_name!r} is not supported{hint}")
        if dt.name in WIRE_ONLY:
            raise ModelConfigError(f"{where}: datatype {dt.name} is understood on the wire, but models cannot take "
                                   "or give it yet (the runtime has no IO buffers for it)")
        if (not isinstance(shape, list) or len(shape) < 1
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            raise ModelConfigError(f"{where}: shape {shape!r} must be a list of integers")
        if shape[0] != -1:
            raise ModelConfigError(f"{where}: shape {shape} must start with -1, the batch dimension")
        if any(d < 1 for d in shape[1:]):
            raise ModelConfigError(f"{where}: shape {shape}: only the batch dimension may be variable")
        specs.append(TensorSpec(name, dt, tuple(shape)))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ModelConfigError(f"{model}: duplicate {what} names {names}")
    return tuple(specs)


def _parity(raw: Any, name: str, slo_ms: float) -> ParitySpec | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{name}: [parity] must be a table")
    unknown = set(raw) - _PARITY_KEYS
    if unknown:
        raise ModelConfigError(f"{name}: unknown keys in [parity]: {sorted(unknown)}")
    if raw.get("enabled", True) is False:
        return None
    k, enc, file = raw.get("k"), raw.get("encoder", "sum"), raw.get("file")
    if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= 8:
        raise ModelConfigError(f"{name}: [parity] k = {k!r}: expected an integer in 2..8")
    if enc not in ("sum", "concat"):
        raise ModelConfigError(f"{name}: [parity] encoder = {enc!r}: expected 'sum' or 'concat'")
    if not isinstance(file, str) or "/" in file or not file.endswith(".pt2"):
        raise ModelConfigError(f"{name}: [parity] file = {file!r}: expected a .pt2 file name in the version directory")
    flush = raw.get("flush_ms", slo_ms / 4)
    if isinstance(flush, bool) or not isinstance(flush, int | float) or not 0 < flush <= 3_600_000:
        raise ModelConfigError(f"{name}: [parity] flush_ms = {flush!r}: expected a positive number of milliseconds")
    return ParitySpec(k, enc, file, float(flush))


def _queue_level(raw: Any, where: str, level: bool) -> QueueLevel:
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where} must be a table")
    known = _QUEUE_KEYS | ({"best_effort"} if level else set())
    unknown = set(raw) - known
    if unknown:
        raise ModelConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known)})")

    def number(key: str, lo: float, hi: float) -> float | None:
        v = raw.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
            raise ModelConfigError(f"{where}: {key} = {v!r}: expected a number in [{lo:g}, {hi:g}]")
        return float(v)

    action = raw.get("timeout_action")
    if action is not None and action not in ("reject", "delay"):
        raise ModelConfigError(f"{where}: timeout_action = {action!r}: expected 'reject' or 'delay'")
    for key in ("allow_timeout_override", "best_effort"):
        if key in raw and not isinstance(raw[key], bool):
            raise ModelConfigError(f"{where}: {key} = {raw[key]!r}: expected true or false")
    size = raw.get("max_queue_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= 10**7):
        raise ModelConfigError(f"{where}: max_queue_size = {size!r}: expected an integer in 0..10000000")
    wait = number("max_wait_s", 0.0, 3600.0)
    if wait == 0.0:
        raise ModelConfigError(f"{where}: max_wait_s = 0: expected a number in (0, 3600]")
    return QueueLevel(number("default_timeout_ms", 0.0, 3.6e6), action, raw.get("allow_timeout_override"), size,
                      wait, bool(raw.get("best_effort", False)))


def _queue_policy(raw: Any, name: str) -> QueuePolicy | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{name}: [queue_policy] must be a table")
    raw = dict(raw)
    counts = []
    for key in ("priority_levels", "default_priority_level"):
        v = raw.pop(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 10**6:
            raise ModelConfigError(f"{name}: [queue_policy] {key} = {v!r}: expected an integer in 0..1000000")
        counts.append(v)
    levels_n, default_level = counts
    if levels_n and default_level > levels_n:
        raise ModelConfigError(f"{name}: [queue_policy] default_priority_level = {default_level} is above "
                               f"priority_levels = {levels_n}")
    levels_raw = raw.pop("levels", {})
    if not isinstance(levels_raw, dict):
        raise ModelConfigError(f"{name}: [queue_policy.levels] must hold one table per priority level")
    levels = []
    for key, value in levels_raw.items():
        if not key.isdigit() or not 1 <= int(key) <= 10**6:
            raise ModelConfigError(f"{name}: [queue_policy.levels.{key}]: a level is a priority, an integer >= 1")
        levels.append((int(key), _queue_level(value, f"{name}: [queue_policy.levels.{key}]", True)))
    return QueuePolicy(_queue_level(raw, f"{name}: [queue_policy]", False), tuple(sorted(levels)), levels_n,
                       default_level)


def parse_model_config(model_dir: Path, default_slo_ms: float) -> dict[str, Any]:
    """The validated contents of `<model_dir>/config.toml` (everything but versions)."""
    name = model_dir.name
    cfg_path = model_dir / "config.toml"
    try:
        raw = tomllib.loads(read_regular(cfg_path, MAX_CONFIG_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise ModelConfigError(f"{name}: no config.toml") from None
    except RefusedFile as e:
        raise ModelConfigError(f"{name}: {e}") from None
    except OSError as e:
        raise ModelConfigError(f"{name}: cannot read config.toml: {e.strerror or e}") from None
    # ValueError: a TOML syntax error, bytes that are not UTF-8, an integer past Python's digit
    # limit; RecursionError: arrays nested thousands deep.
    except (ValueError, RecursionError) as e:
        raise ModelConfigError(f"{name}: config.toml is not valid TOML: {e}") from None
    return check_model_config(raw, name, default_slo_ms)


def check_model_config(raw: dict[str, Any], name: str, default_slo_ms: float) -> dict[str, Any]:
    """A model's config table (from its config.toml, or inferred) validated; ModelConfigError says why not."""
    unknown = set(raw) - _KNOWN_KEYS
    if unknown:
        raise ModelConfigError(f"{name}: unknown keys in config.toml: {sorted(unknown)}")
    if raw.get("name", name) != name:
        raise ModelConfigError(f"{name}: config.toml names the model {raw['name']!r}, but its directory "
                               f"is {name!r}")
    mbs = raw.get("max_batch_size")
    if not isinstance(mbs, int) or isinstance(mbs, bool) or not 1 <= mbs <= MAX_BATCH_SIZE:
        raise ModelConfigError(f"{name}: max_batch_size = {mbs!r}: expected an integer in 1..{MAX_BATCH_SIZE}")
    slo = raw.get("slo_ms", default_slo_ms)
    if isinstance(slo, bool) or not isinstance(slo, int | float) or not 0 < slo <= 3_600_000:
        raise ModelConfigError(f"{name}: slo_ms = {slo!r}: expected a positive number of milliseconds")
    meta = raw.get("metadata", {})
    if not isinstance(meta, dict):
        raise ModelConfigError(f"{name}: [metadata] must be a table")
    desc = raw.get("description", "")
    if not isinstance(desc, str):
        raise ModelConfigError(f"{name}: description must be a string")
    parity = _parity(raw.get("parity"), name, float(slo))
    stages = _stages(raw.get("stages"), name)
    if stages and (parity is not None or raw.get("personalization") is not None):
        raise ModelConfigError(f"{name}: a model of stages cannot have [parity] or [personalization] yet")
    preload = raw.get("preload_replicas", 0)
    if isinstance(preload, bool) or not isinstance(preload, int) or not 0 <= preload <= 64:
        raise ModelConfigError(f"{name}: preload_replicas = {preload!r}: expected an integer in 0..64")
    outputs = _tensor_specs(raw.get("outputs"), "outputs", name)
    return {
        "name": name,
        "inputs": _tensor_specs(raw.get("inputs"), "inputs", name),
        "outputs": outputs,
        "max_batch_size": mbs,
        "slo_s": float(slo) / 1000.0,
        "description": desc,
        "metadata": meta,
        "parity": parity,
        "preload_replicas": preload,
        "queue_policy": _queue_policy(raw.get("queue_policy"), name),
        "response_cache": _response_cache(raw.get("response_cache"), name),
        # a PersonalConfig here; _model_versions makes it each version's PersonalSpec (its head file)
        "personalization": _personal_config(raw.get("personalization"), name, outputs),
        "stages": stages,  # relative paths here; _model_versions resolves them per version
        "default_output": _default_output(raw.get("default_output"), name, outputs),
    }


def _default_output(raw: Any, name: str, outputs: tuple[TensorSpec, ...]) -> tuple[float, ...]:
    """`default_output = [...]`: one sample of the model's only output, numbers its datatype holds."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in raw):
        raise ModelConfigError(f"{name}: default_output = {raw!r:.80}: expected a list of numbers (one sample "
                               "of the output)")
    if len(outputs) != 1:
        raise ModelConfigError(f"{name}: default_output needs a model with one output (it has {len(outputs)})")
    out = outputs[0]
    dt = out.datatype.numpy
    if dt.kind not in "fiub":
        raise ModelConfigError(f"{name}: default_output: output {out.name} is {out.datatype.name}, not numbers")
    if any(d < 0 for d in out.sample_shape):
        raise ModelConfigError(f"{name}: default_output needs output {out.name}'s sample shape fixed "
                               f"(it is {list(out.sample_shape)})")
    if len(raw) != out.sample_elements:
        raise ModelConfigError(f"{name}: default_output has {len(raw)} values, but one sample of output "
                               f"{out.name} has {out.sample_elements} ({list(out.sample_shape)})")
    why = out.misfit(raw)
    if why:
        raise ModelConfigError(f"{name}: default_output {why}")
    return tuple(float(v) for v in raw)


def _stages(raw: Any, name: str) -> tuple[str, ...]:
    """`stages`: 2..MAX_STAGES relative paths of .pt2 programs (an absent key: none)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_STAGES or not all(isinstance(p, str) for p in raw):
        raise ModelConfigError(f"{name}: stages = {raw!r}: expected a list of 2 to {MAX_STAGES} file paths "
                               "(torch.export programs, relative to each version directory)")
    for p in raw:
        if not p.endswith(".pt2") or os.path.isabs(p) or "\\" in p or "\0" in p:
            raise ModelConfigError(f"{name}: stage {p!r}: expected a relative path of a .pt2 file")
    return tuple(raw)


def _staged_version(version_dir: Path, stages: tuple[str, ...], root: Path) -> tuple[Path, ...]:
    """The stage files of one version, resolved; _SkippedVersion when one is missing, unreadable or
    outside the repository (a config may share stages between models, but not reach past `root`)."""
    out = []
    for rel in stages:
        path = (version_dir / rel).resolve()
        if not path.is_relative_to(root.resolve()):
            raise _SkippedVersion(f"version {version_dir.name} is skipped: stage {rel!r} is outside the "
                                  "model repository")
        problem = file_problem(path)
        if problem is not None:
            raise _SkippedVersion(f"version {version_dir.name} is skipped: stage {rel!r}: {problem}")
        out.append(path)
    return tuple(out)


def _staged_versions(model_dir: Path, stages: tuple[str, ...]) -> list[tuple[int, Path, tuple[Path, ...]]]:
    """The servable versions of a model of stages: version directories whose stage files all exist."""
    skipped: list[str] = []
    found = []
    for version, d in sorted(_version_dirs(model_dir, skipped).items()):
        try:
            found.append((version, d / STAGED_FILE, _staged_version(d, stages, model_dir.parent)))
        except _SkippedVersion as e:
            skipped.append(str(e))
    if not found:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise ModelConfigError(f"{model_dir.name}: no version directory holds every stage{why}")
    for why in skipped:
        log.warning("model %s: %s", model_dir.name, why)
    return found


def _response_cache(raw: Any, name: str) -> bool:
    """`[response_cache] enabled = true` (Triton's `response_cache { enable: true }`)."""
    if raw is None:
        return False
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{name}: [response_cache] must be a table, e.g. enabled = true")
    unknown = set(raw) - {"enabled"}
    if unknown:
        raise ModelConfigError(f"{name}: unknown keys in [response_cache]: {sorted(unknown)} (known: ['enabled'])")
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ModelConfigError(f"{name}: [response_cache] enabled = {enabled!r}: expected true or false")
    return enabled


def _personal_config(raw: Any, name: str, outputs: tuple[TensorSpec, ...]) -> PersonalConfig | None:
    """`[personalization]`: which output holds the features, the head's file, the added output's
    name and the RLS prior."""
    if raw is None:
        return None
    where = f"{name}: [personalization]"
    if not isinstance(raw, dict):
        raise ModelConfigError(f'{where} must be a table, e.g. features = "features" and head = "head.npz"')
    unknown = set(raw) - _PERSONAL_KEYS
    if unknown:
        raise ModelConfigError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(_PERSONAL_KEYS)})")
    features, head, out = raw.get("features"), raw.get("head"), raw.get("output", "personalized")
    by_name = {o.name: o for o in outputs}
    if not isinstance(features, str) or features not in by_name:
        raise ModelConfigError(f"{where}: features = {features!r}: expected the name of one of the outputs "
                               f"{sorted(by_name)}")
    f = by_name[features]
    if len(f.shape) != 2 or f.datatype.name not in ("FP16", "FP32", "FP64"):
        raise ModelConfigError(f"{where}: output {features} is {f.datatype.name} {list(f.shape)}: the features "
                               "must be a floating-point [-1, d] output")
    if not isinstance(head, str) or "/" in head or head.startswith(".") or not head.endswith(".npz"):
        raise ModelConfigError(f"{where}: head = {head!r}: expected a .npz file name in the version directory")
    if not isinstance(out, str) or not _NAME_RE.fullmatch(out) or out in by_name:
        raise ModelConfigError(f"{where}: output = {out!r}: expected a new output name (letters, digits, '_', "
                               f"'.', '-'), not one of {sorted(by_name)}")

    def number(key: str, default: float, ok: Any, expected: str) -> float:
        v = raw.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not ok(v):
            raise ModelConfigError(f"{where}: {key} = {v!r}: expected {expected}")
        return float(v)

    return PersonalConfig(features, head, out,
                          number("prior", 1.0, lambda v: 0 < v <= 1e6, "a number in (0, 1e6]"),
                          number("forgetting", 1.0, lambda v: 0.5 <= v <= 1, "a number in [0.5, 1]"),
                          number("target_scale", 0.0, lambda v: 0 <= v <= 1e6, "a number in [0, 1e6] (0: the "
                                 "head's own)"))


def load_head(cfg: PersonalConfig, version_dir: Path, outputs: tuple[TensorSpec, ...]) -> PersonalSpec:
    """A version's PersonalSpec: its head file read and checked against the features output."""
    path = version_dir / cfg.head
    try:
        raw = read_regular(path, MAX_HEAD_BYTES)
    except FileNotFoundError:
        raise ModelConfigError(f"[personalization] head {cfg.head} is missing in {version_dir}") from None
    except OSError as e:  # RefusedFile included
        raise ModelConfigError(f"[personalization] head {cfg.head}: {e.strerror or e}") from None
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # np.load raises several types for a file that is not an npz
        raise ModelConfigError(f"[personalization] head {cfg.head} is not a readable .npz: {e}") from None
    w = arrays.get("W")
    index = next(i for i, o in enumerate(outputs) if o.name == cfg.features)
    dim = outputs[index].shape[1]
    if not isinstance(w, np.ndarray) or w.ndim != 2 or w.shape[0] != dim + 1 or w.shape[1] < 1 or \
            w.dtype.kind != "f" or not np.isfinite(w).all():
        got = f"{w.dtype} {list(w.shape)}" if isinstance(w, np.ndarray) else "nothing"
        raise ModelConfigError(f"[personalization] head {cfg.head}: W must be finite floats of shape "
                               f"[{dim + 1}, C] (features {cfg.features} has {dim}, plus the bias row); got {got}")
    scale = cfg.target_scale
    if scale == 0:
        s = arrays.get("scale")
        scale = float(s) if isinstance(s, np.ndarray) and s.size == 1 and np.isfinite(s).all() and s > 0 else 1.0
    head = np.array(w, dtype=np.float64, order="C")
    head.flags.writeable = False
    return PersonalSpec(cfg, index, dim, int(w.shape[1]), scale, hashlib.blake2b(raw, digest_size=16).hexdigest(),
                        head)


class _SkippedVersion(ModelConfigError):
    """One version directory cannot be served; the model's other versions still can."""


def _version_number(name: str) -> int | None:
    """The version a directory name stands for; None if it is no version's name (a "notes"
    directory, say); _SkippedVersion if it looks like a number but is not one we take."""
    if _VERSION_RE.fullmatch(name):
        return int(name)
    if name.isdigit():  # what scans before this one took for a version: say why it is not
        raise _SkippedVersion(f"version directory {name!r} is skipped: versions are 1 to {MAX_VERSION_DIGITS} "
                              "ASCII digits")
    return None


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be served as a model file (None: it can); stats it, never opens it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{path.name} is a symbolic link to nothing" if path.is_symlink() else f"{path.name} is missing"
    except OSError as e:  # a symlink loop, a directory we may not enter
        return f"{path.name}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path.name} is {file_type(st.st_mode)}, not a regular file"
    if not os.access(path, os.R_OK):
        return f"{path.name} is not readable (permission denied)"
    return None


def _version_file(d: Path, what: str = "") -> tuple[Path, ModelFormat] | None:
    """The model file of a version directory (None: it holds none); _SkippedVersion when it
    cannot be served (a FIFO, a socket, a directory, a broken link, unreadable, or both files).
    `what` names the directory in messages ("version 3" by default)."""
    what = what or f"version {d.name}"
    found: list[tuple[Path, ModelFormat]] = []
    for f, fmt in MODEL_FILES.items():
        path = d / f
        try:
            os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:  # a version directory we may not search
            raise _SkippedVersion(f"{what} is skipped: {e.strerror or e}") from None
        problem = file_problem(path)
        if problem is not None:
            raise _SkippedVersion(f"{what} is skipped: {problem}")
        found.append((path, fmt))
    if len(found) > 1:  # which one is meant cannot be told
        raise _SkippedVersion(f"{what} is skipped: it holds both model.pt2 and model.ts")
    return found[0] if found else None


def _version_dirs(model_dir: Path, skipped: list[str]) -> dict[int, Path]:
    """Version -> its directory. Entries named like a version that cannot be one go to `skipped`.
    Two directories for one number ("1" and "01"): the one spelled as the version is ("1") is
    taken and the other skipped; with none spelled so ("01" and "001"), which one is meant cannot
    be told, and both are skipped."""
    by_version: dict[int, list[Path]] = {}
    for d in sorted(model_dir.iterdir()):
        try:
            version = _version_number(d.name)
            if version is None:
                continue
            try:
                st = d.stat()
            except OSError as e:  # a symlink loop, a dangling link
                raise _SkippedVersion(f"version {d.name} is skipped: {e.strerror or e}") from None
        except _SkippedVersion as e:
            skipped.append(str(e))
            continue
        if stat.S_ISDIR(st.st_mode):  # a file named like a number is no version directory
            by_version.setdefault(version, []).append(d)
    dirs: dict[int, Path] = {}
    for version, found in by_version.items():
        canonical = [d for d in found if d.name == str(version)]
        if len(found) == 1 or canonical:
            dirs[version] = (canonical or found)[0]
        names = [d.name for d in found]
        for d in found:
            if d is not dirs.get(version):
                others = [n for n in names if n != d.name]
                skipped.append(f"version directory {d.name!r} is skipped: {', '.join(map(repr, others))} "
                               f"{'is' if len(others) == 1 else 'are'} version {version} too")
    return dirs


def _versions(model_dir: Path) -> tuple[Layout, list[tuple[int, Path, ModelFormat]]]:
    """The layout and servable versions of a model. A version that cannot be served is skipped
    with one WARNING while another one can be; with none left the model is broken, and its reason
    says what was skipped. With no version directory at all, a bare model file is version 1."""
    model = model_dir.name
    skipped: list[str] = []
    found: dict[int, tuple[Path, ModelFormat]] = {}
    dirs = _version_dirs(model_dir, skipped)
    for version, d in sorted(dirs.items()):
        try:
            file = _version_file(d)
        except _SkippedVersion as e:
            skipped.append(str(e))
            continue
        if file is not None:
            found[version] = file
    try:
        bare = _version_file(model_dir, "its model file")
    except _SkippedVersion as e:
        bare = None
        if not found:
            skipped.append(str(e))
    if not found and not dirs and bare is not None:
        return "bare", [(1, *bare)]
    if bare is not None:  # both layouts: which one is meant cannot be told, so the versions win
        log.warning("model %s: %s beside version directories is not served (a bare model file is served only "
                    "in a directory with no version directories)", model, bare[0].name)
    if not found:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise ModelConfigError(f"{model}: no version directory with model.pt2 or model.ts, nor a bare model.pt2 "
                               f"or model.ts{why}")
    for why in skipped:
        log.warning("model %s: %s", model, why)
    return "versions", [(v, *found[v]) for v in sorted(found)]


def _model_dirs(root: Path, broken: dict[str, str]) -> list[Path]:
    """The repository's model directories, by name. An entry that cannot even be looked at (a
    symlink loop, a dangling link) is broken; one that is neither a directory nor a regular file
    (a FIFO, a socket) is skipped with a WARNING; regular files (a README) are passed over."""
    dirs: list[Path] = []
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        try:
            mode = p.stat().st_mode
        except OSError as e:
            broken[p.name] = f"{p.name!r}: {e.strerror or e}"
            log.warning("model %r is not served: %s", p.name, broken[p.name])
            continue
        if stat.S_ISDIR(mode):
            dirs.append(p)
        elif not stat.S_ISREG(mode):
            log.warning("model repository: skipping %r: it is %s", p.name, file_type(mode))
    return dirs


def _model_versions(model_dir: Path, default_slo_ms: float) -> list[ModelSpec]:
    """Every servable version of one model; ModelConfigError or OSError if there is none."""
    name = model_dir.name
    if not _NAME_RE.fullmatch(name):
        raise ModelConfigError(f"{name!r}: model names must be letters, digits, '_', '.', '-'")
    if os.path.lexists(model_dir / "config.toml"):
        cfg = parse_model_config(model_dir, default_slo_ms)
        if cfg["stages"]:  # a plan of stages: its version directories hold stage files, not a model file
            try:
                memory = kserve.declared_memory(model_dir)
            except AgentFileError as e:
                raise ModelConfigError(f"{name}: KServe's agent file {e}") from None
            return [ModelSpec(version=v, path=path, format="pt2", **{**cfg, "stages": files, "memory_bytes": memory})
                    for v, path, files in _staged_versions(model_dir, cfg["stages"])]
    try:
        layout, versions = _versions(model_dir)
    except ModelConfigError:
        if os.path.lexists(model_dir / "config.toml"):
            parse_model_config(model_dir, default_slo_ms)  # a broken config is the first thing to fix
        raise
    if layout == "bare" and not os.path.lexists(model_dir / "config.toml"):
        path, fmt = versions[0][1:]
        if fmt == "ts":
            raise ModelConfigError(f"{name}: a bare model.ts needs a config.toml beside it (a TorchScript file "
                                   "records no input or output shapes)")
        try:
            cfg = check_model_config(inferred_config(path), name, default_slo_ms)
        except SignatureError as e:
            raise ModelConfigError(f"{name}: no config.toml, and {e}") from None
    else:
        cfg = parse_model_config(model_dir, default_slo_ms)
    try:
        memory = kserve.declared_memory(model_dir)
    except AgentFileError as e:
        raise ModelConfigError(f"{name}: KServe's agent file {e}") from None
    specs: list[ModelSpec] = []
    for version, path, fmt in versions:
        cfg_v = {**cfg, "layout": layout, "memory_bytes": memory, "stages": ()}
        if cfg["parity"] is not None:
            problem = file_problem(path.parent / cfg["parity"].file)
            if problem is not None:
                log.warning("%s:%d: parity file %s: served without parity", name, version, problem)
                cfg_v = {**cfg_v, "parity": None}
        if cfg["personalization"] is not None:
            try:
                cfg_v["personalization"] = load_head(cfg["personalization"], path.parent, cfg["outputs"])
            except ModelConfigError as e:
                raise ModelConfigError(f"{name}: version {version}: {e}") from None
        specs.append(ModelSpec(version=version, path=path, format=fmt, **cfg_v))
    return specs


def scan(root: str | Path, default_slo_ms: float = 100.0) -> ScanResult:
    """Every servable model version under `root`, and the reason each broken entry is not."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"model repository {root} is not a directory")
    models: list[ModelSpec] = []
    broken: dict[str, str] = {}
    for model_dir in _model_dirs(root, broken):
        name = model_dir.name
        try:
            models.extend(_model_versions(model_dir, default_slo_ms))
        except (ModelConfigError, OSError) as e:
            broken[name] = str(e)
            log.warning("model %r is not served: %s", name, e)
        except Exception as e:
            # NOTE: a bug the checks above miss must cost one model, not the scan (and with it
            # the start-up or a reload of every other model); the type names it in the log.
            broken[name] = f"{name}: cannot be read: {type(e).__name__}: {e}"
            log.warning("model %r is not served: %s", name, broken[name], exc_info=True)
    return ScanResult(models, broken)


def write_model_config(model_dir: Path, text: str) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.toml").write_text(text, encoding="utf-8")

