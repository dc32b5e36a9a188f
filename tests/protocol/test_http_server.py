"""HttpServer on its own, bytes in and bytes out over a real 127.0.0.1 socket (no daemon).

A Router with trivial handlers (echo, raise BadRequest, raise anything, wait on an event) behind
`HttpServer`; each test talks raw HTTP/1.1 to it with `asyncio.open_connection`. Nothing waits by
sleeping: every wait is on bytes or an event, under `asyncio.wait_for` as an upper bound.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import struct
import threading
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from daemon.api import httpserver
from daemon.api.budget import RequestMemory
from daemon.api.httpserver import HttpServer, Request, Response, Router, error_response
from daemon.errors import BadRequest

MAX_BODY = 1024
WAIT_S = 2.0  # upper bound on any one wait; a passing test waits for bytes or events, never this long


async def until(cond: Callable[[], bool], limit_s: float = WAIT_S) -> None:
    """Run the loop (no timer) until the server's state satisfies cond, limit_s at most."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "the server never reached the state"
        await asyncio.sleep(0)
SHORT_S = 0.5  # upper bound where the failure mode is "nothing ever comes"


# ------------------------------------------------------------------ the server under test


@dataclass
class Hooks:
    """What the handlers report to the test."""

    started: asyncio.Event = field(default_factory=asyncio.Event)  # /wait entered
    release: asyncio.Event = field(default_factory=asyncio.Event)  # /wait may answer
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # /wait was cancelled
    errors: list[tuple[Request, BaseException]] = field(default_factory=list)  # what on_error saw


def build_router(hooks: Hooks) -> Router:
    async def echo(req: Request) -> Response:
        return Response(orjson.dumps({
            "method": req.method, "path": req.path, "query": req.query, "params": req.params,
            "headers": req.headers, "body": req.body.decode("latin-1"), "keep_alive": req.keep_alive,
        }))

    async def bad(req: Request) -> Response:
        raise BadRequest("the input is wrong")

    async def boom(req: Request) -> Response:
        raise RuntimeError("boom")

    async def wait(req: Request) -> Response:
        hooks.started.set()
        try:
            await hooks.release.wait()
        except asyncio.CancelledError:
            hooks.cancelled.set()
            raise
        return Response(b'{"waited": true}')

    r = Router()
    r.add("POST", "/echo/{name}", echo)
    r.add("GET", "/echo/{name}", echo)
    r.add("GET", "/bad", bad)
    r.add("GET", "/boom", boom)
    r.add("GET", "/wait", wait)
    r.add("POST", "/wait", wait)
    r.add("POST", "/post-only", echo)

    async def big(req: Request) -> Response:
        return Response(b"x" * (1 << 20))

    r.add("GET", "/big", big)
    return r


Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter


class Harness:
    def __init__(self, server: HttpServer, port: int, hooks: Hooks) -> None:
        self.server = server
        self.port = port
        self.hooks = hooks
        self.writers: list[Writer] = []

    async def connect(self) -> tuple[Reader, Writer]:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port), WAIT_S)
        self.writers.append(writer)
        return reader, writer

    async def aclose(self) -> None:
        for w in self.writers:
            if not w.is_closing():
                w.close()
            try:
                await asyncio.wait_for(w.wait_closed(), WAIT_S)
            except (ConnectionError, OSError):
                pass
        await self.server.close()


Start = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """`await start(max_body=..., keepalive_s=..., request_timeout_s=...)` -> a listening Harness."""
    harnesses: list[Harness] = []

    async def _start(*, max_body: int = MAX_BODY, keepalive_s: float = 75.0, request_timeout_s: float = 60.0,
                     max_connections: int = 1024, write_timeout_s: float = 30.0,
                     memory: RequestMemory | None = None) -> Harness:
        hooks = Hooks()

        def on_error(req: Request, exc: BaseException) -> Response:
            hooks.errors.append((req, exc))
            return error_response(exc)

        server = HttpServer(build_router(hooks), on_error, max_body=max_body, keepalive_s=keepalive_s,
                            request_timeout_s=request_timeout_s, max_connections=max_connections,
                            write_timeout_s=write_timeout_s, memory=memory)
        port = await server.start("127.0.0.1", 0)
        h = Harness(server, port, hooks)
        harnesses.append(h)
        return h

    yield _start
    for h in harnesses:
        await h.aclose()


