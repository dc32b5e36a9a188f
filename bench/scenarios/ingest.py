"""`ingest`: requests/s and controller-loop CPU per request against the number of frontend workers.

A near-null model (`null_784`: one 784 -> 10 linear layer, ~5 µs a sample, built here) keeps the
device out of the way, so what is measured is the frontend: parsing, decoding, validation,
answer encoding, and the controller's own per-request work. Closed loop: `clients` connections
each keep one batch-1 request in flight (HTTP binary, msgpack frames on the unix socket, or gRPC
ModelInfer with `raw_input_contents`, sent as pre-serialized messages over 4 channels) for
`seconds`; the generator runs on the same machine (on 2 cores it takes a share of them: compare
ratios between worker counts, not absolute figures with other machines).

`loop_us_per_request`: CPU of the controller process's main thread (its event loop: the one that
decides) per request answered, from /proc/PID/task/PID/stat. With 0 workers that thread also
does every frontend's protocol work; with N > 0 only the link records and the controller.

`--shm true` runs the shared-memory variant instead (results under ingest-shm): one large input
(`image_3x224`, a 3x224x224 FP32 image, 588 KiB; the model only averages it) sent by the
unmodified tritonclient one request at a time, over HTTP binary, gRPC raw, HTTP with the input
and output in system shared memory, and gRPC with shared memory: loop CPU per request and
latency percentiles (the client writes its input into the region before each request: what a
real client pays).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import uvloop
from torch import nn

from bench import results
from bench.scenarios.common import command, http_binary, sample_inputs, socket_frame, spec_of
from bench.servers import Escapement, cpu_seconds
from daemon.demo import save_model

MODEL = "null_784"
PROTOCOLS = ("http", "socket", "grpc")
GRPC_CHANNELS = 4  # connections: with SO_REUSEPORT, each lands on one worker
IMAGE = "image_3x224"
SHM_VARIANTS = ("http binary", "grpc raw", "http shm", "grpc shm")


def _build_repo(root: Path) -> Path:
    model = nn.Linear(784, 10).eval()
    save_model(model, "ts", torch.zeros(2, 784), 32, root / MODEL / "1" / "model.ts")
    (root / MODEL / "config.toml").write_text(
        'max_batch_size = 32\nslo_ms = 100.0\n[[inputs]]\nname = "INPUT__0"\ndatatype = "FP32"\nshape = [-1, 784]\n'
        '[[outputs]]\nname = "OUTPUT__0"\ndatatype = "FP32"\nshape = [-1, 10]\n', encoding="utf-8")
    return root


def _thread_cpu(pid: int, tid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _http_client(port: int, request: bytes, stop: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            if head.startswith(b"HTTP/1.1 200"):
                counts[0] += 1
            else:
                counts[1] += 1
    finally:
        writer.close()


async def _socket_client(path: str, frame: Any, stop: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    i = 0
    try:
        while time.monotonic() < stop:
            i += 1
            writer.write(frame.with_id(i))
            n = int.from_bytes(await reader.readexactly(4), "big")
            answer = await reader.readexactly(n)
            counts[0 if b"\xa6status\xcc\xc8" in answer else 1] += 1
    finally:
        writer.close()


def grpc_infer_message(spec: Any) -> bytes:
    """A serialized ModelInferRequest of one batch-1 sample in raw_input_contents (what tritonclient sends)."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=spec.name)
    for t, (name, arr) in zip(spec.inputs, sample_inputs(spec).items(), strict=True):
        req.inputs.add(name=name, datatype=t.datatype.name, shape=list(arr.shape))
        req.raw_input_contents.append(arr.tobytes())
    return req.SerializeToString()


async def _grpc_client(call: Any, message: bytes, stop: float, counts: list[int]) -> None:
    import grpc

    while time.monotonic() < stop:
        try:
            await call(message)
            counts[0] += 1
        except grpc.aio.AioRpcError:
            counts[1] += 1


