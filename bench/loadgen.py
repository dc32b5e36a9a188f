"""An open-loop load generator: arrivals follow a schedule and never wait for answers.

Schedules: constant rate, Poisson, bursty (gamma inter-arrivals or on/off) and traces (a file
of `seconds model` lines). Transports: HTTP/1.1 (KServe v2 binary or JSON, or any prebuilt
request for peers) and the daemon's unix-socket msgpack protocol. Both clients are small
asyncio protocols written for this: a general HTTP client costs several times more CPU per
request, and on a 2-core machine that CPU comes out of the server's share.

Every request records when it was scheduled, when it was actually written, when its answer
was complete, its status and whether it was reconstructed. The generator's own lag (written
minus scheduled) is part of the result: a run where the generator, not the server, fell
behind is flagged.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

# uvloop's loop.time() is cached per iteration at millisecond resolution: too coarse for latencies.
_now = time.monotonic

# Status codes for failures that never got an HTTP status.
NO_ANSWER = -1  # still outstanding when the run's drain time ran out
CONN_ERROR = -2  # the connection broke
POOL_FULL = -3  # every connection was busy at the pool's limit: refused by the generator itself


# ------------------------------------------------------------------ schedules


@dataclass(frozen=True)
class Schedule:
    """Arrival offsets (s, sorted) and which target each arrival uses."""

    times: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return len(self.times)

    @property
    def duration(self) -> float:
        return float(self.times[-1]) if len(self.times) else 0.0


def _pick_targets(n: int, n_targets: int, weights: Sequence[float] | None, rng: np.random.Generator) -> np.ndarray:
    if n_targets == 1:
        return np.zeros(n, dtype=np.int32)
    p = None if weights is None else np.asarray(weights, dtype=float) / float(np.sum(weights))
    return rng.choice(n_targets, size=n, p=p).astype(np.int32)


def constant(rate: float, duration: float, n_targets: int = 1, weights: Sequence[float] | None = None,
             seed: int = 0) -> Schedule:
    n = max(1, int(rate * duration))
    rng = np.random.default_rng(seed)
    return Schedule(np.arange(n) / rate, _pick_targets(n, n_targets, weights, rng))


def poisson(rate: float, duration: float, n_targets: int = 1, weights: Sequence[float] | None = None,
            seed: int = 0) -> Schedule:
    rng = np.random.default_rng(seed)
    n = max(1, int(rate * duration * 1.2) + 20)
    times = np.cumsum(rng.exponential(1.0 / rate, size=n))
    times = times[times < duration]
    return Schedule(times, _pick_targets(len(times), n_targets, weights, rng))


def gamma(rate: float, duration: float, cv: float = 3.0, n_targets: int = 1,
          weights: Sequence[float] | None = None, seed: int = 0) -> Schedule:
    """Bursty arrivals: gamma inter-arrival times with coefficient of variation `cv` (1 = Poisson)."""
    rng = np.random.default_rng(seed)
    shape = 1.0 / (cv * cv)
    n = max(1, int(rate * duration * 1.5) + 50)
    times = np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=n))
    times = times[times < duration]
    return Schedule(times, _pick_targets(len(times), n_targets, weights, rng))


def on_off(rate: float, duration: float, period: float = 1.0, duty: float = 0.25, n_targets: int = 1,
           weights: Sequence[float] | None = None, seed: int = 0) -> Schedule:
    """Poisson bursts at rate/duty during the first `duty` of every `period`, silence otherwise."""
    burst = poisson(rate / duty, duration, n_targets, weights, seed)
    keep = (burst.times % period) < duty * period
    return Schedule(burst.times[keep], burst.targets[keep])


def trace(path: str | Path, names: Sequence[str], speed: float = 1.0) -> Schedule:
    """A file of `seconds model` lines (seconds from the start); unknown models are an error."""
    index = {n: i for i, n in enumerate(names)}
    times, targets = [], []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        t, _, model = line.partition(" ")
        if model.strip() not in index:
            raise ValueError(f"{path}:{lineno}: unknown model {model.strip()!r}")
        times.append(float(t) / speed)
        targets.append(index[model.strip()])
    order = np.argsort(times, kind="stable")
    return Schedule(np.asarray(times)[order], np.asarray(targets, dtype=np.int32)[order])


def zipf_weights(n: int, s: float = 1.0) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


# ------------------------------------------------------------------ records


@dataclass
class Records:
    """Per-request measurements of one run, as arrays (times in seconds on the loop's clock)."""

    scheduled: np.ndarray
    target: np.ndarray
    sent: np.ndarray = field(init=False)
    done: np.ndarray = field(init=False)
    status: np.ndarray = field(init=False)
    reconstructed: np.ndarray = field(init=False)
    # the first error message the server sent per status: a row says why, not only how many
    messages: dict[int, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.scheduled)
        self.sent = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.status = np.full(n, NO_ANSWER, dtype=np.int32)
        self.reconstructed = np.zeros(n, dtype=bool)

    @property
    def latency(self) -> np.ndarray:
        return self.done - self.sent

    @property
    def lag(self) -> np.ndarray:
        return self.sent - self.scheduled


# ------------------------------------------------------------------ HTTP


@dataclass(frozen=True)
class HttpRequest:
    """A prebuilt HTTP/1.1 request; `reconstructed_marker` is searched for in the answer."""

    raw: bytes
    reconstructed_marker: bytes = b'"reconstructed":true'

    @staticmethod
    def build(method: str, path: str, body: bytes, headers: dict[str, str] | None = None,
              host: str = "127.0.0.1") -> HttpRequest:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return HttpRequest(("\r\n".join(lines) + "\r\n\r\n").encode() + body)


class _HttpConn(asyncio.Protocol):
    def __init__(self, pool: HttpPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.current: int = -1
        self.marker = b""
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, idx: int, req: HttpRequest) -> None:
        assert self.transport is not None
        self.current = idx
        self.marker = req.reconstructed_marker
        self.transport.write(req.raw)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.current >= 0:
            parsed = _parse_response(self.buf)
            if parsed is None:
                return
            status, consumed, body_start, keep_alive = parsed
            recon = self.marker in self.buf[body_start : min(consumed, body_start + 4096)]
            del self.buf[:consumed]
            idx, self.current = self.current, -1
            self.pool.answered(self, idx, status, recon)
            if not keep_alive:
                self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.current >= 0:
            idx, self.current = self.current, -1
            if self.pool.closing:  # closed by the run's end: still unanswered (NO_ANSWER), not a broken connection
                self.pool.outstanding -= 1
            else:
                self.pool.answered(self, idx, CONN_ERROR, False)
        self.pool.lost(self)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _parse_response(buf: bytearray) -> tuple[int, int, int, bool] | None:
    """(status, bytes consumed, body start, keep-alive) of one complete response, or None."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    length = None
    chunked = False
    keep_alive = True
    for h in head[1:]:
        k, _, v = h.partition(":")
        k = k.strip().lower()
        v = v.strip().lower()
        if k == "content-length":
            length = int(v)
        elif k == "transfer-encoding" and "chunked" in v:
            chunked = True
        elif k == "connection" and v == "close":
            keep_alive = False
    start = end + 4
    if chunked:
        pos = start
        while True:
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                return None
            size = int(bytes(buf[pos:line_end]).split(b";")[0], 16)
            pos = line_end + 2 + size + 2
            if len(buf) < pos:
                return None
            if size == 0:
                return status, pos, start, keep_alive
    length = length or 0
    if len(buf) < start + length:
        return None
    return status, start + length, start, keep_alive


class HttpPool:
    """Keep-alive connections, one request in flight on each; grows up to `max_conns`."""

    def __init__(self, host: str, port: int, records: Records, max_conns: int = 512) -> None:
        self.host, self.port = host, port
        self.records = records
        self.max_conns = max_conns
        self.idle: deque[_HttpConn] = deque()
        self.conns: set[_HttpConn] = set()
        self.waiting: deque[tuple[int, HttpRequest]] = deque()
        self.connecting = 0
        self.loop = asyncio.get_event_loop()
        self.outstanding = 0
        self.closing = False  # the run is over: what is still in flight was never answered

    async def open(self, n: int) -> None:
        await asyncio.gather(*(self._connect() for _ in range(n)))

    async def _connect(self) -> None:
        self.connecting += 1
        try:
            _, conn = await self.loop.create_connection(lambda: _HttpConn(self), self.host, self.port)
        except OSError:
            self.connecting -= 1
            while self.waiting:  # nobody can take them
                idx, _ = self.waiting.popleft()
                self._finish(idx, CONN_ERROR, False)
            return
        self.connecting -= 1
        self.conns.add(conn)
        self._release(conn)

    def submit(self, idx: int, req: HttpRequest) -> None:
        self.outstanding += 1
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self.records.sent[idx] = _now()
                conn.send(idx, req)
                return
        if len(self.conns) + self.connecting < self.max_conns:
            self.waiting.append((idx, req))
            self.loop.create_task(self._connect())
        elif len(self.waiting) < self.max_conns:
            self.waiting.append((idx, req))
        else:
            self.records.sent[idx] = _now()
            self._finish(idx, POOL_FULL, False)

    def _release(self, conn: _HttpConn) -> None:
        if conn.closed:
            return
        if self.waiting:
            idx, req = self.waiting.popleft()
            self.records.sent[idx] = _now()
            conn.send(idx, req)
        else:
            self.idle.append(conn)

    def _finish(self, idx: int, status: int, recon: bool) -> None:
        r = self.records
        r.done[idx] = _now()
        r.status[idx] = status
        r.reconstructed[idx] = recon
        self.outstanding -= 1

    def answered(self, conn: _HttpConn, idx: int, status: int, recon: bool) -> None:
        self._finish(idx, status, recon)
        self._release(conn)

    def lost(self, conn: _HttpConn) -> None:
        self.conns.discard(conn)

    def close(self) -> None:
        self.closing = True
        for c in list(self.conns):
            c._close()


# ------------------------------------------------------------------ unix socket (msgpack)

_ID_PLACEHOLDER = 0xFFFF_FFFE


class SocketFrame:
    """A prebuilt msgpack infer request whose id is patched in place per request."""

    def __init__(self, message: dict[str, Any]) -> None:
        payload = msgpack.packb({**message, "id": _ID_PLACEHOLDER}, use_bin_type=True)
        marker = b"\xce" + struct.pack(">I", _ID_PLACEHOLDER)
        self.offset = payload.rindex(marker) + 1 + 4  # + length prefix
        self.template = bytearray(struct.pack(">I", len(payload)) + payload)

    def with_id(self, idx: int) -> bytes:
        self.template[self.offset : self.offset + 4] = struct.pack(">I", idx)
        return bytes(self.template)


class _SocketConn(asyncio.Protocol):
    def __init__(self, client: SocketLoad) -> None:
        self.client = client
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        buf = self.buf
        while len(buf) >= 4:
            (n,) = struct.unpack_from(">I", buf)
            if len(buf) < 4 + n:
                return
            msg = msgpack.unpackb(bytes(buf[4 : 4 + n]), raw=False)
            del buf[: 4 + n]
            self.client.answered(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.lost()


class SocketLoad:
    """Pipelined requests over a few socket connections, matched by id."""

    def __init__(self, path: str, records: Records, connections: int = 2) -> None:
        self.path = path
        self.records = records
        self.n = connections
        self.conns: list[_SocketConn] = []
        self.loop = asyncio.get_event_loop()
        self.outstanding = 0
        self._next = 0
        self.inflight: set[int] = set()
        self.closing = False  # the run is over: what is still in flight was never answered

    async def open(self) -> None:
        for _ in range(self.n):
            _, c = await self.loop.create_unix_connection(lambda: _SocketConn(self), self.path)
            self.conns.append(c)

    def submit(self, idx: int, frame: SocketFrame) -> None:
        c = self.conns[self._next % len(self.conns)]
        self._next += 1
        self.outstanding += 1
        self.inflight.add(idx)
        self.records.sent[idx] = _now()
        assert c.transport is not None
        c.transport.write(frame.with_id(idx))

    def answered(self, msg: dict[str, Any]) -> None:
        idx = msg.get("id")
        if not isinstance(idx, int) or idx not in self.inflight:
            return
        self.inflight.discard(idx)
        r = self.records
        r.done[idx] = _now()
        r.status[idx] = status = int(msg.get("status", 0))
        r.reconstructed[idx] = bool(msg.get("reconstructed", False))
        if status != 200 and status not in r.messages:
            r.messages[status] = str(msg.get("error", ""))[:300]
        self.outstanding -= 1

    def lost(self) -> None:
        now = _now()
        for idx in self.inflight if not self.closing else ():  # (closing: they stay NO_ANSWER)
            self.records.done[idx] = now
            self.records.status[idx] = CONN_ERROR
        self.outstanding -= len(self.inflight)
        self.inflight.clear()

    def close(self) -> None:
        self.closing = True
        for c in self.conns:
            if c.transport is not None:
                c.transport.close()


# ------------------------------------------------------------------ running a schedule


Sender = Callable[[int, int], None]  # (request index, target index)
MIN_SLEEP_S = 0.001


async def play(schedule: Schedule, send: Sender, outstanding: Callable[[], int], records: Records,
               drain_s: float) -> None:
    """Send every arrival at its time (open loop), then wait up to `drain_s` for the answers."""
    start = _now() + 0.05
    records.scheduled[:] = schedule.times + start
    times = records.scheduled
    targets = schedule.targets
    n = len(schedule)
    i = 0
    while i < n:
        now = _now()
        if times[i] > now:
            # uvloop rounds a timer to whole milliseconds: a shorter sleep returns at once, and
            # waiting for an arrival < 1 ms away that way spun the generator (45 wake-ups per
            # request, 0.4 of a core at 3,000 req/s taken from the server it measures).
            await asyncio.sleep(max(times[i] - now, MIN_SLEEP_S))
            continue
        # Everything due is sent now; arrivals never wait for answers.
        while i < n and times[i] <= now:
            send(i, int(targets[i]))
            i += 1
        await asyncio.sleep(0)  # let answers in between bursts
    deadline = _now() + drain_s
    while outstanding() > 0 and _now() < deadline:  # noqa: ASYNC110 - answers come from protocol callbacks
        await asyncio.sleep(0.01)


@dataclass
class Run:
    """One measured run: records plus how it was produced."""

    records: Records
    duration: float
    warmup: float
    names: list[str]

    def window(self) -> np.ndarray:
        """Requests scheduled after the warm-up: the ones statistics are computed on."""
        t0 = float(np.nanmin(self.records.scheduled)) if len(self.records.scheduled) else 0.0
        return self.records.scheduled >= t0 + self.warmup


async def run_http(schedule: Schedule, host: str, port: int, requests: Sequence[HttpRequest], names: list[str],
                   warmup: float = 0.0, drain_s: float = 5.0, connections: int = 16, max_conns: int = 512) -> Run:
    records = Records(np.zeros(len(schedule)), schedule.targets.copy())
    pool = HttpPool(host, port, records, max_conns)
    await pool.open(connections)
    try:
        await play(schedule, lambda i, t: pool.submit(i, requests[t]), lambda: pool.outstanding, records, drain_s)
    finally:
        pool.close()
    return Run(records, schedule.duration, warmup, names)


async def run_socket(schedule: Schedule, path: str, frames: Sequence[SocketFrame], names: list[str],
                     warmup: float = 0.0, drain_s: float = 5.0, connections: int = 2) -> Run:
    records = Records(np.zeros(len(schedule)), schedule.targets.copy())
    client = SocketLoad(path, records, connections)
    await client.open()
    try:
        await play(schedule, lambda i, t: client.submit(i, frames[t]), lambda: client.outstanding, records, drain_s)
    finally:
        client.close()
    return Run(records, schedule.duration, warmup, names)


def describe_schedule(kind: str, rate: float, duration: float) -> str:
    return f"{kind} {rate:g} req/s for {duration:g} s"

