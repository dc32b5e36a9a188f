"""The HTTP frontend against a real daemon: the unmodified tritonclient, and raw bytes in and out
where real models answer. What is only the wire (every 4xx, routing, limits, shedding) is
tests/protocol/test_http_frontend.py, without a daemon."""

from __future__ import annotations

import asyncio
import http.client
import socket
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import tritonclient.http as th
import tritonclient.http.aio as tha
from tritonclient.utils import InferenceServerException

from daemon.parity.datasets import digits_split
from tests.support import ALL_TYPES, DaemonThread, TinyLinear


def raw(d: DaemonThread, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = d.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def error_of(status_headers_body: tuple[int, dict[str, str], bytes]) -> tuple[int, str]:
    status, headers, body = status_headers_body
    assert headers["content-type"].startswith("application/json"), headers
    return status, orjson.loads(body)["error"]


def torch_digits_reference(demo_repo: Path, x: np.ndarray) -> np.ndarray:
    ep = torch.export.load(str(demo_repo / "digits_mlp" / "1" / "model.pt2"))
    with torch.no_grad():
        return ep.module()(torch.from_numpy(x)).numpy()


# ------------------------------------------------------------------ tritonclient


def test_tritonclient_sync_binary_and_json_both_ways(demo_daemon: DaemonThread, demo_repo: Path) -> None:
    c = th.InferenceServerClient(demo_daemon.http)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("digits_mlp")
    meta = c.get_model_metadata("digits_mlp")
    assert meta["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 64]}]
    assert c.get_model_config("digits_mlp")["max_batch_size"] == 32
    _, _, x, _ = digits_split()
    x = x[:5]
    want = torch_digits_reference(demo_repo, x)
    for bin_in in (True, False):
        for bin_out in (True, False):
            inp = th.InferInput("INPUT__0", [5, 64], "FP32")
            inp.set_data_from_numpy(x, binary_data=bin_in)
            out = th.InferRequestedOutput("OUTPUT__0", binary_data=bin_out)
            r = c.infer("digits_mlp", [inp], outputs=[out], request_id="abc")
            np.testing.assert_allclose(r.as_numpy("OUTPUT__0"), want, rtol=1e-5, atol=1e-5)
            assert r.get_response()["id"] == "abc"
    inp = th.InferInput("INPUT__0", [5, 64], "FP32")
    inp.set_data_from_numpy(x)
    r = c.infer("digits_mlp", [inp], model_version="1")  # no outputs: all come back binary
    np.testing.assert_allclose(r.as_numpy("OUTPUT__0"), want, rtol=1e-5, atol=1e-5)
    c.close()


def test_tritonclient_errors(demo_daemon: DaemonThread) -> None:
    c = th.InferenceServerClient(demo_daemon.http)
    inp = th.InferInput("INPUT__0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 64), np.float32))
    with pytest.raises(InferenceServerException, match="deadline cannot be met") as e:
        c.infer("digits_mlp", [inp], timeout=1)
    assert e.value.status() == "504"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        c.infer("nope", [inp])
    with pytest.raises(InferenceServerException, match="has no version 7"):
        c.infer("digits_mlp", [inp], model_version="7")
    bad = th.InferInput("INPUT__0", [1, 63], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 63), np.float32))
    with pytest.raises(InferenceServerException, match=r"shape \[1, 63\] does not match"):
        c.infer("digits_mlp", [bad])
    c.close()


def test_tritonclient_aio_concurrent(demo_daemon: DaemonThread) -> None:
    _, _, x, y = digits_split()

    async def main() -> list[np.ndarray]:
        c = tha.InferenceServerClient(demo_daemon.http)
        try:
            async def one(i: int) -> np.ndarray:
                inp = tha.InferInput("INPUT__0", [1, 64], "FP32")
                inp.set_data_from_numpy(x[i : i + 1])
                return (await c.infer("digits_mlp", [inp])).as_numpy("OUTPUT__0")
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await c.close()

    outs = asyncio.run(main())
    pred = np.concatenate(outs).argmax(1)
    assert (pred == y[:200]).mean() > 0.9  # real, trained models answer correctly under concurrency


def test_demo_models_reach_their_recorded_accuracy(demo_daemon: DaemonThread, demo_repo: Path) -> None:
    import tomllib

    _, _, x, y = digits_split()
    c = th.InferenceServerClient(demo_daemon.http)
    for name, shape in (("digits_mlp", (64,)), ("digits_cnn", (1, 8, 8))):
        preds = []
        for i in range(0, len(x), 32):
            xb = x[i : i + 32].reshape(-1, *shape)
            inp = th.InferInput("INPUT__0", list(xb.shape), "FP32")
            inp.set_data_from_numpy(xb)
            preds.append(c.infer(name, [inp]).as_numpy("OUTPUT__0").argmax(1))
        acc = float((np.concatenate(preds) == y).mean())
        recorded = tomllib.loads((demo_repo / name / "config.toml").read_text())["metadata"]["test_accuracy"]
        assert acc == pytest.approx(recorded, abs=1e-3)
        assert acc > 0.95
    c.close()


# ------------------------------------------------------------------ raw HTTP


def test_server_and_model_endpoints(test_daemon: DaemonThread) -> None:
    status, _, body = raw(test_daemon, "GET", "/v2")
    assert status == 200 and "binary_tensor_data" in orjson.loads(body)["extensions"]
    assert raw(test_daemon, "GET", "/v2/health/live")[0] == 200
    assert raw(test_daemon, "GET", "/v2/health/ready")[0] == 200
    status, _, body = raw(test_daemon, "GET", "/v2/models/tiny_ts")
    assert orjson.loads(body)["versions"] == ["1", "2"]
    status, _, body = raw(test_daemon, "GET", "/v2/models/tiny_ts/versions/1")
    assert orjson.loads(body)["versions"] == ["1"] and orjson.loads(body)["platform"] == "pytorch_torchscript"
    assert raw(test_daemon, "GET", "/v2/models/tiny_ts/versions/2/ready")[0] == 200
    cfg = orjson.loads(raw(test_daemon, "GET", "/v2/models/tiny_pt2/config")[2])
    assert cfg["input"] == [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [4]}]
    assert cfg["escapement"]["batch_sizes"] == [1, 2, 4, 8]


