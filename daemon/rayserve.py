"""escapement under Ray Serve: one daemon per replica, KServe v2 JSON through Serve's proxy.

    serve run daemon.rayserve:app models=/path/to/repository num_replicas=2     # or deploy/ray/serve.yaml

Two deployments (docs/deploy.md, Ray Serve):

- `EscapementReplica` starts `python -m daemon serve` as a subprocess on a unix socket in a temp
  dir, with the replica's GPUs (`ray.get_gpu_ids()` -> CUDA_VISIBLE_DEVICES, `cuda:0..`), cpu:0
  without, and forwards requests to it with `AsyncSocketClient`. Serve's model multiplexing is
  used only for routing affinity: the multiplexed "loader" asks the daemon whether it serves the
  model and holds nothing; the daemon keeps owning device memory, loads and evictions.
- `V2Ingress` speaks KServe v2 over HTTP (health, model metadata and ready, infer with JSON or
  binary tensors) and calls the replica with `multiplexed_model_id` = the model in the path.

Every forwarded call is bounded (the request's own timeout plus a margin, else `max_wait_s`), so a
replica or daemon that dies answers 503 and never leaves a request hanging; escapement's own
errors keep their statuses (400/404/503/504...).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import Response

from daemon.api.codec import WireTensor, decode_tensor, json_data, tensor_bytes
from daemon.client import AsyncSocketClient, InferenceServerError, SocketClient
from daemon.client.wire import HEADER_LEN, _wire_array
from daemon.datatypes import BY_NAME
from daemon.routing import REPORT_MODELS, REPORT_PERIOD_S, ReportedRouting

# How many model ids Serve remembers per replica for routing; not what the daemon keeps in memory.
MODELS_PER_REPLICA = int(os.environ.get("ESCAPEMENT_RAY_MODELS_PER_REPLICA", "8"))
MARGIN_S = 5.0  # past a request's own deadline the daemon has answered 504 already; this is for a dead one
REPLICA_HEADER = "escapement-replica"
ROUTERS = ("deadline", "multiplex")  # build(router=...): the first is the default


class Failed(Exception):
    """An answer with an HTTP status, as escapement would give it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _error(status: int, message: str) -> tuple[int, bytes, dict[str, str]]:
    return status, orjson.dumps({"error": message}), {}


