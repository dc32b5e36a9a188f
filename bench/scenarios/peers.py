"""`peers`: escapement against NVIDIA Triton (a python-backend model, and PyTriton), TorchServe,
Ray Serve and a plain aiohttp server, in one run.

Every system serves the same program (the demo `mlp_784`, 784-1024-1024-10) through its
natural HTTP JSON API with the same tensor (escapement and both Tritons: the same KServe v2
bytes), tuned as its users would on this machine (`TUNED`), gets the same warm-up, and is
offered the same grid of Poisson loads, then its own capacity is searched. Reported: capacity at
SLO per system and as a fraction of the machine's limit (`limit.py`, measured first), p99 at a
fair common load and at 1,000 req/s, start-up time, idle memory, and Triton's own statistics.

Peers are installed by `bench/peers/setup.sh` into `bench/.peers/`; a peer that is missing is
named in the result's notes and skipped, not failed.

Two more rows for the systems that serve KServe v2 beyond HTTP JSON (escapement and Triton,
peers_protocols.py): `grpc` (ModelInfer with the tensor in `raw_input_contents`) and `shm` (HTTP
with the input and output in system shared memory). Each is searched for its capacity at SLO the
same way; `--rows json,grpc,shm` picks them (default: all).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import loadgen, results
from bench.loadgen import HttpRequest
from bench.scenarios import peers_protocols as protocols
from bench.scenarios.common import Measured, command, demo_repo, http_json, measure, search_capacity, spec_of
from bench.scenarios.ingest import _grpc_port
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
    startup_s: float = 0.0  # from spawning it to its first answer
    idle_rss_mb: float = 0.0  # its process tree's resident memory after the warm-up, between loads
    grpc_port: int = 0  # its KServe v2 gRPC listener (0: none)
    input: np.ndarray | None = None  # the tensor every request carries (the gRPC and shm rows)


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



def _stopper(proc: subprocess.Popen[bytes], work: Path) -> Callable[[], None]:
    """A server's stop: kill its process group and remove its directory."""
    def stop() -> None:
        _kill_group(proc)
        shutil.rmtree(work, ignore_errors=True)
    return stop


def _answering(proc: subprocess.Popen[bytes], port: int, raw: bytes, timeout_s: float,
               stop: Callable[[], None]) -> Callable[[], None]:
    """Wait until a started server answers `raw`; `stop`, run here if it never answers."""
    try:
        _wait_http(port, raw, timeout_s, proc)
    except Exception:
        stop()
        raise
    return stop

def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    # Descendants that left the group (PyTriton starts tritonserver in a session of its own) too.
    strays = [p for p in tree_pids(proc.pid) if p != proc.pid] if proc.poll() is None else []
    for pid in strays:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
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
    # Wait until every descendant is gone: a peer still shutting down can refuse the next start
    # (TorchServe: "already running") or hold its port.
    deadline = time.monotonic() + 30
    while strays and time.monotonic() < deadline:
        strays = [p for p in strays if Path(f"/proc/{p}").exists()]
        time.sleep(0.2)
    for pid in strays:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


@dataclass(frozen=True)
class BatchConfig:
    """TorchServe and Ray Serve: workers (replicas), the batch limit, the batch delay."""

    workers: int = 2
    max_batch: int = 32
    delay_ms: float = 5.0


def start_torchserve(model_file: Path, x: np.ndarray, cfg: BatchConfig = BatchConfig()) -> System:
    workers = cfg.workers
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
                              "maxWorkers": workers, "batchSize": cfg.max_batch, "maxBatchDelay": int(cfg.delay_ms),
                              "responseTimeout": 120}}}
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

    stop = _answering(proc, port, req.raw, 240, _stopper(proc, work))
    return System("torchserve", port, req, proc.pid, stop,
                  [f"torchserve 0.12.0: {workers} workers (OMP_NUM_THREADS=1 each), batchSize {cfg.max_batch}, "
                   f"maxBatchDelay {int(cfg.delay_ms)} ms"])