def test_repository_index_reports_broken_entries_with_reasons(test_daemon: DaemonThread) -> None:
    status, _, body = raw(test_daemon, "POST", "/v2/repository/index", b"")
    index = {(m["name"], m.get("version")): m for m in orjson.loads(body)}
    assert index[("tiny_pt2", "1")]["state"] == "READY"
    assert index[("all_types", "1")]["state"] == "READY"
    for name in ("garbage", "wrong_shape"):
        assert index[(name, "1")]["state"] == "UNAVAILABLE"
    assert "cannot load model.pt2" in index[("garbage", "1")]["reason"]
    assert "running a batch of 1 failed" in index[("wrong_shape", "1")]["reason"]
    assert "no config.toml" in index[("no_config", None)]["reason"]
    assert "not valid TOML" in index[("bad_toml", None)]["reason"]
    ready = orjson.loads(raw(test_daemon, "POST", "/v2/repository/index", b'{"ready": true}')[2])
    assert {m["name"] for m in ready} == {"tiny_pt2", "tiny_ts", "all_types"}
    assert error_of(raw(test_daemon, "GET", "/v2/models/garbage/ready")) == (
        400, "model garbage version 1 is not ready (UNAVAILABLE)")
    status, msg = error_of(raw(test_daemon, "POST", "/v2/models/wrong_shape/infer", b"{}"))
    assert status == 503 and "UNAVAILABLE" in msg
    status, msg = error_of(raw(test_daemon, "POST", "/v2/models/bad_toml/infer", b"{}"))
    assert status == 503 and "not valid TOML" in msg


def infer_body(x: np.ndarray, name: str = "INPUT__0", **params: object) -> bytes:
    return orjson.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                                     "data": x.ravel().tolist()}], **params})


