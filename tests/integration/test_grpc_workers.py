"""gRPC served by frontend worker processes (server.frontend_workers > 0): the gRPC conformance
tests of test_grpc.py and test_shared_memory.py run unchanged through workers (the unmodified
tritonclient[grpc], sync and aio); cancellation and deadlines reach the controller process; a
worker killed under gRPC load is restarted and its RPCs fail cleanly; a shutdown answers the RPCs
it accepted; a forwarded request (one naming a shared-memory region its worker cannot open) is
cancelled in the controller process when its client goes away (socket and gRPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from tritonclient.utils import InferenceServerException

from daemon.client import AsyncSocketClient, ShmInput, SocketClient
from tests.integration.test_frontend_workers import BROKEN_MODELS, _alive, _fault, _until
from tests.integration.test_grpc import (  # noqa: F401 - run again here, through frontend workers
    test_every_datatype_raw_and_typed,
    test_repository_index_load_unload,
    test_tritonclient_aio_concurrent,
    test_tritonclient_errors_map_to_grpc_codes,
    test_tritonclient_sync_health_metadata_config_and_infer,
)
from tests.integration.test_http import reference
from tests.integration.test_shared_memory import (  # noqa: F401 - served by the workers' region replicas
    _key,
    regions,
    test_regions_mix_with_bytes_on_many_inputs,
    test_tritonclient_grpc_inputs_and_outputs_in_shared_memory,
)
from tests.support import DaemonThread, settings, short_tmpdir


@contextlib.contextmanager
def _workers(repo: Path, workers: int, **server: object) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(repo, d, server={"frontend_workers": workers, "grpc": "127.0.0.1:0",
                                                **server})).start()
    try:
        yield dt
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def demo_grpc(demo_repo: Path) -> Iterator[DaemonThread]:
    with _workers(demo_repo, 2) as d:
        yield d


@pytest.fixture(scope="module")
def grpc_daemon(demo_grpc: DaemonThread) -> DaemonThread:
    return demo_grpc


@pytest.fixture(scope="module")
def test_grpc(test_repo: Path) -> Iterator[DaemonThread]:
    with _workers(test_repo, 1, max_body_bytes=256 * 1024) as d:
        yield d


@pytest.fixture(scope="module")
def typed_daemon(test_grpc: DaemonThread) -> DaemonThread:
    return test_grpc


def _cancelled(d: DaemonThread) -> int:
    return int(d.call(lambda: d.daemon.controller.scheduler.counters["cancelled"]))


def _pending(d: DaemonThread) -> int:
    return int(d.call(lambda: d.daemon.controller.scheduler.pending))


def _tiny(lib: object, x: np.ndarray) -> object:
    inp = lib.InferInput("INPUT__0", list(x.shape), "FP32")  # type: ignore[attr-defined]
    inp.set_data_from_numpy(x)
    return inp


@pytest.mark.expect_errors(BROKEN_MODELS)
def test_grpc_is_served_by_the_workers(test_grpc: DaemonThread) -> None:
    d = test_grpc
    fw = d.daemon.frontends
    assert fw is not None and d.daemon.grpc is None  # no gRPC server in the controller process
    assert fw.grpc_port == d.daemon.grpc_port and d.daemon.grpc_port
    c = tg.InferenceServerClient(d.grpc)
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(c.infer("tiny_pt2", [_tiny(tg, x)]).as_numpy("OUTPUT__0"), reference(x), rtol=1e-5)
    # statistics are the controller process's: forwarded whole, counting what the worker submitted
    stats = c.get_inference_statistics("tiny_pt2", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) >= 1
    c.close()


@pytest.mark.expect_errors(BROKEN_MODELS)
def test_cancelled_rpcs_and_deadlines_reach_the_controller(test_grpc: DaemonThread) -> None:
    d = test_grpc
    _fault(d, add_ms=400.0)  # every INFER holds the device 400 ms: the next request stays queued
    try:
        x = np.ones((1, 4), np.float32)

        async def main() -> None:
            c = tga.InferenceServerClient(d.grpc)
            try:
                first = asyncio.ensure_future(c.infer("tiny_pt2", [_tiny(tga, x)]))
                await asyncio.to_thread(_until, lambda: _pending(d) == 1)
                before = _cancelled(d)
                second = asyncio.ensure_future(c.infer("tiny_pt2", [_tiny(tga, x)]))
                await asyncio.to_thread(_until, lambda: _pending(d) == 2)
                second.cancel()  # the client cancels its RPC: the worker's CANCEL drops it in the controller
                await asyncio.to_thread(_until, lambda: _cancelled(d) == before + 1)
                # a gRPC deadline is the request's: one that cannot be met behind the running one fails
                with pytest.raises(InferenceServerException) as e:
                    await c.infer("tiny_pt2", [_tiny(tga, x)], client_timeout=0.15)
                assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED"
                np.testing.assert_allclose((await first).as_numpy("OUTPUT__0"), reference(x), rtol=1e-5)
            finally:
                await c.close()

        asyncio.run(main())
        assert d.wait_idle() == 0
        counters = d.call(lambda: dict(d.daemon.controller.scheduler.counters))
        assert counters.get("succeeded", 0) >= 1 and counters["cancelled"] >= 1
    finally:
        _fault(d, add_ms=0.0)


@pytest.mark.expect_errors(BROKEN_MODELS)
def test_forwarded_requests_are_cancelled_when_their_client_leaves(test_grpc: DaemonThread) -> None:
    """A request naming a region its worker cannot open (the object was unlinked after it was
    registered: only the controller process's descriptor reaches it) is forwarded and answered in
    the controller process; a socket client that disconnects, or a gRPC client that cancels,
    cancels it there (an ABORT record)."""
    d = test_grpc
    key = _key("fwd")
    path = Path("/dev/shm") / key.lstrip("/")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, np.ones((1, 4), np.float32).tobytes())
        with SocketClient(d.socket) as sc:
            sc.register_shared_memory("fwd", key, 16)
    finally:
        os.close(fd)
        path.unlink()  # registered, then gone from /dev/shm: no worker can open it by its key now
    _fault(d, add_ms=400.0)
    try:
        async def socket_client_leaves() -> None:
            before = _cancelled(d)
            c = AsyncSocketClient(d.socket)
            await c.connect()
            call = asyncio.ensure_future(c.infer("tiny_pt2", {"INPUT__0": ShmInput("fwd", 16, "FP32", [1, 4])}))
            await asyncio.to_thread(_until, lambda: _pending(d) == 1)
            await c.close()  # gone before its answer: the controller process cancels the request
            await asyncio.gather(call, return_exceptions=True)
            await asyncio.to_thread(_until, lambda: _cancelled(d) == before + 1)

        async def grpc_client_cancels() -> None:
            before = _cancelled(d)
            c = tga.InferenceServerClient(d.grpc)
            try:
                inp = tga.InferInput("INPUT__0", [1, 4], "FP32")
                inp.set_shared_memory("fwd", 16)
                call = asyncio.ensure_future(c.infer("tiny_pt2", [inp]))
                await asyncio.to_thread(_until, lambda: _pending(d) == 1)
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
                await asyncio.to_thread(_until, lambda: _cancelled(d) == before + 1)
            finally:
                await c.close()

        asyncio.run(socket_client_leaves())
        asyncio.run(grpc_client_cancels())
        assert d.wait_idle() == 0
    finally:
        _fault(d, add_ms=0.0)
        with SocketClient(d.socket) as sc:
            sc.unregister_shared_memory()


@pytest.mark.expect_errors(r"frontend worker \d \(pid \d+\) exited")
def test_a_worker_killed_under_grpc_load_is_restarted_and_its_rpcs_fail_cleanly(demo_repo: Path) -> None:
    with _workers(demo_repo, 2) as d:
        fw = d.daemon.frontends
        assert fw is not None
        victim = fw.pids()[0]
        x = np.zeros((1, 64), np.float32)
        stop = threading.Event()
        outcomes: dict[str, int] = {"ok": 0, "unavailable": 0}
        odd: list[BaseException] = []  # anything but UNAVAILABLE (the connection went) or an answer

        def load() -> None:
            while not stop.is_set():
                c = tg.InferenceServerClient(d.grpc)  # a new channel each round: it may land on either worker
                try:
                    for _ in range(20):
                        inp = tg.InferInput("INPUT__0", [1, 64], "FP32")
                        inp.set_data_from_numpy(x)
                        c.infer("digits_mlp", [inp], client_timeout=30)
                        outcomes["ok"] += 1
                except InferenceServerException as e:
                    if e.status() == "StatusCode.UNAVAILABLE":
                        outcomes["unavailable"] += 1
                    else:
                        odd.append(e)
                finally:
                    c.close()

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            _until(lambda: outcomes["ok"] >= 50)
            os.kill(victim, signal.SIGKILL)
            _until(lambda: fw.restarts >= 1 and victim not in fw.pids())
            _until(lambda: all(w is not None and w.ready.done() and w.ready.exception() is None
                               for w in fw.workers))
            before = outcomes["ok"]
            _until(lambda: outcomes["ok"] >= before + 50)  # still serving
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not odd, odd
        assert not _alive(victim)
        assert d.wait_idle() == 0  # what the dead worker had in flight was cancelled: nothing pending
        for _ in range(6):  # the restarted worker serves too (a new channel may land on either)
            c = tg.InferenceServerClient(d.grpc)
            inp = tg.InferInput("INPUT__0", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            assert c.infer("digits_mlp", [inp]).as_numpy("OUTPUT__0").shape == (1, 10)
            c.close()


@pytest.mark.expect_errors(BROKEN_MODELS)
def test_a_shutdown_answers_the_grpc_requests_workers_accepted(test_repo: Path) -> None:
    d = short_tmpdir()
    dt = DaemonThread(settings(test_repo, d, server={"grpc": "127.0.0.1:0", "http": "", "frontend_workers": 1}))
    dt.start()
    try:
        from daemon.runtime.faults import FaultSpec

        dt.call(dt.daemon.gateway.set_fault, "cpu:0", FaultSpec(add_ms=300))
        x = np.ones((1, 4), np.float32)

        async def main() -> np.ndarray:
            c = tga.InferenceServerClient(dt.grpc)
            try:
                call = asyncio.ensure_future(c.infer("tiny_pt2", [_tiny(tga, x)], timeout=5_000_000))
                await asyncio.to_thread(_until, lambda: _pending(dt) > 0)  # the controller holds it
                assert dt.loop is not None
                dt.loop.call_soon_threadsafe(dt.daemon.request_stop)
                return (await call).as_numpy("OUTPUT__0")
            finally:
                await c.close()

        np.testing.assert_allclose(asyncio.run(main()), reference(x), rtol=1e-5)
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)



@pytest.mark.expect_errors(BROKEN_MODELS)
def test_the_ports_workers_share_cannot_be_joined_by_another_daemon(test_grpc: DaemonThread) -> None:
    """Workers bind with SO_REUSEPORT, which any process of the same user could join: another
    daemon's reservation of the port fails while the workers listen on it (HTTP and gRPC)."""
    from daemon.frontends import _reserve_port

    for address in (test_grpc.grpc, test_grpc.http):
        with pytest.raises(OSError):
            _reserve_port("127.0.0.1", int(address.rsplit(":", 1)[1])).close()
