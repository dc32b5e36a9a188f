"""HTTP/1.1 under the KServe v2 frontend: connections, parsing, routing, responses.

aiohttp cost about 60 µs of event-loop CPU per inference request over a bare protocol on the
same parser (97 vs 37 µs for a 15 KB JSON request and a trivial handler, both on uvloop:
bench/results/http-server.md), a third of what the daemon spent per HTTP JSON request. This is
the part of HTTP/1.1 a KServe v2 server needs, on httptools (llhttp, the parser inside
Node.js): keep-alive and pipelining (answers in request order), chunked and gzip/deflate
request bodies, `Expect: 100-continue`, HEAD, limits on header and body size (431 / 413 before
the body is read), an idle keep-alive timeout and a timeout for a request that never completes.

Each connection serves its requests one at a time in a task of its own; a connection reset
cancels the request it was waiting for, while a FIN is taken as a half-close (its answers are
still written). Everything a client can get wrong is answered with a JSON error and a 4xx, and a
refused connection lingers (FIN, then its unread input drained) so the answer is not lost to a
reset.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools
import orjson

from daemon.api.budget import Lease, RequestMemory
from daemon.errors import (
    BadRequest,
    EscapementError,
    HeadersTooLarge,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestTimeout,
    UnsupportedMediaType,
    message_of,
    retry_after_of,
    status_of,
)

log = logging.getLogger("escapement.http")

MAX_HEADER_BYTES = 64 * 1024  # all header lines of one request together
MAX_HEADERS = 128
PIPELINE_DEPTH = 32  # requests read ahead of their answers on one connection before reading pauses
SWEEP_S = 1.0
LINGER_S = 2.0  # how long a refused connection's unread input is drained before closing
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"




@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes
    keep_alive: bool
    http10: bool = False  # an HTTP/1.0 client is told when the connection stays open
    params: dict[str, str] = field(default_factory=dict)  # filled in by the route
    lease: Lease | None = None  # the request memory its body (and what is decoded from it) holds
    refused: EscapementError | None = None  # answered with this, unread (its body was dropped)
    encoding: str = ""  # the body is still compressed with this (inflated before dispatch)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


@dataclass(slots=True)
class Response:
    body: bytes
    status: int = 200
    content_type: str = "application/json"
    headers: dict[str, str] | None = None
    to_head: bool = False  # the answer to a HEAD request: its body is not sent


Handler = Callable[[Request], Awaitable[Response]]


def error_response(exc: BaseException) -> Response:
    """`{"error": "..."}` (the key tritonclient reads) with the error's status."""
    retry = retry_after_of(exc)
    headers = {"Retry-After": str(max(1, round(retry)))} if retry is not None else None
    return Response(orjson.dumps({"error": message_of(exc)}), status_of(exc), "application/json", headers)


# ------------------------------------------------------------------ routing

_PARAM = re.compile(r"\{(\w+)(?::([^{}]+))?\}")


class Router:
    """Routes tried in the order they were added (put the hot ones first)."""

    def __init__(self) -> None:
        self._routes: list[tuple[re.Pattern[str], dict[str, Handler]]] = []
        self._by_pattern: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        """`pattern` like "/v2/models/{model}/versions/{version:[0-9]+}/infer"."""
        methods = self._by_pattern.get(pattern)
        if methods is None:
            methods = self._by_pattern[pattern] = {}
            self._routes.append((_compile(pattern), methods))
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """Match the raw path (still percent-encoded), then decode each parameter: `%2F` inside a
        model name stays part of the name and never splits the path into another route."""
        allowed = False
        for regex, methods in self._routes:
            m = regex.match(path)
            if m is None:
                continue
            handler = methods.get(method)
            if handler is not None:
                params = m.groupdict()
                if "%" in path:
                    params = {k: unquote(v) for k, v in params.items()}
                return handler, params
            allowed = True
        if allowed:
            raise MethodNotAllowed("Method Not Allowed")
        raise NotFound("Not Found")


def _compile(pattern: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in _PARAM.finditer(pattern):
        out += [re.escape(pattern[pos : m.start()]), f"(?P<{m.group(1)}>{m.group(2) or '[^/]+'})"]
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out) + r"\Z")


# ------------------------------------------------------------------ connections


class _Refuse(Exception):
    """Raised inside a parser callback: answer `error` and close the connection."""

    def __init__(self, error: EscapementError) -> None:
        self.error = error


INFLATORS = 2  # compressed bodies inflated at once (in worker threads)
INFLATE_STEP = 1 << 20  # output per zlib call: the size check runs between steps, not after it all


