"""A stream-race checker for the CUDA stand-in: vector clocks over streams and the host.

Every stream and the host are actors with a vector clock. Enqueuing work on a stream orders it
after what the host did so far (program order); recording an event snapshots its stream's
clock; a stream waiting on an event, or the host synchronizing with one, merges that snapshot.
An access (a range of one buffer, read or written) races with an earlier access of another
actor when neither happens before the other and at least one writes, the same rule as
`torch.cuda._sanitizer`. The check runs when work is enqueued, so a race is reported where the
code is wrong, whatever order the stand-in later runs things in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

HOST = "host"
MAX_RECORDS = 4096  # per buffer; the oldest are forgotten past this (a race may then go unseen)

Clock = dict[str, int]


class RaceError(AssertionError):
    """Two accesses of the same bytes, not ordered by streams, events or host syncs, one a write."""


@dataclass(slots=True)
class Access:
    start: int
    end: int
    actor: str
    tick: int
    write: bool
    what: str

    def before(self, clock: Clock) -> bool:
        return clock.get(self.actor, 0) >= self.tick


def merge(into: Clock, other: Clock) -> None:
    for actor, t in other.items():
        if into.get(actor, 0) < t:
            into[actor] = t


class RaceChecker:
    def __init__(self, strict: bool = True) -> None:
        self.strict = strict  # raise at the first race, else only collect them
        self.races: list[str] = []
        self._clocks: dict[str, Clock] = {HOST: {HOST: 0}}
        self._records: dict[int, list[Access]] = {}
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- ordering

    def enqueue(self, stream: str) -> Clock:
        """A new operation on `stream`: after the stream's earlier work and the host's; its clock."""
        with self._lock:
            vc = self._clocks.setdefault(stream, {stream: 0})
            merge(vc, self._clocks[HOST])
            vc[stream] = vc.get(stream, 0) + 1
            return dict(vc)

    def snapshot(self, stream: str) -> Clock:
        with self._lock:
            return dict(self._clocks.setdefault(stream, {stream: 0}))

    def stream_waits(self, stream: str, clock: Clock) -> None:
        with self._lock:
            merge(self._clocks.setdefault(stream, {stream: 0}), clock)

    def host_syncs(self, clock: Clock) -> None:
        with self._lock:
            merge(self._clocks[HOST], clock)

    def host_tick(self) -> Clock:
        with self._lock:
            vc = self._clocks[HOST]
            vc[HOST] += 1
            return dict(vc)

    # ---------------------------------------------------------------- accesses

    def access(self, actor: str, clock: Clock, buffer: int, start: int, end: int, write: bool, what: str) -> None:
        if end <= start:
            return
        with self._lock:
            records = self._records.setdefault(buffer, [])
            for r in records:
                if r.end <= start or r.start >= end or r.actor == actor:
                    continue
                if (write or r.write) and not r.before(clock):
                    self._report(f"{'write' if write else 'read'} of bytes [{start}, {end}) of buffer {buffer} by "
                                 f"{what} ({actor}) races with the {'write' if r.write else 'read'} of "
                                 f"[{r.start}, {r.end}) by {r.what} ({r.actor}): no stream, event or host "
                                 "synchronization orders them")
                    break
            new = Access(start, end, actor, clock[actor], write, what)
            keep = [r for r in records if not self._superseded(r, new, clock)]
            keep.append(new)
            if len(keep) > MAX_RECORDS:
                del keep[: len(keep) - MAX_RECORDS]
            self._records[buffer] = keep

    @staticmethod
    def _superseded(r: Access, new: Access, clock: Clock) -> bool:
        """Records a later access makes redundant: covered by it, ordered before it, and either both
        reads of one actor or `new` a write (whatever conflicts with them conflicts with `new`)."""
        if r.start < new.start or r.end > new.end or not r.before(clock):
            return False
        return new.write or (not r.write and r.actor == new.actor)

    def forget(self, buffer: int) -> None:
        """The buffer was freed (after the device finished with it)."""
        with self._lock:
            self._records.pop(buffer, None)

    def _report(self, message: str) -> None:
        self.races.append(message)
        if self.strict:
            raise RaceError(message)
