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

Scanning never raises for one bad entry: each broken model is reported with its reason and
the rest are served.
"""

from __future__ import annotations

import logging
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from daemon.datatypes import KNOWN_UNSUPPORTED, DataType, lookup

log = logging.getLogger("escapement.repository")

ModelFormat = Literal["pt2", "ts"]
MODEL_FILES: dict[str, ModelFormat] = {"model.pt2": "pt2", "model.ts": "ts"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_KNOWN_KEYS = {"name", "description", "max_batch_size", "slo_ms", "inputs", "outputs", "metadata", "parity",
               "preload_replicas"}
_PARITY_KEYS = {"k", "encoder", "file", "enabled", "flush_ms", "accuracy"}


class ModelConfigError(ValueError):
    """A model entry cannot be served; the message says why."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: DataType
    shape: tuple[int, ...]  # shape[0] == -1, the batch dimension

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def sample_elements(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def sample_bytes(self) -> int:
        return self.sample_elements * self.datatype.itemsize

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype.name, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class ParitySpec:
    """ParM coded resilience for a model: k data batches per coding group, one parity batch."""

    k: int
    encoder: str  # "sum" or "concat"
    file: str  # the parity model, in the same version directory as the model
    flush_ms: float  # how long a partial group waits for its k-th batch before it is flushed


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One servable version of a model, as its config and files describe it."""

    name: str
    version: int
    path: Path
    format: ModelFormat
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    slo_s: float
    description: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    parity: ParitySpec | None = None
    preload_replicas: int = 0  # devices to load it onto at start-up (its parity model onto another)
    key: str = field(init=False, compare=False)  # "name:version", used on every hot path

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.name}:{self.version}")

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Powers of two up to max_batch_size, plus max_batch_size itself if it is not one."""
        sizes = [1 << i for i in range(max(self.max_batch_size, 1).bit_length()) if 1 << i <= self.max_batch_size]
        if sizes[-1] != self.max_batch_size:
            sizes.append(self.max_batch_size)
        return tuple(sizes)

    def batch_size_for(self, samples: int) -> int:
        """The smallest supported batch size that holds `samples`."""
        for b in self.batch_sizes:
            if b >= samples:
                return b
        raise ValueError(f"{samples} samples exceed max_batch_size {self.max_batch_size}")

    @property
    def platform(self) -> str:
        return "pytorch_torchscript" if self.format == "ts" else "pytorch_export"


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
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ModelConfigError(f"{where}: name {name!r} must be 1-128 letters, digits, '_', '.', '-'")
        dt = lookup(dt_name) if isinstance(dt_name, str) else None
        if dt is None:
            hint = " (not supported by torch models here)" if dt_name in KNOWN_UNSUPPORTED else ""
            raise ModelConfigError(f"{where}: datatype {dt_name!r} is not supported{hint}")
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
    if isinstance(flush, bool) or not isinstance(flush, int | float) or flush <= 0:
        raise ModelConfigError(f"{name}: [parity] flush_ms = {flush!r}: expected a positive number of milliseconds")
    return ParitySpec(k, enc, file, float(flush))


def parse_model_config(model_dir: Path, default_slo_ms: float) -> dict[str, Any]:
    """The validated contents of `<model_dir>/config.toml` (everything but versions)."""
    name = model_dir.name
    cfg_path = model_dir / "config.toml"
    try:
        raw = tomllib.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelConfigError(f"{name}: no config.toml") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{name}: config.toml is not valid TOML: {e}") from e
    unknown = set(raw) - _KNOWN_KEYS
    if unknown:
        raise ModelConfigError(f"{name}: unknown keys in config.toml: {sorted(unknown)}")
    if raw.get("name", name) != name:
        raise ModelConfigError(f"{name}: config.toml names the model {raw['name']!r}, but its directory "
                               f"is {name!r}")
    mbs = raw.get("max_batch_size")
    if not isinstance(mbs, int) or isinstance(mbs, bool) or not 1 <= mbs <= 4096:
        raise ModelConfigError(f"{name}: max_batch_size = {mbs!r}: expected an integer in 1..4096")
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
    preload = raw.get("preload_replicas", 0)
    if isinstance(preload, bool) or not isinstance(preload, int) or not 0 <= preload <= 64:
        raise ModelConfigError(f"{name}: preload_replicas = {preload!r}: expected an integer in 0..64")
    return {
        "name": name,
        "inputs": _tensor_specs(raw.get("inputs"), "inputs", name),
        "outputs": _tensor_specs(raw.get("outputs"), "outputs", name),
        "max_batch_size": mbs,
        "slo_s": float(slo) / 1000.0,
        "description": desc,
        "metadata": meta,
        "parity": parity,
        "preload_replicas": preload,
    }


def _versions(model_dir: Path) -> list[tuple[int, Path, ModelFormat]]:
    found: list[tuple[int, Path, ModelFormat]] = []
    for d in model_dir.iterdir():
        if not d.is_dir() or not d.name.isdigit():
            continue
        files = [(d / f, fmt) for f, fmt in MODEL_FILES.items() if (d / f).is_file()]
        if len(files) > 1:
            raise ModelConfigError(f"{model_dir.name}: version {d.name} holds both model.pt2 and model.ts")
        if files:
            found.append((int(d.name), files[0][0], files[0][1]))
    if not found:
        raise ModelConfigError(f"{model_dir.name}: no version directory with model.pt2 or model.ts")
    return sorted(found)


def scan(root: str | Path, default_slo_ms: float = 100.0) -> ScanResult:
    """Every servable model version under `root`, and the reason each broken entry is not."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"model repository {root} is not a directory")
    models: list[ModelSpec] = []
    broken: dict[str, str] = {}
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        name = model_dir.name
        try:
            if not _NAME_RE.match(name):
                raise ModelConfigError(f"{name!r}: model names must be letters, digits, '_', '.', '-'")
            cfg = parse_model_config(model_dir, default_slo_ms)
            for version, path, fmt in _versions(model_dir):
                cfg_v = cfg
                if cfg["parity"] is not None and not (path.parent / cfg["parity"].file).is_file():
                    log.warning("%s:%d: parity file %s is missing: served without parity", name, version,
                                cfg["parity"].file)
                    cfg_v = {**cfg, "parity": None}
                models.append(ModelSpec(version=version, path=path, format=fmt, **cfg_v))
        except (ModelConfigError, OSError) as e:
            broken[name] = str(e)
            log.error("model %s is not served: %s", name, e)
    return ScanResult(models, broken)


def write_model_config(model_dir: Path, text: str) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.toml").write_text(text, encoding="utf-8")


def parity_key(spec: ModelSpec) -> str:
    return f"{spec.name}.parity:{spec.version}"


def parity_model(spec: ModelSpec) -> ModelSpec:
    """The spec of a model's parity model: same inputs and outputs, its own file and key."""
    assert spec.parity is not None
    return ModelSpec(f"{spec.name}.parity", spec.version, spec.path.parent / spec.parity.file, "pt2", spec.inputs,
                     spec.outputs, spec.max_batch_size, spec.slo_s, f"parity model (k={spec.parity.k}) of {spec.name}")