def start_ray(model_file: Path, x: np.ndarray, cfg: BatchConfig = BatchConfig(1, 32, 5.0)) -> System:
    env_dir = PEERS / "ray"
    if not (env_dir / "bin" / "python").exists():
        raise FileNotFoundError("Ray Serve is not installed: run bench/peers/setup.sh ray")
    port = free_port()
    proc = subprocess.Popen([str(env_dir / "bin" / "python"), str(HERE / "ray_app.py"), str(model_file), str(port),
                             str(cfg.max_batch), str(cfg.delay_ms)],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    req = HttpRequest.build("POST", "/", _json_body(x), {"Content-Type": "application/json"})

    def stop() -> None:
        _kill_group(proc)
        subprocess.run([str(env_dir / "bin" / "ray"), "stop", "--force"], capture_output=True, timeout=120)

    _answering(proc, port, req.raw, 300, stop)
    return System("ray-serve", port, req, proc.pid, stop,
                  [f"ray-serve: one replica, @serve.batch(max_batch_size={cfg.max_batch}, "
                   f"batch_wait_timeout_s={cfg.delay_ms / 1000:g}), 1 intra-op thread"])


TRITON_SITE = PEERS / "triton" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


@dataclass(frozen=True)
class TritonConfig:
    """What a Triton user tunes for a CPU model: instances, the batch limit, the queue delay."""

    instances: int = 2
    max_batch: int = 32
    delay_us: int = 500

    def describe(self) -> str:
        return f"{self.instances} KIND_CPU instances, max_batch_size {self.max_batch}, " \
               f"max_queue_delay {self.delay_us} µs"


def _triton_env() -> dict[str, str]:
    """The bundled server links libpython dynamically: the venv interpreter's own lib first (a
    second Python 3.11 on the machine crashed the stub), then the wheel's libraries."""
    home = Path((PEERS / "triton" / "pyvenv.cfg").read_text().split("home = ", 1)[1].splitlines()[0])
    libs = [str(home.parent / "lib"), str(TRITON_SITE / "nvidia_pytriton.libs")]
    return {**os.environ, "LD_LIBRARY_PATH": ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]),
            "PYTHONPATH": str(TRITON_SITE), "OMP_NUM_THREADS": "1", "PYTRITON_NO_TENSORSTORE": "1"}


