"""The KServe v2 HTTP frontend, bytes in and bytes out: its protocol object fed through a
MockTransport over a FakeGateway (tests/fakes.py). No socket, no daemon, no model; what is
checked is the wire: routes, every 4xx a client can cause, the body limit, shedding while the
loop lags, and answers in JSON and binary. (Against a real daemon: tests/integration/test_http.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from daemon.api.http import HttpFrontend
from daemon.datatypes import BY_NAME
from daemon.model import ModelSpec, TensorSpec
from tests.fakes import FakeGateway, HttpWire

FP32 = BY_NAME["FP32"]
TINY = ModelSpec("tiny", 1, Path("/nowhere/tiny"), "pt2", (TensorSpec("INPUT__0", FP32, (-1, 4)),),
                 (TensorSpec("OUTPUT__0", FP32, (-1, 3)),), 8, 1.0)
W = np.arange(12, dtype=np.float32).reshape(4, 3) / 10


def linear(inputs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return (inputs[0] @ W,)


def wire(**server: object) -> tuple[FakeGateway, HttpWire]:
    gw = FakeGateway(TINY, answer=linear, server={"max_body_bytes": 256 * 1024, **server})
    return gw, HttpWire(HttpFrontend(gw))


def infer_body(x: np.ndarray, **params: object) -> bytes:
    return orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape),
                                     "data": x.ravel().tolist()}], **params})


async def test_json_inference_reaches_the_gateway_and_comes_back_as_json() -> None:
    gw, w = wire()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    r = await w.call("POST", "/v2/models/tiny/infer", infer_body(x, id="r1", parameters={"timeout": 5_000_000}))
    assert r.status == 200 and r.headers["content-type"].startswith("application/json")
    got = r.json()
    assert got["model_name"] == "tiny" and got["model_version"] == "1" and got["id"] == "r1"
    (out,) = got["outputs"]
    assert out["name"] == "OUTPUT__0" and out["shape"] == [2, 3] and out["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(out["data"], np.float32).reshape(2, 3), x @ W, rtol=1e-6)
    (req,) = gw.fake.submitted
    assert req.samples == 2 and req.deadline == pytest.approx(req.arrival + 5.0)  # the client's timeout
    assert not w.transport.closed  # keep-alive


async def test_a_binary_request_gets_its_selected_output_in_binary() -> None:
    _, w = wire()
    x = np.ones((3, 4), np.float32)
    header = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [3, 4],
                                       "parameters": {"binary_data_size": 48}}],
                           "outputs": [{"name": "OUTPUT__0", "parameters": {"binary_data": True}}]})
    r = await w.call("POST", "/v2/models/tiny/infer", header + x.tobytes(),
                     {"Inference-Header-Content-Length": str(len(header))})
    assert r.status == 200 and r.headers["content-type"] == "application/octet-stream"
    n = int(r.headers["inference-header-content-length"])
    assert orjson.loads(r.body[:n])["outputs"][0]["parameters"] == {"binary_data_size": 36}
    np.testing.assert_allclose(np.frombuffer(r.body[n:], "<f4").reshape(3, 3), x @ W, rtol=1e-6)


BIN_HEADER = (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], '
              b'"parameters": {"binary_data_size": 16}}]}')
JSON_HEADER = b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4]}]}'


@pytest.mark.parametrize(("body", "headers", "needle"), [
    (b"{not json", {}, "malformed JSON in the request body"),
    (b"[1, 2]", {}, "must be a JSON object"),
    (b'{"inputs": []}', {}, "inputs must be a non-empty list"),
    (b'{"inputs": [{"name": "INPUT__0"}]}', {}, "needs a string name and datatype"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2]}]}', {},
     "2 values of data, but its shape needs 4"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4]}], '
     b'"outputs": [{"name": "nope"}]}', {}, "unknown output 'nope'"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4]}], '
     b'"parameters": {"timeout": -5}}', {}, "timeout must be an integer number of microseconds"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4]}], '
     b'"parameters": {"priority": "high"}}', {}, "priority must be a non-negative integer"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 5], "data": [1,2,3,4,5]}]}', {},
     "shape [1, 5] does not match"),
    (BIN_HEADER + b"\0" * 8, {"Inference-Header-Content-Length": str(len(BIN_HEADER))},
     "runs past the end of the body"),
    (b"{}", {"Inference-Header-Content-Length": "500"}, "outside the body of 2 bytes"),
    (b"{}", {"Inference-Header-Content-Length": "two"}, "must be an integer"),
    (JSON_HEADER + b"xx", {"Inference-Header-Content-Length": str(len(JSON_HEADER))},
     "2 bytes of binary data follow the inputs unused"),
    (b"\0" * 15, {"Inference-Header-Content-Length": "0"}, "15 bytes of data"),
])
async def test_bad_requests_get_clear_json_errors_and_never_reach_the_controller(
        body: bytes, headers: dict[str, str], needle: str) -> None:
    gw, w = wire()
    r = await w.call("POST", "/v2/models/tiny/infer", body, headers)
    assert r.status == 400 and needle in r.error, r.error
    assert gw.fake.submitted == []
    assert (await w.call("GET", "/v2/health/live")).status == 200  # the connection goes on


async def test_routing_errors() -> None:
    _, w = wire()
    for method, path, status, error in [
        ("GET", "/v2/nothing", 404, "Not Found"),
        ("GET", "/v2/models/tiny/versions/x", 404, "Not Found"),
        ("GET", "/v2/models/tiny/infer", 405, "Method Not Allowed"),
        ("GET", "/v2/models/nope", 404, "unknown model 'nope'"),
        ("POST", "/v2/models/tiny/versions/7/infer", 404, "has no version 7"),
    ]:
        r = await w.call(method, path, b"{}" if method == "POST" else b"")
        assert r.status == status and error in r.error, (method, path, r.status, r.body)
    r = await w.call("POST", "/v2/repository/other/index")
    assert r.status == 501 and "not supported" in r.error


async def test_a_body_over_the_limit_is_413_from_its_headers_and_closes() -> None:
    gw, w = wire()
    w.send(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (300 * 1024))
    r = await w.reply()
    assert r.status == 413 and "max_body_bytes" in r.error and r.headers["connection"] == "close"
    assert w.transport.eof  # a lingering close: FIN, the rest of the body read and dropped
    assert gw.fake.submitted == []


async def test_a_lagging_loop_sheds_new_inference_with_503_and_health_still_answers() -> None:
    gw, w = wire()
    x = np.ones((1, 4), np.float32)
    gw.lag(1.0)  # as if the loop ran a second behind
    r = await w.call("POST", "/v2/models/tiny/infer", infer_body(x))
    assert r.status == 503 and r.headers["retry-after"] == "1" and "overloaded" in r.error
    assert (await w.call("GET", "/v2/health/live")).status == 200
    assert gw.fake.submitted == [] and gw.overload.shed == 1
    gw.lag(0.0)
    assert (await w.call("POST", "/v2/models/tiny/infer", infer_body(x))).status == 200
    stats = (await w.call("GET", "/v2/controller/stats")).json()
    assert stats["loop"]["shed"] == 1


async def test_readiness_follows_the_daemon_health() -> None:
    gw, w = wire()
    assert (await w.call("GET", "/v2/health/ready")).status == 200
    assert (await w.call("GET", "/v2/models/tiny/ready")).status == 200
    gw.ready = False  # every device lost, or stopping
    assert (await w.call("GET", "/v2/health/ready")).status != 200
    assert (await w.call("GET", "/v2/health/live")).status == 200
