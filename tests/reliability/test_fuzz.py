"""Fuzzing both frontends with malformed input: the daemon answers a client's mistake with a 4xx and a
clear message, never a 5xx, never a crash, and keeps serving everyone else.

One daemon for the module. Every example goes over a fresh connection as raw bytes, so what the
daemon sees is exactly what hypothesis generated. Examples are derandomized (the same inputs each
run) and bounded in number; `deadline=None` because a shared 2-core CI machine is noisy.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.client import SocketClient
from tests.reliability.helpers import LENGTH, RawSocket, frame, record
from tests.support import DaemonThread, short_tmpdir
from tests.support import settings as daemon_settings

MAX_BODY = 64 * 1024  # small, so bodies over the limit are cheap to generate
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "fp32", "", "FP8"]
HEADER_LEN = "Inference-Header-Content-Length"


@pytest.fixture(scope="module")
def fuzz_daemon(test_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    repo = d / "repo"
    for name in ("tiny_pt2", "all_types"):  # only models that serve: a broken one is a 503 by design
        shutil.copytree(test_repo / name, repo / name)
    # No load shedding: hypothesis shares this process's GIL with the daemon's loop, so the loop's
    # lag would be the generator's doing, and a 503 would hide what the input itself gets.
    dt = DaemonThread(daemon_settings(repo, d, server={"max_body_bytes": MAX_BODY, "shed_lag_ms": 0})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


# -------------------------------------------------------------------- strategies

# Any JSON value, with integers beyond 64 bits and text that is not ASCII.
json_leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6))
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                        max_size=4), max_leaves=10)
dims = st.integers(min_value=-2, max_value=10) | st.sampled_from([0, 4, 2**31, 2**40, -(2**40), 2**63 - 1])
shapes = st.lists(dims, max_size=4) | st.sampled_from([[1, 4], [2, 4], [9, 4], [1, 4, 1], [1], [0, 4]]) | json_any
numbers = (st.floats(allow_nan=False, allow_infinity=False, width=64) | st.integers(-(2**66), 2**66)
           | st.sampled_from([70000.0, 1e39, -1e308, 255, 256, -1, 2**31, 2**63]))
datas = (st.lists(numbers, max_size=10) | st.lists(st.lists(numbers, max_size=5), max_size=3)
         | st.lists(st.booleans(), max_size=10) | st.just([0.5] * 4) | st.just([[0.5] * 4] * 2) | json_any)
params = st.fixed_dictionaries({}, optional={
    "binary_data_size": st.integers(-5, 40) | json_any,
    "binary_data": json_any,
    "shared_memory_region": st.text(max_size=4),
})
tensor = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["INPUT__0", "a", "b", "f", "OUTPUT__0", ""]) | json_any,
    "datatype": st.sampled_from(DATATYPES) | json_any,
    "shape": shapes,
    "data": datas,
    "parameters": params | json_any,
})
request_params = st.fixed_dictionaries({}, optional={
    "timeout": st.integers(-10, 2**40) | json_any,
    "priority": st.integers(-3, 5) | json_any,
    "binary_data_output": json_any,
})
outputs = st.lists(st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["OUTPUT__0", "out_a", "nope"]) | json_any,
    "parameters": st.fixed_dictionaries({}, optional={"binary_data": json_any, "classification": st.integers(0, 3)})
    | json_any,
}), max_size=3) | json_any
infer_objects = st.fixed_dictionaries({}, optional={
    "id": st.text(max_size=5) | json_any,
    "inputs": st.lists(tensor, max_size=3) | json_any,
    "outputs": outputs,
    "parameters": request_params | json_any,
}) | json_any


ALL_TYPES = [("a", "BOOL", "?"), ("b", "UINT8", "<u1"), ("c", "INT32", "<i4"), ("d", "INT64", "<i8"),
             ("e", "FP16", "<f2"), ("f", "FP64", "<f8")]
TOO_BIG = {"BOOL": 2, "UINT8": 256, "INT32": 2**31, "INT64": 2**63, "FP16": 70000.0, "FP32": 1e39, "FP64": -1e308}
TRICKY = st.sampled_from([70000.0, 1e39, -1e308, 2**63, 2**64, -(2**63) - 1, 256, -1, 0.5, True, None, "1", [1], {}])


@st.composite
def valid_request(draw: st.DrawFn, model: str) -> tuple[dict[str, Any], list[bytes]]:
    """A well-formed request for `model` (JSON data or binary tensors) and its binary chunks."""
    n = draw(st.integers(1, 4))
    specs = [("INPUT__0", "FP32", "<f4", 4)] if model == "tiny_pt2" else [(a, b, c, 3) for a, b, c in ALL_TYPES]
    inputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, dt, np_dt, width in specs:
        arr = np.arange(n * width).reshape(n, width) % 2 == 1 if dt == "BOOL" else \
            (np.arange(n * width).reshape(n, width) % 7).astype(np_dt)
        t: dict[str, Any] = {"name": name, "datatype": dt, "shape": [n, width]}
        if draw(st.booleans()):
            b = np.ascontiguousarray(arr, dtype=np_dt).tobytes()
            t["parameters"] = {"binary_data_size": len(b)}
            chunks.append(b)
        else:
            t["data"] = arr.tolist() if draw(st.booleans()) else arr.ravel().tolist()
        inputs.append(t)
    obj: dict[str, Any] = {"inputs": inputs}
    if draw(st.booleans()):
        obj["parameters"] = {"binary_data_output": draw(st.booleans())}
    return obj, chunks


@st.composite
def mutated(draw: st.DrawFn, obj: Any) -> Any:
    """`obj` with a number in its data poked, and up to two values replaced by tricky or random ones,
    or keys deleted."""
    with_data = [t for t in obj["inputs"] if t.get("data")]
    if with_data and draw(st.booleans()):  # numbers the datatype cannot hold, or that are not numbers
        t = draw(st.sampled_from(with_data))
        row = t["data"]
        if isinstance(row[0], list):
            row = row[draw(st.integers(0, len(row) - 1))]
        row[draw(st.integers(0, len(row) - 1))] = draw(st.just(TOO_BIG[t["datatype"]]) | TRICKY)
    for _ in range(draw(st.integers(0, 2))):
        node, key = obj, None
        parent: Any = None
        # walk down a random path
        while isinstance(node, dict | list) and node and draw(st.integers(0, 3)) > 0:
            k = draw(st.sampled_from(sorted(node, key=str))) if isinstance(node, dict) else \
                draw(st.integers(0, len(node) - 1))
            parent, key, node = node, k, node[k]
        if parent is None:
            continue
        action = draw(st.sampled_from(["tricky", "random", "delete"]))
        if action == "delete":
            del parent[key]
        else:
            parent[key] = draw(TRICKY if action == "tricky" else json_any)
    return obj


@st.composite
def http_bodies(draw: st.DrawFn, model: str) -> tuple[bytes, dict[str, str]]:
    """A body and its headers: a mutated valid request (JSON or binary), random JSON, raw bytes,
    non-UTF-8, or a body over the size limit."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "json", "raw", "non_utf8", "huge"]))
    if kind == "mutated":
        obj, chunks = draw(valid_request(model))
        obj = draw(mutated(obj))
        text = json.dumps(obj).encode()
        tail = b"".join(chunks)
        if not chunks and not draw(st.booleans()):
            return text, {}
        if draw(st.integers(0, 3)) == 0:  # break the binary framing
            tail = tail[: draw(st.integers(0, len(tail)))] + draw(st.binary(max_size=8))
        header = str(len(text))
        if draw(st.integers(0, 3)) == 0:
            header = draw(st.sampled_from(["0", "-1", "", "abc", " 7 ", "1e3", str(2**70), str(len(text) - 1),
                                           str(len(text) + 1), str(len(text) + len(tail))]))
        return text + tail, {HEADER_LEN: header}
    text = json.dumps(draw(infer_objects)).encode()
    if kind == "json":
        return text, {}
    if kind == "raw":
        body = draw(st.binary(max_size=64) | st.just(b"\0" * 16))
        return body, ({HEADER_LEN: draw(st.sampled_from(["0", "1", "4"]))} if draw(st.booleans()) else {})
    if kind == "non_utf8":
        at = draw(st.integers(0, len(text)))
        bad = draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x00", b"\xfe\xfe"]))
        return text[:at] + bad + text[at:], {}
    return b"[" + b"0.5," * (MAX_BODY // 4) + b"0.5]", {}


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    model = draw(st.sampled_from(["tiny_pt2", "tiny_pt2", "all_types"]))
    path = draw(st.sampled_from([f"/v2/models/{model}/infer"] * 6 + [f"/v2/models/{model}/versions/1/infer",
                                 f"/v2/models/{model}/versions/9/infer", "/v2/models/nope/infer"]))
    body, headers = draw(http_bodies(model))
    return path, body, headers


def _mentions(raw: bytes, *words: str) -> bool:
    return any(w.encode() in raw for w in words)


def check_http_answer(status: int, headers: http.client.HTTPMessage, raw: bytes, sent: bytes) -> None:
    """What a client's mistake may get: 200, a 4xx with a JSON error, and two documented others."""
    if status == 200:
        n = headers.get(HEADER_LEN)
        obj = orjson.loads(raw[: int(n)] if n is not None else raw)
        assert obj["outputs"], obj
        return
    obj = orjson.loads(raw)  # every error is JSON
    assert isinstance(obj, dict) and isinstance(obj.get("error"), str) and obj["error"], obj
    if 400 <= status < 500 and status != 499:
        return
    if status == 501:  # a feature the daemon does not offer, named in the body
        assert _mentions(sent, "shared_memory_region", "classification"), obj
        return
    if status == 504:  # the client asked for a deadline it cannot have
        assert _mentions(sent, "timeout"), obj
        return
    raise AssertionError(f"{status} for a client's mistake: {obj}")


def http_post(address: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any, bytes]:
    host, port = address.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request("POST", path, body=body, headers=headers)
        r = c.getresponse()
        return r.status, r.headers, r.read()
    finally:
        c.close()


def test_http_inference_fuzz(fuzz_daemon: DaemonThread) -> None:
    statuses: Counter[int] = Counter()

    @FUZZ
    @given(request=http_requests())
    def one(request: tuple[str, bytes, dict[str, str]]) -> None:
        path, body, headers = request
        status, got_headers, raw = http_post(fuzz_daemon.http, path, body, headers)
        statuses[status] += 1
        check_http_answer(status, got_headers, raw, body)

    one()
    record("fuzz_http", {"examples": sum(statuses.values()), "statuses": dict(sorted(statuses.items()))})
    assert statuses[400] > 0 and statuses[200] > 0  # the generator reaches both sides of validation
    assert_still_serves(fuzz_daemon)


# -------------------------------------------------------------------- socket fuzzing

msgpack_leaf = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
                | st.text(max_size=6) | st.binary(max_size=16))
