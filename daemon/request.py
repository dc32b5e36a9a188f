"""The inference request: one call with its arrival time, absolute deadline and status.

Both frontends decode into this one type. Only the controller changes `status`; it finishes a
request exactly once, and the frontend's `on_finish` callback is then called exactly once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from daemon.errors import EscapementError
from daemon.model import ModelSpec


class RequestStatus(IntEnum):
    QUEUED = 0
    RUNNING = 1  # part of an INFER action in flight
    # Finished statuses compare greater than every live one.
    SUCCEEDED = 10
    FAILED = 11
    CANCELLED = 12

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.SUCCEEDED


class RequestClass(IntEnum):
    """What a request's deadline means (daemon/controller/classes.py decides it at arrival)."""

    HARD = 0  # a timeout that rejects: refused at arrival when infeasible, dropped when hopeless
    TARGET = 1  # no timeout (or one that delays): late work moves to the best-effort lane, answered later
    BEST_EFFORT = 2  # best-effort from the start (a best-effort priority level)


_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class InferenceRequest:
    model: ModelSpec
    key: str  # model.key, read on every step of its path (compiled: a field read, not a lookup)
    inputs: tuple[np.ndarray, ...]  # in the model's input order, each [samples, *sample_shape]
    samples: int
    arrival: float
    deadline: float
    priority: int = 0  # 0 = default; smaller positive values are more urgent, as in Triton
    rank: int = 0  # the priority the queues order by (the default level filled in for 0)
    client_id: str = ""
    on_finish: Callable[[InferenceRequest], None] | None = None
    context: Any = None  # the frontend's own state, untouched by the controller
    id: int = field(default_factory=lambda: next(_ids))
    status: RequestStatus = RequestStatus.QUEUED
    outputs: tuple[np.ndarray, ...] | None = None
    error: EscapementError | None = None
    reconstructed: bool = False
    cached: bool = False  # answered from the prediction cache (daemon/apps/cache.py), the model not run
    defaulted: bool = False  # answered with its model's default_output: it could not make its deadline
    user: str = ""  # personalized models: whose weights add the personalized output (daemon/apps/personal.py)
    query_id: str = ""  # personalized answers: the id feedback for this query names
    cold_start: bool = False
    dispatched_at: float = 0.0
    finished_at: float = 0.0
    compute_s: float = 0.0
    queue_seq: int = 0  # the sequence number of its live entry in its model's queue (0: none)
    failures: int = 0  # INFERs of it that failed on a device (it is retried elsewhere while it can)
    klass: RequestClass = RequestClass.HARD
    late: bool = False  # in the best-effort lane (it could not make its deadline, or never had one)
    give_up_at: float = float("inf")  # best-effort: answered 504 if still not run by then
    lane_bytes: int = 0  # the bytes it holds of the best-effort lane's budget while it lives

    # (Written out, not generated: mypyc compiles a class's own __init__, while a dataclass's
    # generated one runs as interpreted Python, on the loop, once per request. Same parameters.)
    def __init__(self, model: ModelSpec, inputs: tuple[np.ndarray, ...], samples: int, arrival: float,
                 deadline: float, priority: int = 0, rank: int = 0, client_id: str = "",
                 on_finish: Callable[[InferenceRequest], None] | None = None, context: Any = None, id: int = 0,
                 status: RequestStatus = RequestStatus.QUEUED, outputs: tuple[np.ndarray, ...] | None = None,
                 error: EscapementError | None = None, reconstructed: bool = False, cached: bool = False,
                 defaulted: bool = False, user: str = "", query_id: str = "", cold_start: bool = False,
                 dispatched_at: float = 0.0, finished_at: float = 0.0, compute_s: float = 0.0,
                 queue_seq: int = 0, failures: int = 0, klass: RequestClass = RequestClass.HARD,
                 late: bool = False, give_up_at: float = float("inf"), lane_bytes: int = 0) -> None:
        self.model = model
        self.key = model.key
        self.inputs = inputs
        self.samples = samples
        self.arrival = arrival
        self.deadline = deadline
        self.priority = priority
        self.rank = rank
        self.client_id = client_id
        self.on_finish = on_finish
        self.context = context
        self.id = id or next(_ids)  # (0: the next id)
        self.status = status
        self.outputs = outputs
        self.error = error
        self.reconstructed = reconstructed
        self.cached = cached
        self.defaulted = defaulted
        self.user = user
        self.query_id = query_id
        self.cold_start = cold_start
        self.dispatched_at = dispatched_at
        self.finished_at = finished_at
        self.compute_s = compute_s
        self.queue_seq = queue_seq
        self.failures = failures
        self.klass = klass
        self.late = late
        self.give_up_at = give_up_at
        self.lane_bytes = lane_bytes

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.inputs)

    @property
    def ok(self) -> bool:
        return self.status == RequestStatus.SUCCEEDED
