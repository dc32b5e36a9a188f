"""The HTTP frontend: KServe v2 / Open Inference Protocol with Triton's extensions (api/httpserver.py).

It works unmodified with `tritonclient[http]`: JSON tensors and the binary tensor data
extension both ways, errors as `{"error": "..."}` (tritonclient reads that key), no
Content-Type required of the client. Routes match Triton's (the version is numeric). It reaches
the daemon only through the gateway (daemon/gateway.py).
"""

from __future__ import annotations

import hmac
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson

from daemon import __version__
from daemon.api.codec import (
    WireTensor,
    assemble_inputs,
    check_shape,
    json_data,
    region_tensor,
    request_options,
    select_outputs,
    tensor_bytes,
)
from daemon.api.httpserver import HttpServer, Request, Response, Router, error_response
from daemon.api.metadata import model_config_json, model_metadata_json
from daemon.api.sharedmem import OutputTargets, SharedMemoryRegions, ShmRef, region_names, shm_ref
from daemon.apps.personal import check_user
from daemon.datatypes import BY_NAME
from daemon.errors import (
    BadRequest,
    EscapementError,
    Forbidden,
    NotFound,
    NotImplementedByServer,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from daemon.gateway import Gateway
from daemon.model import ModelSpec
from daemon.observability import metrics
from daemon.request import InferenceRequest

log = logging.getLogger("escapement.http")

HEADER_LEN = "Inference-Header-Content-Length"
_HEADER_LEN_KEY = HEADER_LEN.lower()  # request headers are looked up lower-case
EXTENSIONS = ["binary_tensor_data", "model_repository", "schedule_policy", "model_configuration", "parameters",
              "statistics", "system_shared_memory"]
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj, option=_NUMPY), status, "application/json", headers)


def answer_error(request: Request, exc: BaseException) -> Response:
    """The one place a handler's exception becomes an answer."""
    if isinstance(exc, EscapementError):
        # Only the daemon's own failures are ERRORs: refusals and deadline misses are counted, and
        # a 501 answers a client asking for what we do not implement.
        if exc.status == 500:
            log.error("%s %s: %s", request.method, request.path, exc.message)
    else:
        log.exception("%s %s failed", request.method, request.path, exc_info=exc)
    return error_response(exc)


def _parse_json(raw: bytes | memoryview, what: str, limit: int) -> Any:
    # Parsing holds the event loop (~5 ms per MiB here), so its size is bounded before it starts.
    if len(raw) > limit:
        raise PayloadTooLarge(f"{what} is {len(raw)} bytes of JSON, over the limit of {limit} "
                              "(server.max_json_bytes); send large tensors as binary data (binary_data_size)")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"malformed JSON in {what}: {e}") from None


def _parameters(request: Request, limit: int) -> dict[str, Any]:
    """The optional `{"parameters": {...}}` body of a repository load or unload."""
    body = request.body
    if not body.strip():
        return {}
    obj = _parse_json(body, "the request body", limit)
    params = obj.get("parameters", {}) if isinstance(obj, dict) else None
    if not isinstance(params, dict):
        raise BadRequest('the request body must be a JSON object such as {"parameters": {}}')
    return params


