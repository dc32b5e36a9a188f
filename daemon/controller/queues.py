"""Per-model request queues, most urgent first: by priority rank, then deadline, then arrival.

Counted in samples (slots) as well as requests. Entries are invalidated rather than removed
(a request finished while queued, or taken from the middle for a batch, leaves a dead entry
that is dropped when it reaches the head, or when a walk passes over too many); each entry
carries the sequence number it was pushed with, so a request pushed again after an action was
refused is never there twice.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    sequence number it was pushed with. A compiled class, not a tuple (compiled code compares
    tuples item by item through generic calls); the queue orders entries with `_before`."""

    __slots__ = ("key", "rank", "req", "seq")

    def __init__(self, rank: int, key: float, seq: int, req: InferenceRequest) -> None:
        self.rank = rank
        self.key = key
        self.seq = seq
        self.req = req

    def live(self) -> bool:
        r = self.req
        return r.status == RequestStatus.QUEUED and r.queue_seq == self.seq


def _before(a: _Entry, b: _Entry) -> bool:
    """Whether `a` goes before `b`: as the tuple (rank, key, seq) orders (seq is unique, so two
    entries never tie). A function, not `__lt__`: compiled, an operator goes through the generic
    rich comparison."""
    if a.rank != b.rank:
        return a.rank < b.rank
    if a.key != b.key:
        return a.key < b.key
    return a.seq < b.seq


COMPACT_AT: Final = 64  # dead entries passed over by one walk past which the queue drops them all


class ModelQueue:
    """A model's queued requests in order (`_before`), in a list sorted from `_start` on: most new
    requests go at or near the end (a deadline a fixed SLO after their arrival), the head leaves
    by moving `_start`, and `first(n)` reads the first n live entries as they lie. (A binary heap
    needed a best-first walk for `first`, with a frontier of heap indices: each a boxed integer
    written and compared through generic calls, ~3k instructions an entry returned, the most of
    a batch choice under overload: issue 12's callgrind.)"""

    __slots__ = ("_by_arrival", "_items", "_start", "max_deadline", "max_rank", "requests", "samples")

    def __init__(self, by_arrival: bool = False) -> None:
        # the best-effort lane serves oldest first (by arrival, within a priority), not by deadline
        self._by_arrival = by_arrival
        self._items: list[_Entry] = []  # sorted from _start on; dead entries are dropped lazily
        self._start = 0  # entries before it have left
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
        e = _Entry(req.rank, req.arrival if self._by_arrival else req.deadline, seq, req)
        items = self._items
        n = len(items)
        if n == self._start or not _before(e, items[n - 1]):
            items.append(e)  # (most pushes: after everything queued)
        else:  # the first entry after it, by bisection
            lo, hi = self._start, n - 1
            while lo < hi:
                mid = (lo + hi) >> 1
                if _before(e, items[mid]):
                    hi = mid
                else:
                    lo = mid + 1
            items.insert(lo, e)
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

    def _advance(self, i: int) -> None:
        """Entries before `i` have left: forget them (the list is cut once they are half of it)."""
        items = self._items
        if i >= len(items):
            items.clear()
            self._start = 0
        elif i > 32 and 2 * i > len(items):
            del items[:i]
            self._start = 0
        else:
            self._start = i

    def head(self) -> InferenceRequest | None:
        items = self._items
        n = len(items)
        i = self._start
        queued = RequestStatus.QUEUED
        while i < n:
            e = items[i]
            r = e.req
            if r.status == queued and r.queue_seq == e.seq:
                if i != self._start:
                    self._advance(i)
                return r
            i += 1
        if n:
            self._advance(n)
        return None

    def discard(self, req: InferenceRequest) -> None:
        """Account for a queued request finished in place (its entry is dropped lazily)."""
        self.samples -= req.samples
        self.requests -= 1

    def pop(self) -> InferenceRequest:
        r = self.head()
        assert r is not None, "pop from an empty queue"
        self._advance(self._start + 1)
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
        """Up to `n` live requests, most urgent first, without removing them: the first live
        entries as they lie (a walk that passes over more than COMPACT_AT dead ones, left by
        requests taken from the middle, drops every dead entry)."""
        items = self._items
        out: list[InferenceRequest] = []
        if n <= 0:
            return out
        queued = RequestStatus.QUEUED
        dead = 0
        size = len(items)
        i = self._start
        while i < size and len(out) < n:
            e = items[i]
            r = e.req
            if r.status == queued and r.queue_seq == e.seq:
                out.append(r)
            else:
                dead += 1
            i += 1
        if dead > COMPACT_AT:
            self._items = [e for e in items[self._start:] if e.live()]
            self._start = 0
        return out

    def __iter__(self) -> Iterator[InferenceRequest]:
        return iter([e.req for e in self._items[self._start:] if e.live()])
