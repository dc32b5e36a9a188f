"""The SQLite store under the user and application databases: queue order, group commit, a
failed transaction rolled back whole, and a file that cannot be opened failing every operation."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.apps.sqlitestore import SqliteStore


class KV(SqliteStore):
    SCHEMA = "CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, v TEXT NOT NULL)"
    LABEL = "test database"
    THREAD = "test-kv"

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.taken = threading.Event()  # the writer is inside a "hold"
        self.release = threading.Event()

    def apply(self, conn: sqlite3.Connection, op: str, args: tuple[Any, ...]) -> tuple[Any, bool]:
        if op == "put":
            conn.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", args)
            return None, True
        if op == "hold":
            self.taken.set()
            assert self.release.wait(10)
            return None, False
        if op == "fail":
            raise sqlite3.IntegrityError("refused")
        row = conn.execute("SELECT v FROM kv WHERE k = ?", args).fetchone()
        return (None if row is None else row[0]), False


def test_operations_run_in_queue_order_and_are_counted(tmp_path: Path) -> None:
    db = KV(tmp_path / "sub" / "kv.sqlite")
    db.start()
    try:
        db.submit("hold", ())
        assert db.taken.wait(10)
        # queued while the writer is busy: one transaction takes them all, in order
        puts = [db.submit("put", ("a", str(i))) for i in range(5)]
        read = db.submit("get", ("a",))
        assert db.stats().queued == 7
        db.release.set()
        assert read.result(10) == "4"
        assert all(p.result(10) is None for p in puts)
    finally:
        db.close()
    s = db.stats()
    assert (s.writes, s.reads, s.failures, s.queued) == (5, 2, 0, 0)
    assert s.commits == 2  # the hold's, then one for the six queued behind it


@pytest.mark.expect_errors("a transaction of 2 operations failed: refused")
def test_a_failed_transaction_is_rolled_back_whole(tmp_path: Path) -> None:
    db = KV(tmp_path / "kv.sqlite")
    db.start()
    try:
        db.submit("hold", ())
        assert db.taken.wait(10)
        put = db.submit("put", ("b", "lost"))
        bad = db.submit("fail", ())
        db.release.set()
        with pytest.raises(sqlite3.IntegrityError):
            bad.result(10)
        with pytest.raises(sqlite3.IntegrityError):  # in the same transaction: not committed
            put.result(10)
        assert db.submit("get", ("b",)).result(10) is None
    finally:
        db.close()
    assert db.stats().failures == 1 and db.stats().queued == 0


@pytest.mark.expect_errors("cannot be opened")
def test_a_file_that_cannot_be_opened_fails_every_operation(tmp_path: Path) -> None:
    (tmp_path / "dir.sqlite").mkdir()  # a directory where the file should be
    db = KV(tmp_path / "dir.sqlite")
    with pytest.raises(sqlite3.Error):
        db.start()
    late = KV(tmp_path / "dir.sqlite")
    late.start(wait=False)
    op = late.submit("put", ("c", "x"))
    with pytest.raises(sqlite3.Error):
        op.result(10)
    late.close()
    db.close()
    assert late.stats().queued == 0


def test_operations_before_start_fail_with_why(tmp_path: Path) -> None:
    db = KV(tmp_path / "kv.sqlite")
    with pytest.raises(RuntimeError, match="test database is not open"):
        db.submit("get", ("a",)).result(1)
