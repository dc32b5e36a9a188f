"""Request memory: the bytes of client requests the daemon holds, bounded in total and per connection.

A count of requests bounds nothing when one request may carry 64 MiB: the daemon's memory is
bounded by charging every byte a client makes it hold (bodies and frames as they are read,
tensors decoded from JSON, answers until they are written) to one budget. Each connection has a
share: past it the connection stops reading until its own requests finish (back-pressure, which
cannot deadlock, since a connection with nothing in flight always fits one body). Past the total,
new requests are refused (HTTP: 503 with Retry-After, the body read and dropped) or, on the
socket, where a refusal cannot name the request it refuses before the frame is decoded, reading
pauses until memory is released.

A sixteenth of the total is kept for small requests (at most SMALL_REQUEST bytes in all): clients
sending large bodies, however many, fill the rest and are refused, while ordinary requests of a
few KiB keep being served beside them.

Pure bookkeeping, no I/O: the frontends call it, the loop's single thread makes it safe.
"""

from __future__ import annotations

from collections.abc import Callable

from daemon.errors import Overloaded

SMALL_REQUEST = 64 << 10  # a request holding at most this much may use the reserve
RESERVE_FRACTION = 16  # 1/16 of the total is the reserve for small requests


class RequestMemory:
    """The daemon-wide budget (server.request_memory_bytes) and its per-connection share."""

    def __init__(self, limit: int, share: int) -> None:
        if share > limit:
            raise ValueError(f"a connection's share ({share}) cannot exceed the total ({limit})")
        self.limit = limit
        self.large_limit = limit - limit // RESERVE_FRACTION  # what large requests may fill
        self.share_limit = share
        self.held = 0
        self.peak = 0
        self.refused = 0  # requests refused because the total was reached
        self._waiters: dict[object, Callable[[], None]] = {}  # paused readers, woken on release

    def fits(self, n: int, small: bool = False) -> bool:
        return self.held + n <= (self.limit if small else self.large_limit)

    def share(self) -> Share:
        return Share(self)

    def refusal(self, n: int) -> Overloaded:
        self.refused += 1
        return Overloaded(f"the daemon holds {self.held} bytes of requests; {n} more would pass its limit of "
                          f"{self.limit} (server.request_memory_bytes); retry later", retry_after_s=1.0)

    def wait(self, key: object, wake: Callable[[], None]) -> None:
        """Call `wake` once memory is released (a reader paused for the total)."""
        self._waiters[key] = wake

    def forget(self, key: object) -> None:
        self._waiters.pop(key, None)

    def _add(self, n: int) -> None:
        self.held += n
        if self.held > self.peak:
            self.peak = self.held

    def _sub(self, n: int) -> None:
        self.held -= n
        if self._waiters and self.held < self.limit:
            waiters, self._waiters = self._waiters, {}
            for wake in waiters.values():  # each re-checks; one that still does not fit waits again
                wake()


class Share:
    """One connection's part of the budget."""

    __slots__ = ("held", "memory")

    def __init__(self, memory: RequestMemory) -> None:
        self.memory = memory
        self.held = 0

    @property
    def full(self) -> bool:
        """The connection holds its share: it should stop reading until its requests finish."""
        return self.held >= self.memory.share_limit

    def lease(self) -> Lease:
        return Lease(self)


class Lease:
    """The bytes one request holds; released once, when its answer is written or it is dropped."""

    __slots__ = ("bytes", "share")

    def __init__(self, share: Share) -> None:
        self.share = share
        self.bytes = 0

    def take(self, n: int) -> bool:
        """Charge `n` bytes the request is about to hold; False (nothing charged) past the total."""
        if not self.share.memory.fits(n, small=self.bytes + n <= SMALL_REQUEST):
            return False
        self.force(n)
        return True

    def force(self, n: int) -> None:
        """Charge bytes already held (decoded tensors): they count even past the limit."""
        self.bytes += n
        self.share.held += n
        self.share.memory._add(n)

    def release(self) -> None:
        n, self.bytes = self.bytes, 0
        if n:
            self.share.held -= n
            self.share.memory._sub(n)
