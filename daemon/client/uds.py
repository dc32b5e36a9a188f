"""The unix-socket clients: `SocketClient` (blocking, one request at a time) and
`AsyncSocketClient` (asyncio, many requests in flight on one connection, matched by id)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from daemon.client.wire import (
    LENGTH,
    AppResult,
    InferenceServerError,
    InferResult,
    ShmInput,
    ShmOutput,
    answer_body,
    app_feedback_message,
    app_infer_message,
    app_socket_result,
    decode_answer,
    feedback_message,
    frame,
    infer_message,
    infer_result,
    version_field,
)


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
        self._conn().sendall(frame({**msg, "id": req_id}))
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
        return answer_body(self.call(feedback_message(model, query_id, label, version)))

    def user(self, model: str, user: str, version: str | int | None = None) -> dict[str, Any]:
        """A personalized model's user: updates so far, the last one's time (404 if it gave none)."""
        return answer_body(self.call({"op": "user", "model": model, "user": user, **version_field(version)}))

    def app_infer(self, app: str, inputs: Mapping[str, np.ndarray], timeout_us: int | None = None,
                  priority: int | None = None) -> AppResult:
        """A query to an application (docs/applications.md)."""
        return app_socket_result(self.call(app_infer_message(app, inputs, timeout_us, priority)))

    def app_feedback(self, app: str, query_id: str, label: int | list[int] | None = None,
                     reward: float | dict[str, float] | None = None) -> dict[str, Any]:
        """A query's true label(s) or reward; returns once the policy's update is committed."""
        return answer_body(self.call(app_feedback_message(app, query_id, label, reward)))

    def app_status(self, app: str) -> dict[str, Any]:
        """An application's definition, learned weights and counters."""
        return answer_body(self.call({"op": "app_status", "app": app}))

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
        self._writer.write(frame({**msg, "id": req_id}))
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
        return answer_body(await self.call(feedback_message(model, query_id, label, version)))

    async def app_infer(self, app: str, inputs: Mapping[str, np.ndarray], timeout_us: int | None = None,
                        priority: int | None = None) -> AppResult:
        return app_socket_result(await self.call(app_infer_message(app, inputs, timeout_us, priority)))

    async def app_feedback(self, app: str, query_id: str, label: int | list[int] | None = None,
                           reward: float | dict[str, float] | None = None) -> dict[str, Any]:
        return answer_body(await self.call(app_feedback_message(app, query_id, label, reward)))

    async def ready(self) -> bool:
        return bool((await self.call({"op": "ready"}))["ready"])
