"""The socket protocol, bytes in and bytes out, through a fake transport (no sockets, no loop)."""

from __future__ import annotations

import asyncio
import struct
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from daemon.api.uds import SocketConnection, SocketFrontend
from daemon.catalog import ModelCatalog, ModelState
from daemon.config import settings_from_dict
from daemon.datatypes import BY_NAME
from daemon.errors import BadRequest
from daemon.gateway import Gateway
from daemon.model import ModelSpec, TensorSpec
from daemon.request import InferenceRequest, RequestStatus
from tests.fakes import FakeTransport

FP32 = BY_NAME["FP32"]
SPEC = ModelSpec("sum", 1, Path("/x"), "pt2", (TensorSpec("x", FP32, (-1, 3)),), (TensorSpec("y", FP32, (-1, 1)),),
                 8, 0.1)


class InstantController:
    """Answers every request at once with the row sums of its input."""

    def __init__(self) -> None:
        self.cancelled: list[InferenceRequest] = []
        self.hold = False
        self.held: list[InferenceRequest] = []

    def submit(self, req: InferenceRequest) -> None:
        if self.hold:
            self.held.append(req)
            return
        req.outputs = (req.inputs[0].sum(axis=1, keepdims=True),)
        req.status = RequestStatus.SUCCEEDED
        req.on_finish(req)

    def cancel(self, req: InferenceRequest) -> None:
        self.cancelled.append(req)


Conn = tuple[SocketConnection, FakeTransport, InstantController]


def gateway(server: dict[str, Any], ctl: InstantController, cls: type[Gateway] = Gateway) -> Gateway:
    """A gateway serving SPEC over a fake controller: the frontend alone, no daemon."""
    catalog = ModelCatalog()
    catalog.add(SPEC, ModelState.READY)
    return cls(settings_from_dict({"server": server}), catalog, ctl)


@pytest.fixture
def conn() -> Conn:
    ctl = InstantController()
    c = SocketConnection(SocketFrontend(gateway({"max_body_bytes": 4096}, ctl)))
    t = FakeTransport()
    c.connection_made(t)  # type: ignore[arg-type]
    return c, t, ctl


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def infer(req_id: Any, rows: int = 1, **extra: Any) -> dict[str, Any]:
    x = np.arange(rows * 3, dtype="<f4").reshape(rows, 3)
    return {"op": "infer", "id": req_id, "model": "sum",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 3], "data": x.tobytes()}], **extra}


def test_a_frame_split_into_single_bytes_is_reassembled(conn: Conn) -> None:
    c, t, _ = conn
    for b in frame(infer(7, rows=2)):
        c.data_received(bytes([b]))
    (answer,) = t.frames()
    assert answer["id"] == 7 and answer["status"] == 200
    y = np.frombuffer(answer["outputs"][0]["data"], "<f4").reshape(answer["outputs"][0]["shape"])
    assert y.ravel().tolist() == [3.0, 12.0]


def test_many_frames_in_one_chunk_are_answered_by_id(conn: Conn) -> None:
    c, t, _ = conn
    c.data_received(b"".join(frame(infer(i)) for i in range(5)) + frame({"op": "live", "id": "x"}))
    answers = t.frames()
    assert [a["id"] for a in answers] == [0, 1, 2, 3, 4, "x"]
    assert all(a["status"] == 200 for a in answers)


@pytest.mark.parametrize(("payload", "status", "needle", "echo"), [
    (b"\xc1", 400, "malformed msgpack", None),
    (msgpack.packb([1, 2]), 400, "must hold a map", None),
    (msgpack.packb({"id": 3, "op": "dance"}), 400, "unknown op 'dance'", 3),
    (msgpack.packb({"id": 4, "op": "infer"}), 400, "infer needs a model name", 4),
    (msgpack.packb({"id": 5, "model": "nope", "inputs": []}), 404, "unknown model 'nope'", 5),
    (msgpack.packb({"id": 6, "model": "sum", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3],
                                                         "data": b"\0" * 11}]}), 400, "11 bytes of data", 6),
    (msgpack.packb({"id": 7, "model": "sum", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3],
                                                         "data": [1, 2, 3]}]}), 400, "must be raw bytes", 7),
    (msgpack.packb({"id": [1], "op": "live"}), 400, "id must be an integer or a string", None),
    (msgpack.packb({"id": 8, "model": "sum", "version": 3, "inputs": []}), 404, "has no version 3", 8),
])
def test_bad_frames_get_errors_and_the_connection_goes_on(conn: Conn, payload: bytes, status: int, needle: str,
                                                          echo: Any) -> None:
    c, t, _ = conn
    c.data_received(struct.pack(">I", len(payload)) + payload + frame(infer(99)))
    bad, ok = t.frames()
    assert bad["status"] == status and needle in bad["error"] and bad["id"] == echo
    assert ok["id"] == 99 and ok["status"] == 200
    assert not t.closed


