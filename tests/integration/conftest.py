from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import DaemonThread, settings, short_tmpdir


@pytest.fixture(scope="module")
def demo_daemon(demo_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    try:
        with DaemonThread(settings(demo_repo, d)) as dt:
            yield dt
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def test_daemon(test_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    try:
        with DaemonThread(settings(test_repo, d, server={"max_body_bytes": 256 * 1024})) as dt:
            yield dt
    finally:
        shutil.rmtree(d, ignore_errors=True)
