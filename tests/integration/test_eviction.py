"""A weight budget that holds one model at a time: the daemon loads and evicts on demand."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from daemon.client import SocketClient
from daemon.repository import scan
from daemon.runtime.program import load_program
from tests.support import DaemonThread, settings, short_tmpdir


@pytest.fixture(scope="module")
def small_daemon(test_repo: Path) -> Iterator[DaemonThread]:
    spec = next(m for m in scan(test_repo).models if m.key == "tiny_pt2:1")
    one_model = load_program(spec).weight_bytes
    d = short_tmpdir()
    dt = DaemonThread(settings(test_repo, d, runtime={"weight_budget": one_model + 100})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


def test_alternating_models_are_loaded_and_evicted_under_a_small_budget(small_daemon: DaemonThread) -> None:
    x = np.ones((1, 4), np.float32)
    ex = small_daemon.daemon.executors["cpu:0"]
    sched = small_daemon.daemon.controller.scheduler
    with SocketClient(small_daemon.socket) as c:
        for i in range(12):
            model = ("tiny_pt2", "tiny_ts")[i % 2]
            r = c.infer(model, {"INPUT__0": x}, version=1)
            assert r.outputs["OUTPUT__0"].shape == (1, 3)
            resident = small_daemon.call(lambda: list(ex.resident))
            assert resident == [f"{model}:1"]  # the other one was evicted to make room
    assert small_daemon.call(lambda: sched.devices["cpu:0"].memory.used) <= ex.device.weight_budget
