"""The unix-socket frontend: length-prefixed msgpack frames, many requests in flight per connection.

A frame is a 4-byte big-endian length followed by that many bytes of one msgpack map. Every
request carries an `id` that its response echoes; responses come back in completion order,
not request order. Statuses are the HTTP ones. The format is documented in
docs/socket-protocol.md.

A malformed frame (bad msgpack, not a map, bad fields) gets an error response and the
connection goes on, since framing is intact; a frame whose length is over the limit cannot be
skipped safely, so it gets an error response and the connection is closed. A client that
half-closes (shuts down its sending side) still gets the answers to what it sent; then the
connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from daemon.api.budget import Lease
from daemon.api.codec import (
    WireTensor,
    assemble_inputs,
    check_shape,
    region_tensor,
    request_options,
    select_outputs,
    tensor_bytes,
)
from daemon.api.metadata import model_config_json, model_metadata_json
from daemon.api.sharedmem import OutputTargets, ShmRef, shm_ref
from daemon.apps.personal import check_user
from daemon.catalog import ModelState
from daemon.errors import (
    BadRequest,
    EscapementError,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    message_of,
    retry_after_of,
    status_of,
)
from daemon.gateway import Gateway
from daemon.model import ModelSpec
from daemon.request import InferenceRequest

log = logging.getLogger("escapement.socket")

LENGTH = struct.Struct(">I")
HIGH_WATER = 4 * 2**20  # bytes of unsent responses after which the connection stops reading
FRAMES_PER_TURN = 64  # frames handled per event-loop turn (~1-2 ms of decoding and admission)
# Decoding builds one Python object per msgpack object, all while holding the loop: a frame's
# cost is bounded by its object count, not its bytes (a 10 MiB map of a million keys took a
# second). A request is a few dozen objects around large binary payloads.
SCAN_ABOVE = 64 * 1024  # frames larger than this have their objects counted before decoding
MAX_OBJECTS = 4096
REHEARSE_MAX_BYTES = 64 * 1024  # a frame, or an answer's outputs, kept for keep-warm's replay at most
UNPACK_LIMITS: dict[str, int] = {"max_map_len": 64, "max_array_len": 1024, "max_str_len": 65536, "max_ext_len": 0}


# The bytes after each msgpack type byte: fixed sizes, or (length bytes, extra) for str/bin/ext.
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2,
          0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1), 0xD9: (1, 0),
          0xDA: (2, 0), 0xDB: (4, 0)}
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # (length bytes, children per item)


def count_objects(frame: bytes, limit: int) -> int:
    """The number of msgpack objects in `frame`, walking headers only (payloads are skipped, not
    read); BadRequest past `limit`, so the walk itself costs at most `limit` steps."""
    pos, todo, count, end = 0, 1, 0, len(frame)
    while todo:
        todo -= 1
        count += 1
        if count > limit:
            raise BadRequest(f"the frame holds more than {limit} msgpack objects; a request needs a few dozen "
                             "(send tensors as bin)")
        if pos >= end:
            raise BadRequest("malformed msgpack frame: it ends inside an object")
        b = frame[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0:
            continue
        if b <= 0x8F:
            todo += 2 * (b & 0x0F)
        elif b <= 0x9F:
            todo += b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            pos += width + extra + int.from_bytes(frame[pos : pos + width], "big")
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            todo += per * int.from_bytes(frame[pos : pos + width], "big")
            pos += width
        else:
            raise BadRequest(f"malformed msgpack frame: byte 0x{b:02x} at {pos - 1} starts no object")
    return count


def pack_frame(obj: dict[str, Any]) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return LENGTH.pack(len(payload)) + payload


def error_frame(req_id: Any, exc: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {"id": req_id, "status": status_of(exc), "error": message_of(exc)}
    retry = retry_after_of(exc)
    if retry is not None:
        out["retry_after_s"] = retry
    return out


class SocketConnection(asyncio.Protocol):
    def __init__(self, frontend: SocketFrontend) -> None:
        self.frontend = frontend
        self.gateway = frontend.gateway
        self.settings = frontend.settings
        self.max_frame = frontend.settings.max_body_bytes
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._inflight: dict[int, InferenceRequest] = {}  # internal request id -> request
        self._tasks: set[asyncio.Task[None]] = set()  # ops answered later (feedback)
        self.share = frontend.gateway.request_memory.share()
        self._frame_lease: Lease | None = None  # the frame being received, charged whole from its length
        self._starved = False  # the daemon's request memory cannot take the next frame: not reading
        self._cap = frontend.settings.max_inflight_per_connection
        self._stalled = False  # frames wait for its requests to finish (_held)
        self._closed = False
        self._paused = False  # the client is not reading its answers
        self._yielded = False  # a turn's worth of frames handled; the rest waits for the next turn
        self._reading = True
        self._eof = False  # the client half-closed
        self._input_done = False  # ... and every frame it sent is handled: close once all are answered
        self._discarding = False  # a frame over the limit: nothing more is read
        self.frame_begun: float | None = None  # when the frame being received began (None: between frames)
        self.last_active = 0.0  # when it last sent bytes or got an answer (the idle sweep reads it)
        self.write_blocked_since: float | None = None  # the client stopped reading its answers at

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses
        self.transport.set_write_buffer_limits(high=HIGH_WATER)  # type: ignore[union-attr]  # set just above
        limit = self.settings.max_connections
        if len(self.frontend.connections) >= limit:
            self.frontend.refused += 1
            self.send(error_frame(None, Overloaded(f"the server holds {limit} socket connections, its limit "
                                                   "(server.max_connections); retry later")))
            self.close()
            return
        self.frontend.connections.add(self)
        self.last_active = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self.frontend.connections.discard(self)
        self.gateway.request_memory.forget(self)
        for req in list(self._inflight.values()):
            self.gateway.cancel(req)
            req.context[2].release()
            req.context[3].release()  # its regions (the request's answer is never written now)
        self._inflight.clear()
        if self._frame_lease is not None:
            self._frame_lease.release()
            self._frame_lease = None
        self._buf = bytearray()

    def pause_writing(self) -> None:  # the client is not reading: stop taking its requests
        self._paused = True
        self.write_blocked_since = time.monotonic()
        self._want_reading()

    def resume_writing(self) -> None:
        self._paused = False
        self.write_blocked_since = None
        self._want_reading()
        self._pump()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self._discarding:
            return
        self._buf += data
        self._pump()

    def eof_received(self) -> bool:
        """The client has finished sending (a half-close), but may still read: answer what it sent,
        then close. Returning False would close now and cancel its requests unanswered."""
        self._eof = True
        self._pump()
        return True

    # ---------------------------------------------------------------- frames

    def _want_reading(self) -> None:
        """Read from the client only while its answers drain, no turn of frames is pending and its
        requests fit in the request memory (its share, and the daemon's total)."""
        want = not (self._paused or self._yielded or self._starved or self._discarding or self._held())
        if self.transport is not None and not self._closed and want != self._reading:
            self._reading = want
            if want:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def _pump(self) -> None:
        """Handle the whole frames buffered, FRAMES_PER_TURN at a time: a client that pipelines
        thousands of frames in one write must not hold the event loop (and every other client,
        timer and the controller) for the tens of milliseconds they take."""
        if self._paused or self._yielded or self._closed or self._starved or self._discarding:
            return
        if self._drain_frames(FRAMES_PER_TURN):
            self._yielded = True
            self._want_reading()
            asyncio.get_running_loop().call_soon(self._next_turn)
            return
        self._stalled = self._held()
        self._want_reading()  # its share may have filled (or emptied)
        if self._eof and not self._paused and not self._starved and not self._held():
            self._after_eof()

    def _held(self) -> bool:
        """It holds its share of memory, or as many requests as one connection may have in flight:
        the next frame waits (unread) for one of them to finish, so one connection cannot take every
        pending slot, and a client that pipelines gets back-pressure rather than refusals."""
        return self.share.full or len(self._inflight) + len(self._tasks) >= self._cap

    def _busy(self) -> bool:
        """Requests or ops (answered later) still to answer: the connection stays open for them."""
        return bool(self._inflight or self._tasks)

    def _next_turn(self) -> None:
        self._yielded = False
        self._want_reading()
        self._pump()

    def _after_eof(self) -> None:
        self._input_done = True
        if self._buf:  # a frame that can never complete now
            self.send(error_frame(None, BadRequest(
                f"the connection ended inside a frame ({len(self._buf)} bytes of it received)")))
            self._buf.clear()
        if not self._busy():
            self.close()

    def _drain_frames(self, limit: int) -> bool:
        """Handle up to `limit` whole frames; True when it stopped at the limit with more buffered."""
        buf = self._buf
        handled = 0
        while len(buf) >= 4 and not self._closed and not self._paused and not self._held():
            if handled == limit:
                return True
            (n,) = LENGTH.unpack_from(buf)
            if n > self.max_frame:
                # The rest of the stream cannot be framed without reading the whole frame: read no
                # more, answer the requests sent before it, then close.
                self.send(error_frame(None, PayloadTooLarge(
                    f"frame of {n} bytes is over the limit of {self.max_frame} (server.max_body_bytes); "
                    "closing the connection once the requests before it are answered")))
                self._discarding = True
                self._input_done = True
                buf.clear()
                self._want_reading()
                if not self._busy():
                    self.close()
                return False
            lease = self._frame_lease
            if lease is None:
                lease = self.share.lease()
                if not lease.take(n):  # wait, not reading, until requests finish and memory frees
                    self._starved = True
                    self._want_reading()
                    self.gateway.request_memory.wait(self, self._memory_freed)
                    return False
                self._frame_lease = lease
                self.frame_begun = time.monotonic()
            if len(buf) < 4 + n:
                return False
            self._frame_lease = None
            self.frame_begun = None
            frame = bytes(buf[4 : 4 + n])
            del buf[: 4 + n]
            self._handle(frame, lease)
            handled += 1
        return False

    def frame_too_slow(self, limit_s: float) -> None:
        """A frame begun `limit_s` ago is still not whole: say so, read no more, answer what came
        before it and close (its memory is released then)."""
        self.send(error_frame(None, RequestTimeout(
            f"a frame was not received whole within {limit_s:g} s (server.request_timeout_s); closing the "
            "connection once the requests before it are answered")))
        self.frame_begun = None
        self._discarding = True
        self._input_done = True
        self._buf.clear()
        if self._frame_lease is not None:
            self._frame_lease.release()
            self._frame_lease = None
        self._want_reading()
        if not self._busy():
            self.close()

    def _memory_freed(self) -> None:
        if self._closed:
            return
        self._starved = False
        self._want_reading()
        asyncio.get_running_loop().call_soon(self._pump)

    def send(self, obj: dict[str, Any]) -> None:
        if self.transport is not None and not self._closed:
            self.transport.write(pack_frame(obj))

    def close(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection and what it has in flight (its client stopped reading answers)."""
        if self.transport is not None:
            self.transport.abort()  # connection_lost cancels its requests

    def _handle(self, frame: bytes, lease: Lease) -> None:
        """Decode and act on one frame; `lease` (its bytes) passes to the request it makes, or is
        released here."""
        req_id: Any = None
        try:
            if len(frame) > SCAN_ABOVE:
                count_objects(frame, MAX_OBJECTS)
            try:
                msg = msgpack.unpackb(frame, raw=False, max_bin_len=self.max_frame, **UNPACK_LIMITS)
            except Exception as e:  # msgpack raises several types for bad bytes
                raise BadRequest(f"malformed msgpack frame: {type(e).__name__}: {e}") from None
            if not isinstance(msg, dict):
                raise BadRequest(f"a frame must hold a map, not {type(msg).__name__}")
            req_id = msg.get("id")
            if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, int | str)):
                req_id = None
                raise BadRequest("id must be an integer or a string")
            limit = self.settings.max_request_id_bytes
            if isinstance(req_id, str) and len(req_id.encode()) > limit:
                req_id = None  # not echoed: it is what the limit keeps from being held
                raise BadRequest(f"id is longer than {limit} bytes (server.max_request_id_bytes)")
            op = msg.get("op", "infer")
            if op == "infer":
                if self._infer(req_id, msg, lease):
                    self.frontend.rehearsal.heard(frame)
                return
            if op in ASYNC_OPS:
                self._async_op(req_id, op, msg, lease)  # the op holds the frame's memory until answered
                return
            self._control_op(req_id, op, msg)
        except EscapementError as e:
            self.send(error_frame(req_id, e))
        except Exception as e:  # never let one frame kill the connection's other requests
            log.exception("socket frame failed")
            self.send(error_frame(req_id, e))
        lease.release()

    def _control_op(self, req_id: Any, op: Any, msg: dict[str, Any]) -> None:
        """Answer a control op (a frontend worker forwards some to the controller process instead)."""
        self.send({"id": req_id, "status": 200, **control_answer(self.gateway, op, msg)})

    def _async_op(self, req_id: Any, op: str, msg: dict[str, Any], lease: Lease) -> None:
        """An op answered later (feedback waits for its commit, an application for its models): the
        connection goes on meanwhile, the op counted in flight and holding its frame's memory, so a
        client pipelining them gets the same back-pressure as one pipelining inferences."""
        task = asyncio.get_running_loop().create_task(self._answer_later(req_id, op, msg), name=f"socket {op}")
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._async_done, lease))

    def _async_done(self, lease: Lease, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        lease.release()
        if self._closed:
            return
        if self._input_done and not self._busy():
            self.close()
        elif self._stalled and not self._held():
            self._stalled = False
            asyncio.get_running_loop().call_soon(self._pump)

    async def _answer_later(self, req_id: Any, op: str, msg: dict[str, Any]) -> None:
        try:
            body = await async_answer(self.gateway, op, msg)
        except EscapementError as e:
            self.send(error_frame(req_id, e))
            return
        except Exception as e:  # answered, whatever happened: the client waits for this id
            log.exception("socket op %s failed", op)
            self.send(error_frame(req_id, e))
            return
        self.send({"id": req_id, "status": 200, **body})

    # ---------------------------------------------------------------- inference

    def _infer(self, req_id: Any, msg: dict[str, Any], lease: Lease) -> bool:
        """Submit an infer frame's request; True if it names no shared-memory region (keep-warm may
        replay such a frame: Rehearsal)."""
        p = parse_infer(self.gateway, msg)
        targets = p.targets
        try:
            lease.force(p.copied)  # read from shared memory: new memory (bytes inputs view the frame)
            req = self.gateway.new_request(p.spec, p.arrays, p.samples, p.timeout_us, p.priority, "")
            req.user = p.user
            req.context = (req_id, p.out_idx, lease, targets)
            req.on_finish = self._finished
            self._inflight[req.id] = req
            try:
                self.gateway.submit(req)
            except BaseException:
                self._inflight.pop(req.id, None)
                raise
        except BaseException:
            targets.release()
            raise
        return not p.copied and not targets

    def _finished(self, req: InferenceRequest) -> None:
        self._inflight.pop(req.id, None)
        lease: Lease = req.context[2]
        targets: OutputTargets = req.context[3]
        if self._closed:  # closing, connection_lost not yet run: it no longer sees this request
            lease.release()
            targets.release()
            return
        self.last_active = time.monotonic()
        try:
            self._answer(req)
        finally:
            lease.release()
            targets.release()
            if self._input_done and not self._busy():
                self.close()
            elif self._stalled and not self._held():
                # it stopped for its share or its cap; go on in a turn of its own, not inside _handle
                self._stalled = False
                asyncio.get_running_loop().call_soon(self._pump)

    def _answer(self, req: InferenceRequest) -> None:
        req_id, out_idx, _, targets = req.context
        if not req.ok:
            if req.error is not None:
                self.send(error_frame(req_id, req.error))
            return
        try:
            body = answer_body(req, out_idx, targets)
        except EscapementError as e:  # an output that does not fit its region
            self.send(error_frame(req_id, e))
            return
        self.send({"id": req_id, "status": 200, **body})
        if not targets:
            self.frontend.rehearsal.answered(req)


@dataclass(slots=True)
class ParsedInfer:
    """An infer frame, checked. `targets` are pinned: whoever parsed it releases them."""

    spec: ModelSpec
    arrays: tuple[np.ndarray, ...]
    samples: int
    out_idx: list[int]
    targets: OutputTargets
    timeout_us: int | None
    priority: int | None
    copied: int  # bytes of inputs read from shared memory
    user: str = ""  # a personalized model's user (daemon/apps/personal.py)


def parse_infer(gw: Gateway, msg: dict[str, Any]) -> ParsedInfer:
    """An infer frame, checked: its model, inputs (bytes, or read from shared-memory regions), the
    outputs wanted and the regions they go to, timeout, priority."""
    name = msg.get("model")
    if not isinstance(name, str):
        raise BadRequest("infer needs a model name")
    spec = gw.admit(name, _version(msg))
    raw_inputs = msg.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequest("inputs must be a non-empty list")
    tensors: list[WireTensor] = []
    copied = 0
    for i, t in enumerate(raw_inputs):
        if not isinstance(t, dict):
            raise BadRequest(f"inputs[{i}] must be a map")
        tname, dt, data = t.get("name"), t.get("datatype"), t.get("data")
        if not isinstance(tname, str) or not isinstance(dt, str):
            raise BadRequest(f"inputs[{i}] needs a string name and datatype")
        shape = check_shape(t.get("shape"), tname)
        ref = shm_ref(_params(t, f"input {tname}"), f"input {tname}")
        if ref is not None:
            if data is not None:
                raise BadRequest(f"input {tname}: data given beside shared_memory_region")
            tensors.append(region_tensor(tname, dt, shape, gw.shared_memory.read(ref, f"input {tname}")))
            copied += ref.byte_size
            continue
        if not isinstance(data, bytes):
            raise BadRequest(f"input {tname}: data must be raw bytes (msgpack bin)")
        tensors.append(WireTensor(tname, dt, shape, raw=data))
    arrays, samples = assemble_inputs(spec, tensors)
    wanted = msg.get("outputs")
    if wanted is not None and not isinstance(wanted, list):
        raise BadRequest("outputs must be a list of names (or of maps with a name and parameters)")
    names: list[str] | None = None
    refs: list[ShmRef | None] = []
    if wanted is not None:
        names = []
        for w in wanted:
            if isinstance(w, dict) and isinstance(w.get("name"), str):
                names.append(w["name"])
                refs.append(shm_ref(_params(w, f"output {w['name']}"), f"output {w['name']}"))
            elif isinstance(w, str):
                names.append(w)
                refs.append(None)
            else:
                raise BadRequest("outputs must be a list of names (or of maps with a name and parameters)")
    # a model without [personalization] ignores a user, as it does keys it does not know
    user = check_user(msg["user"]) if msg.get("user") is not None and spec.personalization else ""
    out_idx = select_outputs(spec, names, bool(user))
    timeout_us, priority = request_options(msg.get("timeout_us"), msg.get("priority"))
    targets = OutputTargets(gw.shared_memory)
    try:
        for i, ref in zip(out_idx, refs, strict=False):
            if ref is not None:
                targets.add(i, ref, f"output {spec.served_outputs[i].name}")
    except BaseException:
        targets.release()
        raise
    return ParsedInfer(spec, arrays, samples, out_idx, targets, timeout_us, priority, copied, user)


def _params(t: dict[str, Any], what: str) -> dict[str, Any]:
    p = t.get("parameters") or {}
    if not isinstance(p, dict):
        raise BadRequest(f"{what}: parameters must be a map")
    return p


def answer_body(req: InferenceRequest, out_idx: list[int], targets: OutputTargets) -> dict[str, Any]:
    """An answered request's frame (less id and status): outputs as bytes, or where in their regions
    they were written."""
    assert req.outputs is not None
    return answer_fields(req.model, req.outputs, out_idx, targets, req.reconstructed, req.cached, req.defaulted,
                         req.query_id)


def answer_fields(spec: ModelSpec, outputs: Sequence[np.ndarray], out_idx: list[int], targets: OutputTargets,
                  reconstructed: bool, cached: bool, defaulted: bool, query_id: str) -> dict[str, Any]:
    """`answer_body` from the fields of the answer it encodes."""
    items: list[dict[str, Any]] = []
    for i in out_idx:
        o, arr = spec.served_outputs[i], outputs[i]
        item: dict[str, Any] = {"name": o.name, "datatype": o.datatype.name, "shape": list(arr.shape)}
        written = targets.write(i, arr, f"output {o.name}") if targets else None
        if written is None:
            item["data"] = tensor_bytes(arr)
        else:
            item["parameters"] = written
        items.append(item)
    body = {"model": spec.name, "version": str(spec.version), "outputs": items, "reconstructed": reconstructed,
            "cached": cached}
    if defaulted:  # its model's default_output: no answer could make the deadline
        body["default"] = True
    if query_id:  # personalized: feedback names this query
        body["query_id"] = query_id
    return body


async def infer_answer(gw: Gateway, msg: dict[str, Any]) -> dict[str, Any]:
    """Answer an infer frame a frontend worker forwarded (it names a region: the regions are here)."""
    p = parse_infer(gw, msg)
    try:
        req = gw.new_request(p.spec, p.arrays, p.samples, p.timeout_us, p.priority, "")
        req.user = p.user
        await gw.infer(req)
        return answer_body(req, p.out_idx, p.targets)
    finally:
        p.targets.release()


# answered when done (async_answer), not at once; a frontend worker forwards them all
ASYNC_OPS = ("feedback", "user", "app_infer", "app_feedback", "app_status", "apps")


async def async_answer(gw: Gateway, op: str, msg: dict[str, Any]) -> dict[str, Any]:
    """The answer to a personalized model's op: `feedback` (query_id, label) or `user` (user); or an
    application's (docs/applications.md)."""
    if op.startswith("app"):
        return await app_answer(gw, op, msg)
    name = msg.get("model")
    if not isinstance(name, str):
        raise BadRequest(f"op {op} needs a model name")
    if op == "feedback":
        if "label" not in msg:
            raise BadRequest("op feedback needs a query_id and a label")
        return await gw.feedback(name, _version(msg), msg.get("query_id"), msg["label"])
    return await gw.user(name, _version(msg), msg.get("user"))


async def app_answer(gw: Gateway, op: str, msg: dict[str, Any]) -> dict[str, Any]:
    """`app_infer` (app, inputs, timeout_us, priority), `app_feedback` (app, query_id, label or
    reward), `app_status` (app) and `apps` (the index)."""
    if op == "apps":
        return {"applications": gw.apps.index()}
    name = msg.get("app")
    if not isinstance(name, str):
        raise BadRequest(f"op {op} needs an application name (app)")
    if op == "app_status":
        return gw.apps.status(name)
    if op == "app_feedback":
        return await gw.apps.feedback(name, msg.get("query_id"), msg.get("label"), msg.get("reward"))
    specs = gw.admit_app(name)
    raw_inputs = msg.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequest("inputs must be a non-empty list")
    tensors: list[WireTensor] = []
    for i, t in enumerate(raw_inputs):
        if not isinstance(t, dict):
            raise BadRequest(f"inputs[{i}] must be a map")
        tname, dt, data = t.get("name"), t.get("datatype"), t.get("data")
        if not isinstance(tname, str) or not isinstance(dt, str):
            raise BadRequest(f"inputs[{i}] needs a string name and datatype")
        if not isinstance(data, bytes):
            raise BadRequest(f"input {tname}: data must be raw bytes (msgpack bin)")
        tensors.append(WireTensor(tname, dt, check_shape(t.get("shape"), tname), raw=data))
    arrays, samples = assemble_inputs(specs[0], tensors)
    timeout_us, priority = request_options(msg.get("timeout_us"), msg.get("priority"))
    ans = await gw.apps.infer(name, specs, arrays, samples, timeout_us, priority, "")
    o = ans.output_spec
    return {"app": name, "outputs": [{"name": o.name, "datatype": o.datatype.name, "shape": list(ans.output.shape),
                                      "data": tensor_bytes(ans.output)}], **ans.parameters()}


def control_answer(gw: Gateway, op: Any, msg: dict[str, Any]) -> dict[str, Any]:
    """The answer to a control op (every op but infer), from the gateway."""
    if op == "live":
        return {"live": True}
    if op == "ready":
        return {"ready": gw.health().ready}
    if op == "index":
        return {"models": gw.index(bool(msg.get("ready", False)))}
    if op == "stats":
        return {"controller": gw.statistics()}
    if op == "forecast":
        limit = msg.get("limit", 1024)
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise BadRequest("op forecast: limit must be an integer")
        return {"forecast": gw.forecast(limit)}
    if op in ("shm_register", "shm_unregister", "shm_status"):
        return _shm_op(gw, op, msg)
    name = msg.get("model")
    if op in ("metadata", "model_ready", "config"):
        if not isinstance(name, str):
            raise BadRequest(f"op {op} needs a model name")
        entry = gw.model(name, _version(msg))
        spec = entry.spec
        if op == "model_ready":
            return {"ready": entry.state == ModelState.READY, "state": entry.state.value}
        if op == "config":
            return {"config": model_config_json(spec)}
        return model_metadata_json(spec, gw.versions(spec.name))
    raise BadRequest(f"unknown op {op!r}; ops are infer, live, ready, index, stats, forecast, metadata, "
                     "model_ready, config, shm_register, shm_unregister, shm_status, feedback, user, app_infer, "
                     "app_feedback, app_status, apps")


def _shm_op(gw: Gateway, op: str, msg: dict[str, Any]) -> dict[str, Any]:
    """Triton's system shared-memory calls on the socket (whose peers are on this host by nature)."""
    regions = gw.shared_memory
    name = msg.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRequest(f"op {op}: name must be a string")
    if op == "shm_register":
        regions.register(name, msg.get("key"), msg.get("offset", 0), msg.get("byte_size"))
        return {}
    if op == "shm_unregister":
        regions.unregister(name)
        return {}
    return {"regions": regions.status(name)}


def _version(msg: dict[str, Any]) -> str | int | None:
    v = msg.get("version")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int | str)):
        raise BadRequest("version must be an integer or a string of digits")
    return v