def _die_with_parent() -> None:
    """In the daemon's child: SIGTERM when the replica's process dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _devices() -> tuple[list[str], dict[str, str]]:
    """The replica's devices and the daemon's environment: its GPUs as cuda:0.., else cpu:0."""
    env = dict(os.environ)
    gpus = [str(g) for g in ray.get_gpu_ids()]
    if not gpus:
        return ["cpu:0"], env
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return [f"cuda:{i}" for i in range(len(gpus))], env


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64, health_check_period_s=2,
                  health_check_timeout_s=10, graceful_shutdown_timeout_s=10)
class EscapementReplica:
    def __init__(self, models: str, config: str | None = None, extra_args: list[str] | None = None,
                 start_timeout_s: float = 180.0, max_wait_s: float = 60.0) -> None:
        self.max_wait_s = max_wait_s
        self.tmp = tempfile.mkdtemp(prefix="escapement-ray-")
        self.socket = os.path.join(self.tmp, "escapement.sock")
        devices, env = _devices()
        cmd = [sys.executable, "-m", "daemon", "serve", "--socket", self.socket, "--http", "", "--grpc", "",
               "--models", models, *[a for d in devices for a in ("--device", d)], *(extra_args or [])]
        if config:
            cmd += ["--config", config]
        self.log_path = Path(self.tmp) / "daemon.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)
        self.replica = serve.get_replica_context().replica_tag
        self._client: AsyncSocketClient | None = None
        self._lock = asyncio.Lock()
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self._stop()
            raise

    def _wait_ready(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the escapement daemon exited with {self.proc.returncode}: {self._log_tail()}")
            with contextlib.suppress(OSError), SocketClient(self.socket, timeout=5.0) as c:
                if c.ready():
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the escapement daemon was not ready within {limit_s:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the daemon drains what it accepted
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __del__(self) -> None:
        self._stop()

    def check_health(self) -> None:
        """Serve's health check: a replica whose daemon is gone is replaced."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the escapement daemon exited with {self.proc.returncode}")

    async def _conn(self) -> AsyncSocketClient:
        async with self._lock:  # one connection, made once; again after the daemon closed it
            c = self._client
            if c is None or c._task is None or c._task.done():
                if c is not None:
                    await c.close()
                c = AsyncSocketClient(self.socket)
                await c.connect()
                self._client = c
            return c

    async def _call(self, msg: dict[str, Any], bound_s: float | None = None) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise Failed(503, f"replica {self.replica}: its escapement daemon exited with {self.proc.returncode}")
        bound = bound_s or self.max_wait_s
        try:
            return await asyncio.wait_for((await self._conn()).call(msg), bound)
        except InferenceServerError as e:
            raise Failed(e.status or 502, e.message) from None
        except TimeoutError:
            raise Failed(504, f"replica {self.replica}: no answer from its daemon within {bound:g} s") from None
        except (ConnectionError, OSError) as e:
            raise Failed(503, f"replica {self.replica}: lost its escapement daemon: {e}") from None

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats, for DeadlineRouter: the daemon's forecast (daemon/routing.py),
        stamped with this host's clock. {} when the daemon cannot answer: routed without it."""
        try:
            answer = await self._call({"op": "forecast", "limit": REPORT_MODELS}, REPORT_PERIOD_S * 4)
        except Failed:
            return {}
        return {**answer.get("forecast", {}), "at": time.time(), "replica": self.replica}

    @serve.multiplexed(max_num_models_per_replica=MODELS_PER_REPLICA)
    async def _model(self, model_id: str) -> str:
        """Routing affinity only: checks the daemon serves `model_id` (404 if not); holds no weights."""
        await self._call({"op": "model_ready", "model": model_id})
        return model_id

    async def infer(self, model: str, version: str | None, body: bytes,
                    header_len: str | None) -> tuple[int, bytes, dict[str, str]]:
        try:
            await self._model(serve.get_multiplexed_model_id() or model)
            msg, wanted, client_id = infer_message(model, version, body, header_len)
            timeout_us = msg.get("timeout_us")
            answer = await self._call(msg, timeout_us / 1e6 + MARGIN_S if timeout_us is not None else None)
            status, out, headers = 200, *v2_answer(answer, wanted, client_id)
        except Failed as e:
            status, out, headers = _error(e.status, e.message)
        return status, out, {**headers, REPLICA_HEADER: self.replica}

    async def control(self, op: str, model: str | None = None, version: str | None = None) -> tuple[int, bytes]:
        """metadata, model_ready, ready: the daemon's answer as KServe v2 JSON."""
        try:
            if model is not None:
                await self._model(serve.get_multiplexed_model_id() or model)
            msg: dict[str, Any] = {"op": op, **({"model": model} if model else {})}
            if version:
                msg["version"] = version
            answer = await self._call(msg)
        except Failed as e:
            return e.status, orjson.dumps({"error": e.message})
        answer.pop("id", None)
        answer.pop("status", None)
        if op in ("model_ready", "ready"):
            if answer.get("ready"):
                return 200, orjson.dumps({"name": model, "ready": True} if model else {"ready": True})
            what = f"model {model} is not ready ({answer.get('state')})" if model else "not ready"
            return (400 if model else 503), orjson.dumps({"error": what})
        return 200, orjson.dumps(answer)

    def info(self) -> dict[str, Any]:
        return {"replica": self.replica, "pid": os.getpid(), "daemon_pid": self.proc.pid,
                "node_id": ray.get_runtime_context().get_node_id()}


class DeadlineRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Serve's request router for escapement replicas: the deadline-aware rule (daemon/routing.py;
    `python -m bench run routing` measures it against Serve's multiplexed routing). Each replica
    reports its daemon's forecast every REPORT_PERIOD_S; a request goes to the replica holding
    its model that would answer first, while that leaves a quarter of the model's SLO to spare,
    else to the replica that would answer first. Requests sent to a replica after its last report
    are added to its forecast. Before any report, Serve's multiplexed power of two choices."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.forecasts = ReportedRouting()

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        model = pending_request.metadata.multiplexed_model_id
        if model:
            self.forecasts.sent_to(replica_id, model)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.forecasts.forget(replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        model = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if model and candidate_replicas:
            for r in candidate_replicas:
                self.forecasts.report(r.replica_id, r.routing_stats)
            order = self.forecasts.order([r.replica_id for r in candidate_replicas], model, time.time())
            if order:  # one rank each: Serve takes the first that has room, in this order
                return [[candidate_replicas[i]] for i in order]
        ids = self.apply_multiplex_routing(pending_request) if model else {r.replica_id for r in candidate_replicas}
        chosen = [r for r in candidate_replicas if r.replica_id in ids]
        return [random.sample(chosen, min(2, len(chosen)))] if chosen else []


Binary = tuple[dict[str, bool], bool]  # binary_data per output asked for, and binary_data_output


def infer_message(model: str, version: str | None, body: bytes,
                  header_len: str | None) -> tuple[dict[str, Any], Binary, str | None]:
    """A KServe v2 infer body (JSON, or JSON + binary tensors) as the socket's infer message."""
    try:
        n = int(header_len) if header_len is not None else len(body)
        if not 0 < n <= len(body):
            raise ValueError(f"{HEADER_LEN} {n} is outside the body")
        obj = orjson.loads(body[:n])
    except (ValueError, orjson.JSONDecodeError) as e:
        raise Failed(400, f"malformed inference request: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("inputs"), list) or not obj["inputs"]:
        raise Failed(400, "the inference request must be a JSON object with a non-empty inputs list")
    payload, offset = memoryview(body)[n:], 0
    inputs: list[dict[str, Any]] = []
    for i, t in enumerate(obj["inputs"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("datatype") not in BY_NAME:
            raise Failed(400, f"inputs[{i}] needs a name and a known datatype")
        shape = t.get("shape")
        if not isinstance(shape, list):
            raise Failed(400, f"inputs[{i}] needs a shape (a list of dimensions)")
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            raw = bytes(payload[offset:offset + int(size)])
            offset += int(size)
        else:  # JSON data: decoded here with the daemon's own rules, then sent as bytes
            try:
                arr = decode_tensor(t["name"], BY_NAME[t["datatype"]], shape,
                                    WireTensor(t["name"], t["datatype"], shape, data=t.get("data")))
            except Exception as e:  # BadRequest, or a shape that is not a list
                raise Failed(getattr(e, "status", 400), str(e)) from None
            raw = tensor_bytes(arr)
        inputs.append({"name": t["name"], "datatype": t["datatype"], "shape": shape, "data": raw})
    params = obj.get("parameters") or {}
    msg: dict[str, Any] = {"op": "infer", "model": model, "inputs": inputs}
    if version is not None:
        msg["version"] = version
    if isinstance(params, dict):  # the deadline and the priority (request class) pass through unchanged
        for wire, key in (("timeout", "timeout_us"), ("priority", "priority")):
            if params.get(wire) is not None:
                msg[key] = params[wire]
    binary_all = bool(params.get("binary_data_output")) if isinstance(params, dict) else False
    binary: dict[str, bool] = {}
    if isinstance(obj.get("outputs"), list):
        for o in obj["outputs"]:
            if isinstance(o, dict) and isinstance(o.get("name"), str):
                binary[o["name"]] = bool((o.get("parameters") or {}).get("binary_data", binary_all))
        msg["outputs"] = list(binary)
    return msg, (binary, binary_all), obj.get("id")


def v2_answer(answer: dict[str, Any], wanted: Binary, client_id: str | None) -> tuple[bytes, dict[str, str]]:
    """The socket's answer as a KServe v2 body: JSON data, or binary where asked."""
    binary, binary_all = wanted
    outs, chunks = [], []
    for o in answer.get("outputs", []):
        item: dict[str, Any] = {"name": o["name"], "datatype": o["datatype"], "shape": o["shape"]}
        if binary.get(o["name"], binary_all):
            item["parameters"] = {"binary_data_size": len(o["data"])}
            chunks.append(bytes(o["data"]))
        else:
            item["data"] = json_data(_wire_array(o["data"], o["datatype"], o["shape"]), o["name"])
        outs.append(item)
    resp: dict[str, Any] = {"model_name": answer.get("model", ""), "model_version": answer.get("version", ""),
                            "outputs": outs}
    if client_id:
        resp["id"] = client_id
    if answer.get("reconstructed"):
        resp["parameters"] = {"reconstructed": True}
    header = orjson.dumps(resp, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return header, {"content-type": "application/json"}
    return b"".join([header, *chunks]), {"content-type": "application/octet-stream", HEADER_LEN: str(len(header))}


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class V2Ingress:
    """KServe v2 over HTTP through Serve's proxy; the model in the path picks the replica."""

    def __init__(self, backend: DeploymentHandle, max_wait_s: float = 60.0) -> None:
        self.backend = backend
        self.max_wait_s = max_wait_s

    async def __call__(self, request: Request) -> Response:
        parts = [p for p in request.url.path.split("/") if p]
        try:
            return await asyncio.wait_for(self._route(request, parts), self.max_wait_s + 2 * MARGIN_S)
        except TimeoutError:
            return _json(504, {"error": f"no answer from a replica within {self.max_wait_s + 2 * MARGIN_S:g} s"})
        except Exception as e:  # a replica that died mid-request, back-pressure: a clear 503, never a hang
            return _json(503, {"error": f"{type(e).__name__}: {str(e)[:500]}"})

    async def _route(self, request: Request, parts: list[str]) -> Response:
        if parts[:1] != ["v2"]:
            return _json(404, {"error": f"no route {request.url.path}"})
        if parts in (["v2", "health", "live"],):
            return Response(status_code=200)
        if parts == ["v2", "health", "ready"]:
            status, _ = await self.backend.control.remote("ready")
            return Response(status_code=status)
        if parts == ["v2"]:
            return _json(200, {"name": "escapement", "version": _version(), "extensions": []})
        if len(parts) < 3 or parts[1] != "models":
            return _json(404, {"error": f"no route {request.url.path}"})
        model, rest = parts[2], parts[3:]
        version = None
        if rest[:1] == ["versions"] and len(rest) >= 2:
            version, rest = rest[1], rest[2:]
        handle = self.backend.options(multiplexed_model_id=model)
        if rest == [] and request.method == "GET":
            status, body = await handle.control.remote("metadata", model, version)
            return Response(body, status, media_type="application/json")
        if rest == ["ready"] and request.method == "GET":
            status, body = await handle.control.remote("model_ready", model, version)
            return Response(body, status)
        if rest == ["infer"] and request.method == "POST":
            status, body, headers = await handle.infer.remote(model, version, await request.body(),
                                                              request.headers.get(HEADER_LEN))
            return Response(body, status, headers=headers)
        return _json(404, {"error": f"no route {request.method} {request.url.path}"})


def _json(status: int, obj: Any) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")


def _version() -> str:
    from daemon import __version__

    return __version__


def build(models: str, num_replicas: int = 1, config: str | None = None, extra_args: list[str] | None = None,
          num_gpus: float = 0, num_cpus: float = 1, max_wait_s: float = 60.0,
          models_per_replica: int = MODELS_PER_REPLICA, router: str = ROUTERS[0]) -> Any:
    """The application: `num_replicas` daemons (each `num_gpus` GPUs) behind a KServe v2 ingress,
    routed by `router`: "deadline" (DeadlineRouter) or "multiplex" (Serve's own)."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {router!r}")
    env = {"ESCAPEMENT_RAY_MODELS_PER_REPLICA": str(models_per_replica)}
    options: dict[str, Any] = {}
    if router == "deadline":
        fields: dict[str, Any] = {"request_router_class": DeadlineRouter,  # (ray's stubs type each field as a dict)
                                  "request_routing_stats_period_s": REPORT_PERIOD_S,
                                  "request_routing_stats_timeout_s": REPORT_PERIOD_S * 4}
        options["request_router_config"] = RequestRouterConfig(**fields)
    backend = EscapementReplica.options(  # type: ignore[attr-defined]  # @serve.deployment adds it
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus, "runtime_env": {"env_vars": env}},
        **options,
    ).bind(str(Path(models).resolve()), config, extra_args, max_wait_s=max_wait_s)
    return V2Ingress.bind(backend, max_wait_s)  # type: ignore[attr-defined]  # @serve.deployment adds it


def app(args: dict[str, str]) -> Any:
    """`serve run daemon.rayserve:app models=DIR [num_replicas=N] [num_gpus=G] [config=TOML]
    [router=deadline|multiplex]`."""
    return build(args["models"], int(args.get("num_replicas", 1)), args.get("config"),
                 num_gpus=float(args.get("num_gpus", 0)), num_cpus=float(args.get("num_cpus", 1)),
                 models_per_replica=int(args.get("models_per_replica", MODELS_PER_REPLICA)),
                 router=args.get("router", ROUTERS[0]))

