"""The gRPC frontend: KServe v2 / Open Inference Protocol (`grpc_service.proto`) on grpcio's asyncio server.

It runs on the daemon's event loop beside HTTP and reaches the daemon only through the gateway
(daemon/gateway.py). The messages and the service stubs are tritonclient's generated ones
(`tritonclient.grpc.service_pb2`), the same the unmodified `tritonclient[grpc]` speaks.

Served: ServerLive/Ready, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelStatistics, RepositoryIndex/ModelLoad/ModelUnload and ModelInfer, with tensors in
`raw_input_contents` (any datatype) or typed contents. A gRPC deadline becomes the request's
deadline (when tighter than its `timeout` parameter); a cancelled RPC or a passed deadline
cancels the request. Errors map through daemon/errors.py's one tree. System shared memory
(daemon/api/sharedmem.py): the SystemSharedMemory RPCs, and inputs and outputs naming a region
by their `shared_memory_*` parameters, as Triton serves them. Streaming inference, CUDA shared
memory, trace and log settings answer UNIMPLEMENTED (the generated base class).

With frontend workers (daemon/api/worker.py) each worker serves the listener (SO_REUSEPORT) with a
`WorkerInferenceService`: inference whose tensors travel in the request goes through the worker's
gateway (the tensors to the controller process in a shared-memory slot); what only the controller
process has (statistics, the repository, shared-memory regions, users' weights, BYTES tensors,
which slots do not carry) is forwarded whole, as serialized messages, and answered there by the
controller's own `InferenceService` (`answer_forwarded`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar, cast

import grpc
import numpy as np
from google.protobuf import json_format
from mypy_extensions import mypyc_attr
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from daemon import __version__
from daemon.api.budget import Lease
from daemon.api.codec import (
    WireTensor,
    assemble_inputs,
    check_shape,
    region_tensor,
    request_options,
    select_outputs,
    tensor_bytes,
)
from daemon.api.http import EXTENSIONS, is_loopback
from daemon.api.metadata import model_config_json
from daemon.api.sharedmem import SHM_PARAMS, OutputTargets, SharedMemoryRegions, shm_ref
from daemon.apps.personal import check_user
from daemon.catalog import ModelState
from daemon.datatypes import BY_NAME
from daemon.errors import (
    BadRequest,
    EscapementError,
    Forbidden,
    NotImplementedByServer,
    grpc_code_of,
    message_of,
    retry_after_of,
)
from daemon.gateway import Gateway
from daemon.model import ModelSpec
from daemon.request import InferenceRequest

log = logging.getLogger("escapement.grpc")

MIN_SEND_BYTES = 64 << 20  # answers may be larger than requests: at least this much may be sent
# Typed contents: the field each datatype's values travel in (FP16 and BF16 have none: raw only).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                  "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                  "FP64": "fp64_contents", "BYTES": "bytes_contents"}

Ctx: TypeAlias = grpc.aio.ServicerContext
Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, Ctx], Awaitable[Resp]]


def rpc(fn: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """The one place a handler's exception becomes a gRPC status (daemon/errors.py's mapping)."""
    @functools.wraps(fn)
    async def handler(self: Any, request: Req, context: Ctx) -> Resp:
        try:
            return await fn(self, request, context)
        except EscapementError as e:
            if e.status == 500:  # only the daemon's own failures are ERRORs: refusals are counted
                log.error("%s: %s", fn.__name__, e.message)
            exc: Exception = e
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            exc = e
        retry = retry_after_of(exc)
        if retry is not None:
            context.set_trailing_metadata((("retry-after", f"{retry:g}"),))
        await context.abort(getattr(grpc.StatusCode, grpc_code_of(exc)), message_of(exc))
        raise AssertionError("unreachable: abort raises")
    return handler


def _param(p: pb.InferParameter) -> Any:
    """An InferParameter's value (whichever of its oneof is set)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


