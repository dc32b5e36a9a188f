"""The link between the controller process and one frontend worker: msgpack records on a socketpair.

Records are msgpack arrays whose first element is an op code (below); msgpack is self-delimiting,
so a stream of records needs no length prefix. Tensors never travel here: a SUBMIT names where
its inputs lie in the worker's shared-memory slots (daemon/api/slots.py). Answers (DONE) carry
their outputs' raw bytes inline: outputs are written once by the controller and read once by the
worker either way, and inline they need no second pool and no FREE round trip.

Writes are gathered and flushed once per loop turn (one send for a burst of records). Neither end
ever waits for the other: a peer that stops reading lets the writer's buffer grow to `max_buffer`,
and past that the writer calls `on_wedged` (the controller kills that worker). Bounded on the
reading side too: the unpacker holds at most `max_record` bytes of one record.

Records (arrays; "->" controller to worker, "<-" worker to controller):
  -> HELLO    [HELLO, settings (pickle), worker index, workers, http host, http port, grpc host, grpc port]
  -> MODELS   [MODELS, catalog snapshot (pickle), generation]  the served models changed
  <- SEEN     [SEEN, generation]   the worker now answers from that catalog (READY=1 after a
                                   reload waits for every worker's: daemon/frontends.py)
  -> STATE    [STATE, overloaded, lag_s, ready, lost_devices]  health or overload changed
  -> REGIONS  [REGIONS, [[name, key, offset, byte_size, st_dev, st_ino], ...]]  the shared-memory
              registry changed (the worker serves those regions itself: daemon/api/sharedmem.py)
  <- SUBMIT   [SUBMIT, rid, name, version, samples, arrival, deadline, priority, rank, klass,
               give_up_at, client_id, [[offset, shape], ...] (model input order)]
  <- CANCEL   [CANCEL, rid]
  -> DONE     [DONE, rid, status, error, retry_after_s, reconstructed, [[shape, bytes], ...], cached,
               defaulted]
  -> ANSWER   [ANSWER, rid, [[shape, bytes], ...]]   DONE of a plain success (200, none of the flags):
                                                    most answers, in a third of the record's fields
  <- CALL     [CALL, cid, kind, payload]   an HTTP request or socket op for the controller to answer
  -> REPLY    [REPLY, cid, payload]
  <- ABORT    [ABORT, cid]   nobody waits for that CALL's answer any more (its client left, its
                             deadline passed): the controller cancels what answers it
  -> DRAIN    [DRAIN]   stop listening; answer what is held
  -> STOP     [STOP]    close every connection and exit
  <- READY    [READY]   listening

The catalog snapshot and the settings go as pickles: rare, small, between two processes of the
same program over a private socketpair (never a tensor, never from a client).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgpack

log = logging.getLogger("escapement.workers")

HELLO, MODELS, STATE, SUBMIT, CANCEL, DONE, CALL, REPLY, DRAIN, STOP, READY, ABORT, REGIONS, SEEN, ANSWER = range(15)

MAX_BUFFER = 256 << 20  # unsent bytes to one peer before it counts as wedged


class Link(asyncio.Protocol):
    """One end of a link: `on_record(record)` for each record read, `on_lost()` once when it closes."""

    def __init__(self, on_record: Callable[[list[Any]], None], on_lost: Callable[[], None], *,
                 max_record: int, max_buffer: int = MAX_BUFFER, on_wedged: Callable[[], None] | None = None) -> None:
        self.on_record = on_record
        self.on_lost = on_lost
        self.on_wedged = on_wedged
        self.max_buffer = max_buffer
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max_record, use_list=True)
        self._out: list[bytes] = []
        self._packer = msgpack.Packer(use_bin_type=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
            for record in self._unpacker:
                self.on_record(record)
        except (msgpack.exceptions.BufferFull, msgpack.exceptions.ExtraData, ValueError) as e:
            # the peer is our own program: a bad record is a bug, and the stream cannot be resynced
            log.error("link: a bad record (%s: %s); closing the link", type(e).__name__, e)
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._out.clear()
        self.on_lost()

    def send(self, record: list[Any]) -> None:
        """Queue a record; the records of one loop turn are written together after it."""
        if self.closed or self.transport is None:
            return
        if not self._out:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._out.append(self._packer.pack(record))

    def hold(self, record: list[Any]) -> bool:
        """Queue a record without arranging its write: True if the caller must `flush` the link
        (nothing was queued before; else a flush is already arranged and takes it too)."""
        if self.closed or self.transport is None:
            return False
        first = not self._out
        self._out.append(self._packer.pack(record))
        return first

    def flush(self) -> None:
        """Write what is queued now."""
        self._flush()

    def _flush(self) -> None:
        if self.closed or self.transport is None or not self._out:
            return
        out, self._out = self._out, []
        self.transport.write(b"".join(out) if len(out) > 1 else out[0])
        if self.transport.get_write_buffer_size() > self.max_buffer and self.on_wedged is not None:
            self.on_wedged()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self._flush()
            self.transport.close()