async def _grpc_clients(port: int, message: bytes, stop: float, counts: list[int], clients: int) -> None:
    """`clients` RPCs in flight over GRPC_CHANNELS channels, bytes in and out (no client-side protobuf work)."""
    import grpc

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(GRPC_CHANNELS)]
    try:
        calls = [ch.unary_unary("/inference.GRPCInferenceService/ModelInfer") for ch in channels]
        await asyncio.gather(*(_grpc_client(calls[i % len(calls)], message, stop, counts) for i in range(clients)))
    finally:
        for ch in channels:
            await ch.close()


def inline_run_ns(port: int) -> int:
    """The loop's CPU spent running models on the latency path so far (0 for a tree without it):
    model work done on the loop's thread to skip two hand-offs, not the loop's own."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^escapement_controller_events_total\{event="latency_path_cpu_ns"\} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


def _closed_loop(protocol: str, server: Escapement, clients: int, seconds: float, warmup: float,
                 spec: Any) -> dict[str, float]:
    request = http_binary(spec).raw
    frame = socket_frame(spec)
    message = grpc_infer_message(spec)

    async def go(duration: float) -> list[int]:
        counts = [0, 0]
        stop = time.monotonic() + duration
        if protocol == "http":
            await asyncio.gather(*(_http_client(server.port, request, stop, counts) for _ in range(clients)))
        elif protocol == "grpc":
            await _grpc_clients(_grpc_port(server), message, stop, counts, clients)
        else:
            await asyncio.gather(*(_socket_client(server.socket, frame, stop, counts) for _ in range(clients)))
        return counts

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(go(warmup))
        inline0 = inline_run_ns(server.port)
        loop0, all0, t0 = _thread_cpu(server.pid, server.pid), cpu_seconds(server.pid), time.monotonic()
        ok, failed = runner.run(go(seconds))
        wall = time.monotonic() - t0
        loop_s, all_s = _thread_cpu(server.pid, server.pid) - loop0, cpu_seconds(server.pid) - all0
        inline_s = (inline_run_ns(server.port) - inline0) / 1e9
    return {"requests_per_s": ok / wall, "failed": failed, "loop_us_per_request": loop_s / max(ok, 1) * 1e6,
            "inline_run_us_per_request": inline_s / max(ok, 1) * 1e6,
            "loop_us_deciding": (loop_s - inline_s) / max(ok, 1) * 1e6,
            "controller_process_cores": all_s / wall}


def run(quick: bool = False, json_out: str | None = None, workers: list[int] | None = None, reps: int = 3,
        clients: int = 16, seconds: float | None = None, shm: bool = False,
        requests: int | None = None) -> dict[str, Any]:
    if shm:
        return run_shm(quick, json_out, reps, requests or (300 if quick else 1000))
    counts = workers if workers is not None else [0, 1, 2]
    seconds = seconds or (3.0 if quick else 8.0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ingest-") as tmp:
        repo = _build_repo(Path(tmp) / "repo")
        spec = spec_of(repo, MODEL)
        for rep in range(reps):
            for n in counts:  # interleaved: the machine's noise falls on every count alike
                with Escapement(repo, server={"frontend_workers": n, "grpc": "127.0.0.1:0"}) as server:
                    for protocol in PROTOCOLS:
                        m = _closed_loop(protocol, server, clients, seconds, min(1.0, seconds / 3), spec)
                        rows.append({"label": f"{protocol} workers={n}", "protocol": protocol, "workers": n,
                                     "rep": rep, **m})
    summary: dict[str, Any] = {"model": MODEL, "clients": clients, "reps": reps}
    loop_us: dict[str, dict[str, float]] = {}
    deciding: dict[str, dict[str, float]] = {}
    rps: dict[str, dict[str, float]] = {}
    for protocol in PROTOCOLS:
        loop_us[protocol] = {}
        deciding[protocol] = {}
        rps[protocol] = {}
        for n in counts:
            mine = [r for r in rows if r["protocol"] == protocol and r["workers"] == n]
            loop_us[protocol][str(n)] = statistics.median(r["loop_us_per_request"] for r in mine)
            deciding[protocol][str(n)] = statistics.median(r["loop_us_deciding"] for r in mine)
            rps[protocol][str(n)] = statistics.median(r["requests_per_s"] for r in mine)
    summary["loop_us_per_request"] = loop_us
    summary["loop_us_deciding"] = deciding
    summary["requests_per_s_by_workers"] = rps["http"]
    summary["socket_requests_per_s_by_workers"] = rps["socket"]
    summary["grpc_requests_per_s_by_workers"] = rps["grpc"]
    base = counts[0]
    summary["http_ratio_to_workers_" + str(base)] = {str(n): rps["http"][str(n)] / rps["http"][str(base)]
                                                     for n in counts}
    summary["socket_ratio_to_workers_" + str(base)] = {str(n): rps["socket"][str(n)] / rps["socket"][str(base)]
                                                       for n in counts}
    summary["grpc_ratio_to_workers_" + str(base)] = {str(n): rps["grpc"][str(n)] / rps["grpc"][str(base)]
                                                     for n in counts}
    summary["failed_requests"] = sum(r["failed"] for r in rows)
    notes = [f"command: {command('ingest', quick)}",
             f"{clients} closed-loop clients, batch 1, {seconds:g} s per point after a warm-up, {reps} reps "
             "interleaved; medians. The generator shares the machine's cores with the daemon.",
             "loop_us_per_request: CPU of the controller process's main (event-loop) thread per answered request.",
             "loop_us_deciding: the same less the models' runs on that thread (the latency path runs a lone or "
             "small batch there, skipping two thread hand-offs; the daemon counts that CPU, latency_path_cpu_ns): "
             "the link records, the controller and the answers."]
    config = {"command": command("ingest", quick), "workers": counts, "clients": clients, "seconds": seconds,
              "reps": reps}
    return results.write("ingest", config,
                         rows, summary, json_out, notes=notes,
                         columns=["label", "rep", "requests_per_s", "loop_us_per_request", "loop_us_deciding",
                                  "controller_process_cores", "failed"])


# ---------------------------------------------------------------- the shared-memory variant


def _build_image_repo(root: Path) -> Path:
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 10)).eval()
    save_model(model, "ts", torch.zeros(2, 3, 224, 224), 8, root / IMAGE / "1" / "model.ts")
    (root / IMAGE / "config.toml").write_text(
        'max_batch_size = 8\nslo_ms = 1000.0\n[[inputs]]\nname = "INPUT__0"\ndatatype = "FP32"\n'
        'shape = [-1, 3, 224, 224]\n[[outputs]]\nname = "OUTPUT__0"\ndatatype = "FP32"\nshape = [-1, 10]\n',
        encoding="utf-8")
    return root


def _thread_cpu_ns(pid: int, tid: int) -> int:
    """A thread's CPU time in ns (schedstat: /proc's stat counts 10 ms ticks, too coarse for one request)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])


