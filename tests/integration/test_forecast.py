"""The socket's `forecast` op (what a cluster router reads of a node: daemon/routing.py) on a real
daemon, in one process and through a frontend worker."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from daemon.client import InferenceServerError, SocketClient
from daemon.routing import NodeForecast
from tests.support import DaemonThread, settings, short_tmpdir


def check_forecast(socket: str) -> None:
    with SocketClient(socket) as c:
        c.infer("tiny_pt2", {"INPUT__0": np.ones((2, 4), np.float32)})
        answer = c.call({"op": "forecast"})["forecast"]
        parsed = NodeForecast.parse({**answer, "at": 0.0})
        assert parsed is not None, answer
        finish, slo, row = parsed.models["tiny_pt2"]  # it just ran: held on the device
        assert 0.0 <= finish < slo and slo > 0.0 and row > 0.0
        assert parsed.cold_s >= 0.0 and parsed.per_request_s > 0.0 and parsed.pending >= 0
        assert len(c.call({"op": "forecast", "limit": 1})["forecast"]["models"]) <= 1
        with pytest.raises(InferenceServerError) as e:
            c.call({"op": "forecast", "limit": "all"})
        assert e.value.status == 400 and "limit" in e.value.message


def test_forecast_in_one_process(test_daemon: DaemonThread) -> None:
    check_forecast(test_daemon.socket)


@pytest.fixture(scope="module")
def worker_daemon(test_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(test_repo, d, server={"frontend_workers": 1})).start()
    try:
        yield dt
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_forecast_through_a_frontend_worker(worker_daemon: DaemonThread) -> None:
    check_forecast(worker_daemon.socket)  # forwarded whole to the controller process
