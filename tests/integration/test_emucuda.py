"""A whole daemon on the CUDA stand-in (`emucuda:N`): the real CUDA backend end to end on a CPU."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon.client import HttpClient, InferenceServerError, SocketClient
from daemon.repository import scan
from daemon.runtime.emucuda import EmuCuda
from daemon.runtime.program import load_program
from tests.device.models import build_device_repo
from tests.support import DaemonThread, settings, short_tmpdir

EMU = {"capacity": "256MiB", "mode": "random", "seed": 11}


def emucuda_settings(repo: Path, d: Path, devices: list[str] | None = None, **runtime: object) -> object:
    return settings(repo, d, runtime={"devices": devices or ["emucuda:0"], "weight_budget": "64MiB",
                                      "device_workspace": "16MiB", "emucuda": EMU, **runtime})


def reference(repo: Path, name: str, xs: list[np.ndarray]) -> list[np.ndarray]:
    spec = next(m for m in scan(repo).models if m.name == name)
    with torch.inference_mode():
        return [o.numpy() for o in load_program(spec).host_runner([torch.from_numpy(x) for x in xs])]


def inputs(meta: dict, n: int, seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    out = {}
    for t in meta["inputs"]:
        dt = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64,
              "UINT8": np.uint8, "BOOL": np.bool_}[t["datatype"]]
        shape = (n, *t["shape"][1:])
        out[t["name"]] = (g.random(shape) * 4 - 1).astype(dt) if dt in (np.float32, np.float16, np.float64) \
            else g.integers(0, 2, shape).astype(dt)
    return out


def serve_and_compare(dt: DaemonThread, repo: Path, names: list[str]) -> None:
    with SocketClient(dt.socket) as c:
        for name in names:
            meta = c.metadata(name)
            for n, seed in ((1, 0), (3, 1)):
                xs = inputs(meta, n, seed)
                r = c.infer(name, xs, timeout_us=5_000_000)
                want = reference(repo, name, [xs[t["name"]] for t in meta["inputs"]])
                # a personalized model also lists its user's output, which only a request naming a user gets
                answered = [o for o in meta["outputs"] if o["name"] in r.outputs]
                for o, w in zip(answered, want, strict=True):
                    np.testing.assert_allclose(r.outputs[o["name"]], w, rtol=1e-3, atol=1e-4, err_msg=name)


@pytest.fixture(scope="module")
def mixed_repo(test_repo: Path) -> Iterator[Path]:
    d = short_tmpdir()
    repo = build_device_repo(d / "repo")
    for name in ("tiny_pt2", "tiny_ts", "all_types"):
        shutil.copytree(test_repo / name, repo / name)
    yield repo
    shutil.rmtree(d, ignore_errors=True)


def test_every_demo_model_on_the_standin_equals_the_cpu(demo_repo: Path) -> None:
    d = short_tmpdir()
    repo = d / "repo"
    shutil.copytree(demo_repo, repo)
    dt = DaemonThread(emucuda_settings(repo, d, weight_budget="192MiB", device_workspace="64MiB")).start()
    try:
        serve_and_compare(dt, repo, sorted(m.name for m in scan(repo).models if not m.name.endswith("parity")))
        assert not dt.errors
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_dtype_conversions_built_tensors_torchscript_and_eager_models(mixed_repo: Path) -> None:
    d = short_tmpdir()
    dt = DaemonThread(emucuda_settings(mixed_repo, d)).start()
    try:
        serve_and_compare(dt, mixed_repo, ["converts", "tiny_ts", "all_types", "branchy", "wide", "tiny_pt2"])
        with HttpClient(dt.http) as http:
            index = {m["name"]: m for m in http.index()}
        assert "runs without CUDA graphs" in index["branchy"]["reason"]  # ready, and says why
        assert index["branchy"]["state"] == "READY" and "reason" not in index["converts"]
        assert not dt.errors
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_defect5_warm_ups_share_the_serving_device(mixed_repo: Path) -> None:
    """Reloads warm new versions up on the serving executor: no second backend, no new streams."""
    d = short_tmpdir()
    repo = d / "repo"
    shutil.copytree(mixed_repo, repo)
    dt = DaemonThread(emucuda_settings(repo, d)).start()
    try:
        ex = dt.daemon.executors["emucuda:0"]
        api = ex.backend.api
        assert isinstance(api, EmuCuda)
        streams = api.streams
        for i in range(3):
            for f in repo.glob("*/*/profile.json"):
                f.unlink()  # every version is measured again, on the serving device
            (repo / "wide" / "config.toml").write_text((repo / "wide" / "config.toml").read_text() + f"# {i}\n")
            changes = dt.on_loop(dt.daemon.models.reload_repository(), 120)
            assert changes["reloaded"] == ["wide:1"]
            serve_and_compare(dt, repo, ["wide"])
        assert api.streams == streams == 5
        assert dt.daemon.executors["emucuda:0"].backend is ex.backend
        stats = dt.daemon.gateway.statistics()["devices"]["emucuda:0"]
        assert stats["used"] == ex.used_bytes  # the controller's charge is the device's
        assert not any(k.startswith("warmup:") for k in stats["models"])
        assert not dt.errors
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_zipf_over_twenty_models_with_room_for_a_quarter(tmp_path: Path) -> None:
    """Loads and evictions under a skewed load: the charge never passes the budget; no ERROR."""
    from daemon.demo import save_model
    from tests.device.models import Wide, config

    d = short_tmpdir()
    repo = d / "repo"
    for i in range(20):
        # (weights of their own: identical copies would share a leading stage, and then all fit)
        save_model(Wide(width=384, seed=i).eval(), "pt2", torch.zeros(2, 16), 8, repo / f"m{i:02d}" / "1" / "model.pt2")
        (repo / f"m{i:02d}" / "config.toml").write_text(config(16, 4))
    one = load_program(scan(repo).models[0]).weight_bytes  # ~0.66 MB
    workspace = 8 << 20
    budget = workspace + int(5.5 * (one + 4096))
    dt = DaemonThread(emucuda_settings(repo, d, weight_budget=budget, device_workspace=workspace)).start()
    try:
        rng = np.random.default_rng(5)
        ranks = np.arange(1, 21)
        p = 1 / ranks**1.1
        p /= p.sum()
        charged = []
        ex = dt.daemon.executors["emucuda:0"]
        x = {"INPUT__0": rng.random((2, 16)).astype(np.float32)}
        with SocketClient(dt.socket) as c:
            for k in rng.choice(20, size=300, p=p):
                try:
                    c.infer(f"m{k:02d}", x, timeout_us=2_000_000)
                except InferenceServerError as e:
                    pytest.fail(f"m{k:02d}: {e}")
                charged.append(ex.used_bytes)
        assert max(charged) <= budget
        stats = dt.daemon.gateway.statistics()
        assert stats["counters"]["unloads"] > 5  # it evicted, and reloaded
        assert len(stats["devices"]["emucuda:0"]["models"]) <= 5
        assert not dt.errors
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.expect_errors('illegal memory access')
def test_defect7_a_lost_device_is_left_and_reported(mixed_repo: Path) -> None:
    """A sticky error on one of two devices: its work moves to the other; ready says which and why."""
    d = short_tmpdir()
    dt = DaemonThread(emucuda_settings(mixed_repo, d, devices=["emucuda:0", "emucuda:1"])).start()
    try:
        with SocketClient(dt.socket) as c:
            x = {"INPUT__0": np.ones((2, 4), np.float32)}
            c.infer("tiny_pt2", x, timeout_us=5_000_000)
            holders = [n for n, s in dt.daemon.gateway.statistics()["devices"].items() if "tiny_pt2:1" in s["models"]]
            lost = holders[0]
            api = dt.daemon.executors[lost].backend.api
            assert isinstance(api, EmuCuda)
            api.fail_next_kernel("an illegal memory access was encountered")
            for _ in range(5):
                c.infer("tiny_pt2", x, timeout_us=5_000_000)  # the first is retried on the other device
        with HttpClient(dt.http) as http:
            body = http.get_json("/v2/health/ready")
            metrics = http.request("GET", "/metrics")[1].decode()
        assert body["ready"] and "illegal memory access" in body["lost_devices"][lost]
        assert f'escapement_device_up{{device="{lost}"}} 0.0' in metrics
        assert dt.daemon.gateway.statistics()["devices"][lost]["failed"]
        assert [e for e in dt.errors if "illegal memory access" not in e] == []
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.expect_errors('device-side assert', 'every device is lost')
def test_defect7_the_last_device_lost_stops_the_daemon_for_a_restart(mixed_repo: Path) -> None:
    d = short_tmpdir()
    dt = DaemonThread(emucuda_settings(mixed_repo, d)).start()
    try:
        api = dt.daemon.executors["emucuda:0"].backend.api
        assert isinstance(api, EmuCuda)
        api.fail_next_kernel("device-side assert triggered")
        with SocketClient(dt.socket) as c, pytest.raises(InferenceServerError) as e:
            c.infer("tiny_pt2", {"INPUT__0": np.ones((1, 4), np.float32)}, timeout_us=5_000_000)
        assert e.value.status in (500, 503)
        assert dt.wait_stopped(30)  # it stops by itself
        assert dt.daemon.exit_code == 1
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)
