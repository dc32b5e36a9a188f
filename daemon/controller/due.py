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
    """An entry: due at `at` (then `then`, for keys of two times), tie-broken by `seq`, with what
    it is about: a request (`request_due`), an action in flight (`action_due`) or a model's key
    (`key_due`). One class for every kind, not a subclass per kind: compiled, an entry read from
    a heap is checked against its class with one comparison where a subclass's took a walk of its
    bases, at every comparison of a push or pop (a third of a pop's instructions: issue 12)."""

    __slots__ = ("action", "at", "gone", "hung_at", "key", "req", "seq", "then")

    def __init__(self, at: float, seq: int, then: float = 0.0, req: InferenceRequest | None = None,
                 action: Action | None = None, key: str = "", hung_at: float = 0.0) -> None:
        self.at = at
        self.then = then
        self.seq = seq
        self.req = req
        self.action = action
        self.key = key
        self.hung_at = hung_at  # an action's: when it counts as hung
        # a work index's entry (`key_due`) that is no longer its model's live one there: popped,
        # discarded or replaced (lets a model keep its live entries without looking them up)
        self.gone = False


def request_due(at: float, req: InferenceRequest) -> Due:
    """A queued request, looked at again at `at`."""
    return Due(at, req.id, 0.0, req)


def action_due(at: float, action: Action, hung_at: float) -> Due:
    """An action in flight, looked at again at `at`; it counts as hung from `hung_at`."""
    return Due(at, action.id, 0.0, None, action, "", hung_at)


def key_due(rank: float, t: float, seq: int, key: str) -> Due:
    """A model's entry in a policy's work index: its key, by (rank, time)."""
    return Due(rank, seq, t, None, None, key)


def request_of(e: Due) -> InferenceRequest:
    """The request of a `request_due` entry."""
    req = e.req
    assert req is not None
    return req


def action_of(e: Due) -> Action:
    """The action of an `action_due` entry."""
    action = e.action
    assert action is not None
    return action


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
    """The first entry, removed (the heap must not be empty). As heapq does: the hole left at the
    root moves down along the smaller children to a leaf (one comparison a level), and the last
    entry goes up from there (it belongs near the bottom, so that is a comparison or two), rather
    than sinking the last entry from the root (two a level): under overload the expiry heap holds
    thousands of queued requests (issue 12's callgrind: ~9k instructions a request in pops)."""
    last = heap.pop()
    if not heap:
        return last
    first = heap[0]
    n = len(heap)
    pos = 0
    child = 1
    while child < n:
        right = child + 1
        if right < n and _before(heap[right], heap[child]):
            child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    while pos > 0:
        parent = (pos - 1) >> 1
        up = heap[parent]
        if not _before(last, up):
            break
        heap[pos] = up
        pos = parent
    heap[pos] = last
    return first


def first_of(a: list[Due], b: list[Due]) -> list[Due]:
    """Of two heaps, the one whose first entry comes first (`b` if `a` is empty): popped in turn,
    two heaps give their entries in the order one heap of them all would."""
    if not a:
        return b
    if not b:
        return a
    return b if _before(b[0], a[0]) else a
