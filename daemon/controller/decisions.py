"""What a policy or the ParM workflow decides, as small records the scheduler applies.

A policy's `schedule` is a generator of these: the scheduler applies each one as it comes
(the requests leave their queue, the device's memory and lanes account for the action) and
sends back the `Action` it issued, so the next decision sees the state the last one left.
Policies never mutate the controller's state themselves.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.actions import Action
from daemon.errors import EscapementError
from daemon.model import ModelSpec
from daemon.request import InferenceRequest


@dataclass(slots=True)
class Infer:
    """Run `requests` (taken from their model's queue) as one batch of `batch_size` on `device`,
    starting no later than `latest`; `expected` seconds. A parity batch names its members'
    requests in `coded` instead; a replica names the action it duplicates."""

    spec: ModelSpec
    device: str
    requests: list[InferenceRequest]
    batch_size: int
    latest: float
    expected: float
    coded: list[list[InferenceRequest]] | None = None
    encoder: str = ""
    replica_of: int = 0
    best_effort: bool = False  # requests of the best-effort lane (taken from `ModelEntry.late`)
    # A cross-model batch: other models sharing `spec`'s leading stage, each with its requests
    # (taken from their queues), after `spec`'s own; `expected` covers them all.
    group: list[tuple[ModelSpec, list[InferenceRequest]]] | None = None

    # (Decisions write their __init__ out: mypyc compiles it, while a dataclass's generated one runs
    # as interpreted Python, several times per request. Same parameters as the fields.)
    def __init__(self, spec: ModelSpec, device: str, requests: list[InferenceRequest], batch_size: int,
                 latest: float, expected: float, coded: list[list[InferenceRequest]] | None = None,
                 encoder: str = "", replica_of: int = 0, best_effort: bool = False,
                 group: list[tuple[ModelSpec, list[InferenceRequest]]] | None = None) -> None:
        self.spec = spec
        self.device = device
        self.requests = requests
        self.batch_size = batch_size
        self.latest = latest
        self.expected = expected
        self.coded = coded
        self.encoder = encoder
        self.replica_of = replica_of
        self.best_effort = best_effort
        self.group = group


@dataclass(slots=True)
class Load:
    """Copy a model's weights to `device` (`expected`: the policy's estimate of the copy)."""

    spec: ModelSpec
    device: str
    expected: float | None = None

    def __init__(self, spec: ModelSpec, device: str, expected: float | None = None) -> None:
        self.spec = spec
        self.device = device
        self.expected = expected


@dataclass(slots=True)
class Unload:
    spec: ModelSpec
    device: str

    def __init__(self, spec: ModelSpec, device: str) -> None:
        self.spec = spec
        self.device = device


@dataclass(slots=True)
class Drop:
    """A queued request no device can serve: out of its queue, answered with `error` (by default:
    its deadline cannot be met)."""

    request: InferenceRequest
    error: EscapementError | None = None

    def __init__(self, request: InferenceRequest, error: EscapementError | None = None) -> None:
        self.request = request
        self.error = error


@dataclass(slots=True)
class Save:
    """Answer an action's requests still running with `outputs` (a reconstruction, or a replica's)."""

    action: Action
    outputs: tuple[np.ndarray, ...]
    decode_s: float = 0.0  # measured time the decode took
    counter: str = "reconstructions"


@dataclass(slots=True)
class Release:
    """A lost member whose reconstruction cannot come in time: its requests are retried or failed."""

    action: Action


Step = Infer | Load | Unload | Drop | Save | Release
# A policy's pass (or the ParM workflow's): yields steps, is sent the action each one issued,
# and may return a flag to its caller (what that means is the generator's own contract: a
# bool, or None when it has nothing to say, which a bare `return` or the end gives).
Steps = Generator[Step, Action | None, Any]
# Steps decided all at once, none needing the action another issued: applied in order, each before
# the next (the view a later one meets is current), with no generator to resume. A pass that ends
# after yielding ends in a StopIteration the scheduler catches (~6k instructions compiled, issue 12),
# most of a lone request's scheduling when it is the model's whole batch.
Planned = list[Step]
# A policy's pass that may end by yielding None as its last statement: the scheduler stops there
# and drops it without resuming it, where running off its end would raise the StopIteration the
# scheduler catches. (A compiled generator dropped while suspended runs nothing more, not even a
# `finally`; an interpreted one is closed. Nothing may follow that last yield.)
Pass = Generator[Step | None, Action | None, Any]
