"""A frontend worker process: it owns listeners and does the protocol work for the controller process.

Started by the controller process (daemon/frontends.py) as
`python -m daemon.api.worker LINK_FD POOL_FD SOCKET_FD MAX_RECORD`: its end of the link (a
socketpair), its shared-memory region (a memfd), the unix socket listening in the controller
process (-1: none) and the largest record the link takes. It parses HTTP and msgpack frames,
inflates, decodes JSON, validates against the model's metadata and encodes answers; the
controller process only sees small SUBMIT records whose tensors lie in the region.

What a worker answers itself: inference (HTTP, gRPC and the socket; with inputs and outputs in
shared-memory regions too, from its replica of the registry), liveness, and the socket's and
gRPC's model calls from its catalog replica. Everything else over HTTP (readiness, metadata,
statistics, metrics, management), the socket's `stats` and gRPC's statistics, repository and
shared-memory calls are forwarded whole to the controller process, which answers them with its
own handlers: one implementation, and nothing there is hot. So are inferences naming a user (the
controller process owns the users) or a region this worker cannot open itself.

The worker exits when the link closes (the controller process is gone: it never outlives it),
on STOP, or on SIGTERM (the controller restarts it); SIGINT is ignored: the controller process
orders a shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import mmap
import pickle
import signal
import socket
import sys
from typing import Any

import uvloop

from daemon import log as daemon_log
from daemon.api.budget import Lease
from daemon.api.grpc_v2 import GrpcFrontend
from daemon.api.http import HttpFrontend
from daemon.api.httpserver import Request, Response, Router
from daemon.api.link import ANSWER, DONE, DRAIN, HELLO, MODELS, READY, REGIONS, REPLY, SEEN, STATE, STOP, Link
from daemon.api.remote import RemoteController, RemoteGateway, catalog_from, error_from
from daemon.api.sharedmem import region_names
from daemon.api.slots import SlotPool, pool_bytes, pool_classes
from daemon.api.uds import SocketConnection, SocketFrontend, error_frame
from daemon.catalog import ModelCatalog
from daemon.config import Settings
from daemon.errors import EscapementError, PayloadTooLarge
from daemon.gateway import Health
from daemon.overload import LoopMonitor

log = logging.getLogger("escapement.workers")

CALL_HTTP, CALL_SOCKET, CALL_GRPC = 0, 1, 2
STOP_ANSWER_S = 2.0  # on STOP, how long answers already sent by the controller may take to be written


FORWARDED_OPS = ("stats", "forecast", "shm_register", "shm_unregister", "shm_status")


class WorkerSocketConnection(SocketConnection):
    """The socket's `stats` and shared-memory ops, and infer frames naming a user or a region this
    worker does not serve, are the controller process's to answer: forwarded, answered when they
    return. A forwarded infer is cancelled there when its client disconnects, as one answered here
    would be."""

    def __init__(self, frontend: SocketFrontend) -> None:
        super().__init__(frontend)
        self._forwarded_infers: set[asyncio.Task[None]] = set()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for task in list(self._forwarded_infers):
            task.cancel()  # its RemoteController.call sends ABORT: the controller cancels the request

    def _control_op(self, req_id: Any, op: Any, msg: dict[str, Any]) -> None:
        if op not in FORWARDED_OPS:
            super()._control_op(req_id, op, msg)
            return
        self._forward(req_id, op, {k: v for k, v in msg.items() if k != "id"} if op != "stats" else {})

    def _async_op(self, req_id: Any, op: str, msg: dict[str, Any], lease: Lease) -> None:
        # the users and applications are there; in flight here meanwhile, holding the frame's memory
        task = self._forward(req_id, op, {k: v for k, v in msg.items() if k != "id"})
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._async_done, lease))

    def _infer(self, req_id: Any, msg: dict[str, Any], lease: Lease) -> bool:
        # a user's request: the controller process owns the users (their weights, the queries)
        regions = self.gateway.shared_memory
        if msg.get("user") is None and regions.serves(region_names(msg.get("inputs")) +
                                                       region_names(msg.get("outputs"))):
            return super()._infer(req_id, msg, lease)
        lease.release()  # the frame is small (the tensors are in the regions) and is passed on whole
        task = self._forward(req_id, "infer", {k: v for k, v in msg.items() if k != "id"})
        self._forwarded_infers.add(task)
        task.add_done_callback(self._forwarded_infers.discard)
        return False

    def _forward(self, req_id: Any, op: str, msg: dict[str, Any]) -> asyncio.Task[None]:
        gw = self.gateway
        assert isinstance(gw, RemoteGateway)
        task = asyncio.get_running_loop().create_task(self._forwarded(gw.remote, req_id, op, msg))
        gw.background.add(task)
        task.add_done_callback(gw.background.discard)
        return task

    async def _forwarded(self, remote: RemoteController, req_id: Any, op: str, msg: dict[str, Any]) -> None:
        try:
            status, body, retry = await remote.call(CALL_SOCKET, [op, msg])
        except EscapementError as e:
            self.send(error_frame(req_id, e))
            return
        if status == 200:
            self.send({"id": req_id, "status": 200, **body})
        else:
            self.send(error_frame(req_id, error_from(status, body, retry)))


class Worker:
    def __init__(self, link_fd: int, pool_fd: int, socket_fd: int, max_record: int) -> None:
        self.link_fd = link_fd
        self.pool_fd = pool_fd
        self.socket_fd = socket_fd
        self.max_record = max_record
        self.link: Link | None = None
        self.gateway: RemoteGateway | None = None
        self.remote: RemoteController | None = None
        self.http: HttpFrontend | None = None
        self.socket: SocketFrontend | None = None
        self.grpc: GrpcFrontend | None = None
        self._hello: asyncio.Future[list[Any]] | None = None
        self._stop = asyncio.Event()
        self._early: list[list[Any]] = []  # records before the gateway exists (MODELS, STATE)
        self._idle = asyncio.Event()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        hello: asyncio.Future[list[Any]] = loop.create_future()
        self._hello = hello
        sock = socket.socket(fileno=self.link_fd)
        _, self.link = await loop.connect_accepted_socket(
            lambda: Link(self._on_record, self._on_lost, max_record=self.max_record), sock=sock)
        stopped = loop.create_task(self._stop.wait())
        waiters: list[asyncio.Future[Any]] = [hello, stopped]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not self._hello.done():
            return 1
        _, blob, index, workers, host, port, grpc_host, grpc_port = self._hello.result()
        settings: Settings = pickle.loads(blob)  # our own controller process, over a private socketpair
        daemon_log.setup(settings.server.log_level)
        s = settings.server
        classes = pool_classes(s.frontend_slots, s.max_body_bytes)
        region = mmap.mmap(self.pool_fd, pool_bytes(classes))
        self.remote = RemoteController(self.link, SlotPool(classes), memoryview(region))
        self.gateway = gw = RemoteGateway(settings, ModelCatalog(), self.remote, workers)
        for record in self._early:
            self._on_record(record)
        self._early.clear()
        if host:
            self.http = HttpFrontend(gw)
            self.http.router = worker_router(self.http, self._forward_http)
            self.http.forward_shm = self._forward_http  # users, and regions this worker cannot open
            await self.http.start(host, port, reuse_port=True)
        if self.socket_fd >= 0:
            self.socket = SocketFrontend(gw, WorkerSocketConnection)
            await self.socket.start_on(socket.socket(fileno=self.socket_fd))
        if grpc_host:
            self.grpc = GrpcFrontend(gw, forward=self._forward_grpc)
            await self.grpc.start(grpc_host, grpc_port, reuse_port=True)
        freeze_heap()
        monitor = LoopMonitor(gw.overload)
        monitor.start()
        self.link.send([READY])
        log.debug("frontend worker %d ready", index)
        await self._stop.wait()
        monitor.stop()
        await self._close()
        return 0

    async def _forward_http(self, request: Request) -> Response:
        assert self.remote is not None and self.gateway is not None
        limit = self.gateway.settings.server.max_json_bytes
        if len(request.body) > limit:  # what is forwarded is small (management, metadata): JSON at most
            raise PayloadTooLarge(f"a body of {len(request.body)} bytes is over the limit of {limit} for this "
                                  "endpoint (server.max_json_bytes)")
        status, ctype, headers, body = await self.remote.call(
            CALL_HTTP, [request.method, request.path, request.query, request.headers, bytes(request.body)])
        return Response(body, status, ctype, headers or None)

    async def _forward_grpc(self, method: str, blob: bytes, metadata: list[list[str]],
                            deadline: float | None) -> list[Any]:
        assert self.remote is not None
        reply: list[Any] = await self.remote.call(CALL_GRPC, [method, blob, metadata, deadline])
        return reply

    # ---------------------------------------------------------------- the link

    def _on_record(self, record: list[Any]) -> None:
        op = record[0]
        if op in (ANSWER, DONE):
            assert self.remote is not None
            if op == ANSWER:
                self.remote.done(record[1], 200, "", None, False, record[2])
            else:
                self.remote.done(*record[1:])
            if self._stopping and not self.remote.inflight:
                self._idle.set()
        elif op == REPLY:
            assert self.remote is not None
            self.remote.reply(record[1], record[2])
        elif op == HELLO:
            assert self._hello is not None
            self._hello.set_result(record)
        elif self.gateway is None:
            self._early.append(record)
        elif op == MODELS:
            self.gateway.catalog = catalog_from(record[1])
            if self.link is not None:
                self.link.send([SEEN, record[2]])  # (a client that saw READY=1 finds this catalog here)
        elif op == REGIONS:
            self.gateway.regions.apply(record[1])
        elif op == STATE:
            _, overloaded, lag_s, ready, lost = record
            self.gateway.controller_overloaded, self.gateway.controller_lag_s = overloaded, lag_s
            self.gateway.health_state = Health(ready, lost)
        elif op == DRAIN:
            asyncio.get_running_loop().create_task(self._stop_listening())
        elif op == STOP:
            self._stop.set()

    _stopping = False

    def _on_lost(self) -> None:
        if self.remote is not None:
            self.remote.controller_lost()
        self._stop.set()  # the controller process is gone: so is this worker

    async def _stop_listening(self) -> None:
        for fe in (self.http, self.socket):
            if fe is not None:
                await fe.stop_listening()
        if self.grpc is not None and self.gateway is not None:  # RPCs running get the drain's time
            await self.grpc.stop_listening(self.gateway.settings.server.drain_timeout_s)

    async def _close(self) -> None:
        """Let answers the controller already sent reach their clients, then close every connection."""
        self._stopping = True
        if self.remote is not None and self.remote.inflight and not self.remote.lost:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), STOP_ANSWER_S)
            except TimeoutError:
                log.warning("[shutdown] frontend worker: %d request(s) still unanswered", len(self.remote.inflight))
        for _ in range(5):  # the handlers woken by the last answers write them in the next turns
            await asyncio.sleep(0)
        await self._stop_listening()
        for fe in (self.http, self.socket, self.grpc):
            if fe is not None:
                await fe.close()
        if self.link is not None:
            self.link.close()
        if self.gateway is not None:
            self.gateway.regions.close()


def worker_router(fe: HttpFrontend, forward: Any) -> Router:
    """Inference and liveness here; every other route forwarded to the controller process."""
    r = Router()
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version:[0-9]+}"):
        r.add("POST", base + "/infer", fe.infer)
    r.add("GET", "/v2/health/live", fe.live)
    for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        r.add(method, "/{path:.*}", forward)
    return r


def freeze_heap() -> int:
    """Move what start-up left (the imports, torch's among them: ~180,000 objects) out of the
    collector's reach, as the controller process does; how many objects that froze. Without it a
    full collection in a worker walks them all, ~110 ms on the 2-core machine, and its loop monitor
    reads that stall as overload: the worker answers 503 for a moment (bench run peers, issue 15)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def main(argv: list[str]) -> int:
    link_fd, pool_fd, socket_fd, max_record = (int(a) for a in argv)
    return uvloop.run(Worker(link_fd, pool_fd, socket_fd, max_record).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
