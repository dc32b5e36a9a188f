"""Fakes for protocol tests: a gateway over a fake controller, and transports that keep the bytes.

A frontend (daemon/api/) talks to nothing but the gateway (daemon/gateway.py). `FakeGateway` is
the real `Gateway` class (so it cannot drift from the interface the frontends use: admission,
deadlines, the prediction cache, shared memory, management) over a registry of the given model
specs, all READY, and a `FakeController` that answers each request at once (or holds it). A
protocol test then feeds bytes to a frontend's protocol object through `MockTransport` (HTTP,
uvicorn's style) or `FakeTransport` (the msgpack socket) and reads the bytes written back: no
socket, no daemon, no model.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import orjson

from daemon.api.http import HttpFrontend, answer_error
from daemon.api.httpserver import HttpConnection, HttpServer
from daemon.catalog import ModelCatalog, ModelState
from daemon.config import settings_from_dict
from daemon.gateway import Gateway, Health
from daemon.model import ModelSpec
from daemon.request import InferenceRequest, RequestStatus

Answer = Callable[[tuple[np.ndarray, ...]], tuple[np.ndarray, ...]]


def echo(inputs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    return inputs


class FakeController:
    """What the gateway submits to: answers every request at once with `answer(inputs)`, or keeps
    it (`hold`) until the test finishes it (`finish`) or it is cancelled."""

    def __init__(self, answer: Answer = echo) -> None:
        self.answer = answer
        self.hold = False
        self.submitted: list[InferenceRequest] = []
        self.held: list[InferenceRequest] = []
        self.cancelled: list[InferenceRequest] = []

    def submit(self, req: InferenceRequest) -> None:
        self.submitted.append(req)
        if self.hold:
            self.held.append(req)
        else:
            self.finish(req)

    def finish(self, req: InferenceRequest) -> None:
        req.outputs = self.answer(req.inputs)
        req.status = RequestStatus.SUCCEEDED
        if req.on_finish is not None:
            req.on_finish(req)

    def cancel(self, req: InferenceRequest) -> None:
        self.cancelled.append(req)


class FakeGateway(Gateway):
    """The gateway over `specs` (all READY) and a FakeController; `sections` are settings sections
    ({"server": {...}}). `ready` and `lag_s` stand for the daemon's health and its loop's lag."""

    def __init__(self, *specs: ModelSpec, answer: Answer = echo, **sections: dict[str, Any]) -> None:
        catalog = ModelCatalog()
        for spec in specs:
            catalog.add(spec, ModelState.READY)
        self.fake = FakeController(answer)
        self.ready = True
        super().__init__(settings_from_dict(sections), catalog, self.fake, health=lambda: Health(self.ready))

    def lag(self, seconds: float) -> None:
        """As if the event loop ran `seconds` behind (what the daemon's loop monitor measures)."""
        self.overload.last_s = self.overload.lag_s = seconds

    def statistics(self) -> dict[str, Any]:
        """The gateway's own figures (there is no scheduler behind a fake controller)."""
        o, m = self.overload, self.request_memory
        return {"loop": {"lag_ms": o.lag_s * 1e3, "max_lag_ms": o.max_s * 1e3, "shed": o.shed},
                "request_memory": {"held_bytes": m.held, "peak_bytes": m.peak, "limit_bytes": m.limit,
                                   "refused": m.refused}}


# ------------------------------------------------------------------ HTTP without a socket


class MockTransport:
    """An asyncio transport that keeps what the protocol writes (uvicorn's MockTransport)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.closed = False
        self.reading = True
        self.eof = False  # the protocol wrote its FIN (write_eof)

    def write(self, data: bytes) -> None:
        assert not self.closed, "a write after close"
        self.buffer += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def error(self) -> str:
        assert self.headers["content-type"] == "application/json", self.headers
        return str(self.json()["error"])


async def until(cond: Callable[[], bool], turns: int = 10_000) -> None:
    """Run the loop (no timer) until `cond` holds: a protocol test waits on state, never on time."""
    for _ in range(turns):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the protocol never reached the state")


def split_reply(data: bytes | bytearray) -> tuple[Reply, int] | None:
    """The first whole response in `data` and its length, or None while it is not all there."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    status_line, *lines = bytes(data[:end]).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    n = int(headers.get("content-length", "0"))
    if len(data) < end + 4 + n:
        return None
    return Reply(int(status_line.split(" ", 2)[1]), headers, bytes(data[end + 4 : end + 4 + n])), end + 4 + n


class HttpWire:
    """One connection to an HTTP frontend's protocol object, over a MockTransport. Make it inside
    a running loop (the server's tasks are the loop's)."""

    def __init__(self, frontend: HttpFrontend) -> None:
        s = frontend.settings
        # the server HttpFrontend.start makes, without its listener
        self.server = HttpServer(frontend.router, answer_error, max_body=s.max_body_bytes,
                                 max_connections=s.max_connections, keepalive_s=s.idle_timeout_s,
                                 write_timeout_s=s.write_timeout_s, request_timeout_s=s.request_timeout_s,
                                 memory=frontend.gateway.request_memory)
        self.transport = MockTransport()
        self.conn = HttpConnection(self.server)
        self.conn.connection_made(self.transport)  # type: ignore[arg-type]

    def send(self, data: bytes) -> None:
        self.conn.data_received(data)

    async def reply(self) -> Reply:
        """The next whole response written (the loop runs until it is)."""
        await until(lambda: split_reply(self.transport.buffer) is not None)
        got = split_reply(self.transport.buffer)
        assert got is not None
        reply, n = got
        del self.transport.buffer[:n]
        return reply

    async def call(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> Reply:
        self.send(http_request(method, path, body, headers))
        return await self.reply()


def http_request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# ------------------------------------------------------------------ the socket protocol


class FakeTransport:
    """What a SocketConnection writes to; `frames()` decodes the answers written so far."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def frames(self) -> list[dict[str, Any]]:
        out, buf = [], bytes(self.out)
        while buf:
            (n,) = struct.unpack(">I", buf[:4])
            out.append(msgpack.unpackb(buf[4 : 4 + n], raw=False))
            buf = buf[4 + n :]
        self.out.clear()
        return out
