"""The ingest scenario's closed-loop clients, and generator processes that run them.

Each client keeps one batch-1 request in flight on its own connection (HTTP binary, a msgpack
frame on the unix socket, or a pre-serialized gRPC ModelInferRequest) until a stop time, counting
answers and, where asked, appending each answered request's latency (s) to a list and counting
failures by kind (HTTP status, the socket answer's status, gRPC code).

One asyncio process cannot offer the load a many-core daemon takes, so `Generators` runs the
clients in G spawned processes, each on its own uvloop loop. This module imports only the
standard library and uvloop (grpc when a gRPC job comes): a spawned generator does not import
torch or the daemon, so it starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import uvloop

GRPC_CHANNELS = 4  # connections per generator: with SO_REUSEPORT, each lands on one worker
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"
LEAD_S = 0.1  # how far ahead a shared start time is set: every generator has it before it comes
TIMEOUT_S = 60.0  # beyond a phase's own length: a generator silent this long has failed

_now = time.monotonic  # uvloop's loop.time() is cached per iteration: too coarse for latencies


@dataclass(frozen=True)
class Target:
    """Where and what to send, picklable: what a generator process needs for one point."""

    protocol: str  # "http" | "socket" | "grpc"
    port: int  # the HTTP port, or gRPC's
    socket: str  # the unix socket's path
    payload: bytes  # the HTTP request, the socket frame (length prefix included) or the gRPC message
    id_offset: int = 0  # socket: where the frame's 4-byte big-endian request id sits in payload


class Frame:
    """A socket frame whose request id is patched in place per request (as bench.loadgen.SocketFrame)."""

    def __init__(self, template: bytes, offset: int) -> None:
        self.template = bytearray(template)
        self.offset = offset

    def with_id(self, idx: int) -> bytes:
        self.template[self.offset : self.offset + 4] = idx.to_bytes(4, "big")
        return bytes(self.template)


@dataclass
class Outcome:
    """One measured window: answers, failures, its wall time and the answered requests' latencies (s)."""

    ok: int
    failed: int
    wall_s: float
    latencies: array[float]
    generator_cpu_s: list[float]  # each generator's CPU in the window (the parent's own for G = 1)
    errors: dict[str, int]  # failures by kind


# ------------------------------------------------------------------ the clients


Errors = Counter[str] | None


async def http_client(port: int, request: bytes, stop: float, counts: list[int],
                      lat: list[float] | None = None, errors: Errors = None) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while (t := _now()) < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            if head.startswith(b"HTTP/1.1 200"):
                counts[0] += 1
                if lat is not None:
                    lat.append(_now() - t)
            else:
                counts[1] += 1
                if errors is not None:
                    errors["http " + head.split(b" ", 2)[1].decode()] += 1
    finally:
        writer.close()


async def socket_client(path: str, frame: Any, stop: float, counts: list[int],
                        lat: list[float] | None = None, errors: Errors = None) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    i = 0
    try:
        while (t := _now()) < stop:
            i += 1
            writer.write(frame.with_id(i))
            n = int.from_bytes(await reader.readexactly(4), "big")
            answer = await reader.readexactly(n)
            if b"\xa6status\xcc\xc8" in answer:  # msgpack "status": 200
                counts[0] += 1
                if lat is not None:
                    lat.append(_now() - t)
            else:
                counts[1] += 1
                if errors is not None:
                    errors[f"socket {_socket_status(answer)}"] += 1
    finally:
        writer.close()


def _socket_status(answer: bytes) -> Any:
    import msgpack  # only for failures: an answer's status

    try:
        return msgpack.unpackb(answer, raw=False).get("status", "?")
    except Exception:
        return "undecodable"


async def grpc_client(call: Any, message: bytes, stop: float, counts: list[int],
                      lat: list[float] | None = None, errors: Errors = None) -> None:
    import grpc

    while (t := _now()) < stop:
        try:
            await call(message)
        except grpc.aio.AioRpcError as e:
            counts[1] += 1
            if errors is not None:
                errors[f"grpc {e.code().name}"] += 1
            continue
        counts[0] += 1
        if lat is not None:
            lat.append(_now() - t)


async def grpc_clients(port: int, message: bytes, stop: float, counts: list[int], clients: int,
                       lat: list[float] | None = None, errors: Errors = None) -> None:
    """`clients` RPCs in flight over GRPC_CHANNELS channels, bytes in and out (no client-side protobuf work)."""
    import grpc

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(GRPC_CHANNELS)]
    try:
        calls = [ch.unary_unary(GRPC_METHOD) for ch in channels]
        await asyncio.gather(*(grpc_client(calls[i % len(calls)], message, stop, counts, lat, errors)
                               for i in range(clients)))
    finally:
        for ch in channels:
            await ch.close()


async def phase(target: Target, clients: int, stop: float, lat: list[float] | None,
                errors: Errors = None) -> list[int]:
    """`clients` closed-loop connections until `stop` (monotonic): [answered, failed]."""
    counts = [0, 0]
    if target.protocol == "http":
        await asyncio.gather(*(http_client(target.port, target.payload, stop, counts, lat, errors)
                               for _ in range(clients)))
    elif target.protocol == "grpc":
        await grpc_clients(target.port, target.payload, stop, counts, clients, lat, errors)
    elif target.protocol == "socket":
        frame = Frame(target.payload, target.id_offset)  # one per connection would do too: ids are per connection
        await asyncio.gather(*(socket_client(target.socket, frame, stop, counts, lat, errors)
                               for _ in range(clients)))
    else:
        raise ValueError(f"unknown protocol {target.protocol!r}")
    return counts