msgpack_any = st.recursive(msgpack_leaf, lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=6) | st.integers(-3, 3), c, max_size=4), max_leaves=10)
socket_tensor = st.fixed_dictionaries({}, optional={
    "name": st.sampled_from(["INPUT__0", "a", ""]) | msgpack_any,
    "datatype": st.sampled_from(DATATYPES) | msgpack_any,
    "shape": shapes.filter(lambda s: not isinstance(s, int) or -(2**63) <= s < 2**64) | msgpack_any,
    "data": st.binary(max_size=40) | st.just(b"\0" * 16) | msgpack_any,
})
socket_requests = st.fixed_dictionaries({}, optional={
    "op": st.sampled_from(["infer", "live", "ready", "index", "stats", "metadata", "model_ready", "config",
                           "nope", "", "INFER"]) | msgpack_any,
    "model": st.sampled_from(["tiny_pt2", "all_types", "nope"]) | msgpack_any,
    "version": st.sampled_from([1, "1", "2", -1, "x", 2**64 - 1]) | msgpack_any,
    "inputs": st.lists(socket_tensor, max_size=3) | msgpack_any,
    "outputs": st.lists(st.sampled_from(["OUTPUT__0", "out_a", "nope"]), max_size=3) | msgpack_any,
    "timeout_us": st.integers(-3, 2**40) | msgpack_any,
    "priority": st.integers(-3, 5) | msgpack_any,
    "ready": msgpack_any,
})


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@st.composite
def socket_payloads(draw: st.DrawFn) -> tuple[str, bytes, int, bytes]:
    """(kind, bytes to send, complete frames in them, the request bodies) for one connection."""
    kind = draw(st.sampled_from(["bytes", "value", "request", "request", "lying", "over_limit", "split"]))
    if kind == "bytes":  # framed garbage: framing intact, content not msgpack (or not a map)
        body = draw(st.binary(max_size=40))
        return kind, LENGTH.pack(len(body)) + body, 1, body
    if kind == "value":
        body = _pack(draw(msgpack_any))
        return kind, LENGTH.pack(len(body)) + body, 1, body
    if kind == "request":
        obj = draw(socket_requests)
        if draw(st.booleans()):
            obj["id"] = draw(st.integers(-5, 5) | st.text(max_size=3) | msgpack_any)
        body = _pack(obj)
        return kind, LENGTH.pack(len(body)) + body, 1, body
    if kind == "lying":  # a length prefix that promises more than arrives, then a half-close
        body = _pack(draw(socket_requests))
        extra = draw(st.integers(1, 1000))
        cut = draw(st.integers(0, len(body)))
        return kind, LENGTH.pack(len(body) + extra) + body[:cut], 0, b""
    if kind == "over_limit":
        n = draw(st.integers(MAX_BODY + 1, 2**32 - 1))
        return kind, LENGTH.pack(n) + draw(st.binary(max_size=16)), 0, b""
    # several frames, sent in chunks cut at arbitrary places
    bodies = [_pack(draw(socket_requests)) for _ in range(draw(st.integers(2, 4)))]
    return kind, b"".join(LENGTH.pack(len(b)) + b for b in bodies), len(bodies), b"".join(bodies)


