"""Python clients for both frontends, sync and asyncio.

    with SocketClient("run/escapement.sock") as c:
        r = c.infer("digits_mlp", {"INPUT__0": x})      # x: np.ndarray [batch, 64] float32
        r.outputs["OUTPUT__0"]

`AsyncSocketClient` keeps many requests in flight on one connection, matched by id.

Shared memory (Triton's system shared-memory extension, on the socket): register a region of a
POSIX shared-memory object, then pass `ShmInput`s for inputs and `ShmOutput`s for outputs:

    c.register_shared_memory("in", "/my_input", nbytes)
    r = c.infer("m", {"INPUT__0": ShmInput("in", nbytes, "FP32", [1, 64])},
                outputs=[ShmOutput("OUTPUT__0", "out", 40)])
    r.in_regions["OUTPUT__0"]   # {"datatype", "shape", "parameters": where it was written}
Applications (docs/applications.md): `app_infer` answers an `AppResult` whose `query_id`
`app_feedback` names with the true label or a reward.

`HttpClient` / `AsyncHttpClient` speak KServe v2 with binary tensors. Errors raise
`InferenceServerError` with the daemon's status and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import math
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import msgpack
import numpy as np
import orjson

from daemon.api.codec import decode_bytes, tensor_bytes
from daemon.datatypes import BY_NAME, BY_NUMPY

LENGTH = struct.Struct(">I")
HEADER_LEN = "Inference-Header-Content-Length"


class InferenceServerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass(slots=True)
class InferResult:
    model: str
    version: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    reconstructed: bool = False
    cached: bool = False  # answered from the daemon's prediction cache (docs/cache.md)
    query_id: str = ""  # a personalized answer: what its feedback names (docs/personalization.md)
    in_regions: dict[str, dict[str, Any]] = field(default_factory=dict)  # outputs written to shared memory


@dataclass(slots=True)
class AppResult:
    """An application's answer (docs/applications.md): its one output, the models that made it, and
    the query id its feedback names ("" for a default answer)."""

    app: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)
    query_id: str = ""
    skipped: list[str] = field(default_factory=list)  # left out: the controller expected them too late
    late: list[str] = field(default_factory=list)  # run, but not back by the deadline
    default: bool = False  # the application's default output: no model answered in time
    partial: bool = False  # an ensemble answered without some of its models

    @property
    def output(self) -> np.ndarray:
        return next(iter(self.outputs.values()))


def _app_result(app: str, outputs: dict[str, np.ndarray], p: dict[str, Any]) -> AppResult:
    return AppResult(app, outputs, list(p.get("models", [])), str(p.get("query_id", "")), list(p.get("skipped", [])),
                     list(p.get("late", [])), bool(p.get("default")), bool(p.get("partial")))


def app_infer_message(app: str, inputs: Mapping[str, np.ndarray], timeout_us: int | None = None,
                      priority: int | None = None) -> dict[str, Any]:
    """The msgpack map of an application query (without its id)."""
    msg = infer_message("", inputs, timeout_us=timeout_us, priority=priority)
    del msg["model"]
    return {**msg, "op": "app_infer", "app": app}


def app_feedback_message(app: str, query_id: str, label: int | list[int] | None = None,
                         reward: float | dict[str, float] | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": "app_feedback", "app": app, "query_id": query_id}
    if label is not None:
        msg["label"] = label
    if reward is not None:
        msg["reward"] = reward
    return msg


def app_socket_result(msg: dict[str, Any]) -> AppResult:
    outs = {o["name"]: _wire_array(o["data"], o["datatype"], o["shape"]) for o in msg.get("outputs", [])}
    return _app_result(str(msg.get("app", "")), outs, msg)


@dataclass(frozen=True, slots=True)
class ShmInput:
    """An input read from a registered shared-memory region (`byte_size` bytes at `offset`)."""

    region: str
    byte_size: int
    datatype: str
    shape: list[int]
    offset: int = 0

    def wire(self, name: str) -> dict[str, Any]:
        return {"name": name, "datatype": self.datatype, "shape": list(self.shape),
                "parameters": _shm_params(self.region, self.byte_size, self.offset)}


@dataclass(frozen=True, slots=True)
class ShmOutput:
    """An output the daemon writes into a registered region (at most `byte_size` bytes at `offset`)."""

    name: str
    region: str
    byte_size: int
    offset: int = 0

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "parameters": _shm_params(self.region, self.byte_size, self.offset)}


def _shm_params(region: str, byte_size: int, offset: int) -> dict[str, Any]:
    return {"shared_memory_region": region, "shared_memory_byte_size": byte_size, "shared_memory_offset": offset}


def _datatype(arr: np.ndarray) -> str:
    dt = BY_NUMPY.get(arr.dtype.newbyteorder("=") if arr.dtype.byteorder == ">" else arr.dtype)
    if dt is None:
        raise TypeError(f"no wire datatype for numpy dtype {arr.dtype}")
    return dt.name


def _le_bytes(arr: np.ndarray) -> bytes:
    return tensor_bytes(arr)  # little-endian; BYTES (object arrays) length-prefixed


def _wire_array(raw: bytes | memoryview, datatype: str, shape: list[int]) -> np.ndarray:
    """An output from its wire bytes (BYTES: an object array of bytes)."""
    if datatype == "BYTES":
        return decode_bytes(raw, math.prod(shape), "output").reshape(shape)
    return np.frombuffer(raw, dtype=BY_NAME[datatype].numpy).reshape(shape)


def infer_message(model: str, inputs: Mapping[str, np.ndarray | ShmInput],
                  outputs: Sequence[str | ShmOutput] | None = None, version: str | int | None = None,
                  timeout_us: int | None = None, priority: int | None = None, user: str | None = None
                  ) -> dict[str, Any]:
    """The msgpack map of an infer request (without its id)."""
    msg: dict[str, Any] = {
        "op": "infer", "model": model,
        "inputs": [a.wire(n) if isinstance(a, ShmInput) else
                   {"name": n, "datatype": _datatype(a), "shape": list(a.shape), "data": _le_bytes(a)}
                   for n, a in inputs.items()],
    }
    if outputs is not None:
        msg["outputs"] = [o.wire() if isinstance(o, ShmOutput) else o for o in outputs]
    if version is not None:
        msg["version"] = str(version)
    if timeout_us is not None:
        msg["timeout_us"] = int(timeout_us)
    if priority is not None:
        msg["priority"] = int(priority)
    if user is not None:
        msg["user"] = user
    return msg


def decode_answer(msg: Any) -> dict[str, Any]:
    if not isinstance(msg, dict) or "status" not in msg:
        raise InferenceServerError(0, f"malformed answer from the daemon: {msg!r:.200}")
    if msg["status"] != 200:
        raise InferenceServerError(int(msg["status"]), str(msg.get("error", "")))
    return msg


def infer_result(msg: dict[str, Any]) -> InferResult:
    outs = {}
    in_regions = {}
    for o in msg.get("outputs", []):
        if "data" in o:
            outs[o["name"]] = _wire_array(o["data"], o["datatype"], o["shape"])
        else:
            in_regions[o["name"]] = {"datatype": o["datatype"], "shape": o["shape"], "parameters": o["parameters"]}
    return InferResult(msg.get("model", ""), msg.get("version", ""), outs, bool(msg.get("reconstructed")),
                       bool(msg.get("cached")), str(msg.get("query_id", "")), in_regions)


def _body(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without the frame's own keys (what HTTP's body holds)."""
    return {k: v for k, v in answer.items() if k not in ("id", "status")}


