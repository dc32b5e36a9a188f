"""A/B of two source trees on the ingest scenario's closed loop, interleaved in one run.

`python -m bench.scenarios.ingest_ab BASE_TREE NEW_TREE [--reps 3] [--seconds 4] [--workers 1]
[--protocols http,socket,grpc] [--out FILE.md]`: each tree is a checkout (e.g. `git archive REV |
tar -x -C DIR`) whose daemon is started from that directory with this interpreter; per rep and
tree, each protocol (default HTTP binary and the socket, msgpack; gRPC raw contents on request) is
driven by the ingest scenario's 16 closed-loop clients for SECONDS after a warm-up. Measured: CPU
µs per request of the controller process's loop thread and of the worker's (schedstat), and
requests/s. Medians over reps, and new/base ratios of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from bench import servers
from bench.ingest_clients import grpc_clients, http_client, socket_client
from bench.scenarios.common import http_binary, socket_frame, spec_of
from bench.scenarios.ingest import (
    IMAGE,
    MODEL,
    _build_image_repo,
    _build_repo,
    _grpc_port,
    _shm_point,
    _thread_cpu_ns,
    grpc_infer_message,
)
from bench.scenarios.ingest_profile import _children
from bench.servers import cpu_seconds

PROTOCOLS = ("http", "socket", "grpc")


def _point(protocol: str, server: servers.Escapement, spec: Any, seconds: float) -> dict[str, float]:
    request = http_binary(spec).raw
    frame = socket_frame(spec)
    port = _grpc_port(server) if protocol == "grpc" else 0
    message = grpc_infer_message(spec) if protocol == "grpc" else b""

    async def go(duration: float) -> list[int]:
        counts = [0, 0]
        stop = time.monotonic() + duration
        if protocol == "http":
            await asyncio.gather(*(http_client(server.port, request, stop, counts) for _ in range(16)))
        elif protocol == "grpc":
            await grpc_clients(port, message, stop, counts, 16)
        else:
            await asyncio.gather(*(socket_client(server.socket, frame, stop, counts) for _ in range(16)))
        return counts

    pids = [server.pid, *_children(server.pid)]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(go(1.0))
        cpu0 = [_thread_cpu_ns(p, p) for p in pids]
        all0 = cpu_seconds(server.pid)
        workers0 = [cpu_seconds(p) for p in pids[1:]]
        t0 = time.monotonic()
        ok, failed = runner.run(go(seconds))
        wall = time.monotonic() - t0
        cpu = [(_thread_cpu_ns(p, p) - c) / 1e3 for p, c in zip(pids, cpu0, strict=True)]
        every = (cpu_seconds(server.pid) - all0) * 1e6
        workers = sum(cpu_seconds(p) - c for p, c in zip(pids[1:], workers0, strict=True)) * 1e6
    row = {"requests_per_s": ok / wall, "failed": failed, "loop_us_per_request": cpu[0] / max(ok, 1),
           # every thread of the controller process (the loop, the device's lanes): what the
           # process takes of the machine's cores per request
           "process_us_per_request": every / max(ok, 1)}
    if len(cpu) > 1:
        row["worker_loop_us_per_request"] = cpu[1] / max(ok, 1)
        # every thread of the workers (grpcio's own I/O thread, beside the loop, under gRPC)
        row["worker_process_us_per_request"] = workers / max(ok, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--latency-path", choices=("on", "off"), default="on",
                    help="off: every run on the device's thread, as on a GPU")
    ap.add_argument("--protocols", default="http,socket", help=f"a subset of {','.join(PROTOCOLS)}")
    ap.add_argument("--out", default="")
    ap.add_argument("--shm", type=int, default=0,
                    help="instead: the ingest scenario's shared-memory variants (HTTP), this many requests each")
    a = ap.parse_args()
    protocols = [p for p in PROTOCOLS if p in a.protocols.split(",")]
    if not protocols or set(a.protocols.split(",")) - set(PROTOCOLS):
        ap.error(f"--protocols: a subset of {','.join(PROTOCOLS)}")
    trees = {"base": Path(a.base).resolve(), "new": Path(a.new).resolve()}
    if a.shm:
        shm_ab(trees, a.reps, a.shm, a.workers, a.out)
        return
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ingest-ab-") as tmp:
        repo = _build_repo(Path(tmp) / "repo")
        spec = spec_of(repo, MODEL)
        for rep in range(a.reps):
            for label, tree in trees.items():  # interleaved: the machine's noise falls on both alike
                servers.ROOT = tree  # Escapement.start runs `python -m daemon` in ROOT
                controller = {} if a.latency_path == "on" else {"latency_path": False}
                grpc = {"grpc": "127.0.0.1:0"} if "grpc" in protocols else {}
                with servers.Escapement(repo, server={"frontend_workers": a.workers, **grpc},
                                        controller=controller) as server:
                    for protocol in protocols:
                        rows.append({"tree": label, "rep": rep, "protocol": protocol,
                                     **_point(protocol, server, spec, a.seconds)})
                        print(rows[-1], flush=True)
    keys = ["loop_us_per_request", "process_us_per_request", "worker_loop_us_per_request",
            "worker_process_us_per_request", "requests_per_s"]
    lines = [f"# ingest A/B: {trees['base']} (base) vs {trees['new']} (new)", "",
             f"`python -m bench.scenarios.ingest_ab {a.base} {a.new} --reps {a.reps} --seconds {a.seconds:g} "
             f"--workers {a.workers} --latency-path {a.latency_path} --protocols {','.join(protocols)}`; "
             f"frontend_workers = {a.workers}, "
             "16 closed-loop clients, batch 1, "
             f"null_784; {a.reps} reps interleaved, medians.", "",
             "| protocol | metric | base | new | new/base |", "|---|---|---|---|---|"]
    for protocol in protocols:
        for key in keys:
            med = {}
            for label in trees:
                vals = [r[key] for r in rows if r["tree"] == label and r["protocol"] == protocol and key in r]
                med[label] = statistics.median(vals) if vals else float("nan")
            lines.append(f"| {protocol} | {key} | {med['base']:.1f} | {med['new']:.1f} | "
                         f"{med['new'] / med['base']:.3f} |")
    lines += ["", "Rows:", "",
              "| tree | rep | protocol | controller loop µs/req | worker loop µs/req | req/s | failed |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tree']} | {r['rep']} | {r['protocol']} | {r['loop_us_per_request']:.1f} | "
                     f"{r.get('worker_loop_us_per_request', float('nan')):.1f} | {r['requests_per_s']:.0f} | "
                     f"{r['failed']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


def shm_ab(trees: dict[str, Path], reps: int, requests: int, workers: int, out: str) -> None:
    """`image_3x224` (588 KiB FP32) by the sync tritonclient, one at a time: HTTP binary and HTTP
    with the input and output in system shared memory, through `workers` frontend workers."""
    variants = ("http binary", "http shm")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ingest-ab-shm-") as tmp:
        repo = _build_image_repo(Path(tmp) / "repo")
        for rep in range(reps):
            for label, tree in trees.items():
                servers.ROOT = tree
                with servers.Escapement(repo, server={"frontend_workers": workers, "shed_lag_ms": 0}) as server:
                    for v in variants:
                        rows.append({"tree": label, "rep": rep, "variant": v, **_shm_point(v, server, requests)})
                        print(rows[-1], flush=True)
    lines = [f"# ingest shared-memory A/B: {trees['base']} (base) vs {trees['new']} (new)", "",
             f"`python -m bench.scenarios.ingest_ab BASE NEW --shm {requests} --reps {reps} --workers {workers}`; "
             f"{IMAGE}, one sync tritonclient, {requests} sequential requests per variant, {reps} reps "
             "interleaved, medians. loop = the controller process's main thread.", "",
             "| variant | metric | base | new | new/base |", "|---|---|---|---|---|"]
    for v in variants:
        for key in ("loop_us_per_request", "p50_ms", "p99_ms"):
            med = {t: statistics.median(r[key] for r in rows if r["tree"] == t and r["variant"] == v) for t in trees}
            lines.append(f"| {v} | {key} | {med['base']:.3f} | {med['new']:.3f} | {med['new'] / med['base']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)


if __name__ == "__main__":
    main()