def check_socket_answer(answer: dict[str, Any], sent: bytes) -> None:
    status = answer.get("status")
    assert isinstance(status, int), answer
    if status == 200:
        return
    assert isinstance(answer.get("error"), str) and answer["error"], answer
    if 400 <= status < 500 and status != 499:
        return
    if status == 504:
        assert b"timeout_us" in sent, answer
        return
    raise AssertionError(f"{status} for a client's mistake: {answer}")


def test_socket_frame_fuzz(fuzz_daemon: DaemonThread) -> None:
    kinds: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    sentinel = [0]

    @FUZZ
    @given(payload=socket_payloads(), chunk=st.integers(1, 64))
    def one(payload: tuple[str, bytes, int, bytes], chunk: int) -> None:
        kind, data, frames, sent = payload
        kinds[kind] += 1
        s = RawSocket(fuzz_daemon.socket)
        try:
            if kind == "split":
                for i in range(0, len(data), chunk):
                    s.send(data[i : i + chunk])
            else:
                s.send(data)
            if kind == "over_limit":  # one 413 naming no request, then the daemon hangs up
                answer = s.read_frame()
                assert answer is not None and answer["status"] == 413 and answer["id"] is None, answer
                statuses[413] += 1
                assert s.read_frame() is None
                return
            if kind == "lying":  # a frame that can never complete once we half-close: one 400, then EOF
                s.sock.shutdown(socket.SHUT_WR)
                answer = s.read_frame()
                assert answer is not None and answer["status"] == 400 and answer["id"] is None, answer
                assert "ended inside a frame" in answer["error"]
                statuses[400] += 1
                assert s.read_frame() is None
                return
            # A control op on the same connection: answered in order after the frames before it, so
            # it proves the connection goes on. Inference answers may come later: count them too.
            sentinel[0] += 1
            tag = f"sentinel-{sentinel[0]}"
            s.send(frame({"op": "live", "id": tag}))
            got, seen_tag = 0, False
            while got < frames or not seen_tag:
                answer = s.read_frame()
                assert answer is not None, "the daemon closed a connection whose framing was intact"
                if answer.get("id") == tag:
                    assert answer["status"] == 200 and answer["live"] is True
                    seen_tag = True
                    continue
                got += 1
                statuses[answer.get("status")] += 1
                check_socket_answer(answer, sent)
            assert got == frames
        finally:
            s.close()

    one()
    record("fuzz_socket", {"examples": sum(kinds.values()), "kinds": dict(kinds),
                           "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)}})
    assert statuses[400] > 0 and statuses[200] > 0
    assert_still_serves(fuzz_daemon)


def test_http_framing_errors_do_not_disturb_the_daemon(fuzz_daemon: DaemonThread) -> None:
    """Bytes broken below the body: bad Content-Length, a body cut short, garbage request lines."""
    host, port = fuzz_daemon.http.split(":")
    head = "POST /v2/models/tiny_pt2/infer HTTP/1.1\r\nHost: x\r\n"
    cases = [
        (head + "Content-Length: abc\r\n\r\n{}").encode(),
        (head + "Content-Length: -5\r\n\r\n{}").encode(),
        (head + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}").encode(),
        (head + "Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n").encode(),
        (head + "Content-Length: 100\r\n\r\n{\"inp").encode(),  # then the client hangs up
        b"\xff\xfe GARBAGE\r\n\r\n",
        b"POST /v2/models/tiny_pt2/infer HTTP/9.9\r\n\r\n",
    ]
    statuses: list[int | None] = []
    for raw in cases:
        s = socket.create_connection((host, int(port)), timeout=10)
        answer = b""
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:  # the daemon hung up on bytes it had not read: a clean refusal
            pass
        finally:
            s.close()
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else None
        statuses.append(status)
        assert status is None or 400 <= status < 500, answer  # a 4xx, or a hang-up: never a 5xx
    record("fuzz_http_framing", {"cases": len(cases), "statuses": statuses})
    assert_still_serves(fuzz_daemon)


def test_a_client_that_half_closes_still_gets_its_answers(fuzz_daemon: DaemonThread) -> None:
    """Found while fuzzing: a client that shut down its sending side (`nc -N`, a batch script) had its
    inferences cancelled unanswered; now it gets every answer, then the daemon closes."""
    s = RawSocket(fuzz_daemon.socket)
    try:
        s.send(b"".join(frame({"id": i, "model": "tiny_pt2", "inputs": [
            {"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": b"\0" * 16}]}) for i in range(20)))
        s.sock.shutdown(socket.SHUT_WR)
        answers = []
        while (a := s.read_frame()) is not None:
            answers.append(a)
    finally:
        s.close()
    assert sorted(a["id"] for a in answers) == list(range(20)) and all(a["status"] == 200 for a in answers)


@pytest.mark.parametrize(("model", "inputs"), [
    ("tiny_pt2", [("INPUT__0", "FP32", [1e39, 0.0, 0.0, 0.0])]),
    ("all_types", [("a", "BOOL", [True] * 3), ("b", "UINT8", [1, 2, 3]), ("c", "INT32", [1, 2, 3]),
                   ("d", "INT64", [1, 2, 3]), ("e", "FP16", [70000, 1, 2]), ("f", "FP64", [1.0, 2.0, 3.0])]),
])
def test_a_float_too_large_for_its_datatype_is_a_400(fuzz_daemon: DaemonThread, model: str,
                                                     inputs: list[tuple[str, str, list[Any]]]) -> None:
    """Found by the fuzzer: such a value was cast to inf (a 500 where warnings are errors)."""
    body = orjson.dumps({"inputs": [{"name": n, "datatype": dt, "shape": [1, len(v)], "data": v}
                                    for n, dt, v in inputs]})
    status, _, raw = http_post(fuzz_daemon.http, f"/v2/models/{model}/infer", body, {})
    assert status == 400 and b"out of range" in raw, raw


# -------------------------------------------------------------------- afterwards


def assert_still_serves(dt: DaemonThread) -> None:
    """Health and one real inference, from a new client on each frontend, with the right numbers."""
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    want = x @ (np.arange(12, dtype=np.float32).reshape(3, 4) / 10).T + np.array([0.5, -0.5, 1.0], np.float32)
    host, port = dt.http.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request("GET", "/v2/health/live")
        r = c.getresponse()
        assert r.status == 200 and orjson.loads(r.read()) == {"live": True}
        body = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4],
                                         "data": x.ravel().tolist()}]})
        c.request("POST", "/v2/models/tiny_pt2/infer", body=body)
        r = c.getresponse()
        out = orjson.loads(r.read())
        assert r.status == 200, out
        np.testing.assert_allclose(np.array(out["outputs"][0]["data"]).reshape(1, 3), want, rtol=1e-5)
    finally:
        c.close()
    with SocketClient(dt.socket, timeout=30) as s:
        assert s.live()
        np.testing.assert_allclose(s.infer("tiny_pt2", {"INPUT__0": x}).outputs["OUTPUT__0"], want, rtol=1e-5)
    assert dt.wait_idle() == 0  # nothing a malformed request started is left pending

