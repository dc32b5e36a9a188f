"""Applications' policy state on disk: SQLite in WAL mode, written by one thread of its own.

The same store as the users' weights (daemon/apps/sqlitestore.py gives the durability argument):
one writer thread that owns the connection and runs every operation in queue order (a read queued
after a write sees it), group commit, and a write's future resolved only after its COMMIT
(feedback is acknowledged once its update is durable against a process crash).

One row per (application, digest): the digest names the policy and the member list the weights
belong to (daemon/apps/application.py AppDefinition.digest), so an application redefined over
other models starts again while the old row stays for a definition that comes back.
"""

from __future__ import annotations

import json
import sqlite3
from concurrent.futures import Future
from typing import Any

from daemon.apps.selection import PolicyState
from daemon.apps.sqlitestore import SqliteStore

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


class AppDB(SqliteStore):
    """The policy store. `start()` opens the file in the writer thread; `close()` commits what is
    queued and stops it. Operations before `start()` fail (the loop opens it on first use)."""

    SCHEMA = _SCHEMA
    LABEL = "application database"
    THREAD = "escapement-appdb"

    def put(self, app: str, digest: str, state: PolicyState, updated_at: float) -> Future[None]:
        """Store an application's policy state; resolves once committed."""
        return self.submit("put", (app, digest, json.dumps(state.weights), state.updates, updated_at))

    def get(self, app: str, digest: str) -> Future[PolicyState | None]:
        """The stored state (None: nothing stored), after every write queued before it."""
        return self.submit("get", (app, digest))

    def apply(self, conn: sqlite3.Connection, op: str, args: tuple[Any, ...]) -> tuple[Any, bool]:
        if op == "put":
            conn.execute("INSERT OR REPLACE INTO application_policies VALUES (?, ?, ?, ?, ?)", args)
            return None, True
        row = conn.execute("SELECT weights, updates FROM application_policies WHERE app = ? AND digest = ?",
                           args).fetchone()
        return (None if row is None else PolicyState(json.loads(row[0]), int(row[1]))), False
