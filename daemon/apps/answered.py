"""Answered queries remembered by id until their feedback comes (applications, personalized
models): oldest first, bounded in count, bytes and age."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from daemon.apps.queryid import new_query_id
from daemon.clock import Clock


class Remembered(Protocol):
    @property
    def at(self) -> float: ...  # clock time it was answered

    @property
    def nbytes(self) -> int: ...  # what holding it costs


Q = TypeVar("Q", bound=Remembered)


class AnsweredQueries(Generic[Q]):
    """Answered queries by id, oldest first; bounded in count, bytes and age (the newest one is
    always kept, whatever its size)."""

    def __init__(self, max_queries: int, max_bytes: int, ttl_s: float, clock: Clock) -> None:
        self.max_queries = max(1, max_queries)
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._queries: OrderedDict[str, Q] = OrderedDict()
        self.bytes = 0
        self.evictions = 0  # pushed out by the bounds or expired

    def __len__(self) -> int:
        return len(self._queries)

    def add(self, q: Q) -> str:
        qid = new_query_id()  # not guessable: feedback moves weights
        self._queries[qid] = q
        self.bytes += q.nbytes
        self._expire(q.at)
        while len(self._queries) > 1 and (len(self._queries) > self.max_queries or self.bytes > self.max_bytes):
            self._pop_oldest()
        return qid

    def get(self, qid: str) -> Q | None:
        """The query (still remembered); None if unknown or expired."""
        self._expire(self.clock.now())
        return self._queries.get(qid)

    def take(self, qid: str) -> Q | None:
        """The query, forgotten (one feedback per query); None if unknown or expired."""
        self._expire(self.clock.now())
        q = self._queries.pop(qid, None)
        if q is not None:
            self.bytes -= q.nbytes
        return q

    def _expire(self, now: float) -> None:
        # insertion order is answer order: the expired ones are at the front
        while self._queries and now - next(iter(self._queries.values())).at > self.ttl_s:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, q = self._queries.popitem(last=False)
        self.bytes -= q.nbytes
        self.evictions += 1