# (not a subclass of grpc's generated servicer: its module is untyped, and compiled, a class over
# an untyped base loses that base's methods; `_servicer` hands grpcio one. A Python class even where
# the module is compiled: the methods' bodies and the module's functions still run compiled)
@mypyc_attr(native_class=False)
class InferenceService:
    def __init__(self, gateway: Gateway, listener: str) -> None:
        self.gateway = gateway
        self.settings = gateway.settings.server
        self.listener = listener  # HOST:PORT, for the loopback rule of management calls
        self.share = gateway.request_memory.share()  # every gRPC request charges this one share

    # ---------------------------------------------------------------- server

    @rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Ctx) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Ctx) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.gateway.health().ready)

    @rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Ctx) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="escapement", version=__version__, extensions=EXTENSIONS)

    # ---------------------------------------------------------------- models

    @rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Ctx) -> pb.ModelReadyResponse:
        entry = self.gateway.model(request.name, request.version or None)
        return pb.ModelReadyResponse(ready=entry.state == ModelState.READY)

    @rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Ctx) -> pb.ModelMetadataResponse:
        spec = self.gateway.model(request.name, request.version or None).spec
        versions = [spec.version] if request.version else self.gateway.versions(spec.name)

        def tensors(ts: Any) -> list[pb.ModelMetadataResponse.TensorMetadata]:
            return [pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype.name, shape=list(t.shape))
                    for t in ts]

        return pb.ModelMetadataResponse(name=spec.name, versions=[str(v) for v in versions], platform=spec.platform,
                                        inputs=tensors(spec.inputs), outputs=tensors(spec.outputs))

    @rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Ctx) -> pb.ModelConfigResponse:
        spec = self.gateway.model(request.name, request.version or None).spec
        cfg = {k: v for k, v in model_config_json(spec).items() if k != "escapement"}  # ours has no proto field
        return pb.ModelConfigResponse(config=json_format.ParseDict(cfg, mc.ModelConfig()))

    @rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Ctx) -> pb.ModelStatisticsResponse:
        stats = self.gateway.model_statistics(request.name or None, request.version or None)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    @rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Ctx) -> pb.RepositoryIndexResponse:
        self._no_named_repository(request.repository_name)
        models = [pb.RepositoryIndexResponse.ModelIndex(**m) for m in self.gateway.index(request.ready)]
        return pb.RepositoryIndexResponse(models=models)

    @rpc
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Ctx) -> pb.RepositoryModelLoadResponse:
        self._authorize(context)
        self._no_named_repository(request.repository_name)
        if "config" in request.parameters or any(k.startswith("file:") for k in request.parameters):
            raise NotImplementedByServer("a load request carrying a config or model files is not supported; put "
                                         "them in the model repository and load the model by name")
        await self.gateway.load_model(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @rpc
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Ctx) -> pb.RepositoryModelUnloadResponse:
        self._authorize(context)
        self._no_named_repository(request.repository_name)
        # A model's only dependent is its parity model, which always goes with it (unload_dependents).
        await self.gateway.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ---------------------------------------------------------------- shared memory

    @rpc
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Ctx) -> pb.SystemSharedMemoryStatusResponse:
        resp = pb.SystemSharedMemoryStatusResponse()
        for r in self.gateway.shared_memory.status(request.name or None):
            resp.regions[r["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**r))
        return resp

    @rpc
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Ctx) -> pb.SystemSharedMemoryRegisterResponse:
        self._shm_allowed(context)
        self.gateway.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context: Ctx) -> pb.SystemSharedMemoryUnregisterResponse:
        self._shm_allowed(context)
        self.gateway.shared_memory.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    def _shm_allowed(self, context: Ctx) -> None:
        """Only from this host (a loopback listener), or with the admin token, as on HTTP."""
        token = self.gateway.admin_token
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if token and hmac.compare_digest(str(given).encode(), f"Bearer {token}".encode()):
            return
        if not is_loopback(self.listener):
            raise Forbidden("shared memory is for clients on this host: on a listener that is not loopback, "
                            "registering needs metadata authorization: Bearer <the admin token>")

    @staticmethod
    def _no_named_repository(name: str) -> None:
        if name:
            raise NotImplementedByServer("'repository_name' specification is not supported")

    def _authorize(self, context: Ctx) -> None:
        """Management calls: the bearer token in the `authorization` metadata, or (only when the operator
        opted in) a loopback listener, as on HTTP."""
        token = self.gateway.admin_token
        if token:
            given = dict(context.invocation_metadata() or ()).get("authorization", "")
            if not hmac.compare_digest(str(given).encode(), f"Bearer {token}".encode()):
                raise Forbidden("a management call: metadata authorization: Bearer <the admin token> is required")
        elif not (self.settings.admin_open_loopback and is_loopback(self.listener)):
            raise Forbidden("management calls need a token (server.admin_token_file, or a systemd credential named "
                            "admin-token), or server.admin_open_loopback on a loopback listener")

    # ---------------------------------------------------------------- inference

    @rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Ctx) -> pb.ModelInferResponse:
        gw = self.gateway
        spec = gw.admit(request.model_name, request.model_version or None)  # before decoding
        raw = request.raw_input_contents
        size = sum(len(r) for r in raw)
        lease = self.share.lease()
        if not lease.take(size):  # grpcio holds the message already: refusing frees it sooner
            raise gw.request_memory.refusal(size)
        try:
            return await self._infer(spec, request, context, lease)
        finally:
            lease.release()

    async def _infer(self, spec: ModelSpec, request: pb.ModelInferRequest, context: Ctx,
                     lease: Lease) -> pb.ModelInferResponse:
        tensors = self._wire_inputs(request, self.gateway.shared_memory)
        arrays, samples = assemble_inputs(spec, tensors)
        # decoded from typed contents or read from shared memory: new memory (raw ones view the message)
        lease.force(sum(a.nbytes for a, t in zip(arrays, tensors, strict=False) if t.raw is None or t.owned))
        targets = OutputTargets(self.gateway.shared_memory)
        try:
            return await self._infer_into(spec, request, context, arrays, samples, targets)
        finally:
            targets.release()

    async def _infer_into(self, spec: ModelSpec, request: pb.ModelInferRequest, context: Ctx,
                          arrays: tuple[np.ndarray, ...], samples: int,
                          targets: OutputTargets) -> pb.ModelInferResponse:
        gw = self.gateway
        params = {k: _param(v) for k, v in request.parameters.items()}
        user = check_user(params["user"], "parameter user") if "user" in params and spec.personalization else ""
        out_idx = self._wanted_outputs(spec, request, targets, bool(user))
        if len(request.id.encode()) > self.settings.max_request_id_bytes:
            raise BadRequest(f"id is longer than {self.settings.max_request_id_bytes} bytes "
                             "(server.max_request_id_bytes)")
        timeout_us, priority = request_options(params.get("timeout"), params.get("priority"))
        left = context.time_remaining()  # the client's gRPC deadline: a hard one
        if left is not None:
            grpc_us = max(0, int(left * 1e6))
            timeout_us = grpc_us if timeout_us is None else min(timeout_us, grpc_us)
        req = gw.new_request(spec, arrays, samples, timeout_us, priority, request.id)
        req.user = user
        await gw.infer(req)  # a cancelled RPC (client gone, deadline passed) cancels it
        return self._response(spec, req, out_idx, targets)

    @staticmethod
    def _wire_inputs(request: pb.ModelInferRequest, regions: SharedMemoryRegions) -> list[WireTensor]:
        raw = request.raw_input_contents
        if not request.inputs:
            raise BadRequest("inputs must be a non-empty list")
        refs = [shm_ref({k: _param(v) for k, v in t.parameters.items()}, f"input {t.name}") for t in request.inputs]
        plain = sum(ref is None for ref in refs)  # raw_input_contents holds these only (Triton's rule)
        if raw and len(raw) != plain:
            raise BadRequest(f"raw_input_contents has {len(raw)} entries for {plain} inputs not in shared memory; "
                             "give every such input's data there, or none")
        tensors: list[WireTensor] = []
        next_raw = 0
        for t, ref in zip(request.inputs, refs, strict=True):
            shape = check_shape(list(t.shape), t.name)
            if ref is not None:
                if t.HasField("contents"):
                    raise BadRequest(f"input {t.name}: data in contents beside shared_memory_region")
                tensors.append(region_tensor(t.name, t.datatype, shape, regions.read(ref, f"input {t.name}")))
                continue
            if raw:
                if t.HasField("contents"):
                    raise BadRequest(f"input {t.name}: data in both contents and raw_input_contents")
                tensors.append(WireTensor(t.name, t.datatype, shape, raw=raw[next_raw]))
                next_raw += 1
                continue
            field = CONTENTS_FIELD.get(t.datatype)
            if field is None:
                known = t.datatype in BY_NAME
                raise BadRequest(f"input {t.name}: {t.datatype} data must come in raw_input_contents"
                                 if known else f"input {t.name}: unknown datatype {t.datatype}")
            values = getattr(t.contents, field)
            others = [f.name for f, v in t.contents.ListFields() if f.name != field and v]
            if others:
                raise BadRequest(f"input {t.name}: {t.datatype} data belongs in contents.{field}, not {others[0]}")
            tensors.append(WireTensor(t.name, t.datatype, shape, data=list(values)))
        return tensors

    @staticmethod
    def _wanted_outputs(spec: ModelSpec, request: pb.ModelInferRequest, targets: OutputTargets,
                        personalized: bool = False) -> list[int]:
        if not request.outputs:
            return select_outputs(spec, None, personalized)
        for o in request.outputs:
            if "classification" in o.parameters and _param(o.parameters["classification"]):
                raise NotImplementedByServer("the classification extension is not supported")
        idx = select_outputs(spec, [o.name for o in request.outputs], personalized)
        for i, o in zip(idx, request.outputs, strict=True):
            ref = shm_ref({k: _param(v) for k, v in o.parameters.items()}, f"output {o.name}")
            if ref is not None:
                targets.add(i, ref, f"output {o.name}")
        return idx

    @staticmethod
    def _response(spec: ModelSpec, req: InferenceRequest, out_idx: list[int],
                  targets: OutputTargets) -> pb.ModelInferResponse:
        assert req.outputs is not None
        resp = pb.ModelInferResponse(model_name=spec.name, model_version=str(spec.version), id=req.client_id)
        for i in out_idx:
            o = spec.served_outputs[i]
            arr = req.outputs[i]
            out = resp.outputs.add(name=o.name, datatype=o.datatype.name, shape=list(arr.shape))
            written = targets.write(i, arr, f"output {o.name}") if targets else None
            if written is None:
                resp.raw_output_contents.append(tensor_bytes(arr))
                continue
            # In its region: the parameters say where, and an empty raw entry keeps the raw
            # contents in step with the outputs (as Triton's answers do).
            out.parameters["shared_memory_region"].string_param = written["shared_memory_region"]
            out.parameters["shared_memory_byte_size"].int64_param = written["shared_memory_byte_size"]
            if "shared_memory_offset" in written:
                out.parameters["shared_memory_offset"].int64_param = written["shared_memory_offset"]
            resp.raw_output_contents.append(b"")
        if req.reconstructed:
            resp.parameters["reconstructed"].bool_param = True
        if req.cached:
            resp.parameters["cached"].bool_param = True
        if req.defaulted:  # its model's default_output: no answer could make the deadline
            resp.parameters["default"].bool_param = True
        if req.query_id:  # personalized: feedback names this query
            resp.parameters["query_id"].string_param = req.query_id
        return resp


