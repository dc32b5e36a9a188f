"""A model's `config.toml`: read, checked and turned into the fields of its ModelSpec.

The scan (daemon/repository.py) finds the models and their versions; this module says what a
model's config.toml may hold and why a given one is refused (every ModelConfigError names the
model and the key). A bare model.pt2 with no config.toml gets the table its exported program
implies (daemon/signature.py), checked here the same way.

`config.toml` of a model::

    description = "MLP trained on scikit-learn digits"
    max_batch_size = 32          # batch sizes run are the powers of two up to this
    slo_ms = 100                 # default SLO; a request may ask for a tighter one
    preload_replicas = 0         # devices to load it onto at start-up (its parity model onto another)
    default_output = []          # one sample of the only output: the answer when no model makes the deadline
    # stages = ["../../.stages/backbone.pt2", "head.pt2"]: a plan of stages instead (repository.py)
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
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from daemon.datatypes import KNOWN_UNSUPPORTED, WIRE_ONLY, lookup
from daemon.errors import ModelConfigError, RefusedFile
from daemon.files import read_regular
from daemon.model import ParitySpec, PersonalConfig, PersonalSpec, QueueLevel, QueuePolicy, TensorSpec

NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")  # model, tensor and output names
_KNOWN_KEYS = {"name", "description", "max_batch_size", "slo_ms", "inputs", "outputs", "metadata", "parity",
               "preload_replicas", "queue_policy", "response_cache", "personalization", "stages",
               "default_output"}
MAX_STAGES = 8
_QUEUE_KEYS = {"default_timeout_ms", "timeout_action", "allow_timeout_override", "max_queue_size", "max_wait_s"}
_PARITY_KEYS = {"k", "encoder", "file", "enabled", "flush_ms", "accuracy"}
_PERSONAL_KEYS = {"features", "head", "output", "prior", "forgetting", "target_scale"}
MAX_HEAD_BYTES = 256 << 20  # a head is (d+1) x C floats; this only stops a runaway file
MAX_BATCH_SIZE = 4096
MAX_CONFIG_BYTES = 1 << 20  # a config.toml is a few hundred bytes; this only stops a runaway file


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
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
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
    if not isinstance(out, str) or not NAME_RE.fullmatch(out) or out in by_name:
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
