"""The `peers` scenario's gRPC and shared-memory rows: open-loop load over KServe v2 gRPC, and over
HTTP with the tensors in system shared memory, against escapement and Triton (both serve these
APIs the same way, so the same bytes go to both).

- gRPC: a pre-serialized `ModelInferRequest` (the [1, 784] FP32 tensor in `raw_input_contents`,
  what tritonclient sends) played by a Poisson schedule over `CHANNELS` grpc.aio channels; the
  generator never decodes an answer's protobuf (it only checks the call succeeded).
- shm: the input written once into a registered region (every request reads the same input),
  each request's output into its own `OUT_BYTES` slot of a second region (`OUT_SLOTS` of them,
  used round robin: far more than ever in flight), named by `shared_memory_offset`; the request
  is a small JSON body over HTTP with no tensor bytes. Regions are registered over each server's
  own `/v2/systemsharedmemory` API, unregistered and unlinked after.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import orjson
import uvloop

from bench import loadgen
from bench.loadgen import HttpRequest, Records, Run, Schedule
from bench.scenarios.common import Measured, _self_cpu
from bench.servers import CpuMeter

CHANNELS = 4  # gRPC connections (escapement's frontend workers take connections by SO_REUSEPORT)
OUT_SLOTS = 1024
OUT_BYTES = 40  # [1, 10] FP32
GRPC_ERROR = 500  # a failed RPC whose status code has no HTTP counterpart below
# gRPC status names -> the HTTP status the records count them as (bench/results.py names them), so
# a refusal under overload reads "unavailable" and a missed deadline "deadline", as over HTTP
GRPC_AS_HTTP = {"UNAVAILABLE": 503, "RESOURCE_EXHAUSTED": 503, "DEADLINE_EXCEEDED": 504, "CANCELLED": 499,
                "INVALID_ARGUMENT": 400, "NOT_FOUND": 404}


def grpc_status(code_name: str) -> int:
    """The HTTP status a failed RPC is recorded as, by its gRPC status code's name."""
    return GRPC_AS_HTTP.get(code_name, GRPC_ERROR)


def grpc_message(model: str, x: np.ndarray) -> bytes:
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model)
    req.inputs.add(name="INPUT__0", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(np.ascontiguousarray(x, np.float32).tobytes())
    return req.SerializeToString()


async def run_grpc(schedule: Schedule, port: int, message: bytes, names: list[str], warmup: float = 0.0,
                   drain_s: float = 5.0, channels: int = CHANNELS) -> Run:
    import grpc

    records = Records(np.zeros(len(schedule)), schedule.targets.copy())
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]
    calls = [c.unary_unary("/inference.GRPCInferenceService/ModelInfer") for c in chans]
    loop = asyncio.get_running_loop()
    outstanding = [0]
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int) -> None:
        try:
            await calls[i % channels](message)
            records.status[i] = 200
        except grpc.aio.AioRpcError as e:
            records.status[i] = grpc_status(e.code().name)
        finally:
            records.done[i] = time.monotonic()
            outstanding[0] -= 1

    def send(i: int, _target: int) -> None:
        outstanding[0] += 1
        records.sent[i] = time.monotonic()
        task = loop.create_task(one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    try:
        await asyncio.gather(*(c.channel_ready() for c in chans))
        await loadgen.play(schedule, send, lambda: outstanding[0], records, drain_s)
    finally:
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in chans:
            await c.close()
    return Run(records, schedule.duration, warmup, names)


def shm_requests(path: str, n_in: int, slots: int = OUT_SLOTS) -> list[HttpRequest]:
    """One HTTP request per output slot: the input from region `in`, the output into slot k of `out`."""
    out: list[HttpRequest] = []
    for k in range(slots):
        body = orjson.dumps({
            "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, n_in // 4],
                        "parameters": {"shared_memory_region": "in", "shared_memory_byte_size": n_in}}],
            "outputs": [{"name": "OUTPUT__0",
                         "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": OUT_BYTES,
                                        "shared_memory_offset": k * OUT_BYTES}}]})
        out.append(HttpRequest.build("POST", path, body, {"Content-Type": "application/json"}))
    return out


async def run_shm(schedule: Schedule, port: int, requests: Sequence[HttpRequest], names: list[str],
                  warmup: float = 0.0, drain_s: float = 5.0, connections: int = 16) -> Run:
    records = Records(np.zeros(len(schedule)), schedule.targets.copy())
    pool = loadgen.HttpPool("127.0.0.1", port, records)
    await pool.open(connections)
    try:
        await loadgen.play(schedule, lambda i, t: pool.submit(i, requests[i % len(requests)]),
                           lambda: pool.outstanding, records, drain_s)
    finally:
        pool.close()
    return Run(records, schedule.duration, warmup, names)


def _http(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


@contextlib.contextmanager
def registered_regions(port: int, x: np.ndarray) -> Iterator[None]:
    """The input region (written once) and the output slots, registered with the server on `port`."""
    import tritonclient.utils.shared_memory as shm

    tag = f"{os.getpid()}-{port}"
    x = np.ascontiguousarray(x, np.float32)
    made = []
    try:
        hin = shm.create_shared_memory_region("in", f"/escb-peers-in-{tag}", x.nbytes)
        made.append(hin)
        hout = shm.create_shared_memory_region("out", f"/escb-peers-out-{tag}", OUT_SLOTS * OUT_BYTES)
        made.append(hout)
        shm.set_shared_memory_region(hin, [x])
        for name, key, size in (("in", f"/escb-peers-in-{tag}", x.nbytes),
                                ("out", f"/escb-peers-out-{tag}", OUT_SLOTS * OUT_BYTES)):
            status, body = _http(port, "POST", f"/v2/systemsharedmemory/region/{name}/register",
                                 orjson.dumps({"key": key, "offset": 0, "byte_size": size}))
            if status != 200:
                raise RuntimeError(f"registering shared memory failed: {status} {body[:200]!r}")
        yield
    finally:
        with contextlib.suppress(OSError):
            _http(port, "POST", "/v2/systemsharedmemory/unregister")
        for h in made:
            shm.destroy_shared_memory_region(h)


def measure_with(go: Callable[[], Any], server_pid: int) -> Measured:
    """Run one load (a coroutine factory) on a fresh uvloop and meter the server's and our CPU."""
    meter = CpuMeter(server_pid)
    gc.collect()
    gc.freeze()
    t0, c0 = time.monotonic(), _self_cpu()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        meter.start()
        run = runner.run(go())
    server_cores = meter.stop()
    return Measured(run, server_cores, (_self_cpu() - c0) / (time.monotonic() - t0))
