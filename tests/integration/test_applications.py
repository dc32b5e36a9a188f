"""Applications on a real daemon (docs/applications.md): queries over HTTP and the socket answer
with the models that made them and a query id; feedback teaches the policy (committed, and back
after a restart); a query no model can make in time gets the default output, flagged; every
bad call is a clear 4xx."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from torch import nn

from daemon import cli
from daemon.client import HttpClient, InferenceServerError, SocketClient
from tests.integration.test_http import raw
from tests.support import DaemonThread, save_model, settings, short_tmpdir, tiny_config

APPS = """
[[applications]]
name = "sel"
models = ["a", "b", "c"]
policy = "exp3"
exploration = 0.3

[[applications]]
name = "ens"
models = ["a", "b", "c"]
policy = "exp4"
combine = "vote"
default_output = [0.0, 0.0, 1.0]

[[applications]]
name = "misfit"
models = ["a", "wide"]
"""
X = np.array([[1.0, -0.5, 2.0, 0.3]], np.float32)


def constant(cls: int) -> nn.Module:
    """A model that answers class `cls` whatever its input (its bias decides)."""
    m = nn.Linear(4, 3)
    with torch.no_grad():
        m.weight.zero_()
        m.bias.copy_(torch.tensor([5.0 if i == cls else 0.0 for i in range(3)]))
    return m.eval()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("apps-repo")
    for cls, name in enumerate("abc"):
        save_model(constant(cls), "pt2", torch.zeros(2, 4), 8, root / name / "1" / "model.pt2")
        (root / name / "config.toml").write_text(tiny_config(), encoding="utf-8")
    save_model(constant(2), "pt2", torch.zeros(2, 4), 2, root / "small" / "1" / "model.pt2")
    for cls, name in ((0, "h0"), (1, "h1")):  # FP16 members: an ensemble of them answers FP32
        save_model(constant(cls).half(), "pt2", torch.zeros(2, 4, dtype=torch.float16), 8,
                   root / name / "1" / "model.pt2")
        (root / name / "config.toml").write_text(tiny_config().replace('"FP32"', '"FP16"'), encoding="utf-8")
    (root / "small" / "config.toml").write_text(tiny_config(max_batch=2), encoding="utf-8")
    save_model(nn.Linear(5, 3).eval(), "pt2", torch.zeros(2, 5), 8, root / "wide" / "1" / "model.pt2")
    (root / "wide" / "config.toml").write_text(tiny_config(inp=5), encoding="utf-8")
    (root / "applications.toml").write_text(APPS, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("appdb") / "apps.sqlite3"


def daemon_over(repo: Path, d: Path, db: Path, workers: int = 0) -> DaemonThread:
    return DaemonThread(settings(repo, d, server={"frontend_workers": workers}, apps={"db_path": str(db)}))


@pytest.fixture(scope="module", params=[0, 1], ids=["in-process", "1-worker"])
def daemon(request: pytest.FixtureRequest, repo: Path, db: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = daemon_over(repo, d, db.with_name(f"w{request.param}.sqlite3"), request.param).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


def post(d: DaemonThread, path: str, obj: object) -> tuple[int, dict]:
    status, _, body = raw(d, "POST", path, orjson.dumps(obj))
    return status, orjson.loads(body)


def infer_body(x: np.ndarray = X, **params: object) -> dict:
    body: dict = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape),
                              "data": x.ravel().tolist()}]}
    if params:
        body["parameters"] = params
    return body


def test_selection_answers_with_one_model_and_learns_from_labels(daemon: DaemonThread) -> None:
    status, ans = post(daemon, "/v2/applications/sel/infer", {**infer_body(), "id": "q1"})
    assert status == 200, ans
    p = ans["parameters"]
    assert ans["id"] == "q1" and ans["model_name"] == "sel"
    assert len(p["models"]) == 1 and p["query_id"]
    out = np.array(ans["outputs"][0]["data"]).reshape(ans["outputs"][0]["shape"])
    assert int(out.argmax()) == "abc".index(p["models"][0])  # the constant model's class
    # class 1 is always right: b's probability climbs over the others
    with HttpClient(daemon.http) as c:
        for _ in range(40):
            r = c.app_infer("sel", {"INPUT__0": X})
            fb = c.app_feedback("sel", r.query_id, label=1)
            assert fb["rewards"] == {r.models[0]: 1.0 if r.models[0] == "b" else 0.0}
        st = c.app_status("sel")
    assert st["probabilities"]["b"] > max(st["probabilities"]["a"], st["probabilities"]["c"])
    assert st["updates"] >= 40 and st["counters"]["feedback"] >= 40 and st["ready"]


def test_ensemble_combines_every_model_and_weights_the_right_one(daemon: DaemonThread) -> None:
    with SocketClient(daemon.socket) as c:
        r = c.app_infer("ens", {"INPUT__0": X})
        assert sorted(r.models) == ["a", "b", "c"] and not r.partial and not r.default
        assert r.output.shape == (1, 3)
        np.testing.assert_allclose(r.output.sum(), 1.0, rtol=1e-5)  # weighted votes
        fb = c.app_feedback("ens", r.query_id, label=2)
        assert fb["rewards"] == {"a": 0.0, "b": 0.0, "c": 1.0}
        assert fb["weights"]["c"] > fb["weights"]["a"]
        r = c.app_infer("ens", {"INPUT__0": np.repeat(X, 3, axis=0)})
        assert int(r.output.argmax(axis=1)[0]) == 2  # one item: c's weight (~0.58) outvotes a's and b's
        # a per-model reward moves only the models named
        fb = c.app_feedback("ens", r.query_id, reward={"a": 1.0})
        assert fb["rewards"] == {"a": 1.0}
        assert c.app_status("ens")["policy"] == "exp4"


def test_no_model_in_time_gets_the_default_or_a_504(daemon: DaemonThread) -> None:
    # a 1 µs timeout: the controller expects every model later, so none is run or waited for
    status, ans = post(daemon, "/v2/applications/ens/infer", infer_body(timeout=1))
    assert status == 200, ans
    p = ans["parameters"]
    assert p["default"] is True and p["models"] == [] and "query_id" not in p
    assert sorted(p["skipped"]) == ["a", "b", "c"]
    assert ans["outputs"][0]["data"] == [0.0, 0.0, 1.0]
    status, ans = post(daemon, "/v2/applications/sel/infer", infer_body(timeout=1))
    assert status == 504 and "deadline" in ans["error"]


def test_bad_calls_are_clear_4xx(daemon: DaemonThread) -> None:
    status, ans = post(daemon, "/v2/applications/nope/infer", infer_body())
    assert status == 404 and "unknown application 'nope'" in ans["error"]
    status, ans = post(daemon, "/v2/applications/sel/feedback", {"query_id": "never-given", "label": 1})
    assert status == 404 and "unknown or expired query_id" in ans["error"]
    qid = post(daemon, "/v2/applications/sel/infer", infer_body())[1]["parameters"]["query_id"]
    for body, needle in (({"query_id": qid, "label": "one"}, "label must be an integer"),
                         ({"query_id": qid, "label": 1.5}, "label must be an integer"),
                         ({"query_id": qid, "label": 7}, "out of range"),
                         ({"query_id": qid, "label": [1, 2]}, "give 1 label"),
                         ({"query_id": qid, "reward": 2}, "reward must be a number in [0, 1]"),
                         ({"query_id": qid, "reward": "good"}, "reward must be a number in [0, 1]"),
                         ({"query_id": qid, "label": 1, "reward": 1}, "exactly one of"),
                         ({"query_id": qid}, "exactly one of"),
                         ({"query_id": qid, "label": 1, "extra": 0}, "unknown keys"),
                         ({"query_id": 3, "label": 1}, "query_id must be")):
        status, ans = post(daemon, "/v2/applications/sel/feedback", body)
        assert status == 400 and needle in ans["error"], (body, ans)
    # a bad label does not use the query up; one feedback does; a second is a 404
    assert post(daemon, "/v2/applications/sel/feedback", {"query_id": qid, "reward": 1})[0] == 200
    assert post(daemon, "/v2/applications/sel/feedback", {"query_id": qid, "reward": 1})[0] == 404
    # another application's query is not this one's
    qid = post(daemon, "/v2/applications/ens/infer", infer_body())[1]["parameters"]["query_id"]
    assert post(daemon, "/v2/applications/sel/feedback", {"query_id": qid, "label": 1})[0] == 404
    status, ans = post(daemon, "/v2/applications/ens/feedback", {"query_id": qid, "reward": 0.5})
    assert status == 400 and "each model's own reward" in ans["error"]
    status, ans = post(daemon, "/v2/applications/ens/feedback", {"query_id": qid, "reward": {"zzz": 1}})
    assert status == 400 and "zzz" in ans["error"]
    # inputs that do not fit the application's models
    status, ans = post(daemon, "/v2/applications/sel/infer", infer_body(np.zeros((1, 5), np.float32)))
    assert status == 400, ans
    status, _, raw_body = raw(daemon, "POST", "/v2/applications/sel/infer", b"{not json")
    assert status == 400 and b"malformed JSON" in raw_body
    # an application over models with different inputs: declared, it answers 503 saying why; added, 400
    status, ans = post(daemon, "/v2/applications/misfit/infer", infer_body())
    assert status == 503 and "different inputs" in ans["error"]
    status, ans = post(daemon, "/v2/repository/applications/mix/load",
                       {"parameters": {"config": {"models": ["a", "wide"]}}})
    assert status == 400 and "different inputs" in ans["error"]
    for cfg, needle in (({"models": ["a", "ghost"]}, "ghost"), ({"models": []}, "at least one model"),
                        ({"models": ["a"], "policy": "exp9"}, "policy"), ({"models": ["a"], "nope": 1}, "nope"),
                        ({"models": ["a"], "default_output": [1.0]}, "default_output has 1 values"),
                        ({"models": ["a"], "default_output": [1e308, 0.0, 0.0]}, "does not fit")):
        status, ans = post(daemon, "/v2/repository/applications/mix/load", {"parameters": {"config": cfg}})
        assert status in (400, 404) and needle in ans["error"], (cfg, ans)
    with SocketClient(daemon.socket) as c:
        with pytest.raises(InferenceServerError) as e:
            c.app_feedback("sel", "never-given", label=1)
        assert e.value.status == 404
        with pytest.raises(InferenceServerError) as e:
            c.call({"op": "app_infer", "inputs": []})
        assert e.value.status == 400 and "application name" in e.value.message


def test_repository_api_adds_and_removes_an_application(daemon: DaemonThread) -> None:
    with HttpClient(daemon.http) as c:
        added = c.add_application("pair", {"models": ["b", "c"], "policy": "exp4", "combine": "mean"})
        assert added["source"] == "api" and added["models"] == ["b", "c"]
        r = c.app_infer("pair", {"INPUT__0": X})
        assert sorted(r.models) == ["b", "c"]
        names = [a["name"] for a in c.get_json("/v2/applications")]
        assert {"sel", "ens", "pair", "misfit"} <= set(names)
        # as declared: read again from applications.toml
        assert c.add_application("sel")["source"] == "repository"
    status, _ = post(daemon, "/v2/repository/applications/pair/unload", {})
    assert status == 200
    assert post(daemon, "/v2/applications/pair/infer", infer_body())[0] == 404


def test_metrics_count_applications(daemon: DaemonThread) -> None:
    post(daemon, "/v2/applications/ens/infer", infer_body())
    _, _, body = raw(daemon, "GET", "/metrics")
    text = body.decode()
    assert 'escapement_app_queries_total{application="ens"}' in text
    assert 'escapement_app_model_weight{application="ens",model="c"}' in text
    assert "escapement_app_default_answers_total" in text


def test_policy_state_survives_a_restart(repo: Path, db: Path) -> None:
    d = short_tmpdir()
    try:
        with daemon_over(repo, d, db) as dt, HttpClient(dt.http) as c:
            for _ in range(5):
                r = c.app_infer("ens", {"INPUT__0": X})
                c.app_feedback("ens", r.query_id, label=0)
            before = c.app_status("ens")
        assert before["updates"] == 5 and before["weights"]["a"] > before["weights"]["b"]
        with daemon_over(repo, d, db) as dt, HttpClient(dt.http) as c:
            after = c.app_status("ens")
        assert after["updates"] == 5
        assert after["weights"] == pytest.approx(before["weights"])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_cli_infer_and_feedback(daemon: DaemonThread, capsys: pytest.CaptureFixture[str]) -> None:
    x = Path(short_tmpdir()) / "x.npy"
    np.save(x, X)
    assert cli.main(["infer", "--socket", daemon.socket, "--app", "sel", "--input", f"INPUT__0={x}", "--json"]) == 0
    ans = orjson.loads(capsys.readouterr().out)
    assert len(ans["models"]) == 1 and ans["query_id"]
    assert cli.main(["feedback", "--socket", daemon.socket, "--app", "sel", ans["query_id"], "1"]) == 0
    assert orjson.loads(capsys.readouterr().out)["application"] == "sel"
    assert cli.main(["feedback", "--socket", daemon.socket, "--app", "sel", "never-given", "1"]) == 1
    assert "404" in capsys.readouterr().err


def test_async_clients(daemon: DaemonThread) -> None:
    from daemon.client import AsyncHttpClient, AsyncSocketClient

    async def go() -> tuple[dict, dict]:
        c = AsyncSocketClient(daemon.socket)
        try:
            r = await c.app_infer("ens", {"INPUT__0": X})
            fb_socket = await c.app_feedback("ens", r.query_id, label=2)
        finally:
            await c.close()
        async with AsyncHttpClient(daemon.http) as h:
            r = await h.app_infer("sel", {"INPUT__0": X}, timeout_us=1_000_000)
            fb_http = await h.app_feedback("sel", r.query_id, reward=1.0)
        return fb_socket, fb_http

    fb_socket, fb_http = asyncio.run(go())
    assert set(fb_socket["rewards"]) == {"a", "b", "c"} and len(fb_http["rewards"]) == 1


def test_one_model_application_gives_that_model_a_default_output(daemon: DaemonThread) -> None:
    with HttpClient(daemon.http) as c:
        c.add_application("b_or_default", {"models": ["b"], "default_output": [9.0, 9.0, 9.0]})
        r = c.app_infer("b_or_default", {"INPUT__0": X})
        assert r.models == ["b"] and int(r.output.argmax()) == 1 and not r.default
        r = c.app_infer("b_or_default", {"INPUT__0": np.repeat(X, 2, axis=0)}, timeout_us=1)
        assert r.default and r.models == [] and r.skipped == ["b"]
        np.testing.assert_array_equal(r.output, [[9.0, 9.0, 9.0], [9.0, 9.0, 9.0]])


def test_without_the_forecast_every_model_runs_and_late_ones_are_dropped(daemon: DaemonThread) -> None:
    with HttpClient(daemon.http) as c:
        c.add_application("clipper", {"models": ["a", "b"], "policy": "exp4", "skip_late": False,
                                      "default_output": [0.0, 0.0, 1.0]})
        assert c.app_status("clipper")["skip_late"] is False
        r = c.app_infer("clipper", {"INPUT__0": X})
        assert sorted(r.models) == ["a", "b"] and not r.default
        # a deadline nothing can make: nothing is left out, both are run, neither is waited for
        r = c.app_infer("clipper", {"INPUT__0": X}, timeout_us=1)
        assert r.default and r.skipped == [] and sorted(r.late) == ["a", "b"]
        counters = c.app_status("clipper")["counters"]
        assert counters["skipped"] == 0 and counters["late"] == 2 and counters["defaults"] == 1


def test_a_query_larger_than_a_members_batch_is_a_400(daemon: DaemonThread) -> None:
    """Inputs are checked against the first model; a later one that takes fewer rows refuses the
    query at once (it once reached the controller, which could not batch it)."""
    with HttpClient(daemon.http) as c:
        c.add_application("tight", {"models": ["a", "small"], "policy": "exp4"})
    try:
        status, ans = post(daemon, "/v2/applications/tight/infer", infer_body(np.tile(X, (4, 1))))
        assert status == 400, ans
        assert "max_batch_size 2" in ans["error"] and "small" in ans["error"]
        status, ans = post(daemon, "/v2/applications/tight/infer", infer_body(np.tile(X, (2, 1))))
        assert status == 200, ans
    finally:
        post(daemon, "/v2/repository/applications/tight/unload", {})


def test_an_ensemble_of_fp16_models_answers_fp32_and_says_so(daemon: DaemonThread) -> None:
    with HttpClient(daemon.http) as c:
        c.add_application("halves", {"models": ["h0", "h1"], "policy": "exp4", "combine": "mean"})
    try:
        x = X.astype(np.float16)
        body = {"inputs": [{"name": "INPUT__0", "datatype": "FP16", "shape": list(x.shape),
                            "data": x.ravel().tolist()}]}
        status, ans = post(daemon, "/v2/applications/halves/infer", body)
        assert status == 200, ans
        (out,) = ans["outputs"]
        assert out["datatype"] == "FP32" and out["shape"] == [1, 3]
        assert np.allclose(out["data"], [2.5, 2.5, 0.0])  # the mean of two one-hot-ish answers
        with SocketClient(daemon.socket) as s:
            r = s.app_infer("halves", {"INPUT__0": x})
        assert r.output.dtype == np.float32 and np.allclose(r.output, [[2.5, 2.5, 0.0]])
    finally:
        post(daemon, "/v2/repository/applications/halves/unload", {})


def test_a_huge_unknown_query_id_is_not_echoed_whole(daemon: DaemonThread) -> None:
    status, ans = post(daemon, "/v2/applications/sel/feedback", {"query_id": "q" * 100_000, "label": 1})
    assert status == 404 and len(ans["error"]) < 400, len(ans["error"])