# ---------------------------------------------------------------- frontend workers

# What a frontend worker forwards whole: (RPC name, serialized request, the `authorization`
# metadata, the call's deadline on CLOCK_MONOTONIC or None) -> [status code name or None,
# details, serialized response, trailing metadata]. CLOCK_MONOTONIC is the same in every process.
Forward = Callable[[str, bytes, list[list[str]], float | None], Awaitable[list[Any]]]

FORWARDED: dict[str, tuple[type[Any], type[Any]]] = {
    "ModelStatistics": (pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
    "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse),
    "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse),
    "SystemSharedMemoryStatus": (pb.SystemSharedMemoryStatusRequest, pb.SystemSharedMemoryStatusResponse),
    "SystemSharedMemoryRegister": (pb.SystemSharedMemoryRegisterRequest, pb.SystemSharedMemoryRegisterResponse),
    "SystemSharedMemoryUnregister": (pb.SystemSharedMemoryUnregisterRequest,
                                     pb.SystemSharedMemoryUnregisterResponse),
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
}


def needs_controller(request: pb.ModelInferRequest, regions: SharedMemoryRegions) -> bool:
    """Whether a worker forwards an inference whole: it names a user (the controller process owns
    them) or a shared-memory region the worker does not serve itself (`regions`, its replica), or
    carries BYTES (slots hold fixed-size elements only)."""
    if "user" in request.parameters:
        return True
    if any(t.datatype == "BYTES" for t in request.inputs):
        return True
    # (a region's parameters without its name: None, which no replica serves; the controller says why)
    names = [_param(t.parameters["shared_memory_region"]) if "shared_memory_region" in t.parameters else None
             for t in (*request.inputs, *request.outputs) if any(k in t.parameters for k in SHM_PARAMS)]
    return bool(names) and not regions.serves(names)


@mypyc_attr(native_class=False)
class WorkerInferenceService(InferenceService):
    """The service in a frontend worker: inference through the worker's gateway, the rest forwarded."""

    def __init__(self, gateway: Gateway, listener: str, forward: Forward) -> None:
        super().__init__(gateway, listener)
        self.forward = forward

    async def _forwarded(self, method: str, request: Any, context: Ctx) -> Any:
        left = context.time_remaining()
        deadline = None if left is None else time.monotonic() + left
        md = [[k, v] for k, v in (context.invocation_metadata() or ()) if k == "authorization" and isinstance(v, str)]
        code, details, body, trailing = await self.forward(method, request.SerializeToString(), md, deadline)
        if code is not None:
            if trailing:
                context.set_trailing_metadata(tuple((k, v) for k, v in trailing))
            await context.abort(getattr(grpc.StatusCode, code), details)
        return FORWARDED[method][1].FromString(body)

    @rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Ctx) -> pb.ModelInferResponse:
        if needs_controller(request, self.gateway.shared_memory):
            return cast(pb.ModelInferResponse, await self._forwarded("ModelInfer", request, context))
        return await super().ModelInfer(request, context)

    @rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Ctx) -> pb.ModelStatisticsResponse:
        return cast(pb.ModelStatisticsResponse, await self._forwarded("ModelStatistics", request, context))

    @rpc
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Ctx) -> pb.RepositoryModelLoadResponse:
        return cast(pb.RepositoryModelLoadResponse, await self._forwarded("RepositoryModelLoad", request, context))

    @rpc
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Ctx) -> pb.RepositoryModelUnloadResponse:
        return cast(pb.RepositoryModelUnloadResponse, await self._forwarded("RepositoryModelUnload", request, context))

    @rpc
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Ctx) -> pb.SystemSharedMemoryStatusResponse:
        return cast(pb.SystemSharedMemoryStatusResponse,
                    await self._forwarded("SystemSharedMemoryStatus", request, context))

    @rpc
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Ctx) -> pb.SystemSharedMemoryRegisterResponse:
        return cast(pb.SystemSharedMemoryRegisterResponse,
                    await self._forwarded("SystemSharedMemoryRegister", request, context))

    @rpc
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context: Ctx) -> pb.SystemSharedMemoryUnregisterResponse:
        return cast(pb.SystemSharedMemoryUnregisterResponse,
                    await self._forwarded("SystemSharedMemoryUnregister", request, context))