def test_a_frame_over_the_limit_closes_the_connection(conn: Conn) -> None:
    c, t, _ = conn
    c.data_received(struct.pack(">I", 10**6) + b"\0" * 100)
    (answer,) = t.frames()
    assert answer["status"] == 413 and "over the limit" in answer["error"]
    assert t.closed  # nothing was in flight: closed at once
    c.data_received(frame(infer(1)))  # nothing more is read from a closed connection
    assert t.frames() == []


def test_control_ops(conn: Conn) -> None:
    c, t, _ = conn
    for op in ("live", "ready", "index"):
        c.data_received(frame({"op": op, "id": op}))
    c.data_received(frame({"op": "metadata", "id": "m", "model": "sum"}))
    live, ready, index, meta = t.frames()
    assert live["live"] is True
    assert ready["ready"] is True  # what the gateway's health says (a fake gateway is always ready)
    assert index["models"] == [{"name": "sum", "version": "1", "state": "READY"}]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]


def test_a_lost_connection_cancels_its_requests(conn: Conn) -> None:
    c, _, ctl = conn
    ctl.hold = True
    c.data_received(frame(infer(1)) + frame(infer(2)))
    c.connection_lost(None)
    assert [r.id for r in ctl.cancelled] == [r.id for r in ctl.held]
    assert len(ctl.cancelled) == 2


def test_reading_pauses_while_the_client_does_not_read(conn: Conn) -> None:
    c, t, _ = conn
    c.pause_writing()
    assert not t.reading
    c.data_received(frame(infer(1)))
    assert t.frames() == []  # buffered, not handled, while paused
    c.resume_writing()
    assert t.reading
    assert [a["id"] for a in t.frames()] == [1]


# ------------------------------------------------------------------ request memory and fairness


def make(server: dict[str, Any], cls: type[Gateway] = Gateway) -> tuple[Gateway, SocketFrontend, InstantController]:
    ctl = InstantController()
    ctl.hold = True
    gw = gateway({"max_body_bytes": 4096, **server}, ctl, cls)
    return gw, SocketFrontend(gw), ctl


def connect(frontend: SocketFrontend) -> tuple[SocketConnection, FakeTransport]:
    c = SocketConnection(frontend)
    t = FakeTransport()
    c.connection_made(t)  # type: ignore[arg-type]
    return c, t


def finish(req: InferenceRequest) -> None:
    req.outputs = (req.inputs[0].sum(axis=1, keepdims=True),)
    req.status = RequestStatus.SUCCEEDED
    assert req.on_finish is not None
    req.on_finish(req)


PAD = b"p" * 1500  # makes a frame of ~1.6 KB (an unknown key is ignored)


async def test_a_connection_past_its_share_of_memory_stops_reading_until_a_request_finishes() -> None:
    daemon, fe, ctl = make({"connection_memory_bytes": 4096})
    c, t = connect(fe)
    c.data_received(b"".join(frame(infer(i, pad=PAD)) for i in range(4)))
    assert len(ctl.held) == 3 and not t.reading  # 3 x 1.6 KB passed the 4 KB share: the 4th waits
    held = daemon.request_memory.held
    assert held == sum(len(frame(infer(i, pad=PAD))) - 4 for i in range(3))
    finish(ctl.held.pop(0))
    await asyncio.sleep(0)  # the connection goes on in a turn of its own
    assert len(ctl.held) == 3 and [a["id"] for a in t.frames()] == [0]
    finish(ctl.held.pop(0))
    await asyncio.sleep(0)
    assert t.reading and len(ctl.held) == 2


