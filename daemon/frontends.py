"""Frontend worker processes, from the controller process's side: start, link, restart, stop.

With `server.frontend_workers = N` (> 0) the HTTP, gRPC and socket listeners live in N worker processes
(daemon/api/worker.py), which do the protocol work and hand requests over as small records on a
socketpair, their tensors in a shared-memory region per worker (daemon/api/slots.py). Here each
SUBMIT becomes an `InferenceRequest` whose inputs are numpy views of that region and goes to the
local `Gateway.submit`: the controller sees one submission path whatever the process layout.
Its answer goes back as a DONE record, which also frees the slot in the worker.

- Listeners: this process reserves the HTTP and gRPC ports (sockets bound with SO_REUSEPORT, never
  listening: `:0` resolves once, a second daemon on the port fails here, and the port stays
  ours while a worker restarts); each worker binds it with SO_REUSEPORT. The unix socket is
  created and listened on here and accepted on in every worker.
- Calls a worker forwards (management, regions, users' requests) are answered here by tasks
  that an ABORT record (the client left, the deadline passed) or the worker's death cancels.
- This process never waits on a worker: link writes are buffered and a worker whose link
  backs up past its bound is killed. A worker that dies (its link closes) has its requests
  cancelled here and is started again (backoff 0.1 s doubling to 5 s); one that dies five times
  in a row before it is ready stops the daemon.
- Shutdown (daemon/server.py): `stop_listening` (DRAIN: the workers close their listeners, the
  socket path goes) -> the controller drains -> `close` (STOP: the workers write the answers
  they got and exit, SIGKILL after WORKER_EXIT_S).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from daemon.api.codec import tensor_bytes
from daemon.api.grpc_v2 import InferenceService, answer_forwarded
from daemon.api.http import HttpFrontend
from daemon.api.httpserver import Request
from daemon.api.link import (
    ABORT,
    ANSWER,
    CALL,
    CANCEL,
    DONE,
    DRAIN,
    HELLO,
    MODELS,
    READY,
    REGIONS,
    REPLY,
    SEEN,
    STATE,
    STOP,
    SUBMIT,
    Link,
)
from daemon.api.slots import pool_bytes, pool_classes
from daemon.api.uds import ASYNC_OPS, SocketFrontend, async_answer, control_answer, infer_answer
from daemon.api.worker import CALL_GRPC, CALL_HTTP
from daemon.config import Settings, parse_hostport
from daemon.errors import Cancelled, EscapementError, InternalError, message_of, retry_after_of, status_of
from daemon.gateway import Gateway
from daemon.request import InferenceRequest, RequestClass, RequestStatus

log = logging.getLogger("escapement.workers")

STATE_TICK_S = 0.005  # how often overload, health and the catalog are compared with what workers have
READY_TIMEOUT_S = 60.0
WORKER_EXIT_S = 5.0
MAX_EARLY_DEATHS = 5
BACKOFF_S = (0.1, 5.0)
_CLASSES = {int(c): c for c in RequestClass}


def default_workers(cores: int) -> int:
    """`server.frontend_workers = -1`: none on one core, else a quarter of the cores and at least one.
    Two cores get one: with HTTP JSON and a real model a worker takes parsing and decoding off the
    loop's GIL, which the controller and the INFER thread's hand-offs need (bench peers, JSON row,
    interleaved: 2,877 and 3,726 req/s at SLO with one worker vs 2,253 and 2,410 without,
    bench/results/peers-gap). The closed-loop null-model ingest runs that chose 0 were
    generator-bound at ~2,600 req/s whatever the count (bench/results/ingest.md)."""
    return 0 if cores < 2 else max(1, cores // 4)


def catalog_snapshot(gateway: Gateway) -> bytes:
    reg = gateway.catalog
    entries = [(e.spec, e.state.value, e.reason) for n in reg.names() for e in reg.versions(n).values()]
    return pickle.dumps((entries, reg.broken()), protocol=pickle.HIGHEST_PROTOCOL)


class WorkerHandle:
    """One worker process, its link and its region; replaced whole when the worker is restarted."""

    def __init__(self, index: int, proc: subprocess.Popen[bytes], region: mmap.mmap) -> None:
        self.index = index
        self.proc = proc
        self.region = region  # numpy views of it keep it mapped while a request still reads it
        self.view = memoryview(region)
        self.link: Link | None = None
        self.requests: dict[int, InferenceRequest] = {}  # the worker's request id -> ours
        self.calls: dict[int, asyncio.Task[None]] = {}  # forwarded calls being answered, by call id
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.started = time.monotonic()
        self.on_finish: Callable[[InferenceRequest], None] = lambda r: None  # set by FrontendWorkers
        self.seen = -1  # the catalog generation the worker said it answers from (SEEN)


class FrontendWorkers:
    def __init__(self, settings: Settings, gateway: Gateway, count: int, on_fatal: Callable[[], None],
                 cores: set[int] | None = None) -> None:
        self.settings = settings
        self.cores = cores  # the workers may run on every core (the loop thread is pinned off the devices')
        self.gateway = gateway
        self.count = count
        self.on_fatal = on_fatal
        s = settings.server
        self.classes = pool_classes(s.frontend_slots, s.max_body_bytes)
        self.max_record = max(s.max_body_bytes, pool_bytes(self.classes)) + (1 << 20)
        self.workers: list[WorkerHandle | None] = [None] * count
        self.http_host = ""
        self.http_port = 0
        self.grpc_host = ""
        self.grpc_port = 0
        self._reserved: socket.socket | None = None
        self._reserved_grpc: socket.socket | None = None
        self._grpc_shadow: InferenceService | None = None  # answers the RPCs workers forward
        self._listener: socket.socket | None = None  # the unix socket (not `_unix`: compiled, C predefines `__unix`)
        self._shadow: HttpFrontend | None = None  # answers what workers forward (never listens)
        self._stopping = False
        self._early_deaths = [0] * count
        self._tasks: set[asyncio.Task[Any]] = set()
        self._tick: asyncio.TimerHandle | None = None
        self._sent: tuple[Any, ...] = ()
        self._generation = -1
        self._seen = asyncio.Event()  # a worker acknowledged a catalog, or one was lost: look again
        self._regions_generation = 0  # (a worker starts with the registry as it is: _start_worker)
        self.restarts = 0
        self.forwarded = 0  # calls workers forwarded here (management, statistics, users' inferences...)
        self._answering = False  # a step's answers are being delivered (answers_begin/end)
        self._held: list[Link] = []  # links holding answers of this step, not yet written

    # ---------------------------------------------------------------- start-up

    async def start(self) -> None:
        s = self.settings.server
        if s.http:
            host, port = parse_hostport(s.http, "server.http")
            self._reserved = _reserve_port(host, port)
            self.http_host, self.http_port = host, self._reserved.getsockname()[1]
            self._shadow = HttpFrontend(self.gateway)
            self._shadow.name_listener(host, self.http_port)
        if s.grpc:
            host, port = parse_hostport(s.grpc, "server.grpc")
            self._reserved_grpc = _reserve_port(host, port)
            self.grpc_host, self.grpc_port = host, self._reserved_grpc.getsockname()[1]
            self._grpc_shadow = InferenceService(self.gateway, f"{host}:{self.grpc_port}")
        if s.socket:
            self._listener = await asyncio.to_thread(SocketFrontend.listen, s.socket, s.socket_mode)
        for i in range(self.count):
            await self._start_worker(i)
        self._schedule_tick()
        handles = [w for w in self.workers if w is not None]
        try:
            await asyncio.wait_for(asyncio.gather(*[w.ready for w in handles]), READY_TIMEOUT_S)
        except TimeoutError:
            raise RuntimeError(f"frontend workers not ready within {READY_TIMEOUT_S:g} s") from None

    async def _start_worker(self, index: int) -> None:
        size = pool_bytes(self.classes)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        memfd = os.memfd_create(f"escapement-frontend-{index}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(memfd, size)
            region = mmap.mmap(memfd, size)
            fds = [theirs.fileno(), memfd] + ([self._listener.fileno()] if self._listener is not None else [])
            argv = [sys.executable, "-m", "daemon.api.worker", str(theirs.fileno()), str(memfd),
                    str(self._listener.fileno() if self._listener is not None else -1), str(self.max_record)]
            # A session of its own: a terminal's ^C reaches this process only, which orders the
            # shutdown. Started from a thread: fork and exec of a large process take milliseconds.
            proc = await asyncio.to_thread(subprocess.Popen, argv, pass_fds=fds, start_new_session=True)
            if self.cores:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(proc.pid, self.cores)
        finally:
            theirs.close()
            os.close(memfd)
        w = WorkerHandle(index, proc, region)
        w.on_finish = functools.partial(self._finished, w)
        self.workers[index] = w
        loop = asyncio.get_running_loop()
        _, w.link = await loop.connect_accepted_socket(
            lambda: Link(functools.partial(self._on_record, w), lambda: self._on_lost(w), max_record=self.max_record,
                         on_wedged=lambda: self._wedged(w)), sock=mine)
        w.link.send([HELLO, pickle.dumps(self.settings, protocol=pickle.HIGHEST_PROTOCOL), index, self.count,
                     self.http_host, self.http_port, self.grpc_host, self.grpc_port])
        w.link.send([MODELS, catalog_snapshot(self.gateway), self.gateway.catalog.generation])
        w.link.send([REGIONS, self.gateway.shared_memory.snapshot()])
        w.link.send(self._state())
        log.info("frontend worker %d started (pid %d)", index, proc.pid)

    # ---------------------------------------------------------------- what workers send

    def _on_record(self, w: WorkerHandle, record: list[Any]) -> None:
        op = record[0]
        if op == SUBMIT:
            self._submit(w, record)
        elif op == CANCEL:
            req = w.requests.get(record[1])
            # A running request finishes on its device anyway (its answer is dropped by the worker);
            # its DONE frees its slot only once nothing reads its inputs any more.
            if req is not None and req.status == RequestStatus.QUEUED:
                self.gateway.cancel(req)
        elif op == CALL:
            self._call(w, record[1], record[2], record[3])
        elif op == ABORT:
            task = w.calls.get(record[1])
            if task is not None:
                task.cancel()  # e.g. a forwarded infer: awaiting Gateway.infer, it cancels the request
        elif op == SEEN:
            self.worker_seen(w, record[1])
        elif op == READY:
            if not w.ready.done():
                w.ready.set_result(None)
            self._early_deaths[w.index] = 0

    def _submit(self, w: WorkerHandle, record: list[Any]) -> None:
        (_, rid, name, version, samples, arrival, deadline, priority, rank, klass, give_up_at, client_id,
         refs) = record
        assert w.link is not None
        try:
            spec = self.gateway.resolve(name, version)  # remembered per catalog generation
            inputs = spec.inputs
            if len(refs) != len(inputs):
                raise InternalError(f"a frontend worker sent {len(refs)} inputs for {spec.name}")
            view = w.view
            made: list[np.ndarray] = []
            try:  # one ndarray call per input (bounds checked by numpy)
                # (by index, not `zip(..., strict=True)`: the lengths are equal, checked above, and
                # compiled, the keyword made a dict and a zip object each request, ~2.5k instructions)
                for i in range(len(inputs)):
                    off, shape = refs[i]
                    # (positional: compiled, keywords to a Python callable build a dict each call)
                    made.append(np.ndarray(shape, inputs[i].datatype.numpy, view, off))
            except (ValueError, TypeError) as e:  # a worker is trusted with its own region, never beyond it
                raise InternalError(f"a frontend worker named tensors outside its region: {e}") from None
            arrays = tuple(made)
            klass = _CLASSES.get(klass)  # a dict lookup: RequestClass(n) costs ~0.35 µs
            if klass is None:
                raise InternalError(f"a frontend worker sent an unknown request class {record[9]!r}")
            if spec.parity is not None:
                # A coding group encodes its members' inputs after they may have been answered (and
                # their slots reused): a parity model's requests keep a copy of their own.
                arrays = tuple(a.copy() for a in arrays)
            # on_finish: one partial per worker, not a closure per request
            req = InferenceRequest(spec, arrays, samples, arrival, deadline, priority, rank, client_id,
                                   w.on_finish, rid, klass=klass, give_up_at=give_up_at)
            w.requests[rid] = req
            self.gateway.submit(req, current=True)  # (resolved above, nothing awaited since)
        except EscapementError as e:
            w.requests.pop(rid, None)
            if e.status == 500:
                log.error("frontend worker %d: %s", w.index, e.message)
            w.link.send([DONE, rid, e.status, e.message, retry_after_of(e), False, []])

    # A step's answers (ControllerService.answers): each worker's go out in one write when the
    # step's last is delivered, not a loop turn later (a call_soon and a turn of the loop each)
    def answers_begin(self) -> None:
        self._answering = True

    def answers_end(self) -> None:
        self._answering = False
        held = self._held
        if held:
            for link in held:
                link.flush()
            held.clear()

    def _answer(self, link: Link, record: list[Any]) -> None:
        if not self._answering:
            link.send(record)
        elif link.hold(record):
            self._held.append(link)

    def _finished(self, w: WorkerHandle, req: InferenceRequest) -> None:
        rid = req.context
        link = w.link
        if w.requests.pop(rid, None) is None or link is None:
            return  # its worker died meanwhile
        if req.ok:
            assert req.outputs is not None
            # shapes as tuples: msgpack writes them as arrays, without a list copy each
            outputs = [[a.shape, tensor_bytes(a)] for a in req.outputs]
            if req.reconstructed or req.cached or req.defaulted:
                self._answer(link, [DONE, rid, 200, "", None, req.reconstructed, outputs, req.cached, req.defaulted])
            else:  # (most answers: a record of three fields, not nine, to pack here and read there)
                self._answer(link, [ANSWER, rid, outputs])
        else:
            err: BaseException = req.error if req.error is not None else Cancelled("the request was cancelled")
            self._answer(link, [DONE, rid, status_of(err), message_of(err), retry_after_of(err), False, []])

    def _call(self, w: WorkerHandle, cid: int, kind: int, payload: Any) -> None:
        assert w.link is not None
        link = w.link
        self.forwarded += 1
        if kind == CALL_GRPC:
            method, blob, metadata, deadline = payload
            service = self._grpc_shadow
            assert service is not None

            async def answer_rpc() -> None:
                self._reply(link, cid, await answer_forwarded(service, method, blob, metadata, deadline))

            self._answer_call(w, cid, answer_rpc(), f"forwarded gRPC {method}")
            return
        if kind != CALL_HTTP:  # a socket op
            op, msg = payload
            if op == "infer":  # it names a shared-memory region or a user: answered here, where they are
                self._answer_call(w, cid, self._socket_infer(link, cid, msg), "forwarded socket infer")
                return
            if op in ASYNC_OPS:  # feedback: answered once committed
                self._answer_call(w, cid, self._socket_async(link, cid, op, msg), f"forwarded socket {op}")
                return
            try:
                self._reply(link, cid, [200, control_answer(self.gateway, op, msg), None])
            except EscapementError as e:
                self._reply(link, cid, [e.status, e.message, retry_after_of(e)])
            return
        method, path, query, headers, body = payload
        shadow = self._shadow
        assert shadow is not None

        async def answer() -> None:
            resp = await shadow.answer(Request(method, path, query, headers, body, keep_alive=True))
            self._reply(link, cid, [resp.status, resp.content_type, resp.headers, resp.body])

        self._answer_call(w, cid, answer(), f"forwarded {method} {path}")

    def _reply(self, link: Link, cid: int, payload: Any) -> None:
        """Answer a forwarded call; the catalog first if the call changed it (a load, an unload), so
        that the worker's next request sees what the answer says (records arrive in order)."""
        self._push_registry()
        link.send([REPLY, cid, payload])

    def _answer_call(self, w: WorkerHandle, cid: int, coro: Any, name: str) -> None:
        """Answer a forwarded call in a task of its own, which the worker's ABORT or death cancels."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        w.calls[cid] = task

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.discard(t)
            if w.calls.get(cid) is t:
                del w.calls[cid]

        task.add_done_callback(done)

    async def _socket_infer(self, link: Link, cid: int, msg: dict[str, Any]) -> None:
        try:
            self._reply(link, cid, [200, await infer_answer(self.gateway, msg), None])
        except Exception as e:  # every failure is answered: the worker waits for this reply
            if not isinstance(e, EscapementError):
                log.exception("a forwarded socket infer failed")
            self._reply(link, cid, [status_of(e), message_of(e), retry_after_of(e)])

    async def _socket_async(self, link: Link, cid: int, op: str, msg: dict[str, Any]) -> None:
        try:
            self._reply(link, cid, [200, await async_answer(self.gateway, op, msg), None])
        except Exception as e:  # every failure is answered: the worker waits for this reply
            if not isinstance(e, EscapementError):
                log.exception("a forwarded socket %s failed", op)
            self._reply(link, cid, [status_of(e), message_of(e), retry_after_of(e)])

    # ---------------------------------------------------------------- what workers are told

    def _state(self) -> list[Any]:
        o = self.gateway.overload
        h = self.gateway.health()
        return [STATE, o.overloaded, o.lag_s, h.ready, h.lost_devices]

    def sync_catalog(self) -> None:
        """Send the workers the catalog now if it changed, not at the next tick: READY=1 follows (after
        a reload), and a client that saw it must not find a worker still saying LOADING: the record is
        on each worker's link before that client can connect (the tick alone left a 5 ms window)."""
        self._push_registry()

    def worker_seen(self, w: WorkerHandle, generation: int) -> None:
        """Worker `w` answers from the catalog of `generation` (its SEEN)."""
        w.seen = max(w.seen, generation)
        self._seen.set()

    async def catalog_seen(self, limit_s: float) -> bool:
        """Wait until every live worker answers from the catalog as it is now (sent by
        `sync_catalog`), at most `limit_s` seconds: READY=1 after a reload follows, and a client that
        saw it must not find a worker still saying LOADING (a record on a worker's link is not yet
        read: the worker may accept that client's connection and answer it first). False if a
        worker had not said so in time."""
        self._push_registry()
        want = self._generation
        deadline = time.monotonic() + limit_s
        while True:
            if all(w is None or w.link is None or w.seen >= want for w in self.workers):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._seen.clear()
            try:
                await asyncio.wait_for(self._seen.wait(), left)
            except TimeoutError:
                pass

    def _push_registry(self) -> None:
        """The catalog and the shared-memory registry, to every worker, each if it changed."""
        regions = self.gateway.shared_memory
        if regions.generation != self._regions_generation:
            self._regions_generation = regions.generation
            self._send_all([REGIONS, regions.snapshot()])
        gen = self.gateway.catalog.generation
        if gen == self._generation:
            return
        self._generation = gen
        self._send_all([MODELS, catalog_snapshot(self.gateway), gen])

    def _send_all(self, record: list[Any]) -> None:
        for w in self.workers:
            if w is not None and w.link is not None:
                w.link.send(record)

    def _schedule_tick(self) -> None:
        self._tick = asyncio.get_running_loop().call_later(STATE_TICK_S, self._on_tick)

    def _on_tick(self) -> None:
        """Push what changed: the catalog (by its generation), overload and health."""
        self._push_registry()
        state = self._state()
        key = (state[1], state[3], tuple(sorted(state[4].items())))
        links = [w.link for w in self.workers if w is not None and w.link is not None]
        if key != self._sent:
            self._sent = key
            for link in links:
                link.send(state)
        self._schedule_tick()

    # ---------------------------------------------------------------- failures

    def _wedged(self, w: WorkerHandle) -> None:
        log.error("frontend worker %d stopped reading its link; killing it", w.index)
        with contextlib.suppress(ProcessLookupError):
            w.proc.kill()

    def _on_lost(self, w: WorkerHandle) -> None:
        """The worker's link closed: it died (or is exiting). Cancel what it had in flight here
        (nothing reads its region after that but requests already on a device, which keep it
        mapped), reap it off the loop and, unless the daemon is stopping, start another."""
        w.link = None
        self._seen.set()  # (a wait for every worker's SEEN no longer waits for this one)
        requests, w.requests = list(w.requests.values()), {}
        for req in requests:
            self.gateway.cancel(req)
        calls, w.calls = list(w.calls.values()), {}
        for task in calls:
            task.cancel()  # nobody is left to read their answers
        if not w.ready.done():
            w.ready.set_exception(RuntimeError(f"frontend worker {w.index} exited before it was ready"))
            w.ready.exception()  # retrieved: start() or the restart reports it
        task = asyncio.get_running_loop().create_task(self._reap_and_restart(w, len(requests)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap_and_restart(self, w: WorkerHandle, cancelled: int) -> None:
        code = await asyncio.to_thread(_reap, w.proc, WORKER_EXIT_S)
        if self._stopping:
            return
        log.error("frontend worker %d (pid %d) exited with status %s; %d request(s) it held cancelled; "
                  "restarting it", w.index, w.proc.pid, code, cancelled)
        early = w.ready.exception() is not None  # it died before READY (its future failed in _on_lost)
        self._early_deaths[w.index] = self._early_deaths[w.index] + 1 if early else 0
        if self._early_deaths[w.index] >= MAX_EARLY_DEATHS:
            log.critical("frontend worker %d died %d times before it was ready; stopping", w.index, MAX_EARLY_DEATHS)
            self.on_fatal()
            return
        if self._early_deaths[w.index]:
            await asyncio.sleep(min(BACKOFF_S[0] * 2 ** (self._early_deaths[w.index] - 1), BACKOFF_S[1]))
        if self._stopping:
            return
        self.restarts += 1
        await self._start_worker(w.index)

    # ---------------------------------------------------------------- shutdown

    async def stop_listening(self) -> None:
        """The workers close their listeners; the socket path and the reserved port go."""
        self._stopping = True
        for w in self.workers:
            if w is not None and w.link is not None:
                w.link.send([DRAIN])
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.settings.server.socket)
        for reserved in (self._reserved, self._reserved_grpc):
            if reserved is not None:
                reserved.close()
        self._reserved = self._reserved_grpc = None

    async def close(self) -> None:
        """After the drain: the workers write the answers they got and exit (SIGKILL past WORKER_EXIT_S)."""
        self._stopping = True
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        live = [w for w in self.workers if w is not None]
        for w in live:
            if w.link is not None:
                w.link.send([STOP])
        codes = await asyncio.gather(*[asyncio.to_thread(_reap, w.proc, WORKER_EXIT_S) for w in live])
        for w, code in zip(live, codes, strict=True):
            if code is None:
                log.warning("[shutdown] frontend worker %d did not exit in %g s; killed", w.index, WORKER_EXIT_S)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w is not None]


def _reserve_port(host: str, port: int) -> socket.socket:
    """Bind HOST:PORT with SO_REUSEPORT, never listening: workers bind it too, and take connections.

    SO_REUSEPORT would let any process of the same user join the port (another daemon started on
    it would share its connections): a plain bind first (SO_REUSEADDR only, so that connections
    left in TIME_WAIT by a previous run do not count) fails while anything listens there, our
    workers' group included, and picks the port for `:0`."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)  # OSError (address in use) while another listener holds it
        addr = probe.getsockname()
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait for a worker to exit (in a thread); SIGKILL it past `timeout`. Its status, None if killed."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
