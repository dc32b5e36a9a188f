"""The prediction cache on a real daemon: HTTP (JSON and binary) and the socket, in the controller
process and through a frontend worker; a model without the opt-in never caches; an unload and
load starts the version's answers afresh; hits and misses in /metrics and the statistics."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import tritonclient.grpc as tg
from prometheus_client.parser import text_string_to_metric_families

from daemon.client import HttpClient, SocketClient
from tests.integration.test_frontend_workers import _until
from tests.integration.test_http import raw
from tests.support import DaemonThread, TinyLinear, save_model, settings, short_tmpdir, tiny_config

CACHED = tiny_config() + "[response_cache]\nenabled = true\n"


@pytest.fixture(scope="module")
def cache_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache-repo")
    model = TinyLinear().eval()
    for name, config in (("cached", CACHED), ("plain", tiny_config())):
        save_model(model, "pt2", torch.zeros(2, 4), 8, root / name / "1" / "model.pt2")
        (root / name / "config.toml").write_text(config, encoding="utf-8")
    return root


@pytest.fixture(scope="module", params=[0, 1], ids=["in-process", "1-worker"])
def daemon(request: pytest.FixtureRequest, cache_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(cache_repo, d, server={"frontend_workers": request.param,
                                                      "grpc": "127.0.0.1:0"})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 4)).astype(np.float32)


def _binary(d: DaemonThread, model: str, x: np.ndarray) -> tuple[dict[str, object], bytes]:
    """One binary HTTP request; the answer's JSON header and its output bytes."""
    header = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape),
                                       "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True}})
    status, headers, body = raw(d, "POST", f"/v2/models/{model}/infer", header + x.tobytes(),
                                {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body
    n = int(headers["inference-header-content-length"])
    return orjson.loads(body[:n]), body[n:]


def test_a_repeat_over_http_binary_is_a_hit_with_the_same_bytes(daemon: DaemonThread) -> None:
    x = _x(1)
    miss_head, miss_bytes = _binary(daemon, "cached", x)
    hit_head, hit_bytes = _binary(daemon, "cached", x)
    assert "parameters" not in miss_head
    assert hit_head["parameters"] == {"cached": True}
    assert hit_bytes == miss_bytes
    other_head, _ = _binary(daemon, "cached", _x(2))  # other inputs: a miss
    assert "parameters" not in other_head


def test_a_repeat_over_json_and_the_socket_is_a_hit(daemon: DaemonThread) -> None:
    x = _x(3)
    body = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [2, 4],
                                     "data": x.ravel().tolist()}]})
    first = orjson.loads(raw(daemon, "POST", "/v2/models/cached/infer", body)[2])
    again = orjson.loads(raw(daemon, "POST", "/v2/models/cached/infer", body)[2])
    assert "parameters" not in first and again["parameters"] == {"cached": True}
    assert again["outputs"] == first["outputs"]
    with SocketClient(daemon.socket) as c:
        s = c.infer("cached", {"INPUT__0": x})  # inputs the HTTP requests left in the cache
        assert s.cached
        assert s.outputs["OUTPUT__0"].tobytes() == np.asarray(first["outputs"][0]["data"], np.float32).tobytes()
        fresh = c.infer("cached", {"INPUT__0": _x(4)})
        assert not fresh.cached and c.infer("cached", {"INPUT__0": _x(4)}).cached
    with HttpClient(daemon.http) as h:
        assert h.infer("cached", {"INPUT__0": _x(4)}).cached


def test_a_repeat_over_grpc_is_a_hit_with_the_same_bytes(daemon: DaemonThread) -> None:
    c = tg.InferenceServerClient(daemon.grpc)
    try:
        inp = tg.InferInput("INPUT__0", [2, 4], "FP32")
        inp.set_data_from_numpy(_x(9))
        first, again = (c.infer("cached", [inp]) for _ in range(2))
        assert "cached" not in first.get_response().parameters
        assert again.get_response().parameters["cached"].bool_param
        assert again.as_numpy("OUTPUT__0").tobytes() == first.as_numpy("OUTPUT__0").tobytes()
    finally:
        c.close()


def test_a_model_without_the_opt_in_never_caches(daemon: DaemonThread) -> None:
    x = _x(5)
    for _ in range(3):
        head, _ = _binary(daemon, "plain", x)
        assert "parameters" not in head
    with SocketClient(daemon.socket) as c:
        assert not c.infer("plain", {"INPUT__0": x}).cached
    stats = orjson.loads(raw(daemon, "GET", "/v2/models/plain/stats")[2])["model_stats"][0]["inference_stats"]
    assert stats["cache_hit"]["count"] == 0 and stats["cache_miss"]["count"] == 0


def test_hits_and_misses_in_metrics_and_statistics(daemon: DaemonThread) -> None:
    def counts() -> tuple[float, float, int, int]:
        text = raw(daemon, "GET", "/metrics")[2].decode()
        m = {(s.name, s.labels.get("model", "")): s.value
             for f in text_string_to_metric_families(text) for s in f.samples}
        st = orjson.loads(raw(daemon, "GET", "/v2/models/cached/versions/1/stats")[2])
        inf = st["model_stats"][0]["inference_stats"]
        assert m[("escapement_cache_bytes", "")] > 0
        assert inf["cache_hit"]["count"] == m[("escapement_cache_hits_total", "cached")]
        return (m[("escapement_cache_hits_total", "cached")], m[("escapement_cache_misses_total", "cached")],
                inf["cache_hit"]["count"], inf["cache_miss"]["count"])

    _binary(daemon, "cached", _x(6))
    h0, m0, sh0, sm0 = counts()
    _binary(daemon, "cached", _x(6))
    _binary(daemon, "cached", _x(7))
    h1, m1, sh1, sm1 = counts()
    assert (h1 - h0, m1 - m0, sh1 - sh0, sm1 - sm0) == (1, 1, 1, 1)


def test_an_unloaded_and_reloaded_version_answers_afresh(daemon: DaemonThread) -> None:
    x = _x(8)
    _binary(daemon, "cached", x)
    assert _binary(daemon, "cached", x)[0].get("parameters") == {"cached": True}
    assert raw(daemon, "POST", "/v2/repository/models/cached/unload", b"{}")[0] == 200
    assert raw(daemon, "POST", "/v2/repository/models/cached/load", b"{}")[0] == 200
    # A frontend worker learns of the unload and the load from the controller's catalog snapshots,
    # which may come after the answers: it refuses (503) until its replica has the version ready.
    answers: list[bytes] = []
    _until(lambda: _answered(daemon, x, answers))
    assert "parameters" not in orjson.loads(answers[0])  # a miss: the model ran again
    assert _binary(daemon, "cached", x)[0].get("parameters") == {"cached": True}


def _answered(d: DaemonThread, x: np.ndarray, answers: list[bytes]) -> bool:
    header = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape),
                                       "parameters": {"binary_data_size": x.nbytes}}]})
    status, _, body = raw(d, "POST", "/v2/models/cached/infer", header + x.tobytes(),
                                {"Inference-Header-Content-Length": str(len(header))})
    assert status in (200, 503), body
    if status == 200:
        answers.append(body)
    return status == 200
