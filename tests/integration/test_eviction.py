"""A weight budget that holds one model at a time: the daemon loads and evicts on demand; models
whose weights are the same content share them and fit together."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon.client import SocketClient
from daemon.demo import save_model
from daemon.repository import scan
from daemon.runtime.program import load_program
from tests.support import DaemonThread, TinyLinear, settings, short_tmpdir, tiny_config


def _one_model(repo: Path) -> int:
    spec = next(m for m in scan(repo).models if m.key == "tiny_pt2:1")
    return load_program(spec).weight_bytes


@pytest.fixture(scope="module")
def small_daemon(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonThread]:
    # tiny_pt2 and tiny_other: the same layer with other weights (tiny_ts holds tiny_pt2's own
    # weights, which a CPU device would keep once for both: see the test below)
    repo = tmp_path_factory.mktemp("evict")
    shutil.copytree(test_repo / "tiny_pt2", repo / "tiny_pt2", ignore=shutil.ignore_patterns("*profile.json"))
    other = TinyLinear().eval()
    with torch.no_grad():
        other.fc.bias.add_(1.0)
    save_model(other, "pt2", torch.zeros(2, 4), 8, repo / "tiny_other" / "1" / "model.pt2")
    (repo / "tiny_other" / "config.toml").write_text(tiny_config(), encoding="utf-8")
    d = short_tmpdir()
    dt = DaemonThread(settings(repo, d, runtime={"weight_budget": _one_model(test_repo) + 100})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


def test_models_with_the_same_weights_share_them_under_a_budget_for_one(test_repo: Path, tmp_path: Path) -> None:
    for name in ("tiny_pt2", "tiny_ts"):  # tiny_ts: TorchScript of the same layer, same weights
        shutil.copytree(test_repo / name, tmp_path / name, ignore=shutil.ignore_patterns("*profile.json"))
    d = short_tmpdir()
    one = _one_model(test_repo)
    dt = DaemonThread(settings(tmp_path, d, runtime={"weight_budget": one + 100})).start()
    try:
        x = np.ones((1, 4), np.float32)
        ex = dt.daemon.executors["cpu:0"]
        with SocketClient(dt.socket) as c:
            for model in ("tiny_pt2", "tiny_ts", "tiny_pt2"):
                r = c.infer(model, {"INPUT__0": x}, version=1)
                np.testing.assert_allclose(r.outputs["OUTPUT__0"], TinyLinear()(torch.from_numpy(x)).detach().numpy(),
                                           rtol=1e-6)
        assert sorted(dt.call(lambda: list(ex.resident))) == ["tiny_pt2:1", "tiny_ts:1"]  # both at once
        assert dt.call(lambda: dt.daemon.controller.scheduler.devices["cpu:0"].memory.used) == one == ex.used_bytes
        assert dt.call(lambda: dt.daemon.controller.scheduler.counters["unloads"]) == 0
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_alternating_models_are_loaded_and_evicted_under_a_small_budget(small_daemon: DaemonThread) -> None:
    x = np.ones((1, 4), np.float32)
    ex = small_daemon.daemon.executors["cpu:0"]
    sched = small_daemon.daemon.controller.scheduler
    with SocketClient(small_daemon.socket) as c:
        for i in range(12):
            model = ("tiny_pt2", "tiny_other")[i % 2]
            r = c.infer(model, {"INPUT__0": x}, version=1)
            assert r.outputs["OUTPUT__0"].shape == (1, 3)
            resident = small_daemon.call(lambda: list(ex.resident))
            assert resident == [f"{model}:1"]  # the other one was evicted to make room
    assert small_daemon.call(lambda: sched.devices["cpu:0"].memory.used) <= ex.device.weight_budget
