"""Applications: a name over a set of models that take the same input (Clipper's applications).

An application is declared in a `[[applications]]` table (the daemon's config, or
`applications.toml` in the model repository; docs/applications.md) or added through the
repository API. Its members are model names (each query goes to each member's newest ready
version); they must take the same inputs (names, datatypes, sample shapes) and give an output
of the same datatype and sample shape (`output`, or each member's first output).

This module is pure: the definition and its checks, the plan of one query (which members run,
given when the controller expects each to finish), the reward a feedback item gives each member,
and the bounded memory of answered queries. The loop's side is daemon/apps/router.py.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daemon.apps.answered import AnsweredQueries
from daemon.apps.selection import Combine, PolicyName
from daemon.errors import BadRequest, Unavailable
from daemon.model import ModelSpec, TensorSpec

APP_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
QUERY_OVERHEAD = 256  # bytes a remembered query costs beyond its arrays


@dataclass(frozen=True, slots=True)
class AppDefinition:
    """One application, as declared (the fields of an `[[applications]]` table)."""

    name: str
    models: tuple[str, ...]
    policy: PolicyName = "exp3"
    output: str = ""  # the members' output it answers with; "": each member's first output
    combine: Combine = "softmax"  # exp4: how the members' outputs are combined
    slo_ms: float = 0.0  # 0: the smallest of its members' SLOs
    default_output: tuple[float, ...] = ()  # one sample's answer when no member makes the deadline
    exploration: float = 0.1  # exp3's gamma
    learning_rate: float = 1.0  # exp4's eta
    share: float = 0.01  # fixed share: what every member gets back after each update
    seed: int = 0  # of the exp3 picks
    skip_late: bool = True  # leave out members expected past the deadline, hard deadlines for the rest

    def __post_init__(self) -> None:
        if not APP_NAME.fullmatch(self.name):
            raise ValueError(f"application name {self.name!r}: letters, digits, '_', '.', '-' (1-128 of them)")
        if not self.models:
            raise ValueError(f"application {self.name}: models must name at least one model")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"application {self.name}: a model is named twice in models {list(self.models)}")
        if self.policy not in ("exp3", "exp4"):
            raise ValueError(f"application {self.name}: policy {self.policy!r}: expected 'exp3' or 'exp4'")
        if self.combine not in ("softmax", "mean", "vote"):
            raise ValueError(f"application {self.name}: combine {self.combine!r}: expected softmax, mean or vote")
        if not (0.0 < self.exploration <= 1.0):
            raise ValueError(f"application {self.name}: exploration must be in (0, 1], got {self.exploration}")
        if not (0.0 < self.learning_rate <= 100.0):
            raise ValueError(f"application {self.name}: learning_rate must be in (0, 100], got {self.learning_rate}")
        if not (0.0 <= self.share < 1.0):
            raise ValueError(f"application {self.name}: share must be in [0, 1), got {self.share}")
        if not (0.0 <= self.slo_ms <= 3_600_000.0) or not math.isfinite(self.slo_ms):
            raise ValueError(f"application {self.name}: slo_ms must be in [0, 3600000], got {self.slo_ms}")
        if not all(math.isfinite(v) for v in self.default_output):
            raise ValueError(f"application {self.name}: default_output must hold finite numbers")

    @property
    def digest(self) -> str:
        """Its members and policy: learned weights belong to these, in this order (another list starts
        again)."""
        return hashlib.blake2b(f"{self.policy}|{','.join(self.models)}".encode(), digest_size=8).hexdigest()

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "models": list(self.models), "policy": self.policy, "output": self.output,
                "combine": self.combine, "slo_ms": self.slo_ms, "default_output": list(self.default_output),
                "exploration": self.exploration, "learning_rate": self.learning_rate, "share": self.share,
                "seed": self.seed, "skip_late": self.skip_late}


# ---------------------------------------------------------------- members


def _signature(specs: Sequence[TensorSpec]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((t.name, t.datatype.name, t.sample_shape) for t in specs)


def output_index(app: AppDefinition, spec: ModelSpec) -> int:
    """Which of a member's outputs the application answers with."""
    if not app.output:
        return 0
    for i, o in enumerate(spec.outputs):
        if o.name == app.output:
            return i
    raise ValueError(f"model {spec.name} has no output {app.output!r} (it has {[o.name for o in spec.outputs]})")


