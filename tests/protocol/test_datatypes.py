"""BYTES and BF16 on every frontend (HTTP JSON and binary, the socket, gRPC raw and typed), each
frontend alone over a gateway whose fake controller echoes its inputs; and gRPC's deadline and
cancellation reaching the request. No daemon, no model: what is checked is the wire."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc.aio as tga
import tritonclient.http.aio as tha
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from daemon.api.codec import WireTensor, assemble_inputs, decode_bytes, json_data, tensor_bytes
from daemon.api.grpc_v2 import GrpcFrontend
from daemon.api.http import HttpFrontend
from daemon.api.uds import SocketConnection, SocketFrontend
from daemon.catalog import ModelCatalog, ModelState
from daemon.config import settings_from_dict
from daemon.datatypes import BY_NAME
from daemon.errors import BadRequest
from daemon.gateway import Gateway
from daemon.model import ModelSpec, TensorSpec
from daemon.request import InferenceRequest, RequestStatus
from tests.protocol.test_socket_framing import FakeTransport, frame

BYTES, BF16 = BY_NAME["BYTES"], BY_NAME["BF16"]
SPEC = ModelSpec("echo", 1, Path("/x"), "pt2", (TensorSpec("s", BYTES, (-1, 2)), TensorSpec("h", BF16, (-1, 2))),
                 (TensorSpec("s_out", BYTES, (-1, 2)), TensorSpec("h_out", BF16, (-1, 2))), 8, 1.0)
WORDS = np.array([[b"hello", b""], [b"\xc3\xa9t\xc3\xa9", b"x" * 300]], dtype=object)
HALF = np.array([[1.5, -2.0], [0.00390625, 3e38]], dtype=np.float32).astype(ml_dtypes.bfloat16)


class EchoController:
    """Answers every request with its inputs, or holds them (hold=True) until cancelled."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.held: list[InferenceRequest] = []
        self.cancelled: list[InferenceRequest] = []
        self.arrived = asyncio.Event()
        self.gone = asyncio.Event()

    def submit(self, req: InferenceRequest) -> None:
        self.arrived.set()
        if self.hold:
            self.held.append(req)
            return
        req.outputs = req.inputs
        req.status = RequestStatus.SUCCEEDED
        assert req.on_finish is not None
        req.on_finish(req)

    def cancel(self, req: InferenceRequest) -> None:
        self.cancelled.append(req)
        self.gone.set()


def gateway(ctl: EchoController) -> Gateway:
    catalog = ModelCatalog()
    catalog.add(SPEC, ModelState.READY)
    return Gateway(settings_from_dict({"server": {"max_body_bytes": 64 * 1024}}), catalog, ctl)


def length_prefixed(words: np.ndarray) -> bytes:
    return b"".join(struct.pack("<I", len(w)) + w for w in words.ravel())


# ------------------------------------------------------------------ the codec


def test_bytes_round_trip_and_bad_lengths() -> None:
    raw = length_prefixed(WORDS)
    assert tensor_bytes(decode_bytes(raw, 4, "s")) == raw
    with pytest.raises(BadRequest, match="ends before element 3 of 4"):
        decode_bytes(raw[:-302], 4, "s")
    with pytest.raises(BadRequest, match="says 300 bytes, but only 299 remain"):
        decode_bytes(raw[:-1], 4, "s")
    with pytest.raises(BadRequest, match="1 bytes of data follow its 4 BYTES elements"):
        decode_bytes(raw + b"!", 4, "s")
    with pytest.raises(BadRequest, match=r"says 4294967295 bytes"):
        decode_bytes(b"\xff\xff\xff\xff", 1, "s")


