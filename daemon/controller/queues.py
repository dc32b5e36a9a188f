"""Per-model request queues, FIFO by arrival, counted in samples (slots) as well as requests."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from daemon.request import InferenceRequest, RequestStatus


class ModelQueue:
    __slots__ = ("_q", "requests", "samples")

    def __init__(self) -> None:
        self._q: deque[InferenceRequest] = deque()
        self.samples = 0  # queued samples of live (QUEUED) requests
        self.requests = 0

    def __len__(self) -> int:
        return self.requests

    def push(self, req: InferenceRequest) -> None:
        self._q.append(req)
        self.samples += req.samples
        self.requests += 1

    def push_front(self, reqs: list[InferenceRequest]) -> None:
        """Return requests taken for an action that did not run, ahead of newer ones."""
        for r in reversed(reqs):
            self._q.appendleft(r)
            self.samples += r.samples
            self.requests += 1

    def _skip_dead(self) -> None:
        # Requests finished while queued (cancelled, expired) are left in place and dropped here.
        q = self._q
        while q and q[0].status != RequestStatus.QUEUED:
            q.popleft()

    def head(self) -> InferenceRequest | None:
        self._skip_dead()
        return self._q[0] if self._q else None

    def discard(self, req: InferenceRequest) -> None:
        """Account for a queued request finished in place (its entry is dropped lazily)."""
        self.samples -= req.samples
        self.requests -= 1

    def pop(self) -> InferenceRequest:
        self._skip_dead()
        r = self._q.popleft()
        self.samples -= r.samples
        self.requests -= 1
        return r

    def __iter__(self) -> Iterator[InferenceRequest]:
        return (r for r in self._q if r.status == RequestStatus.QUEUED)
