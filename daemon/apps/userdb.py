"""Per-user weights on disk: a SQLite file written by one thread of its own (daemon/apps/sqlitestore.py
gives the durability, ordering and group-commit argument).

Velox keeps its per-user weights in a store that outlives the serving process; here that is an
embedded SQLite file (`[personalization] db_path`). One row per (model, version, user): the RLS
state, W (d+1, C) and P (d+1, d+1) as little-endian float64 blobs, the number of updates and the
time of the last one. Every operation goes through the writer's queue in order, so a user evicted
from memory while its write is pending is read back with that write.
"""

from __future__ import annotations

import sqlite3
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.apps.sqlitestore import SqliteStore

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
_F8 = np.dtype("<f8")


@dataclass(slots=True)
class StoredUser:
    """One user's row: the RLS state of one model version."""

    weights: np.ndarray  # (d+1, C) float64
    precision: np.ndarray  # P, (d+1, d+1) float64
    updates: int
    updated_at: float  # Unix time of the last update


class UserDB(SqliteStore):
    """The user-weight store. `start()` opens the file (creating its directory) and starts the
    writer thread; `close()` commits what is queued and stops it."""

    SCHEMA = _SCHEMA
    LABEL = "user database"
    THREAD = "escapement-userdb"

    def put(self, model: str, version: int, user: str, state: StoredUser) -> Future[None]:
        """Store a user's state; the future resolves once it is committed."""
        w, p = np.ascontiguousarray(state.weights, _F8), np.ascontiguousarray(state.precision, _F8)
        row = (model, version, user, p.shape[0] - 1, w.shape[1], w.tobytes(), p.tobytes(), state.updates,
               state.updated_at)
        return self.submit("put", row)

    def get(self, model: str, version: int, user: str) -> Future[StoredUser | None]:
        """A user's stored state (None: the user has none), after every write queued before it."""
        return self.submit("get", (model, version, user))

    def apply(self, conn: sqlite3.Connection, op: str, args: tuple[Any, ...]) -> tuple[Any, bool]:
        if op == "put":
            conn.execute("INSERT OR REPLACE INTO user_weights VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", args)
            return None, True
        return _row(conn.execute("SELECT dim, classes, weights, precision, updates, updated_at FROM user_weights "
                                 "WHERE model = ? AND version = ? AND user = ?", args).fetchone()), False


def _row(row: tuple[Any, ...] | None) -> StoredUser | None:
    if row is None:
        return None
    dim, classes, w, p, updates, updated_at = row
    weights = np.frombuffer(w, _F8).reshape(dim + 1, classes).copy()
    precision = np.frombuffer(p, _F8).reshape(dim + 1, dim + 1).copy()
    return StoredUser(weights, precision, int(updates), float(updated_at))
