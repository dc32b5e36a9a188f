"""The HTTP clients: `HttpClient` (blocking, one keep-alive connection) and `AsyncHttpClient`
(asyncio, over an aiohttp session), speaking KServe v2 with binary tensors."""

from __future__ import annotations

import http.client
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np
import orjson

from daemon.client.wire import (
    HEADER_LEN,
    AppResult,
    InferenceServerError,
    InferResult,
    app_feedback_message,
    app_result,
    http_infer_body,
    http_infer_result,
)


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
        return app_result(app, r.outputs, orjson.loads(data).get("parameters") or {})

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
        return app_result(app, http_infer_result(data, None).outputs, orjson.loads(data).get("parameters") or {})

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
