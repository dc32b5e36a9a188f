"""What scenarios share: the demo repository, request templates per frontend, one measured run."""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson
import uvloop

from bench import loadgen
from bench.loadgen import HttpRequest, Run, Schedule, SocketFrame
from bench.servers import ROOT, CpuMeter
from daemon.client.wire import http_infer_body, infer_message
from daemon.model import ModelSpec
from daemon.repository import scan

Frontend = Literal["socket", "http", "http-json"]
FRONTENDS: tuple[Frontend, ...] = ("socket", "http", "http-json")
DEMO = ROOT / "models"


def demo_repo() -> Path:
    """The demo repository (built offline if missing)."""
    repo = Path(os.environ.get("ESCAPEMENT_BENCH_MODELS", DEMO))
    if not (repo / "mlp_784" / "config.toml").exists():
        from daemon import demo

        demo.build(repo)
    return repo


def spec_of(repo: Path, name: str) -> ModelSpec:
    spec = next((m for m in scan(repo).models if m.name == name), None)
    if spec is None:
        raise SystemExit(f"model {name} is not in {repo}")
    return spec


def sample_inputs(spec: ModelSpec, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for t in spec.inputs:
        shape = (batch, *t.sample_shape)
        dt = t.datatype.numpy
        out[t.name] = (rng.random(shape) if dt.kind == "f" else rng.integers(0, 2, shape)).astype(dt)
    return out


def http_binary(spec: ModelSpec, name: str | None = None, batch: int = 1) -> HttpRequest:
    body, hlen = http_infer_body(sample_inputs(spec, batch))
    return HttpRequest.build("POST", f"/v2/models/{name or spec.name}/infer", body,
                             {"Inference-Header-Content-Length": str(hlen)})


def http_json(spec: ModelSpec, name: str | None = None, batch: int = 1) -> HttpRequest:
    inputs = sample_inputs(spec, batch)
    body = orjson.dumps({"inputs": [{"name": k, "datatype": spec.inputs[i].datatype.name, "shape": list(v.shape),
                                     "data": v.ravel().tolist()} for i, (k, v) in enumerate(inputs.items())]})
    return HttpRequest.build("POST", f"/v2/models/{name or spec.name}/infer", body,
                             {"Content-Type": "application/json"})


def socket_frame(spec: ModelSpec, name: str | None = None, batch: int = 1) -> SocketFrame:
    return SocketFrame(infer_message(name or spec.name, sample_inputs(spec, batch)))


@dataclass
class Measured:
    run: Run
    server_cores: float
    generator_cores: float


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(schedule: Schedule, frontend: Frontend, server_pid: int, names: list[str], *,
            socket_path: str = "", port: int = 0, specs: Sequence[ModelSpec] = (), warmup: float = 0.0,
            drain_s: float = 5.0, http_requests: Sequence[HttpRequest] | None = None) -> Measured:
    """Play `schedule` against a server and meter both processes' CPU while it runs."""
    meter = CpuMeter(server_pid)
    gc.collect()
    gc.freeze()  # the generator imports torch too: no 100 ms collections while it measures

    async def go() -> Run:
        meter.start()
        if frontend == "socket":
            frames = [socket_frame(s, n) for s, n in zip(specs, names, strict=True)]
            return await loadgen.run_socket(schedule, socket_path, frames, names, warmup, drain_s)
        reqs = http_requests or [(http_binary if frontend == "http" else http_json)(s, n)
                                 for s, n in zip(specs, names, strict=True)]
        return await loadgen.run_http(schedule, "127.0.0.1", port, reqs, names, warmup, drain_s)

    t0, c0 = time.monotonic(), _self_cpu()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        run = runner.run(go())
    server_cores = meter.stop()
    wall = time.monotonic() - t0
    return Measured(run, server_cores, (_self_cpu() - c0) / wall)


def command(name: str, quick: bool, extra: dict[str, Any] | None = None) -> str:
    opts = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (extra or {}).items())
    return f"python -m bench run {name}{' --quick' if quick else ''}{' ' + opts if opts else ''}"


def passes(row: dict[str, Any], min_attainment: float = 0.99) -> bool:
    """A point counts towards capacity at SLO (the rule of results.capacity_at_slo)."""
    return row["p99_ms"] <= row["slo_ms"] and row["slo_attainment"] >= min_attainment and not row["generator_bound"]


def search_capacity(point: Callable[[float], dict[str, Any]], ladder: Sequence[float], *, refine: int,
                    grow: float = 2.0, max_rps: float = 50_000.0) -> list[dict[str, Any]]:
    """Probe every load of `ladder` (loads all systems share), then grow the load `grow`-fold until a
    point fails, then bisect (geometrically) `refine` times between the best passing load and the
    lowest failing one above it. A fixed grid would cap a fast system at its top and place a slow
    one only to within a grid step; this finds each system's capacity to within
    grow ** (1 / 2 ** refine). A point that failed only because the generator fell behind while
    the server kept up is measured once more. Returns the rows that count, in the order measured."""
    rows: list[dict[str, Any]] = []

    def probe(rate: float) -> dict[str, Any]:
        r = point(rate)
        if not passes(r) and r["generator_bound"] and r["achieved_rps"] >= 0.97 * r["offered_rps"]:
            # The server answered about everything offered, but the generator fell behind: a stall of
            # the shared machine (every process at once), not the server's limit. Measure again.
            r["superseded"] = True
            r = point(rate)
            r["retry"] = True
        return r

    for rate in ladder:
        rows.append(probe(rate))
        if not passes(rows[-1]) and rows[-1]["slo_attainment"] < 0.5:
            break  # saturated: higher loads only take longer
    rate = max(ladder)
    while rows and passes(rows[-1]) and rate * grow <= max_rps:
        rate *= grow
        rows.append(probe(rate))
    for _ in range(refine):
        good = [r["offered_rps"] for r in rows if passes(r)]
        if not good:
            break
        best = max(good)
        above = [r["offered_rps"] for r in rows if r["offered_rps"] > best and not passes(r)]
        if not above:
            break
        rows.append(probe((best * min(above)) ** 0.5))
    return rows