def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """A gzip / deflate request body (tritonclient's request_compression_algorithm) inflated, at
    most `limit` bytes (413 past it); BadRequest for data that is not a whole compressed stream.
    Run in a worker thread: zlib lets go of the GIL, so a bomb of a few KiB that inflates to
    tens of MiB costs a core for a while, never the event loop."""
    # deflate per RFC 9110 is zlib-wrapped; accept a raw deflate stream too, as common servers do
    wbits = 31 if encoding in ("gzip", "x-gzip") else 15
    try:
        return _inflate(data, wbits, limit)
    except zlib.error as e:
        if wbits != 15:
            raise BadRequest(f"the request body is not valid compressed data: {e}") from None
    try:
        return _inflate(data, -15, limit)
    except zlib.error as e:
        raise BadRequest(f"the request body is not valid compressed data: {e}") from None


def _inflate(data: bytes, wbits: int, limit: int) -> bytes:
    z = zlib.decompressobj(wbits)
    parts: list[bytes] = []
    size = 0
    pending = data
    while True:
        out = z.decompress(pending, min(INFLATE_STEP, limit + 1 - size))
        parts.append(out)
        size += len(out)
        if size > limit:
            raise PayloadTooLarge(f"the decompressed request body is over the limit of {limit} bytes "
                                  "(server.max_body_bytes)")
        if z.eof:
            if z.unused_data:
                raise BadRequest("data follows the end of the compressed request body")
            return parts[0] if len(parts) == 1 else b"".join(parts)
        pending = z.unconsumed_tail
        if not pending and not out:
            raise BadRequest("the compressed request body ends before its compressed stream does")