def reference(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return TinyLinear()(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("model", ["tiny_pt2", "tiny_ts"])
def test_json_inference_like_curl(test_daemon: DaemonThread, model: str) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    status, headers, body = raw(test_daemon, "POST", f"/v2/models/{model}/infer", infer_body(x, id="r1"))
    assert status == 200 and headers["content-type"].startswith("application/json")
    resp = orjson.loads(body)
    assert resp["model_name"] == model and resp["id"] == "r1"
    (out,) = resp["outputs"]
    assert out["shape"] == [2, 3] and out["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(out["data"]).reshape(2, 3), reference(x), rtol=1e-5)


def test_every_datatype_over_json_and_binary(test_daemon: DaemonThread) -> None:
    vals = {"BOOL": [[True, False, True]], "UINT8": [[1, 0, 255]], "INT32": [[1, -2, 3]], "INT64": [[5, 6, -7]],
            "FP16": [[1.5, 0.0, -2.0]], "FP64": [[1.0, 2.0, 3.0]]}
    inputs = [{"name": n, "datatype": dt, "shape": [1, 3], "data": vals[dt]} for n, dt, _ in ALL_TYPES]
    status, _, body = raw(test_daemon, "POST", "/v2/models/all_types/infer", orjson.dumps({"inputs": inputs}))
    assert status == 200, body
    outs = {o["name"]: o for o in orjson.loads(body)["outputs"]}
    assert outs["out_a"]["data"] == [False, True, False]
    assert outs["out_b"]["data"] == [2, 1, 0]  # uint8 wraps
    assert outs["out_c"]["data"] == [2, -4, 6]
    assert outs["out_d"]["data"] == [4, 5, -8]
    assert outs["out_e"]["data"] == [3.0, 0.0, -4.0] and outs["out_e"]["datatype"] == "FP16"
    assert outs["out_f"]["data"] == [0.5, 1.0, 1.5]
    # the same through tritonclient's binary path
    c = th.InferenceServerClient(test_daemon.http)
    tin = []
    for n, dt, t in ALL_TYPES:
        i = th.InferInput(n, [1, 3], dt)
        i.set_data_from_numpy(np.array(vals[dt], dtype=torch.empty(0, dtype=t).numpy().dtype))
        tin.append(i)
    r = c.infer("all_types", tin)
    assert r.as_numpy("out_a").tolist() == [[False, True, False]]
    assert r.as_numpy("out_e").dtype == np.float16 and r.as_numpy("out_e").tolist() == [[3.0, 0.0, -4.0]]
    c.close()


def test_binary_request_body_and_selected_outputs(test_daemon: DaemonThread) -> None:
    x = np.ones((3, 4), np.float32)
    header = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [3, 4],
                                       "parameters": {"binary_data_size": 48}}],
                           "outputs": [{"name": "OUTPUT__0", "parameters": {"binary_data": True}}]})
    status, headers, body = raw(test_daemon, "POST", "/v2/models/tiny_pt2/infer", header + x.tobytes(),
                                {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    n = int(headers["inference-header-content-length"])
    meta = orjson.loads(body[:n])
    assert meta["outputs"][0]["parameters"] == {"binary_data_size": 36}
    np.testing.assert_allclose(np.frombuffer(body[n:], "<f4").reshape(3, 3), reference(x), rtol=1e-5)


def test_raw_binary_request_with_header_length_zero(test_daemon: DaemonThread) -> None:
    x = np.full((1, 4), 2, np.float32)
    status, headers, body = raw(test_daemon, "POST", "/v2/models/tiny_pt2/infer", x.tobytes(),
                                {"Inference-Header-Content-Length": "0"})
    assert status == 200
    n = int(headers["inference-header-content-length"])
    np.testing.assert_allclose(np.frombuffer(body[n:], "<f4"), reference(x)[0], rtol=1e-5)


def test_a_client_that_disconnects_mid_body_does_not_disturb_others(test_daemon: DaemonThread) -> None:
    host, port = test_daemon.http.split(":")
    for _ in range(5):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v2/models/tiny_pt2/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"inputs\"")
        s.close()
    x = np.ones((1, 4), np.float32)
    status, _, body = raw(test_daemon, "POST", "/v2/models/tiny_pt2/infer", infer_body(x))
    assert status == 200
    np.testing.assert_allclose(orjson.loads(body)["outputs"][0]["data"], reference(x)[0], rtol=1e-5)


def test_models_were_profiled_in_their_warm_up(test_daemon: DaemonThread, test_repo: Path) -> None:
    import json

    from daemon.runtime.devices import cpu_model

    for name in ("tiny_pt2", "tiny_ts", "all_types"):
        profile = json.loads((test_repo / name / "1" / "profile.json").read_text())
        assert set(profile[f"cpu:{cpu_model()}"]["infer_ms"]) >= {"1", "2", "4"}
    stats = orjson.loads(raw(test_daemon, "GET", "/v2/controller/stats")[2])
    assert stats["policy"] == "clockwork"
    assert {"executor_lateness_ms", "duration_error", "start_error_ms"} <= set(stats["telemetry"])
    # the daemon's CPU by thread: the event loop and the device's INFER lane by name, in stats and /metrics
    threads = stats["threads_cpu_s"]
    assert "MainThread" in threads and any(n.startswith("cpu:0") for n in threads), threads
    assert b'escapement_thread_cpu_seconds_total{thread="other"}' in raw(test_daemon, "GET", "/metrics")[2]