def _grpc_port(server: Escapement) -> int:
    for line in server.log:
        m = re.search(r"gRPC listening on [^:]+:(\d+)", line)
        if m:
            return int(m.group(1))
    raise RuntimeError("the daemon did not say where gRPC listens")


def _shm_point(variant: str, server: Escapement, n: int) -> dict[str, Any]:
    """`n` sequential batch-1 requests of one variant (after 20 unmeasured): latency and loop CPU."""
    import numpy as np
    import tritonclient.grpc as tg
    import tritonclient.http as th
    import tritonclient.utils.shared_memory as shm

    proto, how = variant.split()
    lib: Any = th if proto == "http" else tg
    client = lib.InferenceServerClient(f"127.0.0.1:{server.port if proto == 'http' else _grpc_port(server)}")
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    tag = f"{os.getpid()}-{proto}"
    regions = []
    inp = lib.InferInput("INPUT__0", list(x.shape), "FP32")
    out = lib.InferRequestedOutput("OUTPUT__0")
    if how == "shm":
        hin = shm.create_shared_memory_region("in", f"/escb-in-{tag}", x.nbytes)
        hout = shm.create_shared_memory_region("out", f"/escb-out-{tag}", 40)
        regions = [hin, hout]
        client.register_system_shared_memory("in", f"/escb-in-{tag}", x.nbytes)
        client.register_system_shared_memory("out", f"/escb-out-{tag}", 40)
        inp.set_shared_memory("in", x.nbytes)
        out.set_shared_memory("out", 40)

    def one() -> None:
        if how == "shm":
            shm.set_shared_memory_region(regions[0], [x])  # the client's input, each time
            client.infer(IMAGE, [inp], outputs=[out])
            shm.get_contents_as_numpy(regions[1], np.float32, [1, 10])
        else:
            inp.set_data_from_numpy(x)
            client.infer(IMAGE, [inp], outputs=[out]).as_numpy("OUTPUT__0")

    try:
        for _ in range(20):
            one()
        lat: list[float] = []
        loop0 = _thread_cpu_ns(server.pid, server.pid)
        for _ in range(n):
            t = time.perf_counter()
            one()
            lat.append(time.perf_counter() - t)
        loop_s = (_thread_cpu_ns(server.pid, server.pid) - loop0) / 1e9
    finally:
        if how == "shm":
            client.unregister_system_shared_memory()
            for h in regions:
                shm.destroy_shared_memory_region(h)
        client.close()
    lat.sort()
    return {"loop_us_per_request": loop_s / n * 1e6, "p50_ms": lat[n // 2] * 1e3,
            "p99_ms": lat[min(n - 1, int(n * 0.99))] * 1e3, "mean_ms": statistics.fmean(lat) * 1e3}


def run_shm(quick: bool, json_out: str | None, reps: int, requests: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"shm": "true"}
    if reps != 3:
        extra["reps"] = reps
    if requests != (300 if quick else 1000):
        extra["requests"] = requests
    with tempfile.TemporaryDirectory(prefix="ingest-shm-") as tmp:
        repo = _build_image_repo(Path(tmp) / "repo")
        # No shedding: a machine shared with other runs can hold the loop back tens of ms, and a
        # one-client sequential loop never overloads the daemon itself.
        with Escapement(repo, server={"frontend_workers": 0, "grpc": "127.0.0.1:0", "shed_lag_ms": 0}) as server:
            for rep in range(reps):
                for variant in SHM_VARIANTS:  # interleaved: the machine's noise falls on every variant alike
                    rows.append({"label": variant, "rep": rep, **_shm_point(variant, server, requests)})
    summary: dict[str, Any] = {"model": IMAGE, "input_bytes": 3 * 224 * 224 * 4, "requests": requests, "reps": reps}
    for key in ("loop_us_per_request", "p50_ms", "p99_ms"):
        summary[key] = {v: round(statistics.median(r[key] for r in rows if r["label"] == v), 3 if "ms" in key else 1)
                        for v in SHM_VARIANTS}
    notes = [f"command: {command('ingest', quick, extra)}",
             f"one tritonclient (sync) client, {requests} sequential batch-1 requests per variant and rep, {reps} "
             "reps interleaved; medians. frontend_workers = 0: every frontend runs on the controller's loop.",
             "shm: the input (and the 40-byte output) in system shared memory, registered once; the client writes "
             "its input into the region before each request and reads the output from its region after.",
             "loop_us_per_request: CPU of the daemon's main (event-loop) thread per request."]
    config = {"command": command("ingest", quick, extra), "requests": requests, "reps": reps}
    return results.write("ingest-shm", config, rows, summary, json_out, notes=notes,
                         columns=["label", "rep", "loop_us_per_request", "p50_ms", "p99_ms", "mean_ms"])