class _ForwardedContext:
    """The part of a ServicerContext the handlers use, for a call a worker forwarded."""

    def __init__(self, metadata: list[list[str]], deadline: float | None) -> None:
        self.metadata = tuple((k, v) for k, v in metadata)
        self.deadline = deadline
        self.trailing: list[list[str]] = []
        self.code: str | None = None
        self.details = ""

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = [[k, v] for k, v in metadata]

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code, self.details = code.name, details
        raise grpc.aio.AbortError()


async def answer_forwarded(service: InferenceService, method: str, blob: bytes, metadata: list[list[str]],
                           deadline: float | None) -> list[Any]:
    """Answer an RPC a frontend worker forwarded with the controller process's own handlers."""
    if method not in FORWARDED:
        return ["INTERNAL", f"a frontend worker forwarded an unknown RPC {method!r}", b"", []]
    ctx = _ForwardedContext(metadata, deadline)
    try:
        request = FORWARDED[method][0].FromString(blob)
        resp = await getattr(service, method)(request, cast(Ctx, ctx))
    except grpc.aio.AbortError:
        return [ctx.code or "INTERNAL", ctx.details, b"", ctx.trailing]
    except Exception as e:  # answered, whatever happened: the worker waits for this reply
        log.exception("a forwarded %s failed", method)
        return ["INTERNAL", message_of(e), b"", []]
    return [None, "", resp.SerializeToString(), []]