class Rehearsal:
    """The socket's request path, replayed between requests while the controller keeps a model warm
    (controller.keep_warm_path): the last small infer frame decoded, checked and made into a
    request again, and the last answer encoded again, all dropped. At light load the machine
    evicts the frontend's code as it does the model's (its decode runs 3-5x slower after a few ms
    idle: bench/latency_breakdown.py); replayed, the next request finds it hot. Nothing replayed is
    submitted, counted or sent. Kept only while `enabled` (the daemon turns it on where keep-warm
    replays it); never a frame that names a shared-memory region, nor a frame or an answer over
    REHEARSE_MAX_BYTES, nor BYTES outputs; a frame that no longer parses (its model unloaded) is
    forgotten with the answer."""

    __slots__ = ("answer", "enabled", "frame", "gateway")

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.enabled = False
        self.frame: bytes | None = None  # the last small infer frame handled
        # the last small answer, as answer_fields takes it (not the request: its inputs, its
        # connection and callbacks stay out of this)
        self.answer: tuple[ModelSpec, tuple[np.ndarray, ...], list[int], bool, bool, bool, str] | None = None

    def heard(self, frame: bytes) -> None:
        """An infer frame that names no shared-memory region was handled."""
        if self.enabled and len(frame) <= REHEARSE_MAX_BYTES:
            self.frame = frame

    def answered(self, req: InferenceRequest) -> None:
        """`req` was answered with its outputs in the frame."""
        outputs = req.outputs
        if not self.enabled or outputs is None:
            return
        size = 0
        for a in outputs:
            if a.dtype == object:  # (BYTES: nbytes counts pointers, not the strings)
                return
            size += a.nbytes
        if size <= REHEARSE_MAX_BYTES:
            self.answer = (req.model, tuple(outputs), list(req.context[1]), req.reconstructed, req.cached,
                           req.defaulted, req.query_id)

    def replay(self) -> bool:
        """Decode the kept frame and encode the kept answer again; True if both were replayed."""
        frame, answer, gw = self.frame, self.answer, self.gateway
        if frame is None:
            self.answer = None  # (nothing of a forgotten frame stays)
            return False
        if answer is None:
            return False
        if gw.overload.overloaded:  # (admitting it would count a refusal)
            return False
        try:
            msg = msgpack.unpackb(frame, raw=False, max_bin_len=REHEARSE_MAX_BYTES, **UNPACK_LIMITS)
            p = parse_infer(gw, msg)
            try:
                gw.new_request(p.spec, p.arrays, p.samples, p.timeout_us, p.priority, "")
            finally:
                p.targets.release()
            spec, outputs, out_idx, reconstructed, cached, defaulted, query_id = answer
            pack_frame({"id": msg.get("id"), "status": 200,
                        **answer_fields(spec, outputs, out_idx, OutputTargets(gw.shared_memory), reconstructed,
                                        cached, defaulted, query_id)})
        except Exception as e:  # (its model went away, or its version): nothing to replay
            log.debug("keep-warm replay of the socket path stopped: %s", e)
            self.clear()
            return False
        return True

    def clear(self) -> None:
        self.frame = self.answer = None


