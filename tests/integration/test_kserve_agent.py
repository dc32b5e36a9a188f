"""KServe's TrainedModel path, against a real daemon on the shipped KServe config.

`Agent` does what KServe's model agent does (kserve/kserve pkg/agent/puller.go and downloader.go at
aaac4e29) to a running daemon: it copies a model's files into `<model dir>/<name>/`, writes
`SUCCESS.<sha256 of the spec>` holding the TrainedModel's `spec.model` as JSON, POSTs `{}` (as
application/json, no token) to /v2/repository/models/<name>/load, and for a removal deletes the
directory first and then POSTs `{}` to .../unload. The test probes readiness and infers between.
"""

from __future__ import annotations

import hashlib
import http.client
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from daemon.client import HttpClient
from daemon.config import load_settings, settings_from_dict
from tests.support import DaemonThread, short_tmpdir

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "k8s-secret-token-0123456789"


class Agent:
    """KServe's model agent, for one pod: the model dir and the server's HTTP address."""

    def __init__(self, model_dir: Path, http: str) -> None:
        self.model_dir = model_dir
        self.http = http

    def download(self, name: str, files: dict[str, Path], storage_uri: str, memory: str) -> None:
        """What Downloader.DownloadModel leaves: the files under <model dir>/<name>/, then the SUCCESS file."""
        target = self.model_dir / name
        for rel, src in files.items():
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target / rel)
        spec = orjson.dumps({"storageUri": storage_uri, "framework": "pytorch", "memory": memory})
        (target / f"SUCCESS.{hashlib.sha256(spec).hexdigest()}").write_bytes(spec)

    def load(self, name: str) -> tuple[int, Any]:
        return self.post(f"/v2/repository/models/{name}/load")

    def remove(self, name: str) -> tuple[int, Any]:
        """Remove op: the directory goes first (storage.RemoveDir), then the unload call."""
        shutil.rmtree(self.model_dir / name)
        return self.post(f"/v2/repository/models/{name}/unload")

    def post(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        host, port = self.http.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:  # Go's http.Post(url, "application/json", bytes.NewBufferString("{}"))
            conn.request("POST", path, body=b"{}", headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            data = r.read()
            return r.status, orjson.loads(data) if data else None
        finally:
            conn.close()

    def get(self, path: str) -> int:
        host, port = self.http.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            r.read()
            return r.status
        finally:
            conn.close()


@pytest.fixture
def pod() -> Iterator[tuple[DaemonThread, Agent]]:
    """A daemon on config/escapement.kserve.toml over an empty model dir (the agent's emptyDir),
    with an admin token (the optional Secret) that the agent does not have."""
    d = short_tmpdir()
    model_dir = d / "models"
    model_dir.mkdir()
    shipped = load_settings(ROOT / "config" / "escapement.kserve.toml")
    assert shipped.server.open_repository_sync and shipped.models.repository == "/mnt/models"
    data = {
        "server": {**{k: getattr(shipped.server, k) for k in ("grpc", "socket", "open_repository_sync")},
                   "http": "127.0.0.1:0", "grpc": "", "admin_token": TOKEN, "log_level": "warning"},
        "models": {"repository": str(model_dir)},
        "runtime": {"devices": ["cpu:0"], "warmup_reps": 1},
    }
    dt = DaemonThread(settings_from_dict(data)).start()
    try:
        yield dt, Agent(model_dir, dt.http)
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)
    assert dt.errors == []


def test_agent_loads_infers_and_unloads_both_layouts(pod: tuple[DaemonThread, Agent], demo_repo: Path) -> None:
    dt, agent = pod
    assert agent.get("/v2/health/ready") == 200  # an empty model dir is a ready server
    # 1. A storage URI holding our layout (config.toml and a version directory).
    agent.download("mlp-784", {"config.toml": demo_repo / "mlp_784" / "config.toml",
                               "1/model.pt2": demo_repo / "mlp_784" / "1" / "model.pt2"},
                   "s3://models/mlp_784", "64Mi")
    # 2. A storage URI holding a bare model.pt2: its config is read from the exported program.
    agent.download("digits", {"model.pt2": demo_repo / "digits_mlp" / "1" / "model.pt2"},
                   "gs://models/digits_mlp/1/model.pt2", "64Mi")
    for name in ("mlp-784", "digits"):
        assert agent.load(name)[0] == 200
        assert agent.get(f"/v2/models/{name}/ready") == 200
    with HttpClient(dt.http) as c:
        meta = orjson.loads(c.request("GET", "/v2/models/digits")[1])
        assert meta["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 64]}]
        assert meta["outputs"] == [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [-1, 10]}]
        assert c.infer("mlp-784", {"INPUT__0": np.zeros((2, 784), np.float32)}).outputs["OUTPUT__0"].shape == (2, 10)
        assert c.infer("digits", {"INPUT__0": np.zeros((3, 64), np.float32)}).outputs["OUTPUT__0"].shape == (3, 10)
    # Without the token, a model whose directory is still there stays (only the files decide),
    # and other management endpoints stay closed.
    status, body = agent.post("/v2/repository/models/digits/unload")
    assert status == 403 and "directory" in body["error"]
    status, body = agent.post("/v2/admin/faults")
    assert status == 403
    # The TrainedModel is deleted: directory removed, then unload.
    assert agent.remove("digits")[0] == 200
    assert agent.get("/v2/models/digits/ready") != 200
    assert agent.get("/v2/models/mlp-784/ready") == 200  # the others are untouched
    # Created again (a new storage URI's files): served again.
    agent.download("digits", {"model.pt2": demo_repo / "digits_mlp" / "1" / "model.pt2"},
                   "gs://models/digits_mlp/1/model.pt2", "64Mi")
    assert agent.load("digits")[0] == 200
    assert agent.get("/v2/models/digits/ready") == 200
    assert agent.remove("digits")[0] == 200
    assert agent.remove("mlp-784")[0] == 200
    assert dt.wait_idle() == 0


def test_declared_memory_is_checked(pod: tuple[DaemonThread, Agent], demo_repo: Path) -> None:
    dt, agent = pod
    agent.download("small", {"model.pt2": demo_repo / "mlp_784" / "1" / "model.pt2"},
                   "s3://models/mlp_784/1/model.pt2", "16Ki")  # mlp_784 holds ~400 KiB of weights
    status, body = agent.load("small")
    assert status == 400 and "spec.model.memory" in body["error"] and "16384" in body["error"]
    assert agent.get("/v2/models/small/ready") != 200
    # An operator with the token may unload it while its directory is there.
    status, _ = agent.post("/v2/repository/models/small/unload", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    shutil.rmtree(agent.model_dir / "small")
    agent.download("big-enough", {"model.pt2": demo_repo / "mlp_784" / "1" / "model.pt2"},
                   "s3://models/mlp_784/1/model.pt2", "1Gi")
    assert agent.load("big-enough")[0] == 200
    entry = dt.call(lambda: dt.daemon.catalog.entry("big-enough"))
    assert entry.spec.memory_bytes == 2**30


def test_a_bare_file_the_config_cannot_be_inferred_from_is_refused(pod: tuple[DaemonThread, Agent],
                                                                    demo_repo: Path) -> None:
    _, agent = pod
    agent.download("ts-model", {"model.ts": demo_repo / "mlp_784" / "1" / "model.pt2"}, "s3://m/model.ts", "1Gi")
    status, body = agent.load("ts-model")
    assert status == 400 and "needs a config.toml beside it" in body["error"]
    agent.download("junk", {"model.pt2": ROOT / "README.md"}, "s3://m/model.pt2", "1Gi")
    status, body = agent.load("junk")
    assert status == 400 and "cannot read model.pt2 as an exported program" in body["error"]
    assert agent.load("never-downloaded")[0] == 404
