"""The trace: every request and action as a JSON line, written by a thread of its own.

`controller.trace_path` turns it on. The loop only queues a line (a bounded queue, dropping when
full); the thread does the file I/O, so neither a slow disk nor a failed write stalls the loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import orjson

log = logging.getLogger("escapement.controller")

TRACE_RETRY_S = 5.0  # after a failed trace write, how long lines are dropped before the next try


class TraceWriter:
    """JSON lines to a file from a thread of its own; a bounded queue, dropping when full."""

    def __init__(self, path: str | Path, max_pending: int = 100_000) -> None:
        self.path = Path(path)
        self._q: queue.Queue[bytes | None] = queue.Queue(max_pending)
        self.dropped = 0
        self.failures = 0  # writes that failed
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    def write(self, event: dict[str, Any]) -> None:
        try:
            self._q.put_nowait(orjson.dumps(event) + b"\n")
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        # A write that fails (a full disk, a removed mount) drops lines, counted, and never stops
        # the thread: the queue keeps draining, so neither the loop nor a shutdown waits on it.
        f: BinaryIO | None = None
        retry_at = 0.0
        while (line := self._q.get()) is not None:
            if f is None and time.monotonic() >= retry_at:
                try:
                    f = self.path.open("ab")
                except OSError as e:
                    self._failed(e)
                    retry_at = time.monotonic() + TRACE_RETRY_S
            if f is None:
                self.dropped += 1
                continue
            try:
                f.write(line)
                if self._q.empty():
                    f.flush()
            except OSError as e:
                self.dropped += 1
                self._failed(e)
                self._discard(f)
                f = None
                retry_at = time.monotonic() + TRACE_RETRY_S
        if f is not None:
            self._discard(f, flush=True)

    def _failed(self, e: OSError) -> None:
        self.failures += 1
        if self.failures == 1:  # once: a full disk must not also fill the journal
            log.error("trace %s cannot be written: %s; lines are dropped (retrying every %.0f s)",
                      self.path, e.strerror or e, TRACE_RETRY_S)

    def _discard(self, f: BinaryIO, flush: bool = False) -> None:
        try:
            if flush:
                f.flush()
        except OSError as e:
            self._failed(e)
        try:
            f.close()
        except OSError:
            pass  # its buffer could not be written: those lines are lost, and said so above
        return None

    def close(self, timeout: float = 5.0) -> None:
        """End the writer: what is queued is written (or dropped) within `timeout` s at most."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:  # the thread is stuck in a write (a hung mount): leave it
            log.warning("trace %s: the writer is stuck; %d line(s) left unwritten", self.path, self._q.qsize())
            return
        self._thread.join(timeout)


    async def aclose(self) -> None:
        """`close` from the event loop: the join happens in a thread, so the loop is never blocked on it."""
        await asyncio.to_thread(self.close)
