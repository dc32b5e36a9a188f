"""`ingest`: requests/s and controller-loop CPU per request against the number of frontend workers.

A near-null model (`null_784`: one 784 -> 10 linear layer, ~5 µs a sample, built here) keeps the
device out of the way, so what is measured is the frontend: parsing, decoding, validation,
answer encoding, and the controller's own per-request work. Closed loop: `clients` connections
each keep one batch-1 request in flight (HTTP binary, msgpack frames on the unix socket, or gRPC
ModelInfer with `raw_input_contents`, sent as pre-serialized messages over 4 channels per
generator) for `seconds`; the generator runs on the same machine (on 2 cores it takes a share of
them: compare ratios between worker counts, not absolute figures with other machines).

`--generators G` (default 1: the clients on one uvloop loop in this process) splits the clients
over G spawned processes (bench/ingest_clients.py, no torch), which start each point's warm-up and
measured window together: one asyncio process cannot offer what many workers take. Every answered
request's latency is recorded: `p50_ms`, `p99_ms` per row, over all generators. Also
`--clients N`, `--workers 0,1,2`, `--seconds S`, `--reps N`, `--protocols http,grpc`.

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

import os
import re
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bench import results
from bench.ingest_clients import Generators, InProcess, Target
from bench.ingest_clients import generators as make_generators
from bench.scenarios.common import command, http_binary, sample_inputs, socket_frame, spec_of
from bench.servers import Escapement, cpu_seconds
from daemon.demo import save_model

MODEL = "null_784"
PROTOCOLS = ("http", "socket", "grpc")
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
    return sum(_thread_times(pid, tid))


def _thread_times(pid: int, tid: int) -> tuple[float, float]:
    """A thread's user and system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def grpc_infer_message(spec: Any) -> bytes:
    """A serialized ModelInferRequest of one batch-1 sample in raw_input_contents (what tritonclient sends)."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name=spec.name)
    for t, (name, arr) in zip(spec.inputs, sample_inputs(spec).items(), strict=True):
        req.inputs.add(name=name, datatype=t.datatype.name, shape=list(arr.shape))
        req.raw_input_contents.append(arr.tobytes())
    return req.SerializeToString()


def inline_run_ns(port: int) -> int:
    """The loop's CPU spent running models on the latency path so far (0 for a tree without it):
    model work done on the loop's thread to skip two hand-offs, not the loop's own."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^escapement_controller_events_total\{event="latency_path_cpu_ns"\} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else 0


class _ControllerMeter:
    """The controller process's CPU over a measured window: its loop thread, the whole process, and
    the models' runs on the loop thread (inline_run_ns)."""

    def __init__(self, server: Escapement) -> None:
        self.server = server
        self.inline0 = self.loop0 = self.all0 = self.sys0 = 0.0
        self.inline_s = self.loop_s = self.all_s = self.sys_s = 0.0

    def open(self) -> None:
        pid = self.server.pid
        self.inline0 = inline_run_ns(self.server.port)
        user, self.sys0 = _thread_times(pid, pid)
        self.loop0, self.all0 = user + self.sys0, cpu_seconds(pid)

    def close(self) -> None:
        pid = self.server.pid
        user, sys = _thread_times(pid, pid)
        self.loop_s, self.all_s = user + sys - self.loop0, cpu_seconds(pid) - self.all0
        self.sys_s = sys - self.sys0
        self.inline_s = (inline_run_ns(self.server.port) - self.inline0) / 1e9


def target(protocol: str, server: Escapement, spec: Any) -> Target:
    """What one protocol's clients send, prebuilt here (a generator process imports neither torch nor the daemon)."""
    if protocol == "http":
        return Target("http", server.port, server.socket, http_binary(spec).raw)
    if protocol == "socket":
        frame = socket_frame(spec)
        return Target("socket", server.port, server.socket, bytes(frame.template), frame.offset)
    if protocol == "grpc":
        return Target("grpc", _grpc_port(server), server.socket, grpc_infer_message(spec))
    raise ValueError(f"unknown protocol {protocol!r}; protocols: {', '.join(PROTOCOLS)}")


def _percentiles_ms(latencies: Any) -> tuple[float, float]:
    lat = np.frombuffer(latencies, dtype=np.float64)
    if not len(lat):
        return float("nan"), float("nan")
    p50, p99 = np.percentile(lat, [50, 99])
    return float(p50) * 1e3, float(p99) * 1e3