def _servicer(service: InferenceService) -> Any:
    """The generated servicer with `service`'s RPCs in place of its defaults (the RPCs escapement
    does not serve, e.g. CUDA shared memory and streaming, keep them: UNIMPLEMENTED)."""
    servicer = pb_grpc.GRPCInferenceServiceServicer()
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        rpc_ = getattr(service, method.name, None)
        if rpc_ is not None:
            setattr(servicer, method.name, rpc_)
    return servicer


class GrpcFrontend:
    """The listener: a grpc.aio server on the running loop (in a frontend worker: with `forward`, which
    takes what only the controller process answers there)."""

    def __init__(self, gateway: Gateway, forward: Forward | None = None) -> None:
        self.gateway = gateway
        self.forward = forward
        self.server: grpc.aio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen; `reuse_port` in frontend workers, which all bind the port the controller reserved."""
        s = self.gateway.settings.server
        # grpcio holds a whole message before the handler sees it (the handler then charges it to the
        # request memory): a message is at most server.max_body_bytes, and at most max_connections
        # RPCs are in flight (past that: RESOURCE_EXHAUSTED).
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", s.max_body_bytes),
            ("grpc.max_send_message_length", max(s.max_body_bytes, MIN_SEND_BYTES)),
            # a second daemon on the same port must fail, not share it (workers share the port the
            # controller process reserved: a second daemon fails there)
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ], maximum_concurrent_rpcs=s.max_connections)
        listener = f"{host}:{port}"
        service = (InferenceService(self.gateway, listener) if self.forward is None
                   else WorkerInferenceService(self.gateway, listener, self.forward))
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(_servicer(service), self.server)
        bound = self.server.add_insecure_port(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}")
        if bound == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")
        await self.server.start()
        return bound

    async def stop_listening(self, grace_s: float) -> None:
        """Stop taking RPCs at once; those running get up to `grace_s` to be answered (the drain)."""
        if self.server is not None and self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self.server.stop(grace_s), name="grpc-stop")

    async def close(self) -> None:
        """Cancel the RPCs still running and close the listener."""
        if self.server is not None:
            await self.server.stop(0)
            if self._stopping is not None:
                await asyncio.gather(self._stopping, return_exceptions=True)
            self.server = None
