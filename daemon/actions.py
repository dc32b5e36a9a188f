"""Actions the controller sends to executors, and the results executors send back.

An action may start only inside [earliest, latest]; an executor refuses one it cannot start in
time (TOO_EARLY / TOO_LATE) without doing any work. Every result carries measured timings.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

import numpy as np

from daemon.model import ModelSpec
from daemon.request import InferenceRequest

# A LOAD moves at least this many bytes per second; one slower than that (plus the hang timeout)
# is a hung device, for the executor's device waits and for the controller's hung-action watch.
LOAD_FLOOR_BPS: Final = 1e9


class ActionKind(IntEnum):
    LOAD = 1
    INFER = 2
    UNLOAD = 3


class ResultStatus(IntEnum):
    OK = 0
    CANCELLED = 1
    TOO_EARLY = 2
    TOO_LATE = 3
    FAILED = 4


class Failure(IntEnum):
    """Why a FAILED action failed, which decides what the controller does next."""

    NONE = 0
    ERROR = 1  # the model or the action (retry elsewhere, back off)
    NO_MEMORY = 2  # a LOAD that does not fit now (evict, then retry)
    DEVICE = 3  # the device is lost (a sticky CUDA error, a hang): nothing more goes there


class _Ids:
    """Action ids for the loop's thread: a compiled counter (`next()` of an `itertools.count` is a
    generic call). Interpreted, an increment is not atomic: an action made on another thread (a
    warm-up's, runtime/profiler.py) passes an id of its own range (WARMUP_IDS)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last += 1
        return self.last


_IDS: Final = _Ids()
WARMUP_IDS: Final = itertools.count(1 << 62)  # ids of actions made off the loop's thread


@dataclass(slots=True, eq=False)
class Action:
    kind: ActionKind
    model: ModelSpec
    key: str  # model.key, read on every step of its path (compiled: a field read, not a lookup)
    device: str
    earliest: float
    latest: float
    expected_duration: float = 0.0
    batch_size: int = 0  # INFER: the batch size run; the requests' samples fill its first slots
    requests: list[InferenceRequest] = field(default_factory=list)
    id: int = field(default_factory=_IDS.next)
    issued_at: float = 0.0
    expected_start: float = 0.0
    # A parity batch: the k members' requests, whose inputs the executor encodes with `encoder`.
    coded: list[list[InferenceRequest]] | None = None
    encoder: str = ""
    replica_of: int = 0  # a replica of this action (the same requests, on another device)
    best_effort: bool = False  # a batch of the best-effort lane (no parity, no replica, no deadline)
    # A cross-model batch: models sharing a leading stage, lead (`model`) first, each with how many
    # of `requests` are its own (in order). The shared stage runs once on every row, then each
    # model's other stages on its own rows (runtime/backend.py).
    group: tuple[tuple[ModelSpec, int], ...] | None = None
    # Warm-ups run on a serving executor outside the scheduler: they name their program, the key
    # its weights are held under there, and where their results go.
    program: Any = None
    resident: str = ""
    reply: Callable[[Result], None] | None = None
    # INFER: its samples the controller counts as running for its model (Scheduler.issue_infer);
    # 0 once they no longer do (its result came, or its device was lost before it did)
    running: int = field(default=0, init=False)
    # Whether the scheduler holds it in flight (issued, its result not back): its watches read this
    # rather than look its id up (every step asks of the heaps' tops; compiled, a field read)
    in_flight: bool = field(default=False, init=False)
    _samples: int = field(default=-1, init=False, repr=False)  # `samples`, once counted (-1: not yet)

    # (Written out, not generated: mypyc compiles a class's own __init__, but a dataclass's generated
    # one runs as interpreted Python, ~8k instructions an action. Same parameters as the fields.)
    def __init__(self, kind: ActionKind, model: ModelSpec, device: str, earliest: float, latest: float,
                 expected_duration: float = 0.0, batch_size: int = 0, requests: list[InferenceRequest] | None = None,
                 id: int = 0, issued_at: float = 0.0, expected_start: float = 0.0,
                 coded: list[list[InferenceRequest]] | None = None, encoder: str = "", replica_of: int = 0,
                 best_effort: bool = False, group: tuple[tuple[ModelSpec, int], ...] | None = None,
                 program: Any = None, resident: str = "", reply: Callable[[Result], None] | None = None,
                 key: str = "") -> None:
        self.kind = kind
        self.model = model
        self.key = key or model.key  # (`key`: model.key where the caller has it; a generic read compiled)
        self.device = device
        self.earliest = earliest
        self.latest = latest
        self.expected_duration = expected_duration
        self.batch_size = batch_size
        self.requests = [] if requests is None else requests
        self.id = id or _IDS.next()  # (0: the next id)
        self.issued_at = issued_at
        self.expected_start = expected_start
        self.coded = coded
        self.encoder = encoder
        self.replica_of = replica_of
        self.best_effort = best_effort
        self.group = group
        self.program = program
        self.resident = resident
        self.reply = reply
        self.running = 0
        self.in_flight = False
        self._samples = -1

    @property
    def holder(self) -> str:
        """The key the executor holds this model's weights under."""
        return self.resident or self.model.key

    @property
    def samples(self) -> int:
        """The rows it runs (an action's requests never change: counted once, read several times)."""
        n = self._samples
        if n < 0:
            if self.coded is not None:
                n = max((sum(r.samples for r in m) for m in self.coded), default=0)
            else:
                n = 0
                for r in self.requests:
                    n += r.samples
            self._samples = n
        return n

    def __lt__(self, other: Action) -> bool:  # executor queues are ordered by earliest start
        return (self.earliest, self.id) < (other.earliest, other.id)

    def __repr__(self) -> str:
        extra = f" b={self.batch_size} n={self.samples}" if self.kind == ActionKind.INFER else ""
        extra += " parity" if self.coded is not None else " replica" if self.replica_of else ""
        extra += f" group={len(self.group)}" if self.group else ""
        return (f"<{self.kind.name} #{self.id} {self.model.key} on {self.device}{extra} "
                f"[{self.earliest:.6f}, {self.latest:.6f}]>")


@dataclass(slots=True, eq=False)
class Result:
    action: Action
    status: ResultStatus
    received: float  # when the executor took the action
    begin: float  # when it started (or was refused)
    end: float
    duration: float = 0.0  # device time of the work itself (CUDA events on GPUs)
    outputs: tuple[np.ndarray, ...] | None = None  # INFER: one array per output, batch rows first
    error: str = ""
    weight_bytes: int = 0  # LOAD / UNLOAD: bytes placed or freed
    ready_at: float = 0.0  # when it could have started: its earliest, its arrival, its lane free
    failure: Failure = Failure.NONE
    parts: tuple[tuple[np.ndarray, ...], ...] | None = None  # a cross-model batch: each member's outputs
    # Stages of a plan run by this INFER: (estimate key, rows, seconds) each (controller/sharing.py)
    stage_runs: tuple[tuple[str, int, float], ...] = ()
    set_up: bool = False  # LOAD: it also warmed up and captured graphs (Resident.set_up)

    def __init__(self, action: Action, status: ResultStatus, received: float, begin: float, end: float,
                 duration: float = 0.0, outputs: tuple[np.ndarray, ...] | None = None, error: str = "",
                 weight_bytes: int = 0, ready_at: float = 0.0, failure: Failure = Failure.NONE,
                 parts: tuple[tuple[np.ndarray, ...], ...] | None = None,
                 stage_runs: tuple[tuple[str, int, float], ...] = (), set_up: bool = False) -> None:
        # (written out, as Action's)
        self.action = action
        self.status = status
        self.received = received
        self.begin = begin
        self.end = end
        self.duration = duration
        self.outputs = outputs
        self.error = error
        self.weight_bytes = weight_bytes
        self.ready_at = ready_at
        self.failure = failure
        self.parts = parts
        self.stage_runs = stage_runs
        self.set_up = set_up

    @property
    def ok(self) -> bool:
        return self.status == ResultStatus.OK

    @property
    def lateness(self) -> float:
        """How long after `earliest` the action started (negative never happens)."""
        return self.begin - self.action.earliest
