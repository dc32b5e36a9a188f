"""Applications' policy state on disk: SQLite in WAL mode, written by one thread of its own.

The same store style as the users' weights (daemon/apps/userdb.py, whose docstring gives the
durability argument): `journal_mode=WAL`, `synchronous=NORMAL`, one writer thread that owns the
connection and runs every operation in queue order (a read queued after a write sees it), group
commit, and a write's future resolved only after its COMMIT (feedback is acknowledged once its
update is durable against a process crash).

One row per (application, digest): the digest names the policy and the member list the weights
belong to (daemon/apps/application.py AppDefinition.digest), so an application redefined over
other models starts again while the old row stays for a definition that comes back.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from daemon.apps.selection import PolicyState

log = logging.getLogger("escapement.appdb")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS application_policies (
    app TEXT NOT NULL,
    digest TEXT NOT NULL,
    weights TEXT NOT NULL,
    updates INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (app, digest)
)
"""
MAX_BATCH = 256  # operations per transaction at most


class _Stop:
    pass


Op = tuple[str, tuple[Any, ...], "Future[Any]"]


class AppDB:
    """The policy store. `start()` opens the file in the writer thread; `close()` commits what is
    queued and stops it. Operations before `start()` fail (the loop opens it on first use)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._queue: queue.SimpleQueue[Op | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready: Future[None] = Future()
        self.writes = self.commits = self.reads = self.failures = 0

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, wait: bool = True) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="escapement-appdb", daemon=True)
            self._thread.start()
        if wait:
            self._ready.result()

    def close(self) -> None:
        t = self._thread
        if t is None:
            return
        self._queue.put(_Stop())
        t.join()
        self._thread = None

    def put(self, app: str, digest: str, state: PolicyState, updated_at: float) -> Future[None]:
        """Store an application's policy state; resolves once committed."""
        return self._submit("put", (app, digest, json.dumps(state.weights), state.updates, updated_at))

    def get(self, app: str, digest: str) -> Future[PolicyState | None]:
        """The stored state (None: nothing stored), after every write queued before it."""
        return self._submit("get", (app, digest))

    def _submit(self, op: str, args: tuple[Any, ...]) -> Future[Any]:
        fut: Future[Any] = Future()
        if self._thread is None:
            fut.set_exception(RuntimeError("the application database is not open"))
            return fut
        self._queue.put((op, args, fut))
        return fut

    # ---------------------------------------------------------------- the writer thread

    def _run(self) -> None:
        try:
            conn = self._open()
        except Exception as e:
            log.error("application database %s cannot be opened: %s", self.path, e)
            self._ready.set_exception(e)
            while not isinstance(item := self._queue.get(), _Stop):
                item[2].set_exception(e)
            return
        self._ready.set_result(None)
        stop = False
        try:
            while not stop:
                batch: list[Op] = []
                item = self._queue.get()
                while True:  # group commit
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
            log.warning("application database %s: journal mode is %s, not WAL", self.path, mode)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(_SCHEMA)
        return conn

    def _transaction(self, conn: sqlite3.Connection, batch: list[Op]) -> None:
        t0 = time.perf_counter()
        results: list[Any] = []
        writes = 0
        try:
            conn.execute("BEGIN")
            for op, args, _ in batch:
                if op == "put":
                    conn.execute("INSERT OR REPLACE INTO application_policies VALUES (?, ?, ?, ?, ?)", args)
                    writes += 1
                    results.append(None)
                else:
                    row = conn.execute("SELECT weights, updates FROM application_policies WHERE app = ? AND "
                                       "digest = ?", args).fetchone()
                    results.append(None if row is None else PolicyState(json.loads(row[0]), int(row[1])))
            conn.execute("COMMIT")
        except Exception as e:
            log.error("application database %s: a transaction of %d operations failed: %s", self.path, len(batch), e)
            self.failures += 1
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            for _, _, fut in batch:
                fut.set_exception(e)
            return
        log.debug("application database: %d operations in %.2f ms", len(batch), (time.perf_counter() - t0) * 1e3)
        self.commits += 1
        self.writes += writes
        self.reads += len(batch) - writes
        for (_, _, fut), result in zip(batch, results, strict=True):
            fut.set_result(result)