def check_members(app: AppDefinition, specs: Sequence[ModelSpec]) -> str:
    """'' when the members fit together, else why not (inputs or outputs that differ)."""
    first = specs[0]
    want = _signature(first.inputs)
    try:
        out0 = first.outputs[output_index(app, first)]
        for s in specs[1:]:
            if _signature(s.inputs) != want:
                return (f"models {first.name} and {s.name} take different inputs ({_describe(first.inputs)} vs "
                        f"{_describe(s.inputs)}): an application's models must take the same input")
            o = s.outputs[output_index(app, s)]
            if (o.datatype, o.sample_shape) != (out0.datatype, out0.sample_shape):
                return (f"models {first.name} and {s.name} answer with different outputs ({out0.datatype.name} "
                        f"{list(out0.sample_shape)} vs {o.datatype.name} {list(o.sample_shape)})")
    except ValueError as e:
        return str(e)
    if app.default_output and len(app.default_output) != out0.sample_elements:
        return (f"default_output has {len(app.default_output)} values, but one sample of the output has "
                f"{out0.sample_elements} ({list(out0.sample_shape)})")
    why = out0.misfit(app.default_output) if out0.datatype.numpy.kind in "fiub" else ""
    return f"default_output {why}" if why else ""


def _describe(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(f"{t.name} {t.datatype.name} {list(t.sample_shape)}" for t in specs)


# ---------------------------------------------------------------- one query's plan


@dataclass(frozen=True, slots=True)
class Plan:
    """Which members a query runs: those the controller expects to make the deadline."""

    run: tuple[int, ...]
    skipped: tuple[int, ...]  # expected to finish after the deadline: neither run nor waited for


def plan(expected: Sequence[float], deadline: float) -> Plan:
    """Members whose expected finish (clock time) is within the deadline run; the others do not."""
    run = tuple(i for i, t in enumerate(expected) if t <= deadline)
    return Plan(run, tuple(i for i in range(len(expected)) if i not in run))


def default_answer(app: AppDefinition, samples: int, like: TensorSpec) -> np.ndarray:
    """The configured default output, one row per sample (BadRequest-free: checked at definition)."""
    return like.rows(app.default_output, samples)


# ---------------------------------------------------------------- feedback


def check_labels(label: Any, samples: int, classes: int) -> list[int]:
    """A query's true labels: an int (one sample) or a list of `samples` ints in [0, classes)."""
    labels = label if isinstance(label, list) else [label]
    if len(labels) != samples:
        raise BadRequest(f"label: the query had {samples} sample(s): give {samples} label(s), got {len(labels)}")
    for v in labels:
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadRequest(f"label must be an integer class index (or a list of them), got {v!r}")
        if not 0 <= v < classes:
            raise BadRequest(f"label {v} is out of range: the output has {classes} classes (0..{classes - 1})")
    return labels


def check_reward(reward: Any, what: str = "reward") -> float:
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not 0.0 <= float(reward) <= 1.0:
        raise BadRequest(f"{what} must be a number in [0, 1] (1: the answer was right), got {reward!r}")
    return float(reward)


# ---------------------------------------------------------------- answered queries


@dataclass(slots=True)
class AppQuery:
    """An answered query, remembered until its feedback."""

    app: str
    digest: str  # the definition it was answered under (feedback after a redefinition is refused)
    members: tuple[str, ...]  # model names of the members that answered
    indices: tuple[int, ...]  # their places in the application's list
    outputs: list[np.ndarray]  # each answering member's output (the reward of a label is computed from it)
    prob: float  # exp3: the chosen member's probability
    samples: int
    at: float
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = QUERY_OVERHEAD + sum(o.nbytes for o in self.outputs)


class AppQueries(AnsweredQueries[AppQuery]):
    """Answered queries by id, oldest first; bounded in count, bytes and age."""


def unavailable(app: str, why: str) -> Unavailable:
    return Unavailable(f"application {app} cannot answer: {why}")
