"""A SQLite file written by one thread of its own: the store under the users' weights
(daemon/apps/userdb.py) and the applications' policy state (daemon/apps/appdb.py).

- Durability: `journal_mode=WAL` and `synchronous=NORMAL`. A committed transaction is in the
  WAL file when COMMIT returns (written, not fsynced), so it survives the daemon's process
  dying (kill -9, an OOM kill); a power cut may lose the last commits (fsync happens only at
  checkpoints). FULL would fsync every commit (milliseconds on most disks).
- One writer thread owns the connection, and every operation (reads too) goes through its
  queue in order: a read queued after a write sees it. The event loop never touches the file.
- Group commit: the thread takes every operation waiting in its queue (up to `MAX_BATCH`), runs
  them in one transaction and commits once; a write's future is resolved only after that
  COMMIT (an update is acknowledged once it is durable against a process crash).

Futures are `concurrent.futures.Future`: the event loop wraps them (asyncio.wrap_future), tests
call `.result()`. A store names its table in `SCHEMA` and answers one operation in `apply`.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

log = logging.getLogger("escapement.sqlitestore")

MAX_BATCH = 256  # operations per transaction at most (bounds how long one commit holds the writers' acks)

Op = tuple[str, tuple[Any, ...], "Future[Any]"]


@dataclass(frozen=True, slots=True)
class DBStats:
    writes: int  # rows written (committed)
    commits: int
    reads: int
    failures: int
    commit_ms_total: float  # time spent in the writer's transactions (execute + COMMIT)
    queued: int


class _Stop:
    pass


class SqliteStore(ABC):
    """`start()` opens the file (creating its directory) in the writer thread; `close()` commits
    what is queued and stops it. Operations before `start()` fail."""

    SCHEMA: ClassVar[str]
    LABEL: ClassVar[str]  # how logs and errors name it: "user database"
    THREAD: ClassVar[str]

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._queue: queue.SimpleQueue[Op | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready: Future[None] = Future()
        self.writes = self.commits = self.reads = self.failures = 0
        self.commit_s = 0.0
        # queued = submitted - finished, each written by one thread only (operations come from the
        # event loop, the writer finishes them)
        self._submitted = 0
        self._finished = 0

    # ---------------------------------------------------------------- lifecycle

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, wait: bool = True) -> None:
        """Open the database in the writer thread. `wait`: until it is open, raising what opening
        raised (a path that cannot be created, a file that is not a database); else at once, and
        such an error fails every operation instead (the event loop never waits for the file)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.THREAD, daemon=True)
            self._thread.start()
        if wait:
            self._ready.result()

    def close(self) -> None:
        """Commit what is queued, then close the file (blocks until the thread is done)."""
        t = self._thread
        if t is None:
            return
        self._queue.put(_Stop())
        t.join()
        self._thread = None

    def stats(self) -> DBStats:
        return DBStats(self.writes, self.commits, self.reads, self.failures, self.commit_s * 1e3,
                       max(0, self._submitted - self._finished))

    # ---------------------------------------------------------------- operations (the event loop's thread)

    def submit(self, op: str, args: tuple[Any, ...]) -> Future[Any]:
        """Queue one operation for `apply` (its future resolves after its transaction commits)."""
        fut: Future[Any] = Future()
        if self._thread is None:
            fut.set_exception(RuntimeError(f"the {self.LABEL} is not open"))
            return fut
        self._submitted += 1
        self._queue.put((op, args, fut))
        return fut

    @abstractmethod
    def apply(self, conn: sqlite3.Connection, op: str, args: tuple[Any, ...]) -> tuple[Any, bool]:
        """Run one operation inside the writer's transaction: (its result, whether it wrote)."""

    # ---------------------------------------------------------------- the writer thread

    def _run(self) -> None:
        try:
            conn = self._open()
        except Exception as e:
            log.error("%s %s cannot be opened: %s", self.LABEL, self.path, e)
            self._ready.set_exception(e)
            while not isinstance(item := self._queue.get(), _Stop):  # every operation fails with why
                item[2].set_exception(e)
                self._finished += 1
            return
        self._ready.set_result(None)
        stop = False
        try:
            while not stop:
                batch: list[Op] = []
                item = self._queue.get()
                while True:  # group commit: everything already waiting goes into this transaction
                    if isinstance(item, _Stop):
                        stop = True
                        break
                    batch.append(item)
                    if len(batch) >= MAX_BATCH:
                        break
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if batch:
                    self._transaction(conn, batch)
        finally:
            conn.close()

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            log.warning("%s %s: journal mode is %s, not WAL", self.LABEL, self.path, mode)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(self.SCHEMA)
        return conn

    def _transaction(self, conn: sqlite3.Connection, batch: list[Op]) -> None:
        t0 = time.perf_counter()
        results: list[Any] = []
        writes = 0
        try:
            conn.execute("BEGIN")
            for op, args, _ in batch:
                result, wrote = self.apply(conn, op, args)
                results.append(result)
                writes += wrote
            conn.execute("COMMIT")
        except Exception as e:
            log.error("%s %s: a transaction of %d operations failed: %s", self.LABEL, self.path, len(batch), e)
            self.failures += 1
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            for _, _, fut in batch:
                fut.set_exception(e)
            self._finished += len(batch)
            return
        self.commit_s += time.perf_counter() - t0
        self.commits += 1
        self.writes += writes
        self.reads += len(batch) - writes
        self._finished += len(batch)
        for (_, _, fut), result in zip(batch, results, strict=True):
            fut.set_result(result)  # after COMMIT: a write is acknowledged only once it is durable