def closed_loop(protocol: str, server: Escapement, clients: int, seconds: float, warmup: float, spec: Any,
                gens: InProcess | Generators) -> dict[str, Any]:
    """One point: `clients` closed-loop connections (split over `gens`) for a warm-up, then `seconds` measured."""
    meter = _ControllerMeter(server)
    out = gens.run(target(protocol, server, spec), clients, warmup, seconds, meter.open, meter.close)
    ok, wall = out.ok, out.wall_s
    p50, p99 = _percentiles_ms(out.latencies)
    return {"requests_per_s": ok / wall, "failed": out.failed, "errors": out.errors, "p50_ms": p50, "p99_ms": p99,
            "loop_us_per_request": meter.loop_s / max(ok, 1) * 1e6,
            # of which in the kernel (the link's and the sockets' system calls)
            "loop_sys_us_per_request": meter.sys_s / max(ok, 1) * 1e6,
            "inline_run_us_per_request": meter.inline_s / max(ok, 1) * 1e6,
            "loop_us_deciding": (meter.loop_s - meter.inline_s) / max(ok, 1) * 1e6,
            "controller_process_cores": meter.all_s / wall,
            # the generators' CPU: a busiest one near 1 core means the load, not the daemon, was the limit
            "generator_cores": sum(out.generator_cpu_s) / wall,
            "generator_busiest_cores": max(out.generator_cpu_s) / wall}


def serve(repo: Path, workers: int, device: str | None = None, latency_path: bool = True) -> Escapement:
    """The daemon for one worker count (not started): HTTP, the socket and gRPC, the model on `device` (default CPU).
    `latency_path=False`: every run on the device's thread, as on a GPU (the loop hands each INFER over)."""
    server = {"frontend_workers": workers, "grpc": "127.0.0.1:0"}
    controller = {} if latency_path else {"latency_path": False}
    if device is None:
        return Escapement(repo, server=server, controller=controller)
    return Escapement(repo, server=server, runtime={"devices": [device]}, controller=controller)


def points(server: Escapement, spec: Any, workers: int, protocols: Sequence[str], clients: int, seconds: float,
           warmup: float, gens: InProcess | Generators, rep: int = 0) -> list[dict[str, Any]]:
    """Every protocol's point against one running daemon."""
    return [{"label": f"{p} workers={workers}", "protocol": p, "workers": workers, "rep": rep, "clients": clients,
             **closed_loop(p, server, clients, seconds, warmup, spec, gens)} for p in protocols]


def int_list(value: Any) -> list[int]:
    """`--workers 0,1,2` (a string), `--workers 2` (an int) or `--workers [0,1]` (JSON)."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, str):
        return [int(x) for x in value.split(",") if x.strip()]
    return [int(x) for x in value]


def protocol_list(value: Any) -> list[str]:
    """`--protocols http,grpc`: a subset of PROTOCOLS, in PROTOCOLS' order."""
    wanted = value.split(",") if isinstance(value, str) else list(value)
    unknown = set(wanted) - set(PROTOCOLS)
    if unknown:
        raise SystemExit(f"unknown protocol(s) {', '.join(sorted(unknown))}; protocols: {', '.join(PROTOCOLS)}")
    return [p for p in PROTOCOLS if p in wanted]


def _median_by(rows: list[dict[str, Any]], key: str, protocol: str, counts: list[int]) -> dict[str, float]:
    """{workers: the median of `key`} for the counts measured."""
    out = {}
    for n in counts:
        mine = [r[key] for r in rows if r["protocol"] == protocol and r["workers"] == n]
        if mine:
            out[str(n)] = statistics.median(mine)
    return out


