"""The floor under escapement's gRPC frontend: CPU a unary call costs grpcio's own server.

    python -m bench.grpc_floor

An echo service (3,200-byte messages, no protobuf work) on grpcio's asyncio server (uvloop) and on
its threaded server (4 and 16 threads), each in a process of its own, driven as `bench run ingest`
drives ModelInfer (16 calls in flight over 4 channels, 4 s after 1 s of warm-up): calls a second
and the server process's CPU a call. Whatever escapement's worker does per ModelInfer comes on top
of this (bench/results/ingest-profile-grpc-2026-11-29-xeon.md).
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import grpc

from bench.servers import cpu_seconds

MODE = sys.argv[1] if len(sys.argv) > 1 else "client"  # ("serve KIND PORT": one server, as a child)

def handler_sync(req: bytes, ctx: Any) -> bytes:
    return req

async def handler_aio(req: bytes, ctx: Any) -> bytes:
    return req



def serve(kind: str, port: int) -> None:
    if kind == "aio":
        async def main() -> None:
            server = grpc.aio.server()
            h = grpc.unary_unary_rpc_method_handler(handler_aio)
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"M": h}),))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            await server.wait_for_termination()
        import uvloop
        uvloop.run(main())
    else:
        from concurrent.futures import ThreadPoolExecutor
        server = grpc.server(ThreadPoolExecutor(max_workers=int(kind.split(":")[1])))
        h = grpc.unary_unary_rpc_method_handler(handler_sync)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {"M": h}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()




async def load(port: int, secs: float, n: int = 16) -> int:
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(4)]
    calls = [c.unary_unary("/t.S/M") for c in chans]
    msg = b"x" * 3200
    cnt = [0]
    stop = time.monotonic() + secs

    async def one(i: int) -> None:
        while time.monotonic() < stop:
            await calls[i % 4](msg)
            cnt[0] += 1
    await asyncio.gather(*(one(i) for i in range(n)))
    for c in chans:
        await c.close()
    return cnt[0]



async def ready(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        await asyncio.wait_for(ch.channel_ready(), 30)


if MODE == "serve":
    serve(sys.argv[2], int(sys.argv[3]))
else:
    for kind in ("aio", "sync:4", "sync:16", "aio", "sync:4"):
        port = 50000 + sum(map(ord, kind)) % 1000
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        p = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "serve", kind, str(port)], cwd=root,
                             env={**os.environ, "PYTHONPATH": root})
        asyncio.run(ready(port))
        asyncio.run(load(port, 1.0))
        c0, t0 = cpu_seconds(p.pid), time.monotonic()
        n = asyncio.run(load(port, 4.0))
        c1, t1 = cpu_seconds(p.pid), time.monotonic()
        print(kind, f"{n / (t1 - t0):.0f} calls/s, server {(c1 - c0) / n * 1e6:.0f} us CPU a call, "
              f"{(c1 - c0) / (t1 - t0):.2f} cores", flush=True)
        p.kill()
        p.wait()
