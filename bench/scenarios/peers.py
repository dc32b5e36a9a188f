"""`peers`: escapement against TorchServe, Ray Serve and a plain aiohttp server, in one run.

Every system serves the same program (the demo `mlp_784`, 784-1024-1024-10) through its
natural HTTP JSON API with the same tensor, gets the same warm-up, and is offered the same
grid of Poisson loads until it saturates. Reported: capacity at SLO per system, and p99 at a
common load (the highest grid load every system sustained within the SLO).

Peers are installed by `bench/peers/setup.sh` into `bench/.peers/`; a peer that is missing is
named in the result's notes and skipped, not failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import loadgen, results
from bench.loadgen import HttpRequest
from bench.scenarios.common import command, demo_repo, http_json, measure, search_capacity, spec_of
from bench.servers import ROOT, Escapement

PEERS = ROOT / "bench" / ".peers"
HERE = ROOT / "bench" / "peers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu_seconds(root: int) -> float:
    total = 0.0
    for pid in tree_pids(root):
        try:
            f = (Path(f"/proc/{pid}/stat")).read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue
    return total


@dataclass
class System:
    name: str
    port: int
    request: HttpRequest
    pid: int = 0
    stop: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)


def _wait_http(port: int, raw: bytes, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Send `raw` until it answers 200 (peers have no common readiness signal)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(raw)
                data = s.recv(65536)
                if data.startswith(b"HTTP/1.1 200") or data.startswith(b"HTTP/1.0 200"):
                    return
                last = data[:200].decode("latin-1")
        except OSError as e:
            last = str(e)
        time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout:.0f} s: {last}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)


def _json_body(x: np.ndarray) -> bytes:
    return orjson.dumps({"inputs": x.tolist()})


def start_plain(model_file: Path, x: np.ndarray) -> System:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "plain_server.py"), str(model_file), str(port)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    req = HttpRequest.build("POST", "/infer", _json_body(x), {"Content-Type": "application/json"})
    _wait_http(port, req.raw, 120, proc)
    return System("plain-aiohttp", port, req, proc.pid, lambda: _kill_group(proc),
                  ["plain-aiohttp: one forward per request in the aiohttp handler, torch's default threads"])


def start_torchserve(model_file: Path, x: np.ndarray, workers: int = 2) -> System:
    env_dir = PEERS / "torchserve"
    if not (env_dir / "bin" / "torchserve").exists():
        raise FileNotFoundError("TorchServe is not installed: run bench/peers/setup.sh torchserve")
    if shutil.which("java") is None:
        raise FileNotFoundError("TorchServe needs a Java runtime (java) on PATH")
    work = Path(tempfile.mkdtemp(prefix="ts-"))
    store = work / "store"
    store.mkdir()
    subprocess.run([str(env_dir / "bin" / "torch-model-archiver"), "--model-name", "mlp", "--version", "1.0",
                    "--serialized-file", str(model_file), "--handler", str(HERE / "torchserve_handler.py"),
                    "--export-path", str(store), "--force"], check=True, capture_output=True)
    port, mport, metrics = free_port(), free_port(), free_port()
    models = {"mlp": {"1.0": {"defaultVersion": True, "marName": "mlp.mar", "minWorkers": workers,
                              "maxWorkers": workers, "batchSize": 32, "maxBatchDelay": 5, "responseTimeout": 120}}}
    (work / "config.properties").write_text("\n".join([
        f"inference_address=http://127.0.0.1:{port}", f"management_address=http://127.0.0.1:{mport}",
        f"metrics_address=http://127.0.0.1:{metrics}", f"model_store={store}", "load_models=mlp.mar",
        "models=" + orjson.dumps(models).decode(), "disable_token_authorization=true",
        "default_response_timeout=120", "job_queue_size=1000", ""]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}",
           "LOG_LOCATION": str(work / "logs"), "METRICS_LOCATION": str(work / "logs")}
    proc = subprocess.Popen([str(env_dir / "bin" / "torchserve"), "--start", "--foreground", "--ncs",
                             "--model-store", str(store), "--ts-config", str(work / "config.properties"),
                             "--disable-token-auth"], cwd=work, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    req = HttpRequest.build("POST", "/predictions/mlp", _json_body(x), {"Content-Type": "application/json"})

    def stop() -> None:
        _kill_group(proc)
        shutil.rmtree(work, ignore_errors=True)

    try:
        _wait_http(port, req.raw, 240, proc)
    except Exception:
        stop()
        raise
    return System("torchserve", port, req, proc.pid, stop,
                  [f"torchserve 0.12.0: {workers} workers (OMP_NUM_THREADS=1 each), batchSize 32, maxBatchDelay 5 ms"])


def start_ray(model_file: Path, x: np.ndarray) -> System:
    env_dir = PEERS / "ray"
    if not (env_dir / "bin" / "python").exists():
        raise FileNotFoundError("Ray Serve is not installed: run bench/peers/setup.sh ray")
    port = free_port()
    proc = subprocess.Popen([str(env_dir / "bin" / "python"), str(HERE / "ray_app.py"), str(model_file), str(port)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    req = HttpRequest.build("POST", "/", _json_body(x), {"Content-Type": "application/json"})

    def stop() -> None:
        _kill_group(proc)
        subprocess.run([str(env_dir / "bin" / "ray"), "stop", "--force"], capture_output=True, timeout=120)

    try:
        _wait_http(port, req.raw, 300, proc)
    except Exception:
        stop()
        raise
    return System("ray-serve", port, req, proc.pid, stop,
                  ["ray-serve: one replica, @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005), "
                   "1 intra-op thread"])


class _TreeMeterPid:
    """measure() meters one pid; peers are process trees, so meter the tree around it."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.t0 = self.c0 = 0.0

    def start(self) -> None:
        self.t0, self.c0 = time.monotonic(), tree_cpu_seconds(self.root)

    def stop(self) -> float:
        return (tree_cpu_seconds(self.root) - self.c0) / max(time.monotonic() - self.t0, 1e-9)


