"""gRPC against HTTP on one daemon: closed-loop batch-1 requests/s and the daemon's CPU per request.

    flock /tmp/escapement-cpu.lock python -m bench.grpc_vs_http [--model digits_mlp] [--concurrency 16]
        [--seconds 5] [--runs 3]

The unmodified tritonclient asyncio clients (HTTP: binary tensors; gRPC: raw_input_contents)
drive `escapement serve` in a child process, alternately, `--runs` times each; it prints the
runs and their medians as JSON. The generator shares the machine's cores with the daemon (on a
2-core machine it is the bottleneck: compare the CPU per request, which is the daemon's own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from typing import Any

import numpy as np
import tritonclient.grpc.aio as tga
import tritonclient.http.aio as tha

from bench.scenarios.common import demo_repo
from bench.servers import Escapement, cpu_seconds

PROTOCOLS = ("grpc", "http")


async def closed_loop(proto: str, address: str, model: str, concurrency: int, seconds: float) -> tuple[float, int]:
    """(requests/s, requests) of `concurrency` clients each sending the next request once answered."""
    mod: Any = tga if proto == "grpc" else tha
    client = mod.InferenceServerClient(address)
    x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
    done = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        inp = mod.InferInput("INPUT__0", [1, 64], "FP32")
        inp.set_data_from_numpy(x)
        while time.perf_counter() < end:
            await client.infer(model, [inp])
            done += 1

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return done / (time.perf_counter() - t0), done


def run(model: str, concurrency: int, seconds: float, runs: int) -> dict[str, Any]:
    with Escapement(demo_repo(), server={"grpc": "127.0.0.1:0"}) as server:
        grpc_port = next(int(m.group(1)) for line in server.log
                         if (m := re.search(r"gRPC listening on [^:]+:(\d+)", line)))
        address = {"grpc": f"127.0.0.1:{grpc_port}", "http": f"127.0.0.1:{server.port}"}
        for proto in PROTOCOLS:  # warm both paths (connections, the model's first batches)
            asyncio.run(closed_loop(proto, address[proto], model, concurrency, 1.0))
        rps: dict[str, list[int]] = {p: [] for p in PROTOCOLS}
        us: dict[str, list[int]] = {p: [] for p in PROTOCOLS}
        for _ in range(runs):
            for proto in PROTOCOLS:
                c0 = cpu_seconds(server.pid)
                rate, n = asyncio.run(closed_loop(proto, address[proto], model, concurrency, seconds))
                rps[proto].append(round(rate))
                us[proto].append(round((cpu_seconds(server.pid) - c0) / max(n, 1) * 1e6))
    return {"model": model, "concurrency": concurrency, "seconds": seconds, "requests_per_s": rps,
            "daemon_cpu_us_per_request": us,
            "median_requests_per_s": {p: statistics.median(v) for p, v in rps.items()},
            "median_daemon_cpu_us_per_request": {p: statistics.median(v) for p, v in us.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="digits_mlp")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps(run(a.model, a.concurrency, a.seconds, a.runs)))


if __name__ == "__main__":
    main()