class HttpConnection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: deque[Request | Response] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.reading = True
        self.writable: asyncio.Future[None] | None = None
        self.last_active = self.loop.time()
        self.begun: float | None = None  # when the request being read began
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_len = 0
        self._encoding = ""  # the request being read has a compressed body
        self._refused = False
        self.share = server.memory.share()
        self._lease: Lease | None = None  # the request being read
        self._charged = False  # its body was charged whole from Content-Length
        self._dropping: EscapementError | None = None  # its body is read and dropped; this is the answer
        self._closing_after = False
        self._continue_owed = False
        self.lingering_since: float | None = None  # refused: discarding the rest before closing
        self.write_blocked_since: float | None = None  # the client stopped reading its answers at

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        over = len(self.server.connections) >= self.server.max_connections
        self.server.connections.add(self)  # a refused one too, while it lingers (LINGER_S at most)
        if over:
            self.server.refused += 1
            self._refuse(Overloaded(f"the server holds {self.server.max_connections} connections, its limit "
                                    "(server.max_connections); retry later"))

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Refuse):
                self._refuse(cause.error)
            else:
                log.exception("HTTP parser callback failed")
                self._refuse(BadRequest("the request could not be read"))
        except httptools.HttpParserUpgrade:
            self._stop_reading()  # the rest is another protocol: answer what was read, then close
            self._close_after_answers()
        except httptools.HttpParserError as e:
            self._refuse(BadRequest(f"malformed HTTP request: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._lease is not None:
            self._lease.release()
        for item in self.queue:
            if isinstance(item, Request):
                item.release()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # nobody waits for the answer any more: cancel the request
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.loop.create_future()
            self.write_blocked_since = self.loop.time()

    def resume_writing(self) -> None:
        self.write_blocked_since = None
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def eof_received(self) -> bool:
        # A FIN cannot be told from a half-close: a client that shuts its side after its request
        # still gets its answers, then we close. (A client that gave up costs the server its
        # request only up to the request's deadline; a reset cancels it at once.)
        if self.lingering_since is not None:
            self.close()
            return False
        self._close_after_answers()
        return True

    # ---- httptools callbacks

    def on_message_begin(self) -> None:
        self.begun = self.loop.time()
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._body = []
        self._body_len = 0
        self._encoding = ""
        if self._lease is not None:
            self._lease.release()  # a request cut short by a refusal
        self._lease = self.share.lease()
        self._charged = False
        self._dropping = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_HEADER_BYTES:
            raise _Refuse(HeadersTooLarge("the request line is too long"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > MAX_HEADER_BYTES or len(self._headers) >= MAX_HEADERS:
            raise _Refuse(HeadersTooLarge(f"request headers over the limit of {MAX_HEADERS} lines / "
                                          f"{MAX_HEADER_BYTES} bytes"))
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self._headers.get(key)
        self._headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        h = self._headers
        limit = self.server.max_body
        length = h.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _Refuse(PayloadTooLarge(f"request body over the limit of {limit} bytes (server.max_body_bytes)"))
        encoding = h.get("content-encoding", "identity").strip().lower()
        if encoding in ("gzip", "x-gzip", "deflate"):
            self._encoding = encoding  # read as it comes (bounded by max_body), inflated off the loop
        elif encoding != "identity":
            raise _Refuse(UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)"))
        if length is not None and length.isdigit() and self._lease is not None:
            n = int(length)
            if self._lease.take(n):
                self._charged = True
            else:  # over the daemon's request memory: read the body, keep none of it, answer 503
                self._dropping = self.server.memory.refusal(n)
        if h.get("expect", "").lower() == "100-continue":
            if self.task is None and not self.queue:
                self._write_raw(CONTINUE)
            else:
                self._continue_owed = True  # after the answers owed to the requests before it

    def on_body(self, body: bytes) -> None:
        if self._dropping is not None:
            return
        self._body_len += len(body)
        if self._body_len > self.server.max_body:
            what = "compressed request body" if self._encoding else "request body"
            raise _Refuse(PayloadTooLarge(f"{what} over the limit of {self.server.max_body} bytes "
                                          "(server.max_body_bytes)"))
        lease = self._lease
        if not self._charged and lease is not None and not lease.take(len(body)):
            # A body of unknown length (chunked) ran past the daemon's request memory: what is
            # left of it cannot be skipped cheaply, so answer and close.
            raise _Refuse(self.server.memory.refusal(len(body)))
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode("latin-1")
        if method == "CONNECT":  # a proxy tunnel: its target is no path of ours
            raise _Refuse(MethodNotAllowed("CONNECT is not supported: this is not a proxy"))
        try:
            # (Any: its parts are None where absent, which its stubs do not say and compiled code checks)
            parsed: Any = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            raise _Refuse(BadRequest("the request target is not a valid URL")) from None
        if not parsed.path:  # "http://host" names no resource; "*" is only for OPTIONS
            raise _Refuse(BadRequest("the request target has no path"))
        path = parsed.path.decode("latin-1")  # routed raw: an encoded "/" never reaches another route
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(method, path,
                      (parsed.query or b"").decode("latin-1"), self._headers, body, self.parser.should_keep_alive(),
                      self.parser.get_http_version() == "1.0", lease=self._lease, refused=self._dropping,
                      encoding=self._encoding)
        self._lease = None
        self.begun = None
        self._body = []
        self._enqueue(req)
        if len(self.queue) >= PIPELINE_DEPTH or self.share.full:
            self._stop_reading()  # until its answers are written (and their memory released)

    # ---- serving

    def _enqueue(self, item: Request | Response) -> None:
        self.queue.append(item)
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closed:
                item = self.queue.popleft()
                if isinstance(item, Response):  # a refusal: answer it and hang up
                    self._write(item, None, close=True)
                    self._linger()
                    return
                try:
                    if item.refused:
                        resp = error_response(item.refused)
                    elif item.encoding:
                        resp = await self.server.inflate_and_dispatch(item)
                    else:
                        resp = await self.server.dispatch(item)
                    if self.closed:
                        return
                    self._write(resp, item, close=not item.keep_alive)
                finally:
                    item.release()
                if not item.keep_alive:
                    return
                if self._continue_owed and not self.queue:
                    self._continue_owed = False
                    self._write_raw(CONTINUE)
                if self.writable is not None and not self.writable.done():
                    await self.writable  # the client is not reading its answers
                if not self.reading and len(self.queue) < PIPELINE_DEPTH // 2 and not self.share.full:
                    self._start_reading()
        finally:
            self.task = None
            self.last_active = self.loop.time()
            if self._closing_after and not self.queue:
                self.close()

    def _close_after_answers(self) -> None:
        self._closing_after = True
        if self.task is None and not self.queue:
            self.close()

    def _write(self, resp: Response, req: Request | None, close: bool) -> None:
        if self.transport is None or self.closed:
            return
        extra = "".join(f"{k}: {v}\r\n" for k, v in resp.headers.items()) if resp.headers else ""
        if close:
            extra += "Connection: close\r\n"
        elif req is not None and req.http10:
            extra += "Connection: keep-alive\r\n"
        body = resp.body
        status = resp.status
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\nContent-Type: {resp.content_type}\r\n"
                f"Content-Length: {len(body)}\r\nDate: {self.server.date()}\r\n{extra}\r\n").encode("latin-1")
        self.transport.write(head if resp.to_head or (req is not None and req.method == "HEAD") else head + body)
        if close and req is not None:
            self.close()

    def _write_raw(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _linger(self) -> None:
        """After a refusal, say we are done (FIN) but read and drop what the client still sends for
        a while: closing at once would make the kernel answer its unread body with a reset, which
        can destroy the refusal before the client reads it."""
        if self.transport is None or self.closed:
            return
        if not self.transport.can_write_eof():
            self.close()
            return
        self.transport.write_eof()
        self.lingering_since = self.loop.time()
        self._start_reading()

    def _refuse(self, error: EscapementError) -> None:
        """The request cannot be read on: answer (after those before it) and close."""
        self._refused = True
        self._stop_reading()
        self.begun = None
        if self._lease is not None:  # nothing more of that request is kept
            self._lease.release()
            self._lease = None
        self._body = []
        resp = error_response(error)
        try:
            resp.to_head = self.parser.get_method() == b"HEAD"  # a HEAD answer has no body, refusals too
        except httptools.HttpParserError:
            pass  # the request line was not read: not a HEAD
        self._enqueue(resp)

    def _stop_reading(self) -> None:
        if self.reading and self.transport is not None and not self.closed:
            self.reading = False
            self.transport.pause_reading()

    def _start_reading(self) -> None:
        if not self.reading and self.transport is not None and not self.closed:
            self.reading = True
            self.transport.resume_reading()

    def idle(self) -> bool:
        return self.task is None and not self.queue and self.begun is None

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # flushes what was written, then closes

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # nothing more is written: the client would not read it


_REASONS = {s.value: s.phrase for s in HTTPStatus}


class HttpServer:
    """One listener, its connections and the sweep of idle and stuck ones."""

    def __init__(self, router: Router, dispatch_errors: Callable[[Request, BaseException], Response], *,
                 max_body: int, keepalive_s: float = 75.0, request_timeout_s: float = 60.0,
                 max_connections: int = 1024, write_timeout_s: float = 30.0,
                 memory: RequestMemory | None = None) -> None:
        self.router = router
        self.on_error = dispatch_errors
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.write_timeout_s = write_timeout_s
        self.memory = memory or RequestMemory(1 << 62, 1 << 62)
        self.refused = 0  # connections refused for the limit
        self._inflators = asyncio.Semaphore(INFLATORS)
        self.connections: set[HttpConnection] = set()
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._date_s = -1
        self._date = ""

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen; `reuse_port` for frontend workers, which each bind the same port (SO_REUSEPORT: the
        kernel spreads new connections over them)."""
        self._server = await self.loop.create_server(lambda: HttpConnection(self), host, port, backlog=1024,
                                                     reuse_address=True, reuse_port=reuse_port or None)
        self._sweeper = self.loop.create_task(self._sweep(), name="http-sweeper")
        # (through Any: uvloop's server gives a list where typeshed says tuple, which compiled code checks)
        server: Any = self._server
        bound = list(server.sockets or ())
        return int(bound[0].getsockname()[1]) if bound else port

    async def inflate_and_dispatch(self, req: Request) -> Response:
        """Inflate a compressed body in a worker thread (at most INFLATORS at a time, so what is
        being inflated and not yet charged stays within INFLATORS x max_body), charge it to the
        request's memory, then dispatch."""
        try:
            async with self._inflators:
                body = await self.loop.run_in_executor(None, inflate, req.body, req.encoding, self.max_body)
        except EscapementError as e:
            return error_response(e)
        if req.lease is not None and not req.lease.take(len(body)):
            return error_response(self.memory.refusal(len(body)))
        req.body, req.encoding = body, ""
        return await self.dispatch(req)

    async def dispatch(self, req: Request) -> Response:
        try:
            handler, req.params = self.router.resolve(req.method, req.path)
            return await handler(req)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return self.on_error(req, e)

    def date(self) -> str:
        now = int(time.time())
        if now != self._date_s:
            self._date_s, self._date = now, formatdate(now, usegmt=True)
        return self._date

    async def _sweep(self) -> None:
        """Close connections idle past the keep-alive timeout; answer 408 to a request that has not
        arrived whole in request_timeout_s (a slow or stuck client holds no more than a socket)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep(self.loop.time())

    def sweep(self, now: float) -> None:
        """One pass of the sweep at time `now` (the loop's time)."""
        for c in list(self.connections):
            if c.lingering_since is not None:
                if now - c.lingering_since > LINGER_S:
                    c.close()
            elif c.write_blocked_since is not None and now - c.write_blocked_since > self.write_timeout_s:
                c.abort()  # its client stopped reading its answers: drop them, and its requests
            elif c.begun is not None and now - c.begun > self.request_timeout_s:
                c._refuse(RequestTimeout(f"the request did not arrive whole within {self.request_timeout_s:g} s"))
            elif c.idle() and now - c.last_active > self.keepalive_s:
                c.close()

    async def stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for c in list(self.connections):
            if c.task is not None:
                c.task.cancel()
            c.close()
        if self._server is not None:
            self._server.close()
            self._server = None