class HttpFrontend:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.settings = gateway.settings.server
        self.router = r = Router()
        bases = ("/v2/models/{model}", "/v2/models/{model}/versions/{version:[0-9]+}")
        for base in bases:  # first: routes are tried in order, and infer is the hot path
            r.add("POST", base + "/infer", self.infer)
        # /metrics and the statistics extension (observability/metrics.py), before `/v2/models/{model}` matches "stats"
        metrics.add_routes(r, gateway)
        r.add("GET", "/v2", self.server_metadata)
        r.add("GET", "/v2/health/live", self.live)
        r.add("GET", "/v2/health/ready", self.ready)
        for base in bases:
            r.add("POST", base + "/feedback", self.feedback)  # personalized models (docs/personalization.md)
            r.add("GET", base + "/users/{user}", self.user)
        apps = "/v2/applications/{app}"  # applications (docs/applications.md)
        r.add("POST", apps + "/infer", self.app_infer)
        r.add("POST", apps + "/feedback", self.app_feedback)
        r.add("GET", apps, self.app_status)
        r.add("GET", "/v2/applications", self.app_index)
        r.add("POST", "/v2/repository/applications/{app}/{op:load|unload}", self.app_repository)
        for base in bases:
            r.add("GET", base, self.model_metadata)
            r.add("GET", base + "/ready", self.model_ready)
            r.add("GET", base + "/config", self.model_config)
        r.add("POST", "/v2/repository/index", self.repository_index)
        r.add("POST", "/v2/repository/models/{model}/load", self.repository_load)
        r.add("POST", "/v2/repository/models/{model}/unload", self.repository_unload)
        r.add("GET", "/v2/admin/faults", self.get_faults)
        r.add("POST", "/v2/admin/faults", self.set_fault)
        r.add("DELETE", "/v2/admin/faults/{device}", self.clear_fault)
        r.add("GET", "/v2/controller/stats", self.controller_stats)
        shm = "/v2/systemsharedmemory"
        r.add("GET", shm + "/status", self.shm_status)
        r.add("GET", shm + "/region/{region}/status", self.shm_status)
        r.add("POST", shm + "/region/{region}/register", self.shm_register)
        r.add("POST", shm + "/unregister", self.shm_unregister)
        r.add("POST", shm + "/region/{region}/unregister", self.shm_unregister)
        r.add("POST", "/v2/repository/{repo}/index", self.named_repository)
        r.add("POST", "/v2/repository/{repo}/models/{model}/{op:load|unload}", self.named_repository)
        self.server: HttpServer | None = None
        # In a frontend worker: requests naming a user, or a shared-memory region the worker's replica
        # does not serve, go to the controller process (their bodies are small).
        self.forward_shm: Callable[[Request], Awaitable[Response]] | None = None
        self._hosts: frozenset[str] = frozenset()  # Host values that name this listener (loopback only)

    # ---------------------------------------------------------------- lifecycle

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        s = self.settings
        self.server = HttpServer(self.router, answer_error, max_body=s.max_body_bytes,
                                 max_connections=s.max_connections, keepalive_s=s.idle_timeout_s,
                                 write_timeout_s=s.write_timeout_s, request_timeout_s=s.request_timeout_s,
                                 memory=self.gateway.request_memory)
        port = await self.server.start(host, port, reuse_port)
        self.name_listener(host, port)
        return port

    def name_listener(self, host: str, port: int) -> None:
        """The Host values management requests may carry (the controller process answers those for
        frontend workers, which own the listener)."""
        if is_loopback(self.settings.http):  # other listeners have names we cannot know: the token guards them
            self._hosts = frozenset(f"{h}:{port}" for h in (host.lower(), "localhost", "127.0.0.1", "[::1]"))

    async def answer(self, request: Request) -> Response:
        """Route and answer a request read elsewhere (by a frontend worker), errors included."""
        try:
            handler, request.params = self.router.resolve(request.method, request.path)
            return await handler(request)
        except Exception as e:
            return answer_error(request, e)

    async def stop_listening(self) -> None:
        if self.server is not None:
            await self.server.stop_listening()

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None

    # ---------------------------------------------------------------- server

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": "escapement", "version": __version__, "extensions": EXTENSIONS})

    async def live(self, request: Request) -> Response:
        return json_response({"live": True})

    async def ready(self, request: Request) -> Response:
        health = self.gateway.health()
        body: dict[str, Any] = {"ready": health.ready}
        if health.lost_devices:  # which device failed, and why (a sticky CUDA error, a hang)
            body["lost_devices"] = health.lost_devices
        return json_response(body, 200 if health.ready else 503)

    # ---------------------------------------------------------------- models

    def _entry(self, request: Request) -> Any:
        return self.gateway.model(request.params["model"], request.params.get("version"))

    async def model_metadata(self, request: Request) -> Response:
        entry = self._entry(request)
        spec: ModelSpec = entry.spec
        versions = [spec.version] if request.params.get("version") is not None else self.gateway.versions(spec.name)
        return json_response(model_metadata_json(spec, versions))

    async def model_ready(self, request: Request) -> Response:
        entry = self._entry(request)
        if entry.state.value != "READY":
            return json_response({"error": f"model {entry.spec.name} version {entry.spec.version} is not ready "
                                           f"({entry.state.value})"}, 400)
        return json_response({"name": entry.spec.name, "ready": True})

    async def model_config(self, request: Request) -> Response:
        return json_response(model_config_json(self._entry(request).spec))

    # ---------------------------------------------------------------- personalized models

    async def feedback(self, request: Request) -> Response:
        """`{"query_id": ..., "label": 3}`: the true label of a personalized answer; 200 once committed."""
        obj = _parse_json(request.body, "the feedback body", self.settings.max_json_bytes)
        if not isinstance(obj, dict) or "label" not in obj:
            raise BadRequest('a feedback body is a JSON object: {"query_id": "<from the answer>", "label": 3}')
        unknown = set(obj) - {"query_id", "label"}
        if unknown:
            raise BadRequest(f"unknown keys in the feedback body: {sorted(unknown)} (known: label, query_id)")
        return json_response(await self.gateway.feedback(request.params["model"], request.params.get("version"),
                                                         obj.get("query_id"), obj["label"]))

    async def user(self, request: Request) -> Response:
        return json_response(await self.gateway.user(request.params["model"], request.params.get("version"),
                                                     request.params["user"]))

    # ---------------------------------------------------------------- applications

    async def app_infer(self, request: Request) -> Response:
        """A v2 inference body for an application: its answer names the models that made it and a
        query_id for feedback (parameters)."""
        gw = self.gateway
        name = request.params["app"]
        specs = gw.admit_app(name)  # before decoding
        body = request.body
        header_len = request.headers.get(_HEADER_LEN_KEY)
        if header_len is not None:
            try:
                n = int(header_len)
            except ValueError:
                raise BadRequest(f"{HEADER_LEN} must be an integer, got {header_len!r}") from None
            if not 0 < n <= len(body):
                raise BadRequest(f"{HEADER_LEN} {n} is outside the body of {len(body)} bytes (an application "
                                 "takes a JSON header)")
            view = memoryview(body)
            obj, binary = _parse_json(view[:n], "the inference header", self.settings.max_json_bytes), view[n:]
        else:
            obj, binary = _parse_json(body, "the request body", self.settings.max_json_bytes), memoryview(b"")
        if not isinstance(obj, dict):
            raise BadRequest("the inference request must be a JSON object")
        tensors = self._wire_inputs(obj.get("inputs"), binary, gw.shared_memory)
        arrays, samples = assemble_inputs(specs[0], tensors)
        params = obj.get("parameters") or {}
        if not isinstance(params, dict):
            raise BadRequest("parameters must be a JSON object")
        req_id = obj.get("id")
        if req_id is not None and not isinstance(req_id, str):
            raise BadRequest("id must be a string")
        if req_id and len(req_id.encode()) > self.settings.max_request_id_bytes:
            raise BadRequest(f"id is longer than {self.settings.max_request_id_bytes} bytes "
                             "(server.max_request_id_bytes)")
        timeout_us, priority = request_options(params.get("timeout"), params.get("priority"))
        ans = await gw.apps.infer(name, specs, arrays, samples, timeout_us, priority, req_id or "")
        o = ans.output_spec
        wanted = obj.get("outputs")
        if wanted is not None and (not isinstance(wanted, list) or any(
                not isinstance(w, dict) or w.get("name") != o.name for w in wanted)):
            raise BadRequest(f"application {name} answers with one output, {o.name!r}: outputs may name only it")
        resp: dict[str, Any] = {"model_name": name, "model_version": "", "outputs": [
            {"name": o.name, "datatype": o.datatype.name, "shape": list(ans.output.shape),
             "data": json_data(ans.output, o.name)}], "parameters": ans.parameters()}
        if req_id:
            resp["id"] = req_id
        return json_response(resp)

    async def app_feedback(self, request: Request) -> Response:
        """`{"query_id": ..., "label": 3}` or `{"query_id": ..., "reward": 1.0}`; 200 once committed."""
        obj = _parse_json(request.body, "the feedback body", self.settings.max_json_bytes)
        if not isinstance(obj, dict):
            raise BadRequest('a feedback body is a JSON object: {"query_id": "<from the answer>", "label": 3}')
        unknown = set(obj) - {"query_id", "label", "reward"}
        if unknown:
            raise BadRequest(f"unknown keys in the feedback body: {sorted(unknown)} (known: label, query_id, reward)")
        return json_response(await self.gateway.apps.feedback(request.params["app"], obj.get("query_id"),
                                                              obj.get("label"), obj.get("reward")))

    async def app_status(self, request: Request) -> Response:
        return json_response(self.gateway.apps.status(request.params["app"]))

    async def app_index(self, request: Request) -> Response:
        return json_response(self.gateway.apps.index())

    async def app_repository(self, request: Request) -> Response:
        """Add (load, from `parameters.config` or as declared) or remove (unload) an application."""
        self._authorize(request)
        params = _parameters(request, self.settings.max_json_bytes)
        name = request.params["app"]
        if request.params["op"] == "unload":
            return json_response(self.gateway.apps.remove(name))
        config = params.get("config")
        if isinstance(config, str):  # Triton's load takes its config as a JSON string
            config = _parse_json(config.encode(), "parameters.config", self.settings.max_json_bytes)
        return json_response(await self.gateway.load_application(name, config))

    async def repository_index(self, request: Request) -> Response:
        body = request.body
        ready_only = False
        if body.strip():
            obj = _parse_json(body, "the request body", self.settings.max_json_bytes)
            if not isinstance(obj, dict):
                raise BadRequest("the index request body must be a JSON object")
            ready_only = bool(obj.get("ready", False))
        return json_response(self.gateway.index(ready_only))

    async def repository_load(self, request: Request) -> Response:
        """(Re)read a model's entry from the repository and serve it; 200 once it is ready."""
        self._authorize(request, repository_sync=True)  # a load serves only what the repository holds
        params = _parameters(request, self.settings.max_json_bytes)
        if "config" in params or any(k.startswith("file:") for k in params):
            raise NotImplementedByServer("a load request carrying a config or model files is not supported; put "
                                         "them in the model repository and load the model by name")
        return json_response(await self.gateway.load_model(request.params["model"]))

    async def repository_unload(self, request: Request) -> Response:
        """Stop serving a model; 200 once its accepted requests are answered and it is unloaded."""
        full = self._authorize(request, repository_sync=True)
        params = _parameters(request, self.settings.max_json_bytes)
        dependents = params.get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise BadRequest(f"parameters.unload_dependents must be a boolean, got {dependents!r}")
        # A model's only dependent is its parity model, which always goes with it.
        return json_response(await self.gateway.unload_model(request.params["model"], only_if_gone=not full))

    async def controller_stats(self, request: Request) -> Response:
        return json_response(self.gateway.statistics())

    # ---------------------------------------------------------------- management
    # /v2/admin/* and the repository's load and unload change what the daemon does. Each needs the
    # bearer token, or (only when the operator opted in) a loopback listener; and none may come
    # from a web page: a foreign Origin, a Host that is not this listener (DNS rebinding) or a
    # body typed as a form would type it (not JSON) is refused before anything else.

    def _authorize(self, request: Request, faults: bool = False, repository_sync: bool = False) -> bool:
        """Raises Forbidden unless the caller may call this endpoint. True: it may do anything the
        endpoint does; False (a repository call without a token, server.open_repository_sync): it may
        only make the daemon follow the repository's files."""
        s = self.settings
        self._same_site(request)
        if faults and not s.allow_faults:
            raise Forbidden("fault injection is off: set server.allow_faults to use it (tests and demos only)")
        sync = repository_sync and s.open_repository_sync
        token = self.gateway.admin_token
        if token:
            given = request.headers.get("authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):  # no timing hints about the token
                return True
            if sync and not given:
                return False
            raise Forbidden("a management endpoint: Authorization: Bearer <the admin token> is required")
        if s.admin_open_loopback and is_loopback(s.http):
            return True
        if sync:
            return False
        raise Forbidden("management endpoints need a token (server.admin_token_file, or a systemd credential "
                        "named admin-token), or server.admin_open_loopback on a loopback listener")

    def _same_site(self, request: Request) -> None:
        hosts = self._hosts
        host = request.headers.get("host", "").strip().lower()
        if hosts and host and host not in hosts:
            raise Forbidden(f"Host {host!r} is not this listener: management is refused (DNS rebinding)")
        origin = request.headers.get("origin")
        if origin is not None and (not host or origin.strip().lower() != f"http://{host}"):
            raise Forbidden(f"a cross-site request (Origin: {origin}) cannot reach a management endpoint")
        ctype = request.headers.get("content-type")
        if ctype is not None and request.body.strip() and \
                ctype.split(";", 1)[0].strip().lower() != "application/json":
            # what a form or a page's plain fetch sends (tritonclient sends no Content-Type at all)
            raise UnsupportedMediaType("a management request's body must be Content-Type: application/json")

    async def get_faults(self, request: Request) -> Response:
        self._authorize(request, faults=True)
        return json_response(self.gateway.faults())

    async def set_fault(self, request: Request) -> Response:
        self._authorize(request, faults=True)
        from daemon.runtime.faults import FaultSpec

        obj = _parse_json(request.body, "the request body", self.settings.max_json_bytes)
        if not isinstance(obj, dict) or not isinstance(obj.get("device"), str):
            raise BadRequest('expected {"device": "cpu:0", "slowdown": 3.0, ...}')
        device = obj.pop("device")
        if device not in self.gateway.faults():
            raise NotFound(f"no such device; devices: {sorted(self.gateway.faults())}")
        try:
            spec = FaultSpec(**obj)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad fault: {e}") from None
        self.gateway.set_fault(device, spec)
        log.warning("fault injected on %s: %s", device, spec)
        return json_response(spec.as_json())

    async def clear_fault(self, request: Request) -> Response:
        self._authorize(request, faults=True)
        device = request.params["device"]
        self.gateway.set_fault(device, None)
        log.warning("faults cleared on %s", device)
        return json_response({"device": device, "faults": None})

    # ---------------------------------------------------------------- shared memory (Triton's extension)

    async def shm_status(self, request: Request) -> Response:
        return json_response(self.gateway.shared_memory.status(request.params.get("region")))

    async def shm_register(self, request: Request) -> Response:
        self._shm_allowed(request)
        obj = _parse_json(request.body, "the request body", self.settings.max_json_bytes)
        if not isinstance(obj, dict):
            raise BadRequest('expected {"key": "/name", "offset": 0, "byte_size": N}')
        self.gateway.shared_memory.register(request.params["region"], obj.get("key"), obj.get("offset", 0),
                                            obj.get("byte_size"))
        return json_response({})

    async def shm_unregister(self, request: Request) -> Response:
        self._shm_allowed(request)
        self.gateway.shared_memory.unregister(request.params.get("region"))
        return json_response({})

    def _shm_allowed(self, request: Request) -> None:
        """Registering makes the daemon read and write an object of its user in /dev/shm: only from this
        host (a loopback listener), or with the admin token; never from a web page."""
        self._same_site(request)
        token = self.gateway.admin_token
        given = request.headers.get("authorization", "")
        if token and hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return
        if not is_loopback(self.settings.http):
            raise Forbidden("shared memory is for clients on this host: on a listener that is not loopback, "
                            "registering needs Authorization: Bearer <the admin token>")

    async def named_repository(self, request: Request) -> Response:
        raise NotImplementedByServer("'repository_name' specification is not supported")

    # ---------------------------------------------------------------- inference

    async def infer(self, request: Request) -> Response:
        gw = self.gateway
        spec = gw.admit(request.params["model"], request.params.get("version"))  # before decoding
        body = request.body
        max_json = self.settings.max_json_bytes
        header_len = request.headers.get(_HEADER_LEN_KEY)
        if header_len is not None:
            try:
                n = int(header_len)
            except ValueError:
                raise BadRequest(f"{HEADER_LEN} must be an integer, got {header_len!r}") from None
            if not 0 <= n <= len(body):
                raise BadRequest(f"{HEADER_LEN} {n} is outside the body of {len(body)} bytes")
            view = memoryview(body)
            if n == 0:
                return await self._raw_binary(request, spec, view)
            obj, binary = _parse_json(view[:n], "the inference header", max_json), view[n:]
        else:
            obj, binary = _parse_json(body, "the request body", max_json), memoryview(b"")
        if not isinstance(obj, dict):
            raise BadRequest("the inference request must be a JSON object")
        regions = gw.shared_memory
        # in a frontend worker: the controller process owns the users, and the regions this worker
        # could not open itself (RegionReplica)
        if self.forward_shm is not None and (
                (spec.personalization is not None and _names_user(obj))
                or not regions.serves(region_names(obj.get("inputs")) + region_names(obj.get("outputs")))):
            return await self.forward_shm(request)
        tensors = self._wire_inputs(obj.get("inputs"), binary, regions)
        arrays, samples = assemble_inputs(spec, tensors)
        if request.lease is not None:  # tensors decoded from JSON or read from shared memory are new memory
            request.lease.force(sum(decoded_bytes(t) for t in tensors))
        targets = OutputTargets(regions)
        try:
            return await self._infer(spec, obj, arrays, samples, targets)
        finally:
            targets.release()

    async def _infer(self, spec: ModelSpec, obj: dict[str, Any], arrays: tuple[np.ndarray, ...], samples: int,
                     targets: OutputTargets) -> Response:
        gw = self.gateway
        params = obj.get("parameters") or {}
        if not isinstance(params, dict):
            raise BadRequest("parameters must be a JSON object")
        # a model without [personalization] ignores a user, as Triton ignores parameters it does not know
        user = check_user(params["user"], "parameters.user") if "user" in params and spec.personalization else ""
        outputs = self._wanted_outputs(spec, obj, targets, bool(user))
        req_id = obj.get("id")
        if req_id is not None and not isinstance(req_id, str):
            raise BadRequest("id must be a string")
        if req_id and len(req_id.encode()) > self.settings.max_request_id_bytes:
            raise BadRequest(f"id is longer than {self.settings.max_request_id_bytes} bytes "
                             "(server.max_request_id_bytes)")
        timeout_us, priority = request_options(params.get("timeout"), params.get("priority"))
        req = gw.new_request(spec, arrays, samples, timeout_us, priority, req_id or "")
        req.user = user
        await gw.infer(req)
        return self._response(spec, req, outputs, targets)

    async def _raw_binary(self, request: Request, spec: ModelSpec, body: memoryview) -> Response:
        """Inference-Header-Content-Length: 0: the body is the one input's bytes, batch 1."""
        if len(spec.inputs) != 1:
            raise BadRequest(f"a raw binary request needs a model with one input; {spec.name} has "
                             f"{len(spec.inputs)}")
        s = spec.inputs[0]
        tensor = WireTensor(s.name, s.datatype.name, [1, *s.sample_shape], raw=body)
        arrays, samples = assemble_inputs(spec, [tensor])
        req = self.gateway.new_request(spec, arrays, samples, None, None, "")
        await self.gateway.infer(req)
        return self._response(spec, req, [(i, True) for i in range(len(spec.outputs))], None)

    @staticmethod
    def _wire_inputs(raw_inputs: Any, binary: memoryview, regions: SharedMemoryRegions) -> list[WireTensor]:
        if not isinstance(raw_inputs, list) or not raw_inputs:
            raise BadRequest("inputs must be a non-empty list")
        tensors: list[WireTensor] = []
        offset = 0
        for i, t in enumerate(raw_inputs):
            if not isinstance(t, dict):
                raise BadRequest(f"inputs[{i}] must be an object")
            name, datatype = t.get("name"), t.get("datatype")
            if not isinstance(name, str) or not isinstance(datatype, str):
                raise BadRequest(f"inputs[{i}] needs a string name and datatype")
            shape = check_shape(t.get("shape"), name)
            p = t.get("parameters") or {}
            if not isinstance(p, dict):
                raise BadRequest(f"input {name}: parameters must be an object")
            ref = shm_ref(p, f"input {name}")
            size = p.get("binary_data_size")
            if ref is not None:
                if size is not None:
                    raise BadRequest(f"input {name}: binary_data_size and shared_memory_region both given")
                tensors.append(region_tensor(name, datatype, shape, regions.read(ref, f"input {name}")))
            elif size is not None:
                if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    raise BadRequest(f"input {name}: binary_data_size must be a non-negative integer")
                if offset + size > len(binary):
                    raise BadRequest(f"input {name}: binary_data_size {size} runs past the end of the body "
                                     f"({len(binary) - offset} bytes left)")
                tensors.append(WireTensor(name, datatype, shape, raw=binary[offset : offset + size]))
                offset += size
            else:
                tensors.append(WireTensor(name, datatype, shape, data=t.get("data")))
        if offset != len(binary):
            raise BadRequest(f"{len(binary) - offset} bytes of binary data follow the inputs unused")
        return tensors

    @staticmethod
    def _wanted_outputs(spec: ModelSpec, obj: dict[str, Any], targets: OutputTargets,
                        personalized: bool = False) -> list[tuple[int, bool]]:
        params = obj.get("parameters") or {}
        binary_all = bool(params.get("binary_data_output", False)) if isinstance(params, dict) else False
        raw = obj.get("outputs")
        if raw is None:
            return [(i, binary_all) for i in select_outputs(spec, None, personalized)]
        if not isinstance(raw, list):
            raise BadRequest("outputs must be a list")
        names: list[str] = []
        flags: list[bool] = []
        refs: list[ShmRef | None] = []
        for i, o in enumerate(raw):
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise BadRequest(f"outputs[{i}] must be an object with a name")
            p = o.get("parameters") or {}
            if not isinstance(p, dict):
                raise BadRequest(f"output {o['name']}: parameters must be an object")
            if p.get("classification"):
                raise NotImplementedByServer("the classification extension is not supported")
            names.append(o["name"])
            flags.append(bool(p.get("binary_data", binary_all)))
            refs.append(shm_ref(p, f"output {o['name']}"))
        idx = select_outputs(spec, names, personalized)
        for i, ref in zip(idx, refs, strict=True):
            if ref is not None:
                targets.add(i, ref, f"output {spec.served_outputs[i].name}")
        return list(zip(idx, flags, strict=True))

    @staticmethod
    def _response(spec: ModelSpec, req: InferenceRequest, outputs: list[tuple[int, bool]],
                  targets: OutputTargets | None) -> Response:
        assert req.outputs is not None
        out_json: list[dict[str, Any]] = []
        chunks: list[bytes] = []
        for i, binary in outputs:
            o = spec.served_outputs[i]
            arr = req.outputs[i]
            item: dict[str, Any] = {"name": o.name, "datatype": o.datatype.name, "shape": list(arr.shape)}
            written = targets.write(i, arr, f"output {o.name}") if targets else None
            if written is not None:  # in its region: the answer says where, as Triton's does
                item["parameters"] = written
            elif binary:
                b = tensor_bytes(arr)
                item["parameters"] = {"binary_data_size": len(b)}
                chunks.append(b)
            else:
                item["data"] = json_data(arr, o.name)
            out_json.append(item)
        resp: dict[str, Any] = {"model_name": spec.name, "model_version": str(spec.version), "outputs": out_json}
        if req.client_id:
            resp["id"] = req.client_id
        params: dict[str, Any] = {}
        if req.reconstructed:
            params["reconstructed"] = True
        elif req.cached:
            params["cached"] = True
        if req.defaulted:  # its model's default_output: no answer could make the deadline
            params["default"] = True
        if req.query_id:  # personalized: feedback names this query
            params["query_id"] = req.query_id
            params["user"] = req.user
        if params:
            resp["parameters"] = params
        header = orjson.dumps(resp, option=_NUMPY)
        if not chunks:
            return Response(header)
        return Response(b"".join([header, *chunks]), 200, "application/octet-stream",
                        {HEADER_LEN: str(len(header))})


def _names_user(obj: dict[str, Any]) -> bool:
    params = obj.get("parameters")
    return isinstance(params, dict) and "user" in params


def decoded_bytes(t: WireTensor) -> int:
    """New memory an input took to decode (binary tensors view the body, except BYTES, copied out;
    tensors read from shared memory are copies)."""
    dt = BY_NAME[t.datatype]
    if t.owned and t.raw is not None:
        return len(t.raw) + (80 * math.prod(t.shape) if dt.variable else 0)
    if dt.variable:  # an object and a bytes per element (~80 bytes of overhead each), plus the data
        return (len(t.raw) if t.raw is not None else 0) + 80 * math.prod(t.shape)
    return 0 if t.raw is not None else math.prod(t.shape) * dt.itemsize


def is_loopback(hostport: str) -> bool:
    host = hostport.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
