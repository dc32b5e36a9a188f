"""The gateway as a frontend worker process sees it: the controller is at the other end of a link.

`RemoteGateway` is a `Gateway` whose controller is a `RemoteController`: the frontends in the
worker (HTTP, the socket) use it exactly as they use the local one. What a worker answers itself:
admission (from its replica of the catalog and the controller's overload flag, both pushed over
the link), the request's deadline and class (`new_request`: CLOCK_MONOTONIC is the same clock in
every process) and health. Submitting writes the request's inputs into a shared-memory slot and
sends a small SUBMIT record; the DONE record answers it. Everything else (statistics, metrics,
management) is forwarded whole to the controller process with a CALL (daemon/api/worker.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from typing import Any

import numpy as np

from daemon.api.budget import RequestMemory
from daemon.api.link import ABORT, CALL, CANCEL, SUBMIT, Link
from daemon.api.sharedmem import RegionReplica
from daemon.api.slots import ALIGN, SlotPool, packed_size
from daemon.apps.cache import PredictionCache
from daemon.catalog import ModelCatalog, ModelState
from daemon.config import Settings
from daemon.errors import (
    BadRequest,
    Cancelled,
    Conflict,
    DeadlineExceeded,
    EscapementError,
    Forbidden,
    InternalError,
    NotFound,
    NotImplementedByServer,
    Overloaded,
    PayloadTooLarge,
    Unavailable,
)
from daemon.gateway import Gateway, Health
from daemon.overload import LagTracker
from daemon.request import InferenceRequest, RequestStatus

log = logging.getLogger("escapement.workers")

_BY_STATUS: dict[int, type[EscapementError]] = {
    400: BadRequest, 403: Forbidden, 404: NotFound, 409: Conflict, 413: PayloadTooLarge, 499: Cancelled,
    500: InternalError, 501: NotImplementedByServer, 503: Unavailable, 504: DeadlineExceeded}


def error_from(status: int, message: str, retry_after_s: float | None) -> EscapementError:
    """The error an answer's status and message stand for (the controller's, rebuilt here)."""
    if status == 503:
        return Overloaded(message, retry_after_s) if retry_after_s is not None else Unavailable(message)
    cls = _BY_STATUS.get(status)
    if cls is None:
        err = EscapementError(message)
        err.status = status
        return err
    return cls(message)


def catalog_from(snapshot: bytes) -> ModelCatalog:
    """A catalog replica from the controller's snapshot (daemon/frontends.py catalog_snapshot)."""
    entries, broken = pickle.loads(snapshot)  # our own controller process, over a private socketpair
    catalog = ModelCatalog()
    for spec, state, reason in entries:
        catalog.add(spec, ModelState(state))
        if reason:
            catalog.set_state(spec, ModelState(state), reason)
    for name, reason in broken.items():
        catalog.set_broken(name, reason)
    return catalog