@pytest.fixture
async def srv(start: Start) -> Harness:
    return await start()


# ------------------------------------------------------------------ the client side


@dataclass
class Reply:
    version: str
    status: int
    reason: str
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def closes(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


async def read_reply(reader: Reader, *, head: bool = False, within: float = WAIT_S) -> Reply:
    """One response: status line, headers and (unless `head`) a Content-Length body."""
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within)
    status_line, *lines = raw[:-4].decode("latin-1").split("\r\n")
    version, status, reason = status_line.split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines:
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    body = b""
    if not head and int(status) >= 200:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), within)
    return Reply(version, int(status), reason, headers, body)


async def assert_closed(reader: Reader) -> None:
    """The server hung up: nothing more comes, then EOF."""
    assert await asyncio.wait_for(reader.read(), WAIT_S) == b""


def request(method: str, target: str, body: bytes = b"", *, headers: dict[str, str] | None = None,
            version: str = "HTTP/1.1", length: bool = True) -> bytes:
    lines = [f"{method} {target} {version}", "Host: test"]
    if length and (body or method in ("POST", "PUT")):
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(*chunks: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def post_chunked(target: str, *chunks: bytes, headers: dict[str, str] | None = None) -> bytes:
    return request("POST", target, chunked(*chunks), headers={"Transfer-Encoding": "chunked", **(headers or {})},
                   length=False)


def assert_json_error(reply: Reply, status: int, contains: str = "") -> None:
    assert reply.status == status, (reply.status, reply.body)
    assert reply.headers["content-type"] == "application/json"
    obj = reply.json()
    assert list(obj) == ["error"] and isinstance(obj["error"], str)
    assert contains in obj["error"]


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


# ------------------------------------------------------------------ requests and keep-alive


async def test_post_with_content_length(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/m?x=1&y=%20", b'{"a": 1}', headers={"X-Thing": "v"}))
    reply = await read_reply(reader)
    assert reply.version == "HTTP/1.1" and reply.status == 200 and reply.reason == "OK"
    assert reply.headers["content-type"] == "application/json"
    assert int(reply.headers["content-length"]) == len(reply.body)
    assert reply.headers["date"].endswith(" GMT")
    assert not reply.closes
    got = reply.json()
    assert got["method"] == "POST" and got["path"] == "/echo/m" and got["params"] == {"name": "m"}
    assert got["query"] == "x=1&y=%20"  # the query string is passed on raw
    assert got["body"] == '{"a": 1}'
    assert got["headers"]["x-thing"] == "v" and got["headers"]["content-length"] == "8"
    assert got["keep_alive"] is True


async def test_keep_alive_answers_two_requests_in_order(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/one", b"first"))
    first = await read_reply(reader)
    writer.write(request("GET", "/echo/two"))
    second = await read_reply(reader)
    assert (first.status, first.json()["params"], first.json()["body"]) == (200, {"name": "one"}, "first")
    assert (second.status, second.json()["method"], second.json()["params"]) == (200, "GET", {"name": "two"})
    assert len(srv.server.connections) == 1


async def test_repeated_headers_are_joined(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(b"GET /echo/h HTTP/1.1\r\nHost: t\r\nX-Multi: a\r\nx-multi: b\r\n\r\n")
    assert (await read_reply(reader)).json()["headers"]["x-multi"] == "a, b"


async def test_pipelined_requests_are_answered_in_order(srv: Harness) -> None:
    reader, writer = await srv.connect()
    names = [f"r{i}" for i in range(6)]
    writer.write(b"".join(request("POST", f"/echo/{n}", n.encode()) if i % 2 else request("GET", f"/echo/{n}")
                          for i, n in enumerate(names)))
    replies = [await read_reply(reader) for _ in names]
    assert [r.json()["params"]["name"] for r in replies] == names
    assert [r.json()["body"] for r in replies] == [n if i % 2 else "" for i, n in enumerate(names)]


async def test_pipelined_answers_wait_for_a_slow_first_request(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/wait") + request("GET", "/echo/after"))
    await asyncio.wait_for(srv.hooks.started.wait(), WAIT_S)
    srv.hooks.release.set()
    first, second = await read_reply(reader), await read_reply(reader)
    assert first.json() == {"waited": True}
    assert second.json()["params"] == {"name": "after"}


async def test_pipelined_bad_request_after_good_ones_is_answered_last_then_closed(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/echo/a") + request("GET", "/echo/b") + b"BOGUS\x01 / HTTP/1.1\r\n\r\n")
    a, b, bad = await read_reply(reader), await read_reply(reader), await read_reply(reader)
    assert [a.json()["params"]["name"], b.json()["params"]["name"]] == ["a", "b"]
    assert_json_error(bad, 400, "malformed HTTP request")
    assert bad.closes
    await assert_closed(reader)


async def test_pipelining_past_the_read_ahead_depth_still_reads_the_rest(srv: Harness) -> None:
    """More than PIPELINE_DEPTH requests in one write, then one request completed later."""
    depth = httpserver.PIPELINE_DEPTH
    reader, writer = await srv.connect()
    writer.write(b"".join(request("GET", f"/echo/p{i}") for i in range(depth + 4)))
    replies = [await read_reply(reader) for _ in range(depth + 4)]
    assert [r.json()["params"]["name"] for r in replies] == [f"p{i}" for i in range(depth + 4)]
    writer.write(request("GET", "/echo/later"))
    assert (await read_reply(reader)).json()["params"] == {"name": "later"}


async def test_pipelining_past_the_depth_with_a_partly_read_next_request(srv: Harness) -> None:
    """PIPELINE_DEPTH whole requests and the head of one more in one write; its body comes later."""
    depth = httpserver.PIPELINE_DEPTH
    reader, writer = await srv.connect()
    whole = b"".join(request("GET", f"/echo/p{i}") for i in range(depth))
    writer.write(whole + request("POST", "/echo/last", b"hello")[:-5])  # the head only
    replies = [await read_reply(reader) for _ in range(depth)]
    assert [r.json()["params"]["name"] for r in replies] == [f"p{i}" for i in range(depth)]
    writer.write(b"hello")
    last = await read_reply(reader, within=SHORT_S)
    assert last.json()["body"] == "hello"


# ------------------------------------------------------------------ request bodies


async def test_chunked_body_is_dechunked(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(post_chunked("/echo/c", b"hello ", b"chunked ", b"world"))
    reply = await read_reply(reader)
    assert reply.status == 200 and reply.json()["body"] == "hello chunked world"
    # the same again with the chunks split across writes, a chunk extension and a trailer
    writer.write(b"POST /echo/c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nab")
    await writer.drain()
    writer.write(b"cde\r\n3\r\nfgh\r\n0\r\nX-Trailer: t\r\n\r\n")
    reply = await read_reply(reader)
    assert reply.status == 200 and reply.json()["body"] == "abcdefgh"


@pytest.mark.parametrize(("encoding", "compress"), [
    ("gzip", gzip.compress),
    ("x-gzip", gzip.compress),
    ("deflate", zlib.compress),  # RFC 9110 deflate: zlib-wrapped
    ("deflate", raw_deflate),  # what some clients send as deflate: a raw stream
    ("GZip", gzip.compress),  # content codings are case-insensitive
], ids=["gzip", "x-gzip", "deflate-zlib", "deflate-raw", "gzip-mixed-case"])
async def test_compressed_bodies_are_decompressed(srv: Harness, encoding: str,
                                                  compress: Callable[[bytes], bytes]) -> None:
    plain = b"tensor data " * 50  # 600 bytes, under MAX_BODY
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/z", compress(plain), headers={"Content-Encoding": encoding}))
    reply = await read_reply(reader)
    assert reply.status == 200, reply.body
    assert reply.json()["body"] == plain.decode()
    # chunked as well, fed to the decoder a byte at a time after the first two (a one-byte first piece of a
    # raw deflate stream is test_raw_deflate_whose_first_piece_is_one_byte)
    data = compress(plain)
    writer.write(post_chunked("/echo/z", data[:2], *(bytes([b]) for b in data[2:]),
                              headers={"Content-Encoding": encoding}))
    reply = await read_reply(reader)
    assert reply.status == 200, reply.body
    assert reply.json()["body"] == plain.decode()


async def test_gzip_body_that_decompresses_to_exactly_the_limit_is_accepted(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/z", gzip.compress(b"x" * MAX_BODY), headers={"Content-Encoding": "gzip"}))
    reply = await read_reply(reader)
    assert reply.status == 200 and len(reply.json()["body"]) == MAX_BODY


async def test_a_body_in_an_encoding_we_do_not_decode_is_415_and_closes(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/z", b"whatever", headers={"Content-Encoding": "br"}))
    reply = await read_reply(reader)
    assert_json_error(reply, 415, "'br'")
    assert reply.closes
    await assert_closed(reader)


@pytest.mark.parametrize("body", [b"this is not gzip at all", gzip.compress(b"abc") + b"trailing",
                                  gzip.compress(b"x" * 500)[:-12]])
async def test_a_body_that_does_not_inflate_is_400_and_the_connection_goes_on(srv: Harness, body: bytes) -> None:
    reader, writer = await srv.connect()
    # the framing (Content-Length) is intact: the next request on the connection is read and answered
    writer.write(request("POST", "/echo/z", body, headers={"Content-Encoding": "gzip"}) + request("GET", "/echo/next"))
    reply = await read_reply(reader)
    assert reply.status == 400 and not reply.closes, reply.body
    assert (await read_reply(reader)).json()["path"] == "/echo/next"


async def test_truncated_gzip_is_400(srv: Harness) -> None:
    plain = b"0123456789" * 20
    reader, writer = await srv.connect()
    cut = gzip.compress(plain)[:-8]  # no CRC32 / size trailer
    writer.write(request("POST", "/echo/z", cut, headers={"Content-Encoding": "gzip"}))
    reply = await read_reply(reader)
    assert_json_error(reply, 400)


async def test_raw_deflate_whose_first_piece_is_one_byte(srv: Harness) -> None:
    plain = b"tensor data " * 50
    data = raw_deflate(plain)
    reader, writer = await srv.connect()
    writer.write(post_chunked("/echo/z", data[:1], data[1:], headers={"Content-Encoding": "deflate"}))
    reply = await read_reply(reader)
    assert reply.status == 200, reply.body
    assert reply.json()["body"] == plain.decode()


async def test_expect_100_continue(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/e", headers={"Content-Length": "5", "Expect": "100-continue"}, length=False))
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"12345")
    reply = await read_reply(reader)
    assert reply.status == 200 and reply.json()["body"] == "12345"


async def test_expect_100_continue_over_the_limit_is_413_without_100(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/e", headers={"Content-Length": str(MAX_BODY + 1), "Expect": "100-continue"},
                         length=False))
    reply = await read_reply(reader)  # the first thing back is the final answer
    assert_json_error(reply, 413)
    await assert_closed(reader)


async def test_100_continue_of_a_pipelined_request_comes_after_earlier_answers(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/wait") +
                 request("POST", "/echo/e", headers={"Content-Length": "3", "Expect": "100-continue"}, length=False))
    await asyncio.wait_for(srv.hooks.started.wait(), WAIT_S)
    srv.hooks.release.set()
    first = await read_reply(reader)
    assert first.status == 200 and first.json() == {"waited": True}
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"abc")
    assert (await read_reply(reader)).json()["body"] == "abc"


# ------------------------------------------------------------------ methods and routing


async def test_head_on_a_get_route_has_content_length_and_no_body(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/echo/h"))
    get = await read_reply(reader)
    writer.write(request("HEAD", "/echo/h") + request("GET", "/echo/next"))
    head = await read_reply(reader, head=True)
    assert head.status == 200
    assert int(head.headers["content-length"]) == len(get.body) - len('"GET"') + len('"HEAD"')
    # the next bytes are the next answer's status line, not a body
    after = await read_reply(reader)
    assert after.status == 200 and after.json()["params"] == {"name": "next"}


async def test_head_on_a_post_only_route_is_405(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("HEAD", "/post-only"))
    reply = await read_reply(reader, head=True)
    assert reply.status == 405 and int(reply.headers["content-length"]) > 0


async def test_unknown_path_is_404(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/nowhere") + request("GET", "/echo/a/b"))
    for _ in range(2):
        reply = await read_reply(reader)
        assert reply.status == 404 and reply.json() == {"error": "Not Found"}
        assert not reply.closes  # a routing miss keeps the connection
    writer.write(request("GET", "/echo/ok"))
    assert (await read_reply(reader)).status == 200


async def test_wrong_method_is_405(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("PUT", "/echo/x", b"{}") + request("DELETE", "/wait"))
    for _ in range(2):
        reply = await read_reply(reader)
        assert reply.status == 405 and reply.json() == {"error": "Method Not Allowed"}
    assert not srv.hooks.started.is_set()


async def test_routing_uses_the_raw_path_and_decodes_each_parameter(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/echo/a%20b") + request("GET", "/echo/%C3%A9t%C3%A9") + request("GET", "/echo/x%2Fy")
                 + request("GET", "/%65cho/z"))
    first, second, third, fourth = [await read_reply(reader) for _ in range(4)]
    assert first.status == 200 and first.json()["params"] == {"name": "a b"} and first.json()["path"] == "/echo/a%20b"
    assert second.status == 200 and second.json()["params"] == {"name": "été"}
    assert third.status == 200 and third.json()["params"] == {"name": "x/y"}  # an encoded "/" stays in the name
    assert fourth.status == 404  # an encoded path never reaches a route its decoded form would


# ------------------------------------------------------------------ limits and malformed requests


async def test_content_length_over_the_limit_is_413_before_the_body(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/big", headers={"Content-Length": str(MAX_BODY + 1)}, length=False))
    reply = await read_reply(reader)  # no body was sent: the server answered from the headers alone
    assert_json_error(reply, 413, "limit")
    assert reply.closes
    await assert_closed(reader)
    assert srv.hooks.errors == []  # refused by the connection, no handler involved


async def test_content_length_at_the_limit_is_accepted(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/big", b"b" * MAX_BODY))
    reply = await read_reply(reader)
    assert reply.status == 200 and len(reply.json()["body"]) == MAX_BODY


async def test_chunked_body_over_the_limit_is_413(srv: Harness) -> None:
    reader, writer = await srv.connect()
    half = b"c" * (MAX_BODY // 2 + 1)
    writer.write(post_chunked("/echo/big", half, half))
    reply = await read_reply(reader)
    assert_json_error(reply, 413, "limit")
    assert reply.closes
    await assert_closed(reader)


async def test_gzip_body_decompressing_over_the_limit_is_413(srv: Harness) -> None:
    reader, writer = await srv.connect()
    bomb = gzip.compress(b"\0" * (MAX_BODY * 100))
    assert len(bomb) < MAX_BODY
    writer.write(request("POST", "/echo/z", bomb, headers={"Content-Encoding": "gzip"}) + request("GET", "/echo/next"))
    reply = await read_reply(reader)
    assert_json_error(reply, 413, "decompressed")
    assert not reply.closes  # it was read whole: the connection goes on
    assert (await read_reply(reader)).json()["path"] == "/echo/next"


async def test_a_gzip_bomb_is_inflated_off_the_event_loop(srv: Harness) -> None:
    """zlib never runs on the loop's thread: a body of a few KiB that inflates to many MiB costs a
    worker thread a while, not every other connection."""
    reader, writer = await srv.connect()
    threads: list[int] = []
    real = httpserver.inflate

    def spy(data: bytes, encoding: str, limit: int) -> bytes:
        threads.append(threading.get_ident())
        return real(data, encoding, limit)

    httpserver.inflate = spy  # type: ignore[assignment]
    try:
        writer.write(request("POST", "/echo/z", gzip.compress(b"y" * 100), headers={"Content-Encoding": "gzip"}))
        reply = await read_reply(reader)
    finally:
        httpserver.inflate = real  # type: ignore[assignment]
    assert reply.status == 200 and reply.json()["body"] == "y" * 100
    assert len(threads) == 1 and threads[0] != threading.get_ident()


async def test_headers_over_the_limit_are_431_and_close(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/echo/h", headers={"X-Big": "a" * 70_000}))
    reply = await read_reply(reader)
    assert_json_error(reply, 431)
    assert reply.closes
    await assert_closed(reader)


async def test_too_many_header_lines_are_431(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/echo/h", headers={f"X-H{i}": "v" for i in range(httpserver.MAX_HEADERS + 1)}))
    reply = await read_reply(reader)
    assert_json_error(reply, 431)
    await assert_closed(reader)


async def test_malformed_request_line_is_400_json_and_close(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(b"THIS IS NOT HTTP\r\n\r\n")
    reply = await read_reply(reader)
    assert_json_error(reply, 400, "malformed HTTP request")
    assert reply.closes
    await assert_closed(reader)


async def test_http_1_0_without_keep_alive_is_answered_and_closed(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/echo/old", version="HTTP/1.0"))
    reply = await read_reply(reader)
    assert reply.status == 200 and reply.json()["keep_alive"] is False
    assert reply.closes
    await assert_closed(reader)


async def test_connection_close_is_answered_with_connection_close_and_closed(srv: Harness) -> None:
    reader, writer = await srv.connect()
    # what follows the closing request is never answered
    writer.write(request("POST", "/echo/bye", b"x", headers={"Connection": "close"}) + request("GET", "/echo/never"))
    reply = await read_reply(reader)
    assert reply.status == 200 and reply.json()["params"] == {"name": "bye"}
    assert reply.closes
    await assert_closed(reader)


# ------------------------------------------------------------------ handler errors


@pytest.mark.parametrize(("path", "status", "error", "kind"), [
    ("/bad", 400, "the input is wrong", BadRequest),  # the handler's own error and its status
    ("/boom", 500, "internal error: RuntimeError: boom", RuntimeError),  # anything else: 500
])
async def test_a_handler_error_is_answered_as_json_and_the_connection_stays(srv: Harness, path: str, status: int,
                                                                            error: str, kind: type) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", path))
    reply = await read_reply(reader)
    assert reply.status == status and reply.json() == {"error": error}
    assert not reply.closes
    [(req, exc)] = srv.hooks.errors
    assert req.path == path and isinstance(exc, kind)
    writer.write(request("GET", "/echo/still-open"))
    assert (await read_reply(reader)).status == 200


# ------------------------------------------------------------------ hang-ups and timeouts


async def test_client_reset_cancels_its_waiting_handler(srv: Harness) -> None:
    _, writer = await srv.connect()
    writer.write(request("GET", "/wait"))
    await asyncio.wait_for(srv.hooks.started.wait(), WAIT_S)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
    writer.close()
    await asyncio.wait_for(srv.hooks.cancelled.wait(), WAIT_S)
    assert not srv.hooks.release.is_set()


async def test_client_close_is_a_half_close_its_request_runs_and_the_connection_ends(srv: Harness) -> None:
    """A FIN cannot be told from shutdown(SHUT_WR): the request is not cancelled (its deadline bounds
    it), its answer goes nowhere, and the server then closes the connection."""
    _, writer = await srv.connect()
    writer.write(request("GET", "/wait"))
    await asyncio.wait_for(srv.hooks.started.wait(), WAIT_S)
    (conn,) = srv.server.connections
    writer.close()  # an ordinary close: FIN
    srv.hooks.release.set()

    async def closed() -> None:
        while srv.server.connections:  # noqa: ASYNC110 - the close comes from protocol callbacks
            await asyncio.sleep(0)

    await asyncio.wait_for(closed(), WAIT_S)
    assert not srv.hooks.cancelled.is_set() and conn.closed


async def test_body_sent_after_a_413_does_not_reset_the_answer(srv: Harness) -> None:
    """A refused request's unread body is drained (lingering close), so the 413 is read, not reset."""
    reader, writer = await srv.connect()
    body = b"x" * (20 * 2**20)  # more than the kernel buffers on loopback hold
    writer.write(b"POST /echo/a HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    reply = await read_reply(reader)
    assert reply.status == 413
    await assert_closed(reader)


async def test_half_closed_client_still_gets_its_answers(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/a", b"1") + request("GET", "/echo/b"))
    writer.write_eof()  # shutdown(SHUT_WR)
    a, b = await read_reply(reader), await read_reply(reader)
    assert (a.status, a.json()["body"], b.status, b.json()["params"]) == (200, "1", 200, {"name": "b"})
    await assert_closed(reader)


async def test_half_closed_client_waiting_on_a_slow_handler_gets_its_answer(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(request("GET", "/wait"))
    writer.write_eof()
    await asyncio.wait_for(srv.hooks.started.wait(), WAIT_S)
    srv.hooks.release.set()
    reply = await read_reply(reader)
    assert reply.json() == {"waited": True}
    assert not srv.hooks.cancelled.is_set()
    await assert_closed(reader)


def later(seconds: float) -> float:
    """A time `seconds` ahead on the loop's clock, for one pass of the server's sweep."""
    return asyncio.get_running_loop().time() + seconds


async def test_idle_keep_alive_connection_is_closed(start: Start) -> None:
    h = await start(keepalive_s=60.0)
    reader, writer = await h.connect()
    writer.write(request("GET", "/echo/once"))
    assert (await read_reply(reader)).status == 200
    reader2, _ = await h.connect()  # a connection that never sent anything
    await until(lambda: len(h.server.connections) == 2)
    h.server.sweep(later(30.0))  # idle, but not for keepalive_s yet
    assert len(h.server.connections) == 2
    h.server.sweep(later(61.0))  # nothing was asked for keepalive_s: the server hangs up on both
    await assert_closed(reader)
    await assert_closed(reader2)


async def test_connection_with_a_request_in_progress_is_not_idle(start: Start) -> None:
    h = await start(keepalive_s=60.0)
    busy_reader, busy_writer = await h.connect()
    busy_writer.write(request("GET", "/wait"))
    await asyncio.wait_for(h.hooks.started.wait(), WAIT_S)
    idle_reader, _ = await h.connect()
    await until(lambda: len(h.server.connections) == 2)
    h.server.sweep(later(61.0))  # past keepalive_s for both connections
    await assert_closed(idle_reader)
    h.hooks.release.set()
    reply = await read_reply(busy_reader)
    assert reply.json() == {"waited": True}
    assert not h.hooks.cancelled.is_set()


async def test_request_that_never_completes_is_408_and_closed(start: Start) -> None:
    h = await start(request_timeout_s=60.0)
    reader, writer = await h.connect()
    writer.write(request("POST", "/echo/slow", headers={"Content-Length": "10"}, length=False) + b"abc")
    await until(lambda: any(c.begun is not None for c in h.server.connections))  # its head was read
    h.server.sweep(later(61.0))
    reply = await read_reply(reader)
    assert_json_error(reply, 408, "did not arrive whole")
    assert reply.closes
    await assert_closed(reader)


async def test_request_whose_headers_never_complete_is_408(start: Start) -> None:
    h = await start(request_timeout_s=60.0)
    reader, writer = await h.connect()
    writer.write(b"GET /echo/x HTTP/1.1\r\nHost: t\r\nX-Half: ")
    await until(lambda: any(c.begun is not None for c in h.server.connections))
    h.server.sweep(later(61.0))
    reply = await read_reply(reader)
    assert_json_error(reply, 408)
    await assert_closed(reader)


# ------------------------------------------------------------------ hardening: connections


async def test_connections_past_the_limit_get_503_and_are_closed(start: Start) -> None:
    srv = await start(max_connections=2)
    held = [await srv.connect() for _ in range(2)]
    for reader, writer in held:  # both are served
        writer.write(request("GET", "/echo/a"))
        assert (await read_reply(reader)).status == 200
    reader, writer = await srv.connect()
    reply = await read_reply(reader)
    assert reply.status == 503 and reply.headers.get("retry-after") == "1"
    assert "server.max_connections" in reply.json()["error"]
    assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # and closed
    assert srv.server.refused == 1
    writer.close()
    held[0][1].close()
    await held[0][1].wait_closed()
    await until(lambda: len(srv.server.connections) == 1)  # the server saw both closes
    reader, writer = await srv.connect()  # a freed slot serves again
    writer.write(request("GET", "/echo/b"))
    assert (await read_reply(reader)).status == 200


async def test_a_client_that_stops_reading_its_answers_is_dropped(start: Start) -> None:
    srv = await start(write_timeout_s=30.0)
    _reader, writer = await srv.connect()
    writer.transport.set_write_buffer_limits(0)  # type: ignore[attr-defined]
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for _ in range(16):  # 16 MiB of answers nobody reads
        writer.write(request("GET", "/big"))
    await writer.drain()
    await until(lambda: any(c.write_blocked_since is not None for c in srv.server.connections), limit_s=10)
    srv.server.sweep(later(31.0))  # its answers blocked past write_timeout_s: the server gives up on it
    await until(lambda: not srv.server.connections)  # aborted: its connection_lost comes next


# ------------------------------------------------------------------ request memory


async def test_a_body_past_the_request_memory_gets_503_and_the_connection_goes_on(start: Start) -> None:
    memory = RequestMemory(10_000, 10_000)
    srv = await start(memory=memory, max_body=1 << 20)
    reader, writer = await srv.connect()
    writer.write(request("POST", "/echo/a", b"x" * 20_000) + request("POST", "/echo/b", b"small"))
    refused = await read_reply(reader)
    assert refused.status == 503 and refused.headers.get("retry-after") == "1" and not refused.closes
    assert "server.request_memory_bytes" in refused.json()["error"]
    ok = await read_reply(reader)  # the refused body was read and dropped: framing holds
    assert ok.status == 200 and ok.json()["body"] == "small"
    assert memory.refused == 1 and memory.held == 0 and memory.peak == 5


async def test_a_chunked_body_past_the_request_memory_gets_503_and_a_close(start: Start) -> None:
    memory = RequestMemory(10_000, 10_000)
    srv = await start(memory=memory, max_body=1 << 20)
    reader, writer = await srv.connect()
    chunk = b"x" * 6000
    writer.write(request("POST", "/echo/a", headers={"Transfer-Encoding": "chunked"}, length=False)
                 + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2)
    reply = await read_reply(reader)
    assert reply.status == 503 and reply.closes
    await assert_closed(reader)
    await until(lambda: memory.held == 0)


async def test_a_connection_past_its_share_stops_reading_until_its_answers_are_written(start: Start) -> None:
    memory = RequestMemory(1 << 20, 8000)
    srv = await start(memory=memory, max_body=1 << 20)
    reader, writer = await srv.connect()
    writer.write(request("POST", "/wait", b"w" * 5000) + request("POST", "/echo/a", b"a" * 5000))
    await srv.hooks.started.wait()
    (conn,) = srv.server.connections
    await until(lambda: not conn.reading)  # 10,000 bytes held: past its share of 8,000
    assert memory.held == 10_000
    writer.write(request("POST", "/echo/b", b"b" * 5000))  # waits, unread, in the socket
    srv.hooks.release.set()
    replies = [await read_reply(reader) for _ in range(3)]
    assert [r.status for r in replies] == [200, 200, 200]
    assert replies[2].json()["body"] == "b" * 5000
    assert memory.peak == 10_000  # the third body was read only after the first answers were written
    await until(lambda: memory.held == 0)


async def test_a_reset_mid_body_releases_its_memory_at_once(start: Start) -> None:
    memory = RequestMemory(1 << 20, 1 << 20)
    srv = await start(memory=memory, max_body=1 << 20)
    _reader, writer = await srv.connect()
    writer.write(b"POST /echo/a HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000)
    await until(lambda: memory.held == 100_000)  # charged whole, from Content-Length
    writer.transport.abort()  # type: ignore[attr-defined]
    await until(lambda: memory.held == 0)


@pytest.mark.parametrize("target", [
    b"CONNECT example.com:443 HTTP/1.1",          # a proxy tunnel, not a request for us
    b"CONNECT /echo/x HTTP/1.1",                   # CONNECT with an origin-form target
    b"GET http://[::1/echo/x HTTP/1.1",            # an absolute URL whose host never ends
    b"GET http://test:99999999999/echo/x HTTP/1.1",  # a port past 65535
    b"GET http:///echo/x HTTP/1.1",                # an absolute URL with no host
    b"GET * HTTP/1.1",                             # asterisk-form outside OPTIONS
    b"GET //echo HTTP/1.1",                        # an empty first segment: no route
])
async def test_a_target_the_parser_refuses_is_400_without_an_error_logged(srv: Harness, target: bytes) -> None:
    reader, writer = await srv.connect()
    writer.write(target + b"\r\nHost: test\r\n\r\n")
    reply = await read_reply(reader)
    assert 400 <= reply.status < 500, (reply.status, reply.body)
    assert reply.headers["content-type"] == "application/json"
    # (the autouse no_unexpected_errors fixture fails this test if a traceback was logged)


async def test_an_absolute_url_target_is_routed_by_its_path(srv: Harness) -> None:
    reader, writer = await srv.connect()
    writer.write(b"GET http://test/echo/abs?x=1 HTTP/1.1\r\nHost: test\r\n\r\n")
    reply = await read_reply(reader)
    assert reply.status == 200 and reply.json()["path"] == "/echo/abs" and reply.json()["query"] == "x=1"


@pytest.mark.parametrize(("raw", "status"), [
    (b"HEAD /echo/x HTTP/1.1\r\nHost: test\r\nContent-Length: 0x0\r\n\r\n", 400),  # the parser refuses it
    (b"HEAD /echo/" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: test\r\n\r\n", 431),  # over the header limit
])
async def test_a_refused_head_request_is_answered_without_a_body(srv: Harness, raw: bytes, status: int) -> None:
    reader, writer = await srv.connect()
    writer.write(raw)
    reply = await read_reply(reader, head=True)
    assert reply.status == status and reply.closes
    assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # no body before the close
