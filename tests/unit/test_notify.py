"""daemon/notify.py against a real AF_UNIX datagram socket, as systemd would bind it."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.notify import Notifier, keep_alive, monotonic_usec, watchdog_interval
from tests.support import short_tmpdir


@pytest.fixture
def receiver() -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket in a short directory (unix socket paths are limited to 108 bytes)."""
    d = short_tmpdir()
    path = str(d / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()
    shutil.rmtree(d, ignore_errors=True)


def fields(data: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in data.decode().split("\n"))


def test_messages_arrive_as_one_datagram_each(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = Notifier(path)
    assert n.enabled and n.watchdog_s is None
    assert n.status("loading model 1/2: a:1")
    assert sock.recv(4096) == b"STATUS=loading model 1/2: a:1"
    assert n.ready("ready: 2 model version(s)\nserving")  # a newline would split the assignment
    assert fields(sock.recv(4096)) == {"READY": "1", "STATUS": "ready: 2 model version(s) serving"}
    before = monotonic_usec()
    assert n.reloading()
    got = fields(sock.recv(4096))
    assert got["RELOADING"] == "1" and before <= int(got["MONOTONIC_USEC"]) <= monotonic_usec()
    assert n.stopping("stopping: draining 3 request(s)")
    assert fields(sock.recv(4096)) == {"STOPPING": "1", "STATUS": "stopping: draining 3 request(s)"}
    assert n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert n.sent == 5
    n.close()


def test_abstract_socket_name() -> None:
    name = f"esc-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert sock.recv(4096) == b"READY=1"
        n.close()
    finally:
        sock.close()


def test_without_notify_socket_nothing_is_sent() -> None:
    n = Notifier.from_env({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled and n.watchdog_s is None  # no socket: no keep-alive either
    assert not n.ready() and not n.watchdog() and n.sent == 0
    assert not Notifier("relative/path").enabled  # neither a path nor an abstract name


def test_a_vanished_socket_never_raises(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = Notifier(path)
    sock.close()
    Path(path).unlink()
    assert not n.status("nobody listens")
    assert not n.ready() and n.sent == 0
    n.close()


@pytest.mark.parametrize(("env", "expected"), [
    ({}, None),
    ({"WATCHDOG_USEC": "2000000"}, 1.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, 1.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "me"}, None),
])
def test_watchdog_interval_is_half_the_timeout(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env) == expected


@pytest.mark.slow  # asserts in wall-clock time
async def test_keep_alive_pings_from_the_event_loop(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    sock.setblocking(False)
    n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})
    assert n.watchdog_s == 0.01
    loop = asyncio.get_running_loop()
    task = loop.create_task(keep_alive(n, n.watchdog_s))
    t0 = time.monotonic()
    for _ in range(3):
        assert await asyncio.wait_for(loop.sock_recv(sock, 4096), 5) == b"WATCHDOG=1"
    assert time.monotonic() - t0 >= 0.015  # paced by the interval, not sent in a burst
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    n.close()


@pytest.mark.expect_errors("stopping the systemd watchdog keep-alives")
async def test_keep_alive_stops_once_the_daemon_names_a_reason_to_be_restarted(
        receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    sock.setblocking(False)
    n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})
    loop = asyncio.get_running_loop()
    trouble: list[str] = []
    task = loop.create_task(keep_alive(n, n.watchdog_s or 0.01, lambda: trouble[0] if trouble else None))
    assert await asyncio.wait_for(loop.sock_recv(sock, 4096), 5) == b"WATCHDOG=1"
    trouble.append("cpu:1: LOAD of m:1 has not returned for 30.0 s")
    while (msg := await asyncio.wait_for(loop.sock_recv(sock, 4096), 5)) == b"WATCHDOG=1":
        pass  # one may have been sent before the reason appeared
    assert msg == b"STATUS=restart wanted: cpu:1: LOAD of m:1 has not returned for 30.0 s"
    await asyncio.wait_for(task, 5)  # it returned: no keep-alive ever again
    with pytest.raises(BlockingIOError):
        sock.recv(4096)
    n.close()