def test_json_values_are_checked_like_every_datatype() -> None:
    good = [WireTensor("s", "BYTES", [1, 2], data=[["a", "é"]]), WireTensor("h", "BF16", [1, 2], data=[1.5, 2])]
    (s, h), n = assemble_inputs(SPEC, good)
    assert n == 1 and s.tolist() == [[b"a", "é".encode()]] and h.dtype == ml_dtypes.bfloat16
    assert json_data(s, "s") == ["a", "é"] and json_data(h, "h").tolist() == [1.5, 2.0]
    bad = [
        (WireTensor("s", "BYTES", [1, 2], data=[["a", 3]]), "BYTES data must be strings, got int"),
        (WireTensor("s", "BYTES", [1, 2], data=[["a"]]), "1 values of data, but its shape needs 2"),
        (WireTensor("s", "BYTES", [1, 2], data=["a", "b", "c"]), "more values of data than its shape holds"),
        (WireTensor("s", "FP32", [1, 2], data=[1.0, 2.0]), "datatype FP32 does not match the model's BYTES"),
        (WireTensor("h", "BF16", [1, 2], data=[1e39, 1.0]), "out of range for BF16"),
        (WireTensor("h", "BF16", [1, 2], data=["a", "b"]), "BF16 data must be numbers"),
        (WireTensor("h", "BF16", [1, 2], raw=b"\x00" * 3), "3 bytes of data, but shape [1, 2] of BF16 needs 4"),
    ]
    for t, message in bad:
        other = good[1] if t.name == "s" else good[0]
        with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
            assemble_inputs(SPEC, [t, other])
    with pytest.raises(BadRequest, match="not UTF-8"):
        json_data(np.array([b"\xff"], dtype=object), "s_out")


# ------------------------------------------------------------------ every frontend


async def test_http_json_and_binary() -> None:
    fe = HttpFrontend(gateway(EchoController()))
    port = await fe.start("127.0.0.1", 0)
    c = tha.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        for binary in (True, False):
            s = tha.InferInput("s", [2, 2], "BYTES")
            s.set_data_from_numpy(WORDS if binary else WORDS[:, :1].repeat(2, 1), binary_data=binary)
            h = tha.InferInput("h", [2, 2], "BF16")
            h.set_data_from_numpy(HALF)  # tritonclient sends BF16 as binary data only
            outs = [tha.InferRequestedOutput("s_out", binary_data=binary), tha.InferRequestedOutput("h_out")]
            r = await c.infer("echo", [s, h], outputs=outs)
            want = WORDS if binary else WORDS[:, :1].repeat(2, 1)
            got = r.as_numpy("s_out").tolist()
            assert got == (want.tolist() if binary else [[w.decode() for w in row] for row in want.tolist()])
            np.testing.assert_array_equal(r.as_numpy("h_out").astype(np.float32), HALF.astype(np.float32))
        bad = tha.InferInput("s", [2, 1], "BYTES")
        bad.set_data_from_numpy(WORDS[:, :1], binary_data=True)
        bad.set_shape([2, 2])  # 2 elements for a shape of 4
        with pytest.raises(InferenceServerException, match="BYTES data ends before element 2 of 4"):
            await c.infer("echo", [bad, h])
    finally:
        await c.close()
        await fe.stop_listening()
        await fe.close()


def test_socket_raw_bytes_and_bf16() -> None:
    conn = SocketConnection(SocketFrontend(gateway(EchoController())))
    t = FakeTransport()
    conn.connection_made(t)  # type: ignore[arg-type]
    inputs: list[dict[str, Any]] = [
        {"name": "s", "datatype": "BYTES", "shape": [2, 2], "data": length_prefixed(WORDS)},
        {"name": "h", "datatype": "BF16", "shape": [2, 2], "data": HALF.tobytes()}]
    conn.data_received(frame({"op": "infer", "id": 1, "model": "echo", "inputs": inputs}))
    inputs[0]["data"] = inputs[0]["data"][:-1]
    conn.data_received(frame({"op": "infer", "id": 2, "model": "echo", "inputs": inputs}))
    ok, bad = t.frames()
    s_out, h_out = ok["outputs"]
    assert ok["status"] == 200 and s_out["data"] == length_prefixed(WORDS)
    assert h_out["data"] == HALF.tobytes()
    assert bad["status"] == 400 and "only 299 remain" in bad["error"]