async def test_past_the_daemons_request_memory_a_connection_waits_unread_then_goes_on() -> None:
    daemon, fe, ctl = make({"connection_memory_bytes": 4096, "request_memory_bytes": 6000})
    a, _ = connect(fe)
    b, tb = connect(fe)
    a.data_received(b"".join(frame(infer(i, pad=PAD)) for i in range(3)))  # 4.8 KB of the 6 KB
    b.data_received(frame(infer("b", pad=PAD)))
    assert len(ctl.held) == 3 and not tb.reading and tb.frames() == []  # not refused: waiting
    finish(ctl.held.pop(0))  # memory frees: b is woken
    await asyncio.sleep(0)
    assert ctl.held[-1].context[0] == "b" and tb.reading
    for r in list(ctl.held):
        finish(r)
    assert daemon.request_memory.held == 0 and daemon.request_memory.peak <= 6000


async def test_one_connection_has_at_most_its_cap_of_requests_in_flight() -> None:
    _, fe, ctl = make({"max_inflight_per_connection": 2})
    c, t = connect(fe)
    c.data_received(b"".join(frame(infer(i)) for i in range(5)))
    assert len(ctl.held) == 2 and not t.reading and t.frames() == []  # back-pressure, not refusals
    finish(ctl.held.pop(0))
    await asyncio.sleep(0)
    assert len(ctl.held) == 2 and [a["id"] for a in t.frames()] == [0]


def test_a_frame_over_the_limit_after_requests_answers_them_then_closes() -> None:
    daemon, fe, ctl = make({})
    c, t = connect(fe)
    c.data_received(frame(infer(7)) + struct.pack(">I", 10**6) + b"\0" * 100)
    (refusal,) = t.frames()
    assert refusal["status"] == 413 and refusal["id"] is None
    assert not t.closed and not t.reading  # reads nothing more, but request 7 is still owed its answer
    c.data_received(frame(infer(8)))  # the rest of the stream cannot be framed: dropped
    assert len(ctl.held) == 1
    finish(ctl.held.pop())
    (answer,) = t.frames()
    assert answer["id"] == 7 and answer["status"] == 200
    assert t.closed and daemon.request_memory.held == 0


def test_a_request_finishing_while_its_connection_closes_releases_its_memory() -> None:
    daemon, fe, ctl = make({})
    c, _ = connect(fe)
    c.data_received(frame(infer(1)))
    (req,) = ctl.held
    c.close()  # closing: connection_lost comes later, from the loop
    finish(req)  # ... and the request finishes in between
    assert daemon.request_memory.held == 0
    c.connection_lost(None)
    assert daemon.request_memory.held == 0


def test_a_lost_connection_releases_its_memory_at_once() -> None:
    daemon, fe, ctl = make({})
    c, _ = connect(fe)
    big = frame(infer(9, pad=PAD))
    c.data_received(frame(infer(1)) + big[:100])  # one request held, one frame half received
    assert daemon.request_memory.held == len(frame(infer(1))) - 4 + len(big) - 4
    c.connection_lost(None)
    assert daemon.request_memory.held == 0
    assert [r.id for r in ctl.cancelled] == [ctl.held[0].id]  # and its request is cancelled


@pytest.mark.parametrize(("obj", "needle"), [
    ({"id": 1, **{f"k{i}": i for i in range(100)}}, "malformed msgpack frame"),  # a map past max_map_len
    ({"id": 1, "x": list(range(5000))}, "malformed msgpack frame"),  # an array past max_array_len
    ({"id": 1, "x": [[i] * 900 for i in range(90)]}, "more than 4096 msgpack objects"),  # many small arrays
])
def test_frames_that_would_build_many_objects_are_refused_before_decoding(obj: Any, needle: str) -> None:
    _, fe, ctl = make({"max_body_bytes": 1 << 20})
    ctl.hold = False
    c, t = connect(fe)
    c.data_received(frame(obj) + frame(infer(2)))
    bad, ok = t.frames()
    assert bad["status"] == 400 and needle in bad["error"], bad
    assert ok["id"] == 2 and ok["status"] == 200


