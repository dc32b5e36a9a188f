"""Personalized models on a real daemon: a request naming a user gets its own output and a query id,
feedback (HTTP, the socket, the clients) moves that user's answers and no one else's, every bad
call is a clear 4xx, and acknowledged feedback survives kill -9 of the daemon."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from torch import nn

from daemon.client import HttpClient, InferenceServerError, SocketClient
from tests.integration.test_http import raw
from tests.support import DaemonThread, save_model, settings, short_tmpdir, tiny_config

MODEL = "pers"
CONFIG = """max_batch_size = 8
slo_ms = 1000
[[inputs]]
name = "INPUT__0"
datatype = "FP32"
shape = [-1, 4]
[[outputs]]
name = "logits"
datatype = "FP32"
shape = [-1, 3]
[[outputs]]
name = "features"
datatype = "FP32"
shape = [-1, 5]
[personalization]
features = "features"
head = "head.npz"
"""


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 5), nn.ReLU())
        self.last = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.body(x)
        return self.last(f), f


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("personal-repo")
    m = Split().eval()
    save_model(m, "pt2", torch.zeros(2, 4), 8, root / MODEL / "1" / "model.pt2")
    w = np.vstack([m.last.weight.detach().numpy().T, m.last.bias.detach().numpy()[None]])
    np.savez(root / MODEL / "1" / "head.npz", W=w, scale=np.float64(2.0))
    (root / MODEL / "config.toml").write_text(CONFIG, encoding="utf-8")
    save_model(nn.Linear(4, 3).eval(), "pt2", torch.zeros(2, 4), 8, root / "plain" / "1" / "model.pt2")
    (root / "plain" / "config.toml").write_text(tiny_config(), encoding="utf-8")
    return root


@pytest.fixture(scope="module", params=[0, 1], ids=["in-process", "1-worker"])
def daemon(request: pytest.FixtureRequest, repo: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    db = tmp_path_factory.mktemp("db") / "users.sqlite3"
    dt = DaemonThread(settings(repo, d, server={"frontend_workers": request.param, "grpc": "127.0.0.1:0"},
                               personalization={"db_path": str(db)})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


X = np.array([[1.0, -0.5, 2.0, 0.3]], np.float32)


def _infer_json(d: DaemonThread, user: str | None, outputs: list[str] | None = None) -> tuple[int, dict]:
    body: dict = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": X.ravel().tolist()}]}
    if user is not None:
        body["parameters"] = {"user": user}
    if outputs is not None:
        body["outputs"] = [{"name": o} for o in outputs]
    status, _, data = raw(d, "POST", f"/v2/models/{MODEL}/infer", orjson.dumps(body))
    return status, orjson.loads(data)


def _feedback(d: DaemonThread, body: object, model: str = MODEL) -> tuple[int, dict]:
    status, _, data = raw(d, "POST", f"/v2/models/{model}/feedback", orjson.dumps(body))
    return status, orjson.loads(data)


def test_http_user_answer_feedback_and_errors(daemon: DaemonThread) -> None:
    status, glob = _infer_json(daemon, None)
    assert status == 200 and [o["name"] for o in glob["outputs"]] == ["logits", "features"]
    assert "parameters" not in glob  # no user: the global answer only, no query id
    status, first = _infer_json(daemon, "ann")
    assert status == 200 and [o["name"] for o in first["outputs"]] == ["logits", "features", "personalized"]
    qid = first["parameters"]["query_id"]
    assert first["parameters"]["user"] == "ann"
    fresh = np.array(first["outputs"][2]["data"])
    np.testing.assert_allclose(fresh, glob["outputs"][0]["data"], rtol=1e-5, atol=1e-6)  # starts as the head
    # every 4xx
    assert _infer_json(daemon, None, ["personalized"])[0] == 400  # a user's output without a user
    assert _infer_json(daemon, "")[0] == 400
    assert _feedback(daemon, {"query_id": qid, "label": "1"})[0] == 400
    assert _feedback(daemon, {"query_id": qid, "label": 3})[0] == 400  # 3 classes
    assert _feedback(daemon, {"query_id": qid, "label": 1.5})[0] == 400
    assert _feedback(daemon, {"query_id": qid})[0] == 400
    assert _feedback(daemon, [1, 2])[0] == 400
    assert _feedback(daemon, {"query_id": "no-such-query", "label": 1})[0] == 404
    assert _feedback(daemon, {"query_id": qid, "label": 1}, model="plain")[0] == 400  # not personalized
    assert _feedback(daemon, {"query_id": qid, "label": 1}, model="nope")[0] == 404
    assert raw(daemon, "GET", f"/v2/models/{MODEL}/users/ann")[0] == 404  # no feedback yet
    assert raw(daemon, "GET", "/v2/models/nope/users/ann")[0] == 404
    # feedback: the least likely class, until it is ann's first choice
    label = int(np.argmin(fresh))
    status, ack = _feedback(daemon, {"query_id": qid, "label": label})
    assert status == 200 and ack["updates"] == 1 and ack["user"] == "ann", ack
    assert _feedback(daemon, {"query_id": qid, "label": label})[0] == 404  # one feedback per query
    for _ in range(5):
        _, r = _infer_json(daemon, "ann")
        assert _feedback(daemon, {"query_id": r["parameters"]["query_id"], "label": label})[0] == 200
    _, r = _infer_json(daemon, "ann", ["personalized"])
    assert [o["name"] for o in r["outputs"]] == ["personalized"]
    assert int(np.argmax(r["outputs"][0]["data"])) == label
    _, other = _infer_json(daemon, "bob", ["personalized"])
    np.testing.assert_allclose(other["outputs"][0]["data"], fresh, rtol=1e-5, atol=1e-6)  # bob is untouched
    status, _, body = raw(daemon, "GET", f"/v2/models/{MODEL}/users/ann")
    info = orjson.loads(body)
    assert status == 200 and info["updates"] == 6 and info["last_update"] > 1.7e9
    status, _, body = raw(daemon, "GET", f"/v2/models/{MODEL}")
    assert [o["name"] for o in orjson.loads(body)["outputs"]] == ["logits", "features", "personalized"]


def test_socket_and_clients(daemon: DaemonThread) -> None:
    with SocketClient(daemon.socket) as c:
        r = c.infer(MODEL, {"INPUT__0": X}, user="sam")
        assert r.query_id and set(r.outputs) == {"logits", "features", "personalized"}
        assert not c.infer(MODEL, {"INPUT__0": X}).query_id
        label = int(np.argmin(r.outputs["personalized"][0]))
        ack = c.feedback(MODEL, r.query_id, label)
        assert ack["updates"] == 1
        for bad, status in ((lambda: c.feedback(MODEL, r.query_id, label), 404),
                            (lambda: c.feedback(MODEL, "nope", 0), 404),
                            (lambda: c.feedback(MODEL, r.query_id, True), 404),  # used up before the label
                            (lambda: c.feedback("plain", r.query_id, 0), 400),
                            (lambda: c.feedback("nope", r.query_id, 0), 404),
                            (lambda: c.user(MODEL, "nobody"), 404),
                            (lambda: c.infer(MODEL, {"INPUT__0": X}, user=7), 400)):  # type: ignore[arg-type]
            with pytest.raises(InferenceServerError) as e:
                bad()
            assert e.value.status == status, (status, e.value)
        r2 = c.infer(MODEL, {"INPUT__0": np.repeat(X, 2, 0)}, user="sam", outputs=["personalized"])
        with pytest.raises(InferenceServerError) as e:
            c.feedback(MODEL, r2.query_id, 1.0)  # type: ignore[arg-type]
        assert e.value.status == 400
        assert c.feedback(MODEL, r2.query_id, [label, label])["updates"] == 3  # a batch: a label per sample
        assert c.user(MODEL, "sam")["updates"] == 3
    with HttpClient(daemon.http) as h:
        r = h.infer(MODEL, {"INPUT__0": X}, user="sam")
        assert r.query_id and h.feedback(MODEL, r.query_id, label)["updates"] == 4
        assert h.user(MODEL, "sam")["updates"] == 4
        with pytest.raises(InferenceServerError) as e:
            h.user(MODEL, "nobody")
        assert e.value.status == 404
    import tritonclient.grpc as tg

    g = tg.InferenceServerClient(daemon.grpc)
    inp = tg.InferInput("INPUT__0", [1, 4], "FP32")
    inp.set_data_from_numpy(X)
    res = g.infer(MODEL, [inp], parameters={"user": "sam"})
    assert res.get_response().parameters["query_id"].string_param
    assert res.as_numpy("personalized") is not None


@pytest.mark.timeout(120)
def test_acknowledged_feedback_survives_kill_9(repo: Path, tmp_path: Path) -> None:
    from bench.servers import Escapement

    db = tmp_path / "users.sqlite3"
    server = Escapement(repo, personalization={"db_path": str(db)})
    server.start(timeout=90)
    try:
        with SocketClient(server.socket) as c:
            for _ in range(3):
                r = c.infer(MODEL, {"INPUT__0": X}, user="kim")
                c.feedback(MODEL, r.query_id, 0)
            before = c.infer(MODEL, {"INPUT__0": X}, user="kim").outputs["personalized"]
        server.kill()  # SIGKILL: no drain, no close
        server.start(timeout=90)
        with SocketClient(server.socket) as c:
            after = c.infer(MODEL, {"INPUT__0": X}, user="kim").outputs["personalized"]
            assert c.user(MODEL, "kim")["updates"] == 3
        np.testing.assert_array_equal(before, after)
    finally:
        server.stop()