def summarize(rows: list[dict[str, Any]], protocols: Sequence[str], counts: list[int]) -> dict[str, Any]:
    """Per protocol and worker count, medians over reps (the keys of every earlier run, for the protocols run)."""
    summary: dict[str, Any] = {}
    rps = {p: _median_by(rows, "requests_per_s", p, counts) for p in protocols}
    summary["loop_us_per_request"] = {p: _median_by(rows, "loop_us_per_request", p, counts) for p in protocols}
    summary["loop_us_deciding"] = {p: _median_by(rows, "loop_us_deciding", p, counts) for p in protocols}
    summary["loop_sys_us_per_request"] = {p: _median_by(rows, "loop_sys_us_per_request", p, counts) for p in protocols}
    for p in protocols:
        summary["requests_per_s_by_workers" if p == "http" else f"{p}_requests_per_s_by_workers"] = rps[p]
    base = str(counts[0])
    for p in protocols:
        ref = rps[p].get(base, 0.0)
        summary[f"{p}_ratio_to_workers_{base}"] = {n: v / ref if ref else float("nan") for n, v in rps[p].items()}
    summary["p50_ms_by_workers"] = {p: _median_by(rows, "p50_ms", p, counts) for p in protocols}
    summary["p99_ms_by_workers"] = {p: _median_by(rows, "p99_ms", p, counts) for p in protocols}
    summary["failed_requests"] = sum(r["failed"] for r in rows)
    return summary


def run(quick: bool = False, json_out: str | None = None, workers: Any = None, reps: int = 3,
        clients: int = 16, seconds: float | None = None, shm: bool = False,
        requests: int | None = None, generators: int = 1, protocols: Any = None,
        latency_path: Any = True) -> dict[str, Any]:
    if shm:
        return run_shm(quick, json_out, reps, requests or (300 if quick else 1000))
    counts = int_list(workers) if workers is not None else [0, 1, 2]
    chosen = protocol_list(protocols) if protocols is not None else list(PROTOCOLS)
    seconds = seconds or (3.0 if quick else 8.0)
    path = latency_path not in (False, "off", "false", "0", 0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ingest-") as tmp, closing(make_generators(generators)) as gens:
        repo = _build_repo(Path(tmp) / "repo")
        spec = spec_of(repo, MODEL)
        for rep in range(reps):
            for n in counts:  # interleaved: the machine's noise falls on every count alike
                with serve(repo, n, latency_path=path) as server:
                    rows += points(server, spec, n, chosen, clients, seconds, min(1.0, seconds / 3), gens, rep)
    summary: dict[str, Any] = {"model": MODEL, "clients": clients, "generators": generators, "reps": reps,
                               **summarize(rows, chosen, counts)}
    extra = {k: v for k, v in (("workers", ",".join(map(str, counts)) if workers is not None else None),
                               ("clients", clients if clients != 16 else None),
                               ("seconds", seconds if seconds != (3.0 if quick else 8.0) else None),
                               ("reps", reps if reps != 3 else None),
                               ("generators", generators if generators != 1 else None),
                               ("protocols", ",".join(chosen) if protocols is not None else None),
                               ("latency-path", None if path else "off"))
             if v is not None}
    where = ("in this process (one uvloop loop)" if generators <= 1 else
             f"in {generators} spawned processes (a uvloop loop each, clients split among them, one shared start)")
    notes = [f"command: {command('ingest', quick, extra)}",
             f"{clients} closed-loop clients, batch 1, {seconds:g} s per point after a warm-up, {reps} reps "
             f"interleaved; medians. The clients run {where}, sharing the machine's cores with the daemon.",
             "loop_us_per_request: CPU of the controller process's main (event-loop) thread per answered request.",
             "loop_us_deciding: the same less the models' runs on that thread (the latency path runs a lone or "
             "small batch there, skipping two thread hand-offs; the daemon counts that CPU, latency_path_cpu_ns): "
             "the link records, the controller and the answers.",
             "loop_sys_us_per_request: the part of loop_us_per_request spent in the kernel (the link's and the "
             "sockets' system calls).",
             "p50_ms, p99_ms: latency of every answered request of the measured window (all generators), as each "
             "client saw it from writing its request to reading the whole answer.",
             "generator_busiest_cores: the busiest generator's CPU over the window; near 1 the generator, not the "
             "daemon, limited requests/s."]
    config = {"command": command("ingest", quick, extra), "workers": counts, "clients": clients, "seconds": seconds,
              "reps": reps, "generators": generators, "protocols": chosen, "latency_path": path}
    return results.write("ingest", config,
                         rows, summary, json_out, notes=notes,
                         columns=["label", "rep", "requests_per_s", "p50_ms", "p99_ms", "loop_us_per_request",
                                  "loop_us_deciding", "loop_sys_us_per_request", "controller_process_cores",
                                  "generator_busiest_cores",
                                  "failed"])


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