async def test_grpc_raw_and_typed() -> None:
    fe = GrpcFrontend(gateway(EchoController()))
    port = await fe.start("127.0.0.1", 0)
    c = tga.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        s = tga.InferInput("s", [2, 2], "BYTES")
        s.set_data_from_numpy(WORDS)
        h = tga.InferInput("h", [2, 2], "BF16")
        h.set_data_from_numpy(HALF)
        r = await c.infer("echo", [s, h])
        assert r.as_numpy("s_out").tolist() == WORDS.tolist()
        np.testing.assert_array_equal(r.as_numpy("h_out").astype(np.float32), HALF.astype(np.float32))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            req = pb.ModelInferRequest(model_name="echo")
            req.inputs.add(name="s", datatype="BYTES", shape=[2, 2]).contents.bytes_contents.extend(WORDS.ravel())
            typed = req.inputs.add(name="h", datatype="BF16", shape=[2, 2])
            typed.contents.fp32_contents.extend(HALF.astype(np.float32).ravel())
            with pytest.raises(grpc.aio.AioRpcError, match="BF16 data must come in raw_input_contents") as e:
                await stub.ModelInfer(req)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            del req.inputs[1]
            req.raw_input_contents.extend([length_prefixed(WORDS), HALF.tobytes()])
            req.inputs[0].ClearField("contents")
            req.inputs.add(name="h", datatype="BF16", shape=[2, 2])
            resp = await stub.ModelInfer(req)
            assert resp.raw_output_contents[0] == length_prefixed(WORDS)
    finally:
        await c.close()
        await fe.close()


# ------------------------------------------------------------------ gRPC deadline and cancellation


async def test_grpc_deadline_becomes_the_request_deadline_and_cancels_it() -> None:
    ctl = EchoController(hold=True)
    fe = GrpcFrontend(gateway(ctl))
    port = await fe.start("127.0.0.1", 0)
    c = tga.InferenceServerClient(f"127.0.0.1:{port}")
    s = tga.InferInput("s", [1, 2], "BYTES")
    s.set_data_from_numpy(WORDS[:1])
    h = tga.InferInput("h", [1, 2], "BF16")
    h.set_data_from_numpy(HALF[:1])
    try:
        with pytest.raises(InferenceServerException) as e:
            await c.infer("echo", [s, h], client_timeout=0.5)  # the model's SLO is 1 s: the tighter one wins
        assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        await asyncio.wait_for(ctl.gone.wait(), 10)  # the passed deadline cancelled the held request
        (req,) = ctl.cancelled
        assert 0.3 < req.deadline - req.arrival <= 0.55  # what the deadline left when it arrived
        # a client that gives up cancels its request
        ctl.arrived.clear()
        ctl.gone.clear()
        call = asyncio.ensure_future(c.infer("echo", [s, h]))
        await asyncio.wait_for(ctl.arrived.wait(), 10)
        call.cancel()
        await asyncio.wait_for(ctl.gone.wait(), 10)
        assert ctl.cancelled[-1] is ctl.held[-1]
        assert abs(ctl.held[-1].deadline - ctl.held[-1].arrival - SPEC.slo_s) < 1e-6  # no gRPC deadline: the SLO
    finally:
        await c.close()
        await fe.close()


def test_our_socket_client_encodes_and_decodes_bytes_and_bf16() -> None:
    from daemon.client.wire import infer_message, infer_result

    conn = SocketConnection(SocketFrontend(gateway(EchoController())))
    t = FakeTransport()
    conn.connection_made(t)  # type: ignore[arg-type]
    conn.data_received(frame({"id": 5, **infer_message("echo", {"s": WORDS, "h": HALF})}))
    (answer,) = t.frames()
    r = infer_result(answer)
    assert r.outputs["s_out"].tolist() == WORDS.tolist()
    assert r.outputs["h_out"].dtype == ml_dtypes.bfloat16 and r.outputs["h_out"].tobytes() == HALF.tobytes()