def run(quick: bool = False, json_out: str | None = None, model: str = "mlp_784", seconds: float | None = None,
        systems: str = "escapement,torchserve,ray-serve,plain-aiohttp", refine: int | None = None,
        pin: bool = True) -> dict[str, Any]:
    seconds = seconds or (4.0 if quick else 10.0)
    refine = refine if refine is not None else (3 if quick else 4)
    grid = [250, 1000] if quick else [100, 250, 500, 1000]  # every system is offered these; then each is searched
    repo = demo_repo()
    spec = spec_of(repo, model)
    model_file = spec.path
    x = np.random.default_rng(0).random((1, *spec.inputs[0].sample_shape)).astype(np.float32)
    slo = spec.slo_s
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    missing: dict[str, str] = {}
    by_system: dict[str, list[dict[str, Any]]] = {}

    def sweep(sys_: System) -> None:
        measure(loadgen.poisson(200, 3.0 if quick else 5.0, seed=9), "http", sys_.pid, [model], port=sys_.port,
                http_requests=[sys_.request])  # warm-up, not reported
        seeds = iter(range(1000))

        def point(rate: float) -> dict[str, Any]:
            meter = _TreeMeterPid(sys_.pid)
            meter.start()
            m = measure(loadgen.poisson(rate, seconds, seed=next(seeds)), "http", sys_.pid, [model], port=sys_.port,
                        http_requests=[sys_.request], warmup=min(1.0, seconds / 4), drain_s=max(2.0, 3 * slo))
            r = results.row(m.run, sys_.name, slo, server_cores=meter.stop(), generator_cores=m.generator_cores)
            rows.append(r)
            return r

        by_system[sys_.name] = search_capacity(point, grid, refine=refine)

    starters: dict[str, Callable[[], System]] = {
        "torchserve": lambda: start_torchserve(model_file, x),
        "ray-serve": lambda: start_ray(model_file, x),
        "plain-aiohttp": lambda: start_plain(model_file, x),
    }
    for name in [s.strip() for s in systems.split(",") if s.strip()]:
        if name == "escapement":
            with Escapement(repo, runtime={"pin_threads": pin}) as server:
                sys_ = System("escapement", server.port, http_json(spec), server.pid,
                              notes=["escapement: KServe v2 JSON, one cpu device (1 intra-op thread), "
                                     "policy clockwork (the default)"])
                sweep(sys_)
                notes += sys_.notes
            continue
        try:
            sys_ = starters[name]()
        except (FileNotFoundError, RuntimeError, subprocess.CalledProcessError, KeyError) as e:
            missing[name] = f"{type(e).__name__}: {e}"
            notes.append(f"{name}: MISSING, not measured ({missing[name]})")
            continue
        try:
            sweep(sys_)
            notes += sys_.notes
        finally:
            sys_.stop()
    capacity = {name: results.capacity_at_slo(rs) for name, rs in by_system.items()}
    rows[:] = [r for rs in by_system.values() for r in sorted(rs, key=lambda r: r["offered_rps"])]
    retried = [f"{r['label']} at {r['offered_rps']:.0f}/s" for r in rows if r.get("retry")]
    if retried:
        notes.append("Measured again after the generator fell behind while the server kept up (a stall of the "
                     f"machine; the first try is not shown): {', '.join(retried)}.")
    sustained = [rate for rate in grid
                 if all(any(abs(r["offered_rps"] - rate) / rate < 0.1 and r["p99_ms"] <= r["slo_ms"]
                            and r["slo_attainment"] >= 0.99 for r in rs) for rs in by_system.values())]
    common = max(sustained) if sustained else grid[0]
    p99_common = {}
    for name, rs in by_system.items():
        near = [r for r in rs if abs(r["offered_rps"] - common) / common < 0.1]
        p99_common[name] = near[0]["p99_ms"] if near else None
    peers_cap = {k: v for k, v in capacity.items() if k != "escapement"}
    best_peer = max(peers_cap, key=lambda k: peers_cap[k]) if peers_cap else None
    summary: dict[str, Any] = {"model": model, "slo_ms": slo * 1e3, "capacity_at_slo_rps": capacity,
                               "common_load_rps": common, "p99_ms_at_common_load": p99_common,
                               "missing": missing}
    if best_peer and "escapement" in capacity and peers_cap[best_peer] > 0:
        summary["best_peer"] = best_peer
        summary["capacity_ratio_vs_best_peer"] = capacity["escapement"] / peers_cap[best_peer]
        if p99_common.get("escapement") and p99_common.get(best_peer):
            summary["p99_ratio_vs_best_peer_at_common_load"] = p99_common["escapement"] / p99_common[best_peer]
    config = {"command": command("peers", quick), "model": model, "seconds_per_point": seconds,
              "common_grid_rps": grid, "search": f"x2 from the grid's top until a point fails, then {refine} "
                                                  "geometric bisections",
              "arrivals": "poisson", "frontend": "HTTP JSON, each system's own API, the same [1, 784] tensor"}
    png = results.plot_curve("peers", rows, slo * 1e3, f"{model} through each system's HTTP JSON API")
    notes.append("Capacity at SLO: the highest load found with p99 within the SLO, >= 99% of requests within it, "
                 f"and the generator on schedule; searched per system to within 2^(1/{2 ** refine}) "
                 f"(~{(2 ** (1 / 2 ** refine) - 1) * 100:.0f}%).")
    if png:
        notes.append(f"Plot: {png.name}")
    return results.write("peers", config, rows, summary, json_out, notes,
                         columns=["label", "offered_rps", "achieved_rps", "goodput_rps", "slo_attainment", "p50_ms",
                                  "p99_ms", "p999_ms", "errors", "server_cores", "generator_cores",
                                  "generator_bound"])