def test_counting_objects_matches_msgpack() -> None:
    from daemon.api.uds import count_objects
    obj = {"id": 1, "f": 1.5, "n": None, "t": True, "neg": -5, "big": 2**40, "s": "a" * 300, "b": b"x" * 70000,
           "arr": list(range(20)), "nested": [{"a": [1, 2]}, -1000]}
    payload = msgpack.packb(obj, use_bin_type=True)
    # the map, its 10 keys and 10 values, 20 ints inside arr, and inside nested: {"a": [1, 2]}, -1000 (6)
    assert count_objects(payload, 4096) == 1 + 2 * 10 + 20 + 6
    with pytest.raises(BadRequest, match="ends inside an object"):
        count_objects(b"\x92\x01", 10)  # an array of two holding one
    with pytest.raises(BadRequest, match="starts no object"):
        count_objects(b"\xc1", 10)


def test_a_frame_not_whole_in_time_is_refused_and_its_memory_released() -> None:
    daemon, fe, ctl = make({})
    c, t = connect(fe)
    c.data_received(frame(infer(3)))  # answered later
    big = frame(infer(9, pad=PAD))
    c.data_received(big[:10])  # a frame begun (its length charged) and then dripped, or never finished
    assert c.frame_begun is not None and daemon.request_memory.held > len(frame(infer(3)))
    c.frame_too_slow(60.0)  # what the sweep does once server.request_timeout_s has passed
    (refusal,) = t.frames()
    assert refusal["status"] == 408 and "request_timeout_s" in refusal["error"]
    assert not t.closed and not t.reading  # request 3 is still owed its answer
    finish(ctl.held.pop())
    (answer,) = t.frames()
    assert answer["id"] == 3 and t.closed and daemon.request_memory.held == 0


def test_the_sweep_refuses_a_frame_begun_too_long_ago() -> None:
    daemon, fe, _ = make({"request_timeout_s": 0.05, "idle_timeout_s": 60.0})
    c, t = connect(fe)
    c.data_received(frame(infer(9, pad=PAD))[:10])
    assert not t.closed and daemon.request_memory.held > 0
    fe.sweep(time.monotonic() + 0.06)  # one pass, as the sweeper makes it once request_timeout_s has passed
    assert t.closed and t.frames()[0]["status"] == 408 and daemon.request_memory.held == 0


async def test_ops_answered_later_count_in_flight_and_hold_their_memory() -> None:
    """`feedback` and the application ops are answered by a task of their own: they take the same
    back-pressure as inferences (an application's query once let a client pipeline without bound)."""
    waiting: list[asyncio.Future[dict[str, Any]]] = []

    class HeldFeedback(Gateway):  # (a subclass, not a patched method: the gateway is compiled)
        async def feedback(self, name: str, version: str | int | None, query_id: Any, label: Any
                           ) -> dict[str, Any]:
            fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            waiting.append(fut)
            return await fut

    gw, fe, _ = make({"max_inflight_per_connection": 2}, HeldFeedback)
    c, t = connect(fe)
    c.data_received(b"".join(frame({"op": "feedback", "id": i, "model": "sum", "query_id": "q", "label": 1,
                                    "pad": PAD}) for i in range(5)))
    await asyncio.sleep(0)
    assert len(waiting) == 2 and not t.reading and t.frames() == []
    assert gw.request_memory.held > 2 * len(PAD)  # their frames' memory is held while they wait
    waiting[0].set_result({"updates": 1})
    for _ in range(5):  # the op ends, its callback frees its place, the next frame is read, its op starts
        await asyncio.sleep(0)
    answered = [a["id"] for a in t.frames()]
    assert answered == [0] and len(waiting) == 3
    for _ in range(3):  # at most two more ops start per round
        for fut in waiting:
            if not fut.done():
                fut.set_result({"updates": 1})
        for _ in range(5):
            await asyncio.sleep(0)
        answered += [a["id"] for a in t.frames()]
    assert sorted(answered) == [0, 1, 2, 3, 4] and len(waiting) == 5
    assert gw.request_memory.held == 0 and t.reading
