"""A model's own default_output through the real daemon: a request that cannot make its deadline
is answered with it, flagged, over HTTP and the socket, in process and through a frontend worker."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from torch import nn

from daemon.client import HttpClient, SocketClient
from daemon.runtime.faults import FaultSpec
from tests.integration.test_http import raw
from tests.support import DaemonThread, save_model, settings, short_tmpdir, tiny_config

X = np.array([[1.0, -0.5, 2.0, 0.3]], np.float32)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("default-repo")
    m = nn.Linear(4, 3).eval()
    save_model(m, "pt2", torch.zeros(2, 4), 8, root / "dflt" / "1" / "model.pt2")
    (root / "dflt" / "config.toml").write_text("default_output = [0.0, 0.0, 7.0]\n" + tiny_config(),
                                               encoding="utf-8")
    return root


@pytest.fixture(scope="module", params=[0, 1], ids=["in-process", "1-worker"])
def daemon(request: pytest.FixtureRequest, repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(repo, d, server={"frontend_workers": request.param},
                               controller={"batch_wait_ms": 0.0})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


def body(timeout_us: int | None = None) -> bytes:
    obj: dict = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": X.ravel().tolist()}]}
    if timeout_us is not None:
        obj["parameters"] = {"timeout": timeout_us}
    return orjson.dumps(obj)


def test_in_time_the_model_answers_late_its_default_does(daemon: DaemonThread) -> None:
    status, _, b = raw(daemon, "POST", "/v2/models/dflt/infer", body())
    ans = orjson.loads(b)
    assert status == 200 and "default" not in ans.get("parameters", {}), ans
    dt = daemon
    dt.call(dt.daemon.gateway.set_fault, "cpu:0", FaultSpec(add_ms=300))
    try:
        raw(dt, "POST", "/v2/models/dflt/infer", body())  # its estimates learn the slow device
        status, _, b = raw(dt, "POST", "/v2/models/dflt/infer", body(timeout_us=50_000))
        ans = orjson.loads(b)
        assert status == 200, ans
        assert ans["parameters"]["default"] is True
        assert ans["outputs"][0]["data"] == [0.0, 0.0, 7.0]
        with SocketClient(dt.socket) as c:
            msg = c.call({"op": "infer", "model": "dflt", "timeout_us": 50_000,
                          "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4],
                                      "data": X.tobytes()}]})
        assert msg["status"] == 200 and msg["default"] is True
        assert np.frombuffer(msg["outputs"][0]["data"], np.float32).tolist() == [0.0, 0.0, 7.0]
        with HttpClient(dt.http) as h:
            meta = h.get_json("/v2/models/dflt")
        assert meta["name"] == "dflt"
    finally:
        dt.call(dt.daemon.gateway.set_fault, "cpu:0", FaultSpec())
