"""Per-model request queues, most urgent first: by priority rank, then deadline, then arrival.

Counted in samples (slots) as well as requests. Requests finished while queued (cancelled,
expired) are dropped lazily when they reach the head.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from daemon.request import InferenceRequest, RequestStatus


class ModelQueue:
    __slots__ = ("_heap", "requests", "samples")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, InferenceRequest]] = []
        self.samples = 0  # queued samples of live (QUEUED) requests
        self.requests = 0

    def __len__(self) -> int:
        return self.requests

    def push(self, req: InferenceRequest) -> None:
        heapq.heappush(self._heap, (req.rank, req.deadline, req.id, req))
        self.samples += req.samples
        self.requests += 1

    def push_front(self, reqs: list[InferenceRequest]) -> None:
        """Return requests taken for an action that did not run (their place is their urgency)."""
        for r in reqs:
            self.push(r)

    def _skip_dead(self) -> None:
        h = self._heap
        while h and h[0][3].status != RequestStatus.QUEUED:
            heapq.heappop(h)

    def head(self) -> InferenceRequest | None:
        self._skip_dead()
        return self._heap[0][3] if self._heap else None

    def discard(self, req: InferenceRequest) -> None:
        """Account for a queued request finished in place (its entry is dropped lazily)."""
        self.samples -= req.samples
        self.requests -= 1

    def pop(self) -> InferenceRequest:
        self._skip_dead()
        r = heapq.heappop(self._heap)[3]
        self.samples -= r.samples
        self.requests -= 1
        return r

    def __iter__(self) -> Iterator[InferenceRequest]:
        return (e[3] for e in sorted(self._heap) if e[3].status == RequestStatus.QUEUED)
