"""Per-user weights on disk: SQLite in WAL mode, written by one thread of its own.

Velox keeps its per-user weights in a store that outlives the serving process; here that is an
embedded SQLite file (`[personalization] db_path`). One row per (model, version, user): the RLS
state, W (d+1, C) and P (d+1, d+1) as little-endian float64 blobs, the number of updates and the
time of the last one.

- Durability: `journal_mode=WAL` and `synchronous=NORMAL`. A committed transaction is in the
  WAL file when COMMIT returns (written, not fsynced), so it survives the daemon's process
  dying (kill -9, an OOM kill); a power cut may lose the last commits (fsync happens only at
  checkpoints). FULL would fsync every commit (milliseconds on most disks).
- One writer thread owns the connection, and every operation (reads too) goes through its
  queue in order: a read queued after a write sees it, so a user evicted from memory while its
  write is pending is read back with that write. The event loop never touches the file.
- Group commit: the thread takes every operation waiting in its queue, runs them in one
  transaction and commits once; a write's future is resolved only after that COMMIT (feedback
  is acknowledged after commit).

Futures are `concurrent.futures.Future`: the event loop wraps them (asyncio.wrap_future), tests
call `.result()`.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("escapement.userdb")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS user_weights (
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    user TEXT NOT NULL,
    dim INTEGER NOT NULL,
    classes INTEGER NOT NULL,
    weights BLOB NOT NULL,
    precision BLOB NOT NULL,
    updates INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (model, version, user)
)
"""
MAX_BATCH = 256  # operations per transaction at most (bounds how long one commit holds the writers' acks)
_F8 = np.dtype("<f8")


@dataclass(slots=True)
class StoredUser:
    """One user's row: the RLS state of one model version."""

    weights: np.ndarray  # (d+1, C) float64
    precision: np.ndarray  # P, (d+1, d+1) float64
    updates: int
    updated_at: float  # Unix time of the last update


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


class UserDB:
    """The user-weight store. `start()` opens the file (creating its directory) and starts the
    writer thread; `close()` commits what is queued and stops it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._queue: queue.SimpleQueue[tuple[str, tuple[Any, ...], Future[Any]] | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready: Future[None] = Future()
        self.writes = self.commits = self.reads = self.failures = 0
        self.commit_s = 0.0
        self._queued = 0

    # ---------------------------------------------------------------- lifecycle

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, wait: bool = True) -> None:
        """Open the database in the writer thread. `wait`: until it is open, raising what opening
        raised (a path that cannot be created, a file that is not a database); else at once, and
        such an error fails every operation instead (the event loop never waits for the file)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="escapement-userdb", daemon=True)
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

    # ---------------------------------------------------------------- operations (any thread)

    def put(self, model: str, version: int, user: str, state: StoredUser) -> Future[None]:
        """Store a user's state; the future resolves once it is committed."""
        w, p = np.ascontiguousarray(state.weights, _F8), np.ascontiguousarray(state.precision, _F8)
        row = (model, version, user, p.shape[0] - 1, w.shape[1], w.tobytes(), p.tobytes(), state.updates,
               state.updated_at)
        return self._submit("put", row)

    def get(self, model: str, version: int, user: str) -> Future[StoredUser | None]:
        """A user's stored state (None: the user has none), after every write queued before it."""
        return self._submit("get", (model, version, user))

    def stats(self) -> DBStats:
        return DBStats(self.writes, self.commits, self.reads, self.failures, self.commit_s * 1e3, self._queued)

    def _submit(self, op: str, args: tuple[Any, ...]) -> Future[Any]:
        fut: Future[Any] = Future()
        if self._thread is None:
            fut.set_exception(RuntimeError("the user database is not open"))
            return fut
        self._queued += 1
        self._queue.put((op, args, fut))
        return fut

    # ---------------------------------------------------------------- the writer thread

    def _run(self) -> None:
        try:
            conn = self._open()
        except Exception as e:
            log.error("user database %s cannot be opened: %s", self.path, e)
            self._ready.set_exception(e)
            while not isinstance(item := self._queue.get(), _Stop):  # every operation fails with why
                item[2].set_exception(e)
                self._queued -= 1
            return
        self._ready.set_result(None)
        stop = False
        try:
            while not stop:
                batch: list[tuple[str, tuple[Any, ...], Future[Any]]] = []
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
            log.warning("user database %s: journal mode is %s, not WAL", self.path, mode)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(_SCHEMA)
        return conn

    def _transaction(self, conn: sqlite3.Connection, batch: list[tuple[str, tuple[Any, ...], Future[Any]]]) -> None:
        t0 = time.perf_counter()
        results: list[Any] = []
        writes = 0
        try:
            conn.execute("BEGIN")
            for op, args, _ in batch:
                if op == "put":
                    conn.execute("INSERT OR REPLACE INTO user_weights VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", args)
                    writes += 1
                    results.append(None)
                else:
                    results.append(_row(conn.execute(
                        "SELECT dim, classes, weights, precision, updates, updated_at FROM user_weights "
                        "WHERE model = ? AND version = ? AND user = ?", args).fetchone()))
            conn.execute("COMMIT")
        except Exception as e:
            log.error("user database %s: a transaction of %d operations failed: %s", self.path, len(batch), e)
            self.failures += 1
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            for _, _, fut in batch:
                fut.set_exception(e)
            self._queued -= len(batch)
            return
        self.commit_s += time.perf_counter() - t0
        self.commits += 1
        self.writes += writes
        self.reads += len(batch) - writes
        self._queued -= len(batch)
        for (_, _, fut), result in zip(batch, results, strict=True):
            fut.set_result(result)  # after COMMIT: a write is acknowledged only once it is durable


def _row(row: tuple[Any, ...] | None) -> StoredUser | None:
    if row is None:
        return None
    dim, classes, w, p, updates, updated_at = row
    weights = np.frombuffer(w, _F8).reshape(dim + 1, classes).copy()
    precision = np.frombuffer(p, _F8).reshape(dim + 1, dim + 1).copy()
    return StoredUser(weights, precision, int(updates), float(updated_at))
