"""Min-heaps of things due at a time: when a queued request turns hopeless, when a lane request
gives up, when an action in flight must be looked at, which model is most urgent.

An entry is a small record ordered by (`at`, `then`, `seq`); `seq` is unique per heap (a request's
or an action's id, or a counter), so two entries never tie and the order in which entries come
out depends on their keys alone, as with `heapq` over tuples. The heaps are written out here
rather than built on `heapq` because compiled code then compares two floats directly, where
`heapq` compares tuples through the generic comparison (~1.7k instructions a pop at 10,000
queued requests: issue 12's callgrind).
"""

from __future__ import annotations

from daemon.actions import Action
from daemon.request import InferenceRequest


class Due:
    """An entry: due at `at` (then `then`, for keys of two times), tie-broken by `seq`."""

    __slots__ = ("at", "seq", "then")

    def __init__(self, at: float, seq: int, then: float = 0.0) -> None:
        self.at = at
        self.then = then
        self.seq = seq


class RequestDue(Due):
    __slots__ = ("req",)

    def __init__(self, at: float, req: InferenceRequest) -> None:
        self.at = at
        self.then = 0.0
        self.seq = req.id
        self.req = req


class ActionDue(Due):
    """An action in flight, looked at again at `at`; it counts as hung from `hung_at`."""

    __slots__ = ("action", "hung_at")

    def __init__(self, at: float, action: Action, hung_at: float) -> None:
        self.at = at
        self.then = 0.0
        self.seq = action.id
        self.action = action
        self.hung_at = hung_at


class KeyDue(Due):
    """A model's entry in a policy's work index: its key, by (rank, time)."""

    __slots__ = ("key",)

    def __init__(self, rank: float, t: float, seq: int, key: str) -> None:
        self.at = rank
        self.then = t
        self.seq = seq
        self.key = key


def _before(a: Due, b: Due) -> bool:
    if a.at != b.at:
        return a.at < b.at
    if a.then != b.then:
        return a.then < b.then
    return a.seq < b.seq


def push(heap: list[Due], entry: Due) -> None:
    heap.append(entry)
    pos = len(heap) - 1
    while pos > 0:
        parent = (pos - 1) >> 1
        up = heap[parent]
        if not _before(entry, up):
            break
        heap[pos] = up
        pos = parent
    heap[pos] = entry


def pop(heap: list[Due]) -> Due:
    """The first entry, removed (the heap must not be empty)."""
    last = heap.pop()
    if not heap:
        return last
    first = heap[0]
    n = len(heap)
    pos = 0
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        right = child + 1
        if right < n and _before(heap[right], heap[child]):
            child = right
        down = heap[child]
        if not _before(down, last):
            break
        heap[pos] = down
        pos = child
    heap[pos] = last
    return first
