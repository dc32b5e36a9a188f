"""`hostile`: each attack a client on this machine can make, the bound that holds, and what it costs.

A real daemon (a child process, the demo repository, one CPU device) with its limits scaled down
so that each bound is reached in seconds: request memory 64 MiB, a connection's share 8 MiB,
bodies 8 MiB, 200 connections, timeouts of 2 s. Beside every attack a well-behaved client asks
`GET /v2/health/ready` every 20 ms and sends one inference every 50 ms on its own connections:
its p99 says whether the attack reached the others. The daemon's RSS is sampled every 20 ms.

Attacks (each bounded in count and time):
- `pinned-bodies`: 64 connections each announce an 8 MiB body, send all of it but one byte, and
  stall: memory a request holds while it is read.
- `gzip-pipeline`: 16 connections pipeline 32 gzip bodies each that decompress to 8 MiB of
  zeros (8 KiB on the wire).
- `huge-ids`: HTTP and socket requests whose `id` is 1 MiB.
- `connection-flood`: 1,000 connections at once against a limit of 200.
- `slowloris`: 150 connections sending one header byte every 0.5 s.
- `slow-readers`: 20 connections pipelining `GET /metrics` (tens of KiB each) and never reading.
- `msgpack-map`: a 10 MiB socket frame holding a map of a million keys.
- `json-floats`: JSON bodies of float lists just under 2 MiB (the largest parsed by default).
- `one-client-flood`: one socket connection with 5,000 requests in flight at once, beside the
  well-behaved client.

Each row: what the attack did, what it got (statuses, closes), how long refusals took, the
well-behaved client's p99 (health, inference) and failures, the RSS growth over the daemon's
RSS before the attack, and the request memory the daemon held at its peak.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np
import orjson
import uvloop

from bench import results
from bench.probe import rss_kib
from bench.scenarios.common import command, demo_repo, http_binary, spec_of
from bench.servers import Escapement
from daemon.client.wire import infer_message

MiB = 1 << 20
LIMITS = {"max_json_bytes": 2 * MiB, "request_memory_bytes": 64 * MiB, "connection_memory_bytes": 8 * MiB,
          "max_body_bytes": 8 * MiB,
          "max_connections": 200, "idle_timeout_s": 2.0, "write_timeout_s": 2.0, "request_timeout_s": 2.0,
          "max_inflight_per_connection": 64}
MODEL = "mlp_784"


def rss(pid: int) -> int:
    return max(0, rss_kib(pid)) * 1024


def p99(xs: list[float]) -> float | None:
    return float(np.percentile(xs, 99)) * 1e3 if xs else None


class Watch:
    """The well-behaved client and the RSS sampler, run beside an attack."""

    def __init__(self, port: int, pid: int, infer_raw: bytes) -> None:
        self.port, self.pid, self.infer_raw = port, pid, infer_raw
        self.health: list[float] = []
        self.infer: list[float] = []
        self.failures: list[str] = []
        self.rss_peak = 0
        self._stop = asyncio.Event()

    async def _http_loop(self, raw: bytes, every: float, out: list[float]) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                writer.write(raw)
                status, _ = await read_answer(reader)
                out.append(time.perf_counter() - t0)
                if status != 200:
                    self.failures.append(f"{status}")
                await asyncio.sleep(every)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            self.failures.append(type(e).__name__)
        finally:
            writer.close()

    async def _sample(self) -> None:
        while not self._stop.is_set():
            self.rss_peak = max(self.rss_peak, rss(self.pid))
            await asyncio.sleep(0.02)

    async def run(self, attack: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        health = b"GET /v2/health/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        tasks = [asyncio.create_task(self._http_loop(health, 0.02, self.health)),
                 asyncio.create_task(self._http_loop(self.infer_raw, 0.05, self.infer)),
                 asyncio.create_task(self._sample())]
        try:
            return await attack
        finally:
            self._stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------------ raw clients


async def read_answer(reader: asyncio.StreamReader, timeout: float = 10) -> tuple[int, bytes]:  # noqa: ASYNC109
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    status = int(head.split(b" ", 2)[1])
    length = 0
    for h in head.split(b"\r\n")[1:]:
        k, _, v = h.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    body = await asyncio.wait_for(reader.readexactly(length), timeout) if length else b""
    return status, body


def post(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    h = {"Host": "127.0.0.1", "Content-Length": str(len(body)), **(headers or {})}
    return (f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode() + body


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> float | None:  # noqa: ASYNC109
    """Seconds until the server closes (EOF or reset), None if it did not within `timeout`."""
    t0 = time.perf_counter()
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.perf_counter() - t0


# ------------------------------------------------------------------ attacks


async def pinned_bodies(port: int, **_: Any) -> dict[str, Any]:
    size = LIMITS["max_body_bytes"]
    conns, statuses, refusal_s = [], [], []
    for _ in range(64):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.perf_counter()
        head = post(f"/v2/models/{MODEL}/infer", b"\0" * size)
        w.write(head[:-1])  # all but the last byte: the daemon holds what it has read
        await w.drain()
        conns.append((r, w, t0))
    await asyncio.sleep(1.0)  # all pinned at once
    for r, _w, t0 in conns:  # the refused ones have answered 503 already (at their headers)
        try:
            status, _ = await read_answer(r, 0.05)
            statuses.append(status)
            refusal_s.append(time.perf_counter() - t0)
        except TimeoutError:
            statuses.append(0)  # held: its body is being read
    for _, w, _ in conns:
        w.close()
    return {"attempts": len(conns), "held": statuses.count(0),
            **{str(s): statuses.count(s) for s in sorted(set(statuses)) if s}}


async def gzip_pipeline(port: int, **_: Any) -> dict[str, Any]:
    bomb = gzip.compress(b"\0" * LIMITS["max_body_bytes"])
    req = post(f"/v2/models/{MODEL}/infer", bomb, {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    statuses: list[int] = []

    async def one() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(req * 32)
        try:
            for _ in range(32):
                statuses.append((await read_answer(r))[0])
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            statuses.append(-1)  # closed
        w.close()

    await asyncio.gather(*(one() for _ in range(16)))
    return {"attempts": 16 * 32, "wire_bytes_each": len(bomb),
            **{str(s): statuses.count(s) for s in sorted(set(statuses))}}


async def huge_ids(port: int, sock: str, raw_infer: bytes, **_: Any) -> dict[str, Any]:
    body = orjson.dumps({"id": "x" * MiB, "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 784],
                                                    "data": [0.0] * 784}]})
    statuses = []
    for _ in range(50):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(post(f"/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"}))
        statuses.append((await read_answer(r))[0])
        w.close()
    x = np.zeros((1, 784), np.float32)
    frame = msgpack.packb({**infer_message(MODEL, {"INPUT__0": x}), "id": "x" * MiB}, use_bin_type=True)
    r, w = await asyncio.open_unix_connection(sock)
    socket_errors = 0
    for _ in range(50):
        w.write(struct.pack(">I", len(frame)) + frame)
        n = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 10))[0]
        ans = msgpack.unpackb(await asyncio.wait_for(r.readexactly(n), 10))
        socket_errors += "error" in ans
    w.close()
    return {"attempts": 100, **{f"http {s}": statuses.count(s) for s in sorted(set(statuses))},
            "socket errors": socket_errors}


async def connection_flood(port: int, **_: Any) -> dict[str, Any]:
    conns, refused, refusal_s = [], 0, []
    for _ in range(1000):
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            refused += 1
            continue
        conns.append((r, w))
    # While the flood holds its connections: how long one more takes to be told (connect -> 503).
    extra = []
    for _ in range(20):
        t0 = time.perf_counter()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            status, _ = await read_answer(r, 5.0)
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            status = 0
        refusal_s.append(time.perf_counter() - t0)
        extra.append(status)
        w.close()
    statuses = []
    for r, _w in conns[150:]:  # the first ones are within the limit (minus the watchers' two)
        try:
            status, _ = await read_answer(r, 2.0)
            statuses.append(status)
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            statuses.append(0)
    for _, w in conns:
        w.close()
    return {"attempts": 1020, "connect_refused": refused, "503": statuses.count(503) + extra.count(503),
            "extra_503": extra.count(503), "refusal_p50_ms": float(np.median(refusal_s)) * 1e3,
            "refusal_max_ms": max(refusal_s) * 1e3}


async def slowloris(port: int, **_: Any) -> dict[str, Any]:
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(150)]
    line = b"POST /v2/models/mlp_784/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    t0 = time.perf_counter()

    async def drip(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> float | None:
        try:
            for i in range(40):  # at most 20 s
                w.write(line[i:i + 1] if i < len(line) else b"a")
                await w.drain()
                got = await closed_within(r, 0.5)
                if got is not None:
                    return time.perf_counter() - t0
        except OSError:
            return time.perf_counter() - t0
        return None

    closed = await asyncio.gather(*(drip(r, w) for r, w in conns))
    for _, w in conns:
        w.close()
    done = [c for c in closed if c is not None]
    return {"attempts": 150, "closed": len(done), "closed_after_s_max": max(done) if done else None}


async def slow_readers(port: int, **_: Any) -> dict[str, Any]:
    conns = []
    metrics = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for _ in range(20):
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=1024)
        r._transport.pause_reading()  # type: ignore[attr-defined]  # never read a byte of the answers
        w.transport.set_write_buffer_limits(high=64 * MiB)  # keep sending whatever happens
        w.write(metrics * 2000)  # answers of tens of KiB each: far past the socket buffers
        conns.append((r, w))
    t0 = time.perf_counter()
    await asyncio.sleep(LIMITS["write_timeout_s"] * 2 + 1)
    closed = 0
    for r, w in conns:
        r._transport.resume_reading()  # type: ignore[attr-defined]  # now see whether the daemon hung up
        closed += await closed_within(r, 2.0) is not None
        w.close()
    return {"attempts": 20, "closed": closed, "waited_s": time.perf_counter() - t0}


async def msgpack_map(sock: str, **_: Any) -> dict[str, Any]:
    big = msgpack.packb({str(i): i for i in range(1_000_000)}, use_bin_type=True)
    times, errors = [], 0
    for _ in range(5):
        r, w = await asyncio.open_unix_connection(sock)
        t0 = time.perf_counter()
        w.write(struct.pack(">I", len(big)) + big)
        try:
            n = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 10))[0]
            errors += "error" in msgpack.unpackb(await asyncio.wait_for(r.readexactly(n), 10))
        except (asyncio.IncompleteReadError, OSError):
            errors += 1  # refused and closed
        times.append(time.perf_counter() - t0)
        w.close()
    return {"attempts": 5, "frame_bytes": len(big), "refused": errors, "answer_ms_max": max(times) * 1e3}


async def json_floats(port: int, **_: Any) -> dict[str, Any]:
    n = 2 * MiB // 21  # the largest JSON the default server.max_json_bytes (2 MiB) parses
    body = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [n // 784, 784],
                                     "data": np.random.default_rng(0).random(n // 784 * 784).tolist()}]})
    statuses = []
    r, w = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(20):
        w.write(post(f"/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"}))
        statuses.append((await read_answer(r, 30))[0])
    w.close()
    return {"attempts": 20, "body_bytes": len(body), **{str(s): statuses.count(s) for s in sorted(set(statuses))}}


async def one_client_flood(sock: str, **_: Any) -> dict[str, Any]:
    x = np.zeros((1, 784), np.float32)
    frame = msgpack.packb(infer_message(MODEL, {"INPUT__0": x}), use_bin_type=True)
    r, w = await asyncio.open_unix_connection(sock)
    w.write((struct.pack(">I", len(frame)) + frame) * 5000)
    ok = err = 0
    t0 = time.perf_counter()
    for _ in range(5000):
        n = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 60))[0]
        ans = msgpack.unpackb(await asyncio.wait_for(r.readexactly(n), 60))
        if "error" in ans:
            err += 1
        else:
            ok += 1
    w.close()
    return {"attempts": 5000, "served": ok, "refused": err, "took_s": time.perf_counter() - t0}


ATTACKS: dict[str, Callable[..., Awaitable[dict[str, Any]]]] = {
    "pinned-bodies": pinned_bodies, "gzip-pipeline": gzip_pipeline, "huge-ids": huge_ids,
    "connection-flood": connection_flood, "slowloris": slowloris, "slow-readers": slow_readers,
    "msgpack-map": msgpack_map, "json-floats": json_floats, "one-client-flood": one_client_flood,
}


async def _stats(port: int) -> dict[str, Any]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /v2/controller/stats HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    _, body = await read_answer(r)
    w.close()
    return orjson.loads(body)


def run(quick: bool = False, json_out: str | None = None, only: str = "") -> dict[str, Any]:
    repo = demo_repo()
    spec = spec_of(repo, MODEL)
    raw_infer = http_binary(spec).raw
    names = [a for a in ATTACKS if not only or a in only.split(",")]
    rows = []
    with Escapement(repo, server=dict(LIMITS), runtime={"warmup_reps": 1}) as esc:
        async def go() -> None:
            for name in names:
                await asyncio.sleep(0.5)  # the last attack's connections are gone
                base = rss(esc.pid)
                before = (await _stats(esc.port))["request_memory"]
                watch = Watch(esc.port, esc.pid, raw_infer)
                t0 = time.perf_counter()
                got = await watch.run(ATTACKS[name](port=esc.port, sock=esc.socket, raw_infer=raw_infer))
                after = (await _stats(esc.port))["request_memory"]
                rows.append({
                    "attack": name, **{k: v for k, v in got.items()}, "seconds": time.perf_counter() - t0,
                    "rss_base_mib": base / MiB, "rss_growth_mib": max(0, watch.rss_peak - base) / MiB,
                    "request_memory_peak_mib": after["peak_bytes"] / MiB, "memory_refusals":
                        after["refused"] - before["refused"], "health_p99_ms": p99(watch.health),
                    "infer_p99_ms": p99(watch.infer), "bystander_failures": len(watch.failures),
                    "held_after_mib": after["held_bytes"] / MiB,
                })
                print(f"{name}: {rows[-1]}", flush=True)

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(go())
    summary = {
        "rss_growth_max_mib": max(r["rss_growth_mib"] for r in rows),
        "request_memory_limit_mib": LIMITS["request_memory_bytes"] / MiB,
        "health_p99_max_ms": max((r["health_p99_ms"] or 0) for r in rows),
        "bystander_failures": sum(r["bystander_failures"] for r in rows),
    }
    cmd = command("hostile", quick, {"only": only} if only else None)
    notes = [f"limits: {LIMITS}", f"cpus: {os.cpu_count()}",
             "outcome: what the attack got (status -> count; held = still being read; closed = hung up on)",
             "request_memory_peak_mib is the daemon's peak since it started (across attacks)"]
    for r in rows:
        r["outcome"] = {k: v for k, v in r.items() if k not in _MEASURED and k != "attack"}
    columns = ["attack", "outcome", "rss_growth_mib", "health_p99_ms", "infer_p99_ms", "bystander_failures",
               "memory_refusals", "seconds"]
    return results.write("hostile", {"command": cmd, "limits": LIMITS, "model": MODEL}, rows, summary, json_out,
                         notes, columns)


_MEASURED = {"seconds", "rss_base_mib", "rss_growth_mib", "request_memory_peak_mib", "memory_refusals",
             "health_p99_ms", "infer_p99_ms", "bystander_failures", "held_after_mib", "outcome"}