def start_triton(model_file: Path, request: HttpRequest, cfg: TritonConfig = TritonConfig()) -> System:
    """tritonserver (from the nvidia-pytriton wheel) over a plain python-backend model."""
    server = TRITON_SITE / "pytriton" / "tritonserver"
    if not (server / "bin" / "tritonserver").exists():
        raise FileNotFoundError("Triton is not installed: run bench/peers/setup.sh triton")
    work = Path(tempfile.mkdtemp(prefix="triton-"))  # no `triton/` folder here: torch would import it
    backends = work / "backends" / "python"
    backends.mkdir(parents=True)
    for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (backends / f).symlink_to(server / "backends" / "python" / f)
    stub = server / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
    (backends / "triton_python_backend_stub").symlink_to(stub / "triton_python_backend_stub")
    model = work / "models" / "mlp_784"
    (model / "1").mkdir(parents=True)
    code = (HERE / "triton_model.py").read_text().replace("@SITE_PACKAGES@", str(TRITON_SITE))
    (model / "1" / "model.py").write_text(code)
    (model / "config.pbtxt").write_text(f"""name: "mlp_784"
backend: "python"
max_batch_size: {cfg.max_batch}
input [{{ name: "INPUT__0", data_type: TYPE_FP32, dims: [784] }}]
output [{{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [10] }}]
dynamic_batching {{ max_queue_delay_microseconds: {cfg.delay_us} }}
instance_group [{{ count: {cfg.instances}, kind: KIND_CPU }}]
parameters: {{ key: "model_path", value: {{ string_value: "{model_file}" }} }}
parameters: {{ key: "threads", value: {{ string_value: "1" }} }}
""")
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen([str(server / "bin" / "tritonserver"), "--model-repository", str(work / "models"),
                             "--backend-directory", str(work / "backends"), "--http-address", "127.0.0.1",
                             "--http-port", str(port), "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc_port),
                             "--allow-metrics", "false", "--log-verbose", "0"], cwd=work, env=_triton_env(),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    stop = _answering(proc, port, request.raw, 240, _stopper(proc, work))
    return System("triton", port, request, proc.pid, stop,
                  [f"triton: tritonserver 2.51 (nvidia-pytriton 0.7.0 wheel), python backend, {cfg.describe()}, "
                   "the program traced to TorchScript, 1 intra-op thread per instance"], grpc_port=grpc_port)


def start_pytriton(model_file: Path, request: HttpRequest, cfg: TritonConfig = TritonConfig()) -> System:
    python = PEERS / "triton" / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError("Triton is not installed: run bench/peers/setup.sh triton")
    work = Path(tempfile.mkdtemp(prefix="pytriton-"))
    port = free_port()
    env = {**_triton_env(), "HOME": str(work)}  # its ~22 MB copy of the server goes here, and is removed
    log = (work / "pytriton.log").open("wb")
    proc = subprocess.Popen([str(python), str(HERE / "pytriton_app.py"), str(model_file), str(port), str(free_port()),
                             str(free_port()), str(cfg.instances), str(cfg.max_batch), str(cfg.delay_us)], cwd=work,
                            env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    stop = _stopper(proc, work)
    try:
        _wait_http(port, request.raw, 300, proc)
    except Exception as e:
        tail = (work / "pytriton.log").read_text(errors="replace")[-600:]
        stop()
        raise RuntimeError(f"{e}; its log ends: {tail}") from e
    finally:
        log.close()
    return System("pytriton", port, request, proc.pid, stop,
                  [f"pytriton: nvidia-pytriton 0.7.0, @batch, {cfg.describe()}, PYTRITON_NO_TENSORSTORE=1, "
                   "the program traced to TorchScript"])


def triton_stats(port: int) -> dict[str, float]:
    """Triton's own per-request averages (µs): queue, compute input / infer / output, and requests."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /v2/models/mlp_784/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    body = data.split(b"\r\n\r\n", 1)[1]
    try:
        st = orjson.loads(body)["model_stats"][0]["inference_stats"]
    except (KeyError, IndexError, orjson.JSONDecodeError):
        return {}
    n = max(int(st["success"]["count"]), 1)
    return {"requests": n, **{f"{k}_us": int(st[k]["ns"]) / n / 1e3
                              for k in ("queue", "compute_input", "compute_infer", "compute_output")}}


class _TreeMeterPid:
    """measure() meters one pid; peers are process trees, so meter the tree around it."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.t0 = self.c0 = 0.0

    def start(self) -> None:
        self.t0, self.c0 = time.monotonic(), tree_cpu_seconds(self.root)

    def stop(self) -> float:
        return (tree_cpu_seconds(self.root) - self.c0) / max(time.monotonic() - self.t0, 1e-9)


SYSTEMS = "escapement,triton,pytriton,torchserve,ray-serve,plain-aiohttp"

# Each system runs as a competent user would tune it on this machine: the best configuration of a
# recorded sweep (`python -m bench run peers-tuning`, bench/results/peers-tuning.md). escapement
# gets only what its own docs recommend on 2 cores: one CPU device with one intra-op thread.
TUNED: dict[str, Any] = {
    # two CPU devices, as Triton's two instances (peers-tuning, 2026-11-30: the best median of three sweeps)
    "escapement": {"runtime": {"devices": ["cpu:0", "cpu:1"], "cpu_threads": 1}, "controller": {"batch_wait_ms": 1.0}},
    "triton": TritonConfig(instances=2, max_batch=32, delay_us=500),
    "pytriton": TritonConfig(instances=2, max_batch=32, delay_us=500),
    "torchserve": BatchConfig(workers=2, max_batch=32, delay_ms=1.0),
    "ray-serve": BatchConfig(workers=1, max_batch=32, delay_ms=1.0),
    "plain-aiohttp": None,
}


def tree_rss_mb(root: int) -> float:
    total = 0
    for pid in tree_pids(root):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


@contextlib.contextmanager
def serving(name: str, repo: Path, model: str, config: Any) -> Iterator[System]:
    """One system started (its start-up timed), served, and stopped."""
    spec = spec_of(repo, model)
    x = np.random.default_rng(0).random((1, *spec.inputs[0].sample_shape)).astype(np.float32)
    kserve = http_json(spec)  # escapement and Triton take the same bytes
    t0 = time.monotonic()
    if name == "escapement":
        cfg = config or {}
        with Escapement(repo, **{**cfg, "server": {**cfg.get("server", {}), "grpc": "127.0.0.1:0"}}) as server:
            sys_ = System("escapement", server.port, kserve, server.pid, notes=[
                f"escapement: KServe v2 JSON, {cfg}, policy clockwork (the default)"],
                grpc_port=_grpc_port(server), input=x)
            sys_.startup_s = time.monotonic() - t0
            yield sys_
        return
    starters: dict[str, Callable[[], System]] = {
        "triton": lambda: start_triton(spec.path, kserve, config),
        "pytriton": lambda: start_pytriton(spec.path, kserve, config),
        "torchserve": lambda: start_torchserve(spec.path, x, config),
        "ray-serve": lambda: start_ray(spec.path, x, config),
        "plain-aiohttp": lambda: start_plain(spec.path, x),
    }
    sys_ = starters[name]()
    sys_.startup_s = time.monotonic() - t0
    sys_.input = x
    try:
        yield sys_
    finally:
        sys_.stop()


# One load of a row: (schedule, warm-up s, drain s) -> measured.
Load = Callable[[loadgen.Schedule, float, float], Measured]


def row_load(row: str, sys_: System, model: str) -> Load:
    """How a row's requests are played against a system: HTTP JSON (`json`), gRPC or shared memory."""
    if row == "json":
        return lambda sched, warmup, drain: measure(sched, "http", sys_.pid, [model], port=sys_.port,
                                                    http_requests=[sys_.request], warmup=warmup, drain_s=drain)
    assert sys_.input is not None
    if row == "grpc":
        message = protocols.grpc_message(model, sys_.input)
        return lambda sched, warmup, drain: protocols.measure_with(
            lambda: protocols.run_grpc(sched, sys_.grpc_port, message, [model], warmup, drain), sys_.pid)
    requests = protocols.shm_requests(f"/v2/models/{model}/infer", sys_.input.nbytes)
    return lambda sched, warmup, drain: protocols.measure_with(
        lambda: protocols.run_shm(sched, sys_.port, requests, [model], warmup, drain), sys_.pid)


def capacity_search(sys_: System, model: str, slo: float, grid: list[float], refine: int, seconds: float,
                    quick: bool, row: str = "json") -> list[dict[str, Any]]:
    """Warm the system up, then search its capacity at the SLO (rows of every point that counts)."""
    load = row_load(row, sys_, model)
    with _regions(row, sys_):
        load(loadgen.poisson(200, 3.0 if quick else 5.0, seed=9), 0.0, 5.0)  # warm-up, not reported
    if row == "json":
        sys_.idle_rss_mb = tree_rss_mb(sys_.pid)
    seeds = iter(range(1000))
    label = sys_.name if row == "json" else f"{sys_.name} {row}"

    def point(rate: float) -> dict[str, Any]:
        meter = _TreeMeterPid(sys_.pid)
        meter.start()
        m = load(loadgen.poisson(rate, seconds, seed=next(seeds)), min(1.0, seconds / 4), max(2.0, 3 * slo))
        return results.row(m.run, label, slo, server_cores=meter.stop(), generator_cores=m.generator_cores)

    with _regions(row, sys_):
        return search_capacity(point, grid, refine=refine)


def _regions(row: str, sys_: System) -> contextlib.AbstractContextManager[None]:
    """The shm row's regions, registered with the system for as long as it is measured."""
    if row != "shm":
        return contextlib.nullcontext()
    assert sys_.input is not None
    return protocols.registered_regions(sys_.port, sys_.input)


ROWS = "json,grpc,shm"
PROTOCOL_ROWS = ("grpc", "shm")  # the rows only escapement and Triton serve (KServe v2 gRPC, system shm)


MISSING = (FileNotFoundError, RuntimeError, subprocess.CalledProcessError, KeyError, OSError)


def _near(rows: list[dict[str, Any]], rate: float) -> dict[str, Any] | None:
    near = [r for r in rows if abs(r["offered_rps"] - rate) / rate < 0.1]
    return near[0] if near else None


def _plot_name(json_out: str | None) -> str | None:
    """The plot beside the JSON result (bench/results/peers.png by default); none for a result kept
    outside bench/results (a trial run must not overwrite the recorded plot)."""
    if not json_out:
        return "peers"
    out = Path(json_out).resolve().with_suffix("")
    try:
        return str(out.relative_to(results.RESULTS.resolve()))
    except ValueError:
        return None


def run(quick: bool = False, json_out: str | None = None, model: str = "mlp_784", seconds: float | None = None,
        systems: str = SYSTEMS, refine: int | None = None, rows: str = ROWS,
        frontend_workers: int | None = None) -> dict[str, Any]:
    from bench.scenarios import limit

    wanted = [r.strip() for r in str(rows).split(",") if r.strip()]
    seconds = seconds or (4.0 if quick else 10.0)
    refine = refine if refine is not None else (3 if quick else 4)
    grid = [250, 1000] if quick else [100, 250, 500, 1000]  # every system is offered these; then each is searched
    repo = demo_repo()
    spec = spec_of(repo, model)
    slo = spec.slo_s
    # First, on a quiet machine: what its cores could serve with no server in the way.
    floor = limit.measure(model, 1.0 if quick else 2.0)
    measured: list[dict[str, Any]] = []
    notes: list[str] = []
    missing: dict[str, str] = {}
    by_system: dict[str, list[dict[str, Any]]] = {}
    facts: dict[str, dict[str, Any]] = {}
    by_row: dict[str, dict[str, list[dict[str, Any]]]] = {r: {} for r in wanted if r in PROTOCOL_ROWS}
    for name in [s.strip() for s in systems.split(",") if s.strip()]:
        try:
            tuned = TUNED.get(name)
            if name == "escapement" and frontend_workers is not None:  # server.frontend_workers (default: -1)
                tuned = {**tuned, "server": {"frontend_workers": frontend_workers}}
            with serving(name, repo, model, tuned) as sys_:
                if "json" in wanted:
                    by_system[name] = capacity_search(sys_, model, slo, grid, refine, seconds, quick)
                for kind in by_row:
                    if name in ("escapement", "triton"):
                        by_row[kind][name] = capacity_search(sys_, model, slo, grid, refine, seconds, quick, kind)
                facts[name] = {"startup_s": sys_.startup_s, "idle_rss_mb": sys_.idle_rss_mb}
                if name in ("triton", "pytriton"):
                    try:
                        facts[name]["triton_stats_us_per_request"] = triton_stats(sys_.port)
                    except OSError as e:
                        facts[name]["triton_stats_us_per_request"] = {}
                        notes.append(f"{name}: its statistics could not be read ({e})")
                    if not facts[name]["triton_stats_us_per_request"]:
                        notes.append(f"{name}: no statistics (PyTriton restricts Triton's statistics API to its "
                                     "access token)")
                notes += sys_.notes
        except MISSING as e:
            missing[name] = f"{type(e).__name__}: {e}"
            notes.append(f"{name}: MISSING, not measured ({missing[name]})")
    capacity = {name: results.capacity_at_slo(rs) for name, rs in by_system.items()}
    measured[:] = [r for rs in [*by_system.values(), *(x for br in by_row.values() for x in br.values())]
               for r in sorted(rs, key=lambda r: r["offered_rps"])]
    retried = [f"{r['label']} at {r['offered_rps']:.0f}/s" for r in measured if r.get("retry")]
    if retried:
        notes.append("Measured again after the generator fell behind while the server kept up (a stall of the "
                     f"machine; the first try is not shown): {', '.join(retried)}.")
    # A fair common load: the highest grid load that every system able to hold the SLO at all sustains
    # (a system failing even the lowest load is reported, and left out of that choice).
    def holds(r: dict[str, Any] | None) -> bool:
        return r is not None and r["p99_ms"] <= r["slo_ms"] and r["slo_attainment"] >= 0.99

    able = {n: rs for n, rs in by_system.items() if holds(_near(rs, grid[0]))}
    sustained = [rate for rate in grid if all(holds(_near(rs, rate)) for rs in able.values())]
    common = max(sustained) if sustained else grid[0]
    p99_common = {n: (r["p99_ms"] if (r := _near(rs, common)) else None) for n, rs in by_system.items()}
    p99_1000 = {n: (r["p99_ms"] if (r := _near(rs, 1000)) else None) for n, rs in by_system.items()}
    peers_cap = {k: v for k, v in capacity.items() if k != "escapement"}
    best_peer = max(peers_cap, key=lambda k: peers_cap[k]) if peers_cap else None
    summary: dict[str, Any] = {
        "model": model, "slo_ms": slo * 1e3, "capacity_at_slo_rps": capacity,
        "limit_rps": floor["limit_rps"],
        "fraction_of_limit": {n: c / floor["limit_rps"] for n, c in capacity.items()},
        "common_load_rps": common, "left_out_of_common_load": sorted(set(by_system) - set(able)),
        "p99_ms_at_common_load": p99_common, "p99_ms_at_1000_rps": p99_1000,
        "startup_s": {n: f["startup_s"] for n, f in facts.items()},
        "idle_rss_mb": {n: f["idle_rss_mb"] for n, f in facts.items()},
        "missing": missing}
    if best_peer and "escapement" in capacity and peers_cap[best_peer] > 0:
        summary["best_peer"] = best_peer
        summary["capacity_ratio_vs_best_peer"] = capacity["escapement"] / peers_cap[best_peer]
        if p99_common.get("escapement") and p99_common.get(best_peer):
            summary["p99_ratio_vs_best_peer_at_common_load"] = p99_common["escapement"] / p99_common[best_peer]
    for kind, got in by_row.items():
        cap = {n: results.capacity_at_slo(rs) for n, rs in got.items()}
        summary[f"{kind}_capacity_at_slo_rps"] = cap
        summary[f"{kind}_p99_ms_at_1000_rps"] = {n: (x["p99_ms"] if (x := _near(rs, 1000)) else None)
                                              for n, rs in got.items()}
        if cap.get("escapement") is not None and cap.get("triton"):
            summary[f"{kind}_capacity_ratio_vs_triton"] = cap["escapement"] / cap["triton"]
    for n in ("triton", "pytriton"):
        if facts.get(n, {}).get("triton_stats_us_per_request"):
            summary[f"{n}_stats_us_per_request"] = facts[n]["triton_stats_us_per_request"]
    extra = {k: v for k, v in (("systems", systems), ("rows", rows), ("frontend_workers", frontend_workers))
             if v not in (SYSTEMS, ROWS, None)}
    config = {"command": command("peers", quick, extra), "model": model, "rows": wanted, "seconds_per_point": seconds,
              "common_grid_rps": grid, "search": f"x2 from the grid's top until a point fails, then {refine} "
                                                  "geometric bisections",
              "arrivals": "poisson", "frontend": "HTTP JSON, each system's own API, the same [1, 784] tensor "
                                                "(escapement, triton and pytriton: the same KServe v2 bytes)",
              "tuned": {n: (c.__dict__ if hasattr(c, "__dict__") else c) for n, c in TUNED.items()},
              "limit": floor}
    plot = _plot_name(json_out)
    png = None if plot is None else results.plot_curve(plot, measured, slo * 1e3,
                                                       f"{model} through each system's HTTP JSON API")
    notes.append("Capacity at SLO: the highest load found with p99 within the SLO, >= 99% of requests within it, "
                 f"and the generator on schedule; searched per system to within 2^(1/{2 ** refine}) "
                 f"(~{(2 ** (1 / 2 ** refine) - 1) * 100:.0f}%).")
    notes.append(f"limit_rps: {floor['limit_rps']:.0f} req/s = {floor['cores']} cores / "
                 f"{floor['cpu_us_per_request']:.1f} µs of CPU per request (HTTP parse, JSON decode, the model "
                 "at its cheapest batch size, JSON encode; `python -m bench run limit`); the generator shares "
                 "the cores, so no system reaches it.")
    notes.append("Tuned configurations: the best of `python -m bench run peers-tuning` "
                 "(bench/results/peers-tuning.md).")
    if by_row:
        notes.append(f"Rows {', '.join(by_row)} (escapement and triton only): grpc = ModelInfer with the tensor in "
                     f"raw_input_contents over {protocols.CHANNELS} grpc.aio channels (pre-serialized, answers not "
                     "decoded); shm = HTTP JSON naming system shared-memory regions (input written once, each "
                     f"output into its own slot of {protocols.OUT_SLOTS}); labels '<system> grpc' / '<system> shm'.")
    if png:
        notes.append(f"Plot: {png.name}")
    return results.write("peers", config, measured, summary, json_out, notes,
                         columns=["label", "offered_rps", "achieved_rps", "goodput_rps", "slo_attainment", "p50_ms",
                                  "p99_ms", "p999_ms", "errors", "server_cores", "generator_cores",
                                  "generator_bound"])