class SocketFrontend:
    def __init__(self, gateway: Gateway, connection: type[SocketConnection] = SocketConnection) -> None:
        self.gateway = gateway
        self.rehearsal = Rehearsal(gateway)
        self._connection = connection  # a frontend worker's forwards some control ops
        self.settings = gateway.settings.server
        self.server: asyncio.AbstractServer | None = None
        self.connections: set[SocketConnection] = set()
        self.path: Path | None = None
        self.refused = 0  # connections refused for the limit
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, path: str) -> None:
        await asyncio.to_thread(self._prepare, path)
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: self._connection(self), path, backlog=1024)
        os.chmod(path, int(self.settings.socket_mode, 8))
        self.path = Path(path)
        self._sweeper = loop.create_task(self._sweep(), name="socket-sweeper")

    async def start_on(self, sock: socket.socket) -> None:
        """Accept on a socket already listening (a frontend worker: the controller process made it,
        and keeps its path)."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: self._connection(self), sock=sock, backlog=1024)
        self._sweeper = loop.create_task(self._sweep(), name="socket-sweeper")

    @staticmethod
    def listen(path: str, mode: str) -> socket.socket:
        """A listening unix socket at `path` (a stale one replaced), for frontend workers to accept on."""
        SocketFrontend._prepare(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, int(mode, 8))
        sock.listen(1024)
        return sock

    async def _sweep(self) -> None:
        """Close connections idle past server.idle_timeout_s (nothing in flight, no bytes), drop
        those whose client has not read its answers for server.write_timeout_s, and those with a
        frame begun but not whole after server.request_timeout_s (a client dripping a large frame
        would otherwise hold its memory, charged when the frame began, for good)."""
        s = self.settings
        while True:
            await asyncio.sleep(min(1.0, s.idle_timeout_s / 4, s.write_timeout_s / 4, s.request_timeout_s / 4))
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """One pass of the sweep at time `now` (time.monotonic()'s)."""
        s = self.settings
        for c in list(self.connections):
            if c.write_blocked_since is not None and now - c.write_blocked_since > s.write_timeout_s:
                c.abort()
            elif c.frame_begun is not None and now - c.frame_begun > s.request_timeout_s:
                c.frame_too_slow(s.request_timeout_s)
            elif not c._inflight and now - c.last_active > s.idle_timeout_s:
                c.close()

    @staticmethod
    def _prepare(path: str) -> None:
        p = Path(path)
        if len(os.fsencode(p.absolute())) >= 108:
            raise OSError(f"socket path {p} is too long for a unix socket (108 bytes)")
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_socket():
            # A stale socket from a daemon that did not exit cleanly is replaced; a live one is not.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(str(p))
            except OSError:
                p.unlink()
            else:
                raise OSError(f"another daemon is listening on {p}; stop it first")
            finally:
                probe.close()

    async def stop_listening(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def close(self) -> None:
        self.rehearsal.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for c in list(self.connections):
            c.close()
        if self.server is not None:
            await self.server.wait_closed()
            self.server = None