class RemoteController:
    """Submit and cancel over the link; tensors through the slot pool (`buf`, the shared region)."""

    def __init__(self, link: Link, pool: SlotPool, buf: memoryview) -> None:
        self.link = link
        self.pool = pool
        self.buf = buf
        self.inflight: dict[int, tuple[InferenceRequest, int]] = {}  # request id -> (request, slot)
        self.calls: dict[int, asyncio.Future[Any]] = {}
        self._cids = itertools.count(1)
        self.lost = False

    def submit(self, req: InferenceRequest) -> None:
        if self.lost:
            raise Unavailable("the daemon's controller process is gone; retry")
        sizes = [a.nbytes for a in req.inputs]
        need = packed_size(sizes)
        slot = self.pool.alloc(need)
        if slot is None:
            if not self.pool.fits(need):
                raise PayloadTooLarge(f"the request's tensors take {need} bytes, more than the largest shared-memory "
                                      f"slot ({self.pool.class_sizes[-1]} bytes)")
            raise Overloaded(f"this frontend worker's {len(self.pool.offsets)} shared-memory slots are all in use "
                             "(server.frontend_slots); retry later", retry_after_s=1.0)
        offset = self.pool.offsets[slot]
        refs: list[list[Any]] = []
        try:
            for a in req.inputs:
                if a.dtype == object:
                    raise NotImplementedByServer("BYTES inputs cannot go through frontend workers yet")
                np.ndarray(a.shape, a.dtype, buffer=self.buf, offset=offset)[...] = a  # the one copy
                refs.append([offset, list(a.shape)])
                offset += (a.nbytes + ALIGN - 1) // ALIGN * ALIGN
        except BaseException:
            self.pool.free(slot)
            raise
        spec = req.model
        self.inflight[req.id] = (req, slot)
        self.link.send([SUBMIT, req.id, spec.name, spec.version, req.samples, req.arrival, req.deadline, req.priority,
                        req.rank, int(req.klass), req.give_up_at, req.client_id, refs])

    def cancel(self, req: InferenceRequest) -> None:
        if req.id in self.inflight:
            self.link.send([CANCEL, req.id])  # its DONE still comes, and frees the slot

    def done(self, rid: int, status: int, error: str, retry_after_s: float | None, reconstructed: bool,
             outputs: list[list[Any]], cached: bool = False, defaulted: bool = False) -> None:
        item = self.inflight.pop(rid, None)
        if item is None:
            return
        req, slot = item
        self.pool.free(slot)  # the controller is done with the inputs: DONE is sent after they were copied
        if status == 200:
            specs = req.model.outputs  # a list, then a tuple: a generator costs a frame per request
            req.outputs = tuple([np.frombuffer(data, dtype=s.datatype.numpy).reshape(shape)
                                 for s, (shape, data) in zip(specs, outputs, strict=False)])
            req.status = RequestStatus.SUCCEEDED
        else:
            req.error = error_from(status, error, retry_after_s)
            req.status = RequestStatus.CANCELLED if status == 499 else RequestStatus.FAILED
        req.reconstructed = reconstructed
        req.cached = cached
        req.defaulted = defaulted
        self._finish(req)

    @staticmethod
    def _finish(req: InferenceRequest) -> None:
        if req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception:
                log.exception("answering request %d failed", req.id)

    async def call(self, kind: int, payload: Any) -> Any:
        """Ask the controller process to answer something (an HTTP request, a socket op)."""
        if self.lost:
            raise Unavailable("the daemon's controller process is gone; retry")
        cid = next(self._cids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls[cid] = fut
        self.link.send([CALL, cid, kind, payload])
        try:
            return await fut
        except asyncio.CancelledError:
            # the client left or its deadline passed: what answers it in the controller stops too
            if fut.cancelled() or not fut.done():  # (awaiting it, the future was cancelled with us)
                self.link.send([ABORT, cid])
            raise
        finally:
            self.calls.pop(cid, None)

    def reply(self, cid: int, payload: Any) -> None:
        fut = self.calls.get(cid)
        if fut is not None and not fut.done():
            fut.set_result(payload)

    def controller_lost(self) -> None:
        """The link closed: every request in flight fails (503), and calls with it."""
        self.lost = True
        inflight, self.inflight = self.inflight, {}
        for req, slot in inflight.values():
            self.pool.free(slot)
            req.error = Unavailable("the daemon's controller process went away; retry")
            req.status = RequestStatus.FAILED
            self._finish(req)
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(Unavailable("the daemon's controller process went away; retry"))


class RemoteGateway(Gateway):
    """A Gateway over a RemoteController, with the catalog, health and overload pushed to it."""

    def __init__(self, settings: Settings, catalog: ModelCatalog, controller: RemoteController,
                 workers: int) -> None:
        s = settings.server
        share = s.connection_share
        super().__init__(settings, catalog, controller, overload=LagTracker(s.shed_lag_ms / 1000.0),
                         request_memory=RequestMemory(max(s.request_memory_bytes // max(workers, 1), share), share),
                         health=self._pushed_health,
                         # one prediction cache, the controller process's: one budget, one set of
                         # counters, and retired versions dropped where they are retired
                         cache=PredictionCache(0, 0, 0))
        self.remote = controller
        # the regions this worker serves itself, as the controller process pushes its registry
        self.regions = RegionReplica(settings.shared_memory)
        self.shared_memory = self.regions
        self.background: set[asyncio.Task[None]] = set()  # forwarded socket ops being answered
        self.health_state = Health(False)
        self.controller_overloaded = False
        self.controller_lag_s = 0.0

    def _pushed_health(self) -> Health:
        return self.health_state

    def admit(self, name: str, version: str | int | None) -> Any:
        if self.controller_overloaded:
            self.overload.shed += 1
            raise Overloaded(f"the daemon is overloaded: its controller's event loop is "
                             f"{self.controller_lag_s * 1e3:.0f} ms behind; retry later", retry_after_s=1.0)
        return super().admit(name, version)

    def _controller_only(self) -> Unavailable:
        return Unavailable("this is answered by the controller process (a frontend worker forwards it)")

    def statistics(self) -> dict[str, Any]:
        raise self._controller_only()

    def model_statistics(self, name: str | None = None, version: str | int | None = None) -> list[dict[str, Any]]:
        raise self._controller_only()

    def metrics(self) -> bytes:
        raise self._controller_only()