def split(clients: int, generators: int) -> list[int]:
    """Clients per generator: `clients // generators` each, the remainder one apiece to the first."""
    if clients < generators:
        raise ValueError(f"{clients} clients cannot keep {generators} generators busy")
    return [clients // generators + (i < clients % generators) for i in range(generators)]


# ------------------------------------------------------------------ where the clients run


def _sleep_until(t: float) -> None:
    while (left := t - _now()) > 0:
        time.sleep(left)


class InProcess:
    """G = 1: the clients on a uvloop loop in this process (the scenario's original closed loop)."""

    def run(self, target: Target, clients: int, warmup_s: float, seconds: float,
            open_window: Callable[[], None], close_window: Callable[[], None]) -> Outcome:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(phase(target, clients, _now() + warmup_s, None))
            open_window()
            lat: list[float] = []
            errors: Counter[str] = Counter()
            c0, t0 = time.process_time(), _now()
            ok, failed = runner.run(phase(target, clients, t0 + seconds, lat, errors))
            wall, cpu = _now() - t0, time.process_time() - c0
            close_window()
        return Outcome(ok, failed, wall, array("d", lat), [cpu], dict(errors))

    def close(self) -> None:
        pass


def _generator(conn: Connection) -> None:
    """A generator process: per job, a warm-up and a measured window from start times the parent sets."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        conn.send("up")
        while (job := conn.recv()) is not None:
            target, clients, warmup_s, seconds = job
            try:
                if target.protocol == "grpc":
                    import grpc  # noqa: F401  (before the start time: its import is not the window's)
                conn.send("ready")
                if (t0 := conn.recv()) is None:
                    return  # the parent gave up on this point (another generator failed)
                _sleep_until(t0)
                runner.run(phase(target, clients, t0 + warmup_s, None))
                conn.send("warm")
                if (t1 := conn.recv()) is None:
                    return
                _sleep_until(t1)
                lat: list[float] = []
                errors: Counter[str] = Counter()
                c0 = time.process_time()
                ok, failed = runner.run(phase(target, clients, t1 + seconds, lat, errors))
                conn.send(("done", ok, failed, _now(), time.process_time() - c0, dict(errors)))
                conn.send_bytes(array("d", lat).tobytes())
            except Exception as e:  # the parent raises it: a hung parent would hide it
                conn.send(("error", f"{type(e).__name__}: {e}"))


class Generators:
    """G spawned generator processes, started once and reused for every point.

    A point: every generator gets the job and prepares; all start the warm-up at one shared
    monotonic time (CLOCK_MONOTONIC is system-wide), report the end of it, then start the measured
    window at a second shared time, when the parent opens its window (the controller's CPU
    reading), and report their counts and latencies when their last request is answered; the
    window closes when the last generator has reported, so wall and CPU cover the same span.
    """

    def __init__(self, count: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        try:
            for _ in range(count):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_generator, args=(child,), daemon=True, name="ingest-generator")
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            self._gather("up", TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Generators:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self, conn: Connection, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise RuntimeError(f"a generator process was silent for {timeout:.0f} s")
        try:
            msg = conn.recv()
        except EOFError:
            raise RuntimeError("a generator process exited (its stderr says why)") from None
        if isinstance(msg, tuple) and msg[0] == "error":
            raise RuntimeError(f"a generator process failed: {msg[1]}")
        return msg

    def _gather(self, expected: str, timeout: float) -> None:
        for conn in self.conns:
            msg = self._recv(conn, timeout)
            if msg != expected:
                raise RuntimeError(f"a generator process said {msg!r}, not {expected!r}")

    def _start_all(self) -> float:
        t = _now() + LEAD_S
        for conn in self.conns:
            conn.send(t)
        return t

    def run(self, target: Target, clients: int, warmup_s: float, seconds: float,
            open_window: Callable[[], None], close_window: Callable[[], None]) -> Outcome:
        for conn, n in zip(self.conns, split(clients, len(self.conns)), strict=True):
            conn.send((target, n, warmup_s, seconds))
        self._gather("ready", TIMEOUT_S)
        self._start_all()
        self._gather("warm", warmup_s + TIMEOUT_S)
        t1 = self._start_all()
        _sleep_until(t1)
        open_window()
        done = [self._recv(conn, seconds + TIMEOUT_S) for conn in self.conns]
        close_window()
        parts = [conn.recv_bytes() for conn in self.conns]
        lat = array("d")
        for part in parts:
            lat.frombytes(part)
        errors: Counter[str] = Counter()
        for d in done:
            errors.update(d[5])
        return Outcome(sum(d[1] for d in done), sum(d[2] for d in done), max(d[3] for d in done) - t1, lat,
                       [d[4] for d in done], dict(errors))

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass  # that generator is gone already
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def generators(count: int) -> InProcess | Generators:
    """Where a point's clients run: in this process for 1 (the scenario's original loop), else `count` processes."""
    return InProcess() if count <= 1 else Generators(count)
