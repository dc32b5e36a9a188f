"""The model types: what one servable version of a model is (`ModelSpec`), its tensors, and the
policies its config.toml gives it (queue policy, ParM parity, personalization).

The most shared types of the daemon: requests, actions, the controller, the runtime and the
frontends all speak of a `ModelSpec`. They are built by the repository scan (repository.py) from
`<repo>/<model>/config.toml`, whose keys model_config.py lists and checks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from daemon.datatypes import BY_NAME, DataType

ModelFormat = Literal["pt2", "ts"]
Layout = Literal["versions", "bare"]  # <model>/<version>/model.pt2, or <model>/model.pt2 (version 1)


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

    def misfit(self, values: Sequence[float]) -> str:
        """Why `values` cannot be numbers of this datatype ('' when they can: NaN and inf never)."""
        dt = self.datatype.numpy
        lo, hi = (np.finfo(dt).min, np.finfo(dt).max) if dt.kind == "f" else \
            (np.iinfo(dt).min, np.iinfo(dt).max) if dt.kind in "iu" else (0, 1)
        bad = next((v for v in values if not float(lo) <= v <= float(hi)), None)
        return "" if bad is None else f"value {bad!r} does not fit {self.datatype.name} ([{lo}, {hi}])"

    def rows(self, sample: Sequence[float], samples: int) -> np.ndarray:
        """`sample` (one sample's values, checked) repeated as `samples` rows of this tensor."""
        row = np.asarray(sample, dtype=self.datatype.numpy).reshape(self.sample_shape)
        return np.broadcast_to(row, (samples, *self.sample_shape)).copy()


@dataclass(frozen=True, slots=True)
class QueueLevel:
    """A queue policy, for a model or one of its priority levels: each key None leaves the one
    above it in force (the level's model policy, then the daemon's [controller] defaults)."""

    default_timeout_ms: float | None = None
    timeout_action: str | None = None  # "reject" or "delay"
    allow_timeout_override: bool | None = None
    max_queue_size: int | None = None  # 0: the daemon's max_pending_per_model
    max_wait_s: float | None = None
    best_effort: bool = False  # (levels only) its requests start in the best-effort lane


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """Triton's queue policy of a model: its default policy and one per priority level."""

    model: QueueLevel = QueueLevel()
    levels: tuple[tuple[int, QueueLevel], ...] = ()  # (priority level, its policy), ascending
    priority_levels: int = 0  # Triton's: valid priorities are 1..N (0: any)
    default_priority_level: int = 0  # a request with no valid priority gets this one (0: the daemon's default)

    def for_level(self, rank: int) -> QueueLevel | None:
        for level, policy in self.levels:
            if level == rank:
                return policy
        return None


@dataclass(frozen=True, slots=True)
class ParitySpec:
    """ParM coded resilience for a model: k data batches per coding group, one parity batch."""

    k: int
    encoder: str  # "sum" or "concat"
    file: str  # the parity model, in the same version directory as the model
    flush_ms: float  # how long a partial group waits for its k-th batch before it is flushed


@dataclass(frozen=True, slots=True)
class PersonalConfig:
    """`[personalization]` of a model's config.toml, checked (the head file is read per version)."""

    features: str  # the output holding the feature vectors
    head: str  # the head's file name in each version directory
    output: str = "personalized"
    prior: float = 1.0
    forgetting: float = 1.0
    target_scale: float = 0.0  # 0: head.npz's "scale", else 1.0


@dataclass(frozen=True, slots=True)
class PersonalSpec:
    """A version's personalization: its config, and the shared head read from its directory."""

    config: PersonalConfig
    features_index: int  # of the features output in ModelSpec.outputs
    dim: int  # d, the feature vector's length (W has d + 1 rows: the bias is the last)
    classes: int  # C, the personalized output's width
    scale: float  # s: feedback targets are +s at the label, -s elsewhere (the logits' scale)
    head_digest: str  # BLAKE2b of the head file: a changed head is a changed version (reloaded)
    head: np.ndarray = field(compare=False, hash=False, repr=False)  # (d+1, C) float64, read-only

    @property
    def output(self) -> str:
        return self.config.output


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
    queue_policy: QueuePolicy | None = None  # None: the daemon's defaults for everything
    layout: Layout = "versions"
    memory_bytes: int | None = None  # what its KServe TrainedModel declares (spec.model.memory), if any
    response_cache: bool = False  # its answers are kept in the prediction cache (daemon/apps/cache.py)
    personalization: PersonalSpec | None = None  # per-user weights on a feature output (daemon/apps/personal.py)
    # One sample of its only output: the answer (flagged `default`) to a request that cannot be
    # answered by its deadline, in place of a 504 (Clipper's default answers). Empty: none.
    default_output: tuple[float, ...] = ()
    # A plan of stages: the programs run in turn, resolved (empty: one program at `path`).
    stages: tuple[Path, ...] = field(default=(), compare=False)
    key: str = field(init=False, compare=False)  # "name:version", used on every hot path
    # What the frontends answer with: the model's outputs, then the personalized one (present in
    # an answer only when the request named a user). The runtime runs `outputs` only.
    served_outputs: tuple[TensorSpec, ...] = field(init=False, compare=False, repr=False)
    # Powers of two up to max_batch_size, plus max_batch_size itself if it is not one; and, per
    # sample count, the smallest of them that holds it (the scheduler asks per batch it plans).
    batch_sizes: tuple[int, ...] = field(init=False, compare=False, repr=False)
    _size_for: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"{self.name}:{self.version}")
        p = self.personalization
        extra = (TensorSpec(p.output, BY_NAME["FP32"], (-1, p.classes)),) if p is not None else ()
        object.__setattr__(self, "served_outputs", self.outputs + extra)
        cap = max(self.max_batch_size, 1)
        sizes = [1 << i for i in range(cap.bit_length()) if 1 << i <= cap]
        if sizes[-1] != cap:
            sizes.append(cap)
        object.__setattr__(self, "batch_sizes", tuple(sizes))
        object.__setattr__(self, "_size_for", (0, *(next(b for b in sizes if b >= n) for n in range(1, cap + 1))))

    def batch_size_for(self, samples: int) -> int:
        """The smallest supported batch size that holds `samples`."""
        if 0 < samples <= self.max_batch_size:
            return self._size_for[samples]
        if samples <= 0:
            return self.batch_sizes[0]
        raise ValueError(f"{samples} samples exceed max_batch_size {self.max_batch_size}")

    @property
    def config_file(self) -> Path:
        """Where its config.toml is (or would be: an inferred config has none)."""
        return self.path.parent / "config.toml" if self.layout == "bare" else self.path.parent.parent / "config.toml"

    @property
    def platform(self) -> str:
        return "pytorch_torchscript" if self.format == "ts" else "pytorch_export"
