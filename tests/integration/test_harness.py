"""The daemon harness itself (tests/harness.py): the real serve path, a failed start-up, a daemon on a thread."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.config import settings_from_dict
from daemon.errors import ConfigError
from daemon.lifecycle import State
from tests.harness import run_daemon
from tests.support import DaemonThread, settings


def failing(repo: Path, sock_dir: Path) -> object:
    """Settings whose start-up fails: a fault on a device the daemon does not have."""
    return settings_from_dict({"server": {"http": "127.0.0.1:0", "socket": str(sock_dir / "d.sock"),
                                          "frontend_workers": 0, "allow_faults": True},
                               "models": {"repository": str(repo)}, "runtime": {"devices": ["cpu:0"]},
                               "faults": [{"device": "cpu:9", "hang_load": True}]})


async def test_run_daemon_serves_then_stops_in_order(tmp_path: Path, sock_dir: Path) -> None:
    async with run_daemon(settings(tmp_path, sock_dir)) as d:
        assert d.daemon.state == State.RUNNING and d.gateway.health().ready
        assert d.http.startswith("127.0.0.1:") and await asyncio.to_thread(Path(d.socket).is_socket)
        assert await asyncio.wait_for(d.wait_idle(), 30) == 0
    assert d.daemon.state == State.STOPPED
    assert not await asyncio.to_thread(Path(d.socket).exists)  # the loop's default executor works again
    assert d.errors == []


async def test_a_failed_start_up_raises_its_error_and_leaves_the_loop_as_it_was(tmp_path: Path,
                                                                                sock_dir: Path) -> None:
    loop = asyncio.get_running_loop()
    handler = loop.get_exception_handler()
    with pytest.raises(ConfigError, match="cpu:9"):
        async with run_daemon(failing(tmp_path, sock_dir)):  # type: ignore[arg-type]
            pytest.fail("the block must not run")
    assert loop.get_exception_handler() is handler


def test_a_daemon_thread_raises_a_failed_start_up_and_serves_otherwise(tmp_path: Path, sock_dir: Path) -> None:
    with pytest.raises(ConfigError, match="cpu:9"):
        DaemonThread(failing(tmp_path, sock_dir)).start()  # type: ignore[arg-type]
    with DaemonThread(settings(tmp_path, sock_dir)) as dt:
        assert dt.call(lambda: dt.daemon.state) == State.RUNNING
        assert dt.wait_idle() == 0
    assert dt.wait_stopped(30) and dt.daemon.state == State.STOPPED and dt.errors == []