def _version_field(version: str | int | None) -> dict[str, str]:
    return {"version": str(version)} if version is not None else {}


def _feedback_message(model: str, query_id: str, label: int | list[int], version: str | int | None) -> dict[str, Any]:
    return {"op": "feedback", "model": model, "query_id": query_id, "label": label, **_version_field(version)}


def _frame(obj: dict[str, Any]) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return LENGTH.pack(len(payload)) + payload


class SocketClient:
    """A blocking client over the unix socket; one request at a time."""

    def __init__(self, path: str, timeout: float | None = 60.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> SocketClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _conn(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            s.connect(self.path)
            self._sock = s
        return self._sock

    def _read_exact(self, n: int) -> bytes:
        sock = self._conn()
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                self.close()
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
        return bytes(buf)

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        req_id = next(self._ids)
        self._conn().sendall(_frame({**msg, "id": req_id}))
        while True:
            (n,) = LENGTH.unpack(self._read_exact(4))
            answer = msgpack.unpackb(self._read_exact(n), raw=False)
            if answer.get("id") in (req_id, None):
                return decode_answer(answer)

    def infer(self, model: str, inputs: Mapping[str, np.ndarray | ShmInput],
              outputs: Sequence[str | ShmOutput] | None = None, version: str | int | None = None,
              timeout_us: int | None = None, priority: int | None = None, user: str | None = None) -> InferResult:
        """`user`: a personalized model's user (its output and a query_id, docs/personalization.md)."""
        return infer_result(self.call(infer_message(model, inputs, outputs, version, timeout_us, priority, user)))

    def feedback(self, model: str, query_id: str, label: int | list[int],
                 version: str | int | None = None) -> dict[str, Any]:
        """The true label of a personalized answer; returns once the user's update is committed."""
        return _body(self.call(_feedback_message(model, query_id, label, version)))

    def user(self, model: str, user: str, version: str | int | None = None) -> dict[str, Any]:
        """A personalized model's user: updates so far, the last one's time (404 if it gave none)."""
        return _body(self.call({"op": "user", "model": model, "user": user, **_version_field(version)}))

    def app_infer(self, app: str, inputs: Mapping[str, np.ndarray], timeout_us: int | None = None,
                  priority: int | None = None) -> AppResult:
        """A query to an application (docs/applications.md)."""
        return app_socket_result(self.call(app_infer_message(app, inputs, timeout_us, priority)))

    def app_feedback(self, app: str, query_id: str, label: int | list[int] | None = None,
                     reward: float | dict[str, float] | None = None) -> dict[str, Any]:
        """A query's true label(s) or reward; returns once the policy's update is committed."""
        return _body(self.call(app_feedback_message(app, query_id, label, reward)))

    def app_status(self, app: str) -> dict[str, Any]:
        """An application's definition, learned weights and counters."""
        return _body(self.call({"op": "app_status", "app": app}))

    def register_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        """Register `byte_size` bytes at `offset` of the POSIX shared-memory object `key` as region `name`."""
        self.call({"op": "shm_register", "name": name, "key": key, "offset": offset, "byte_size": byte_size})

    def unregister_shared_memory(self, name: str = "") -> None:
        """Unregister region `name`, or every region when `name` is ""."""
        self.call({"op": "shm_unregister", "name": name})

    def shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        return list(self.call({"op": "shm_status", "name": name})["regions"])

    def live(self) -> bool:
        return bool(self.call({"op": "live"})["live"])

    def ready(self) -> bool:
        return bool(self.call({"op": "ready"})["ready"])

    def index(self) -> list[dict[str, str]]:
        return list(self.call({"op": "index"})["models"])

    def metadata(self, model: str, version: str | int | None = None) -> dict[str, Any]:
        return self.call({"op": "metadata", "model": model, **({"version": str(version)} if version else {})})


class AsyncSocketClient:
    """An asyncio client with many requests in flight on one connection."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncSocketClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_unix_connection(self.path, limit=2**26)
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(ConnectionError("client closed"))

    def _fail_all(self, exc: BaseException) -> None:
        for f in self._pending.values():
            if not f.done():
                f.set_exception(exc)
        self._pending.clear()

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                (n,) = LENGTH.unpack(await self._reader.readexactly(4))
                answer = msgpack.unpackb(await self._reader.readexactly(n), raw=False)
                fut = self._pending.pop(answer.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(answer)
                elif answer.get("id") is None:  # a connection-level error: fail everyone
                    self._fail_all(InferenceServerError(answer.get("status", 0), answer.get("error", "")))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._fail_all(ConnectionError(f"the daemon closed the connection: {e}"))

    async def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self._writer is None:
            await self.connect()
        assert self._writer is not None
        req_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        self._writer.write(_frame({**msg, "id": req_id}))
        try:
            return decode_answer(await fut)
        finally:
            self._pending.pop(req_id, None)

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray | ShmInput],
                    outputs: Sequence[str | ShmOutput] | None = None, version: str | int | None = None,
                    timeout_us: int | None = None, priority: int | None = None,
                    user: str | None = None) -> InferResult:
        return infer_result(await self.call(infer_message(model, inputs, outputs, version, timeout_us, priority,
                                                          user)))

    async def feedback(self, model: str, query_id: str, label: int | list[int],
                       version: str | int | None = None) -> dict[str, Any]:
        return _body(await self.call(_feedback_message(model, query_id, label, version)))

    async def app_infer(self, app: str, inputs: Mapping[str, np.ndarray], timeout_us: int | None = None,
                        priority: int | None = None) -> AppResult:
        return app_socket_result(await self.call(app_infer_message(app, inputs, timeout_us, priority)))

    async def app_feedback(self, app: str, query_id: str, label: int | list[int] | None = None,
                           reward: float | dict[str, float] | None = None) -> dict[str, Any]:
        return _body(await self.call(app_feedback_message(app, query_id, label, reward)))

    async def ready(self) -> bool:
        return bool((await self.call({"op": "ready"}))["ready"])


# -------------------------------------------------------------------- HTTP (KServe v2, binary tensors)


def http_infer_body(inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
                    timeout_us: int | None = None, priority: int | None = None,
                    user: str | None = None) -> tuple[bytes, int]:
    """A KServe v2 binary body: JSON header + tensor bytes; returns (body, header length)."""
    chunks = [_le_bytes(a) for a in inputs.values()]
    header: dict[str, Any] = {"inputs": [
        {"name": n, "datatype": _datatype(a), "shape": list(a.shape), "parameters": {"binary_data_size": len(c)}}
        for (n, a), c in zip(inputs.items(), chunks, strict=True)]}
    if outputs is not None:
        header["outputs"] = [{"name": o, "parameters": {"binary_data": True}} for o in outputs]
    params: dict[str, Any] = {} if outputs is not None else {"binary_data_output": True}
    if timeout_us is not None:
        params["timeout"] = int(timeout_us)
    if priority:
        params["priority"] = int(priority)
    if user is not None:
        params["user"] = user
    if params:
        header["parameters"] = params
    h = orjson.dumps(header)
    return b"".join([h, *chunks]), len(h)


def http_infer_result(body: bytes, header_len: str | None) -> InferResult:
    n = int(header_len) if header_len is not None else len(body)
    obj = orjson.loads(body[:n])
    outs: dict[str, np.ndarray] = {}
    offset = n
    for o in obj.get("outputs", []):
        dt = BY_NAME[o["datatype"]].numpy
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            outs[o["name"]] = _wire_array(memoryview(body)[offset : offset + size], o["datatype"], o["shape"])
            offset += size
        elif o["datatype"] == "BYTES":
            outs[o["name"]] = np.array([x.encode() for x in o["data"]], dtype=object).reshape(o["shape"])
        else:
            outs[o["name"]] = np.array(o["data"], dtype=dt).reshape(o["shape"])
    params = obj.get("parameters") or {}
    return InferResult(obj.get("model_name", ""), obj.get("model_version", ""), outs,
                       bool(params.get("reconstructed")), bool(params.get("cached")), str(params.get("query_id", "")))


def _http_error(status: int, body: bytes) -> InferenceServerError:
    try:
        msg = orjson.loads(body).get("error", "")
    except (orjson.JSONDecodeError, AttributeError):
        msg = body.decode("utf-8", "replace")
    return InferenceServerError(status, msg)


def _infer_path(model: str, version: str | int | None) -> str:
    return f"/v2/models/{model}" + (f"/versions/{version}" if version is not None else "") + "/infer"


class HttpClient:
    """A blocking KServe v2 client (binary tensors) on one keep-alive connection."""

    def __init__(self, address: str = "127.0.0.1:8000", timeout: float = 60.0) -> None:
        host, _, port = address.removeprefix("http://").rstrip("/").rpartition(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=timeout)

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes, http.client.HTTPResponse]:
        self._conn.request(method, path, body=body, headers=headers or {})
        resp = self._conn.getresponse()
        data = resp.read()
        return resp.status, data, resp

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
              version: str | int | None = None, timeout_us: int | None = None,
              priority: int | None = None, user: str | None = None) -> InferResult:
        body, hlen = http_infer_body(inputs, outputs, timeout_us, priority, user)
        status, data, resp = self.request("POST", _infer_path(model, version), body, {HEADER_LEN: str(hlen)})
        if status != 200:
            raise _http_error(status, data)
        return http_infer_result(data, resp.getheader(HEADER_LEN))

    def feedback(self, model: str, query_id: str, label: int | list[int],
                 version: str | int | None = None) -> dict[str, Any]:
        """The true label of a personalized answer; returns once the user's update is committed."""
        path = _infer_path(model, version).removesuffix("/infer") + "/feedback"
        status, data, _ = self.request("POST", path, orjson.dumps({"query_id": query_id, "label": label}))
        if status != 200:
            raise _http_error(status, data)
        return dict(orjson.loads(data))

    def user(self, model: str, user: str, version: str | int | None = None) -> dict[str, Any]:
        base = _infer_path(model, version).removesuffix("/infer")
        return dict(self.get_json(f"{base}/users/{quote(user, safe='')}"))

    def app_infer(self, app: str, inputs: Mapping[str, np.ndarray], timeout_us: int | None = None,
                  priority: int | None = None) -> AppResult:
        """A query to an application (binary inputs; its output comes back as JSON)."""
        body, hlen = http_infer_body(inputs, None, timeout_us, priority)
        status, data, _ = self.request("POST", f"/v2/applications/{quote(app, safe='')}/infer", body,
                                       {HEADER_LEN: str(hlen)})
        if status != 200:
            raise _http_error(status, data)
        r = http_infer_result(data, None)
        return _app_result(app, r.outputs, orjson.loads(data).get("parameters") or {})

    def app_feedback(self, app: str, query_id: str, label: int | list[int] | None = None,
                     reward: float | dict[str, float] | None = None) -> dict[str, Any]:
        """A query's true label(s) or reward; returns once the policy's update is committed."""
        msg = app_feedback_message(app, query_id, label, reward)
        body = {k: v for k, v in msg.items() if k not in ("op", "app")}
        status, data, _ = self.request("POST", f"/v2/applications/{quote(app, safe='')}/feedback",
                                       orjson.dumps(body))
        if status != 200:
            raise _http_error(status, data)
        return dict(orjson.loads(data))

    def app_status(self, app: str) -> dict[str, Any]:
        return dict(self.get_json(f"/v2/applications/{quote(app, safe='')}"))

    def add_application(self, app: str, config: dict[str, Any] | None = None, token: str = "") -> dict[str, Any]:
        """The repository API's load of an application: from `config` (an [[applications]] table's
        keys), else as declared; a management call (the admin token, or a loopback listener)."""
        body = orjson.dumps({"parameters": {"config": config}}) if config is not None else b""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        status, data, _ = self.request("POST", f"/v2/repository/applications/{quote(app, safe='')}/load", body,
                                       headers)
        if status != 200:
            raise _http_error(status, data)
        return dict(orjson.loads(data))

    def get_json(self, path: str) -> Any:
        status, data, _ = self.request("GET", path)
        if status != 200:
            raise _http_error(status, data)
        return orjson.loads(data)

    def index(self) -> list[dict[str, str]]:
        status, data, _ = self.request("POST", "/v2/repository/index", b"")
        if status != 200:
            raise _http_error(status, data)
        return list(orjson.loads(data))


class AsyncHttpClient:
    """An asyncio KServe v2 client (binary tensors) over an aiohttp session."""

    def __init__(self, address: str = "127.0.0.1:8000", connections: int = 100) -> None:
        import aiohttp

        self.base = "http://" + address.removeprefix("http://").rstrip("/")
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                              auto_decompress=False)

    async def __aenter__(self) -> AsyncHttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
                    version: str | int | None = None, timeout_us: int | None = None,
                    priority: int | None = None) -> InferResult:
        body, hlen = http_infer_body(inputs, outputs, timeout_us, priority)
        async with self._session.post(self.base + _infer_path(model, version), data=body,
                                      headers={HEADER_LEN: str(hlen)}) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise _http_error(resp.status, data)
            return http_infer_result(data, resp.headers.get(HEADER_LEN))

    async def app_infer(self, app: str, inputs: Mapping[str, np.ndarray], timeout_us: int | None = None,
                        priority: int | None = None) -> AppResult:
        """A query to an application (binary inputs; its output comes back as JSON)."""
        body, hlen = http_infer_body(inputs, None, timeout_us, priority)
        async with self._session.post(f"{self.base}/v2/applications/{quote(app, safe='')}/infer", data=body,
                                      headers={HEADER_LEN: str(hlen)}) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise _http_error(resp.status, data)
        return _app_result(app, http_infer_result(data, None).outputs, orjson.loads(data).get("parameters") or {})

    async def app_feedback(self, app: str, query_id: str, label: int | list[int] | None = None,
                           reward: float | dict[str, float] | None = None) -> dict[str, Any]:
        msg = app_feedback_message(app, query_id, label, reward)
        body = orjson.dumps({k: v for k, v in msg.items() if k not in ("op", "app")})
        async with self._session.post(f"{self.base}/v2/applications/{quote(app, safe='')}/feedback",
                                      data=body) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise _http_error(resp.status, data)
        return dict(orjson.loads(data))
