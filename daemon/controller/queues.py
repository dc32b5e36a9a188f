"""Per-model request queues, most urgent first: by priority rank, then deadline, then arrival.

Counted in samples (slots) as well as requests. Entries are invalidated rather than removed
(a request finished while queued, or taken from the middle for a batch, leaves a dead entry
that is dropped when it reaches the head); each entry carries the sequence number it was
pushed with, so a request pushed again after an action was refused is never there twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from heapq import heappop, heappush  # (module globals: a read of `heapq.x` is a generic attribute lookup compiled)
from typing import Final, final

from daemon.request import InferenceRequest, RequestStatus


class _Sequence:
    """Numbers for queue entries, unique across every queue (a request moves between a model's
    queue and its lane). A compiled counter: `next()` of an `itertools.count` is a generic call."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last += 1
        return self.last


_SEQ: Final = _Sequence()


@final
class _Entry:
    """A queued request's place: its rank, deadline (or arrival, in the best-effort lane) and the
    sequence number it was pushed with. A compiled class ordered by `__lt__`, not a tuple: heapq
    compares tuples item by item through generic calls, and `first` compares entries directly."""

    __slots__ = ("key", "rank", "req", "seq")

    def __init__(self, rank: int, key: float, seq: int, req: InferenceRequest) -> None:
        self.rank = rank
        self.key = key
        self.seq = seq
        self.req = req

    def __lt__(self, other: _Entry) -> bool:  # (as the tuple (rank, key, seq) orders; seq is unique)
        if self.rank != other.rank:
            return self.rank < other.rank
        if self.key != other.key:
            return self.key < other.key
        return self.seq < other.seq

    def live(self) -> bool:
        r = self.req
        return r.status == RequestStatus.QUEUED and r.queue_seq == self.seq


def _push_index(heap: list[_Entry], frontier: list[int], i: int) -> None:
    """Add heap index `i` to `frontier`, a binary heap of indices in the order of their entries."""
    frontier.append(i)
    k = len(frontier) - 1
    e = heap[i]
    while k > 0:
        parent = (k - 1) >> 1
        p = frontier[parent]
        if not e < heap[p]:
            break
        frontier[k] = p
        k = parent
    frontier[k] = i


def _pop_index(heap: list[_Entry], frontier: list[int]) -> int:
    """Remove and return the index of `frontier`'s most urgent entry."""
    top = frontier[0]
    last = frontier.pop()
    size = len(frontier)
    if size == 0:
        return top
    e = heap[last]
    k = 0
    while True:
        c = 2 * k + 1
        if c >= size:
            break
        if c + 1 < size and heap[frontier[c + 1]] < heap[frontier[c]]:
            c += 1
        if not heap[frontier[c]] < e:
            break
        frontier[k] = frontier[c]
        k = c
    frontier[k] = last
    return top


class ModelQueue:
    __slots__ = ("_by_arrival", "_heap", "max_deadline", "max_rank", "requests", "samples")

    def __init__(self, by_arrival: bool = False) -> None:
        # the best-effort lane serves oldest first (by arrival, within a priority), not by deadline
        self._by_arrival = by_arrival
        self._heap: list[_Entry] = []
        self.samples = 0  # queued samples of live (QUEUED) requests
        self.requests = 0
        # Upper bounds of the queued requests' rank and deadline (exact until one leaves, then
        # high; reset when the queue empties): "every queued request goes before this one".
        self.max_rank = 0
        self.max_deadline = 0.0

    def __len__(self) -> int:
        return self.requests

    def push(self, req: InferenceRequest) -> None:
        req.queue_seq = seq = _SEQ.next()
        heappush(self._heap, _Entry(req.rank, req.arrival if self._by_arrival else req.deadline, seq, req))
        if not self.requests:
            self.max_rank, self.max_deadline = req.rank, req.deadline
        else:
            # (compares, not the builtins: they parse their arguments on every call, once per request)
            if req.rank > self.max_rank:
                self.max_rank = req.rank
            if req.deadline > self.max_deadline:
                self.max_deadline = req.deadline
        self.samples += req.samples
        self.requests += 1

    def push_front(self, reqs: list[InferenceRequest]) -> None:
        """Return requests taken for an action that did not run (their place is their urgency)."""
        for r in reqs:
            self.push(r)

    def _skip_dead(self) -> None:
        h = self._heap
        while h and not h[0].live():
            heappop(h)

    def head(self) -> InferenceRequest | None:
        # (_skip_dead and live() inline: several times per request)
        h = self._heap
        queued = RequestStatus.QUEUED
        while h:
            e = h[0]
            r = e.req
            if r.status == queued and r.queue_seq == e.seq:
                return r
            heappop(h)
        return None

    def discard(self, req: InferenceRequest) -> None:
        """Account for a queued request finished in place (its entry is dropped lazily)."""
        self.samples -= req.samples
        self.requests -= 1

    def pop(self) -> InferenceRequest:
        self._skip_dead()
        r = heappop(self._heap).req
        r.queue_seq = 0
        self.samples -= r.samples
        self.requests -= 1
        return r

    def take(self, req: InferenceRequest) -> None:
        """Remove a queued request from anywhere in the queue (for a batch)."""
        req.queue_seq = 0  # its entry is dead now
        self.samples -= req.samples
        self.requests -= 1

    def take_all(self, reqs: list[InferenceRequest]) -> None:
        """`take` each of `reqs` (a batch)."""
        samples = 0
        for r in reqs:
            r.queue_seq = 0
            samples += r.samples
        self.samples -= samples
        self.requests -= len(reqs)

    def first(self, n: int) -> list[InferenceRequest]:
        """Up to `n` live requests, most urgent first, without removing them: a best-first walk of
        the heap from its root (O(n log n) in what it returns, not in the queue's length, which a
        flood of best-effort requests can make long). Its frontier holds indices into the heap,
        ordered by their entries (compiled: with heapq on tuples of entries, compared item by item
        through generic calls, it took ~9k instructions per request returned)."""
        heap = self._heap
        out: list[InferenceRequest] = []
        size = len(heap)
        if size == 0 or n <= 0:
            return out
        queued = RequestStatus.QUEUED
        if size <= 2 * n:  # (most calls: the queue is short) a sort of its live entries is cheaper
            live = [e for e in heap if e.req.status == queued and e.req.queue_seq == e.seq]
            live.sort()
            if len(live) > n:
                del live[n:]
            return [e.req for e in live]
        frontier: list[int] = [0]
        while frontier and len(out) < n:
            i = _pop_index(heap, frontier)
            e = heap[i]
            r = e.req
            if r.status == queued and r.queue_seq == e.seq:
                out.append(r)
            c = 2 * i + 1
            if c < size:
                _push_index(heap, frontier, c)
                if c + 1 < size:
                    _push_index(heap, frontier, c + 1)
        return out

    def __iter__(self) -> Iterator[InferenceRequest]:
        return iter([e.req for e in sorted(self._heap) if e.live()])
