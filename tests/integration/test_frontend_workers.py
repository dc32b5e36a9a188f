"""Frontend worker processes (server.frontend_workers): the HTTP and socket conformance tests run
unchanged through workers, a worker killed under load, full shared-memory slots, a bounded shutdown.

The conformance tests are the ones of test_http.py and test_socket.py, imported here: pytest runs
them again with this module's `demo_daemon` / `test_daemon`, daemons whose listeners are owned by
frontend worker processes (2 for the demo models, 1 for the test repository).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from daemon.client import AsyncSocketClient, InferenceServerError, ShmInput, ShmOutput, SocketClient
from tests.integration.test_http import (  # noqa: F401 - run again here, through frontend workers
    error_of,
    raw,
    test_a_client_that_disconnects_mid_body_does_not_disturb_others,
    test_binary_request_body_and_selected_outputs,
    test_demo_models_reach_their_recorded_accuracy,
    test_every_datatype_over_json_and_binary,
    test_json_inference_like_curl,
    test_raw_binary_request_with_header_length_zero,
    test_server_and_model_endpoints,
    test_tritonclient_aio_concurrent,
    test_tritonclient_errors,
    test_tritonclient_sync_binary_and_json_both_ways,
)
from tests.integration.test_shared_memory import (  # noqa: F401 - the workers' region replicas serve these
    _key,
    regions,
    test_every_region_check_has_a_clear_error,
    test_socket_client_shared_memory,
    test_tritonclient_http_inputs_and_outputs_in_shared_memory,
)
from tests.integration.test_socket import (  # noqa: F401
    test_async_client_many_in_flight_on_one_connection,
    test_bad_frames_and_lying_lengths_do_not_disturb_other_clients,
    test_socket_file_mode,
    test_sync_client,
)
from tests.support import DaemonThread, settings, short_tmpdir

# ------------------------------------------------------------------ the wire through a worker
# (in process, tests/protocol/test_http_frontend.py checks the same without a daemon)


BIN_HEADER = (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], '
              b'"parameters": {"binary_data_size": 16}}]}')
JSON_HEADER = b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4]}]}'


@pytest.mark.parametrize(("body", "headers", "status", "needle"), [
    (b"{not json", {}, 400, "malformed JSON in the request body"),
    (b"[1, 2]", {}, 400, "must be a JSON object"),
    (b'{"inputs": []}', {}, 400, "inputs must be a non-empty list"),
    (b'{"inputs": [{"name": "INPUT__0"}]}', {}, 400, "needs a string name and datatype"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2]}]}', {}, 400,
     "2 values of data, but its shape needs 4"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4]}], '
     b'"outputs": [{"name": "nope"}]}', {}, 400, "unknown output 'nope'"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4]}], '
     b'"parameters": {"timeout": -5}}', {}, 400, "timeout must be an integer number of microseconds"),
    (b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [1,2,3,4]}], '
     b'"parameters": {"priority": "high"}}', {}, 400, "priority must be a non-negative integer"),
    (BIN_HEADER + b"\0" * 8, {"Inference-Header-Content-Length": str(len(BIN_HEADER))}, 400,
     "runs past the end of the body"),
    (b"{}", {"Inference-Header-Content-Length": "500"}, 400, "outside the body of 2 bytes"),
    (b"{}", {"Inference-Header-Content-Length": "two"}, 400, "must be an integer"),
    (JSON_HEADER + b"xx", {"Inference-Header-Content-Length": str(len(JSON_HEADER))}, 400,
     "2 bytes of binary data follow the inputs unused"),
    (b"\0" * 15, {"Inference-Header-Content-Length": "0"}, 400, "15 bytes of data"),
])
def test_bad_requests_get_clear_json_errors(test_daemon: DaemonThread, body: bytes, headers: dict[str, str],
                                            status: int, needle: str) -> None:
    got_status, msg = error_of(raw(test_daemon, "POST", "/v2/models/tiny_pt2/infer", body, headers))
    assert got_status == status and needle in msg, msg


def test_routing_errors(test_daemon: DaemonThread) -> None:
    assert error_of(raw(test_daemon, "GET", "/v2/nothing")) == (404, "Not Found")
    assert error_of(raw(test_daemon, "GET", "/v2/models/tiny_pt2/versions/x")) == (404, "Not Found")
    assert error_of(raw(test_daemon, "GET", "/v2/models/tiny_pt2/infer")) == (405, "Method Not Allowed")
    assert error_of(raw(test_daemon, "GET", "/v2/models/nope")) == (404, "unknown model 'nope'")
    status, msg = error_of(raw(test_daemon, "POST", "/v2/repository/other/index", b""))
    assert status == 501 and "not supported" in msg


def test_a_body_over_the_limit_is_refused(test_daemon: DaemonThread) -> None:
    status, msg = error_of(raw(test_daemon, "POST", "/v2/models/tiny_pt2/infer", b"x" * (300 * 1024)))
    assert status == 413 and "max_body_bytes" in msg




@contextlib.contextmanager
def _workers(repo: Path, workers: int, **server: object) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(repo, d, server={"frontend_workers": workers, **server})).start()
    try:
        yield dt
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def demo_daemon(demo_repo: Path) -> Iterator[DaemonThread]:
    with _workers(demo_repo, 2) as d:
        yield d


@pytest.fixture(scope="module")
def test_daemon(test_repo: Path) -> Iterator[DaemonThread]:
    with _workers(test_repo, 1, max_body_bytes=256 * 1024) as d:
        yield d


def _until(predicate: object, timeout: float = 30.0) -> None:
    """Poll `predicate` (a callable) until it holds, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {predicate}")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _reset(e: BaseException) -> bool:
    """A connection reset or closed under the client (as geventhttpclient reports it, too)."""
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, OSError) or any(w in text for w in ("reset", "closed", "broken pipe", "refused"))


def _fault(d: DaemonThread, **spec: object) -> None:
    status, _, body = raw(d, "POST", "/v2/admin/faults", orjson.dumps({"device": "cpu:0", **spec}),
                          {"Content-Type": "application/json"})
    assert status == 200, body


def test_workers_own_the_listeners_and_forward_the_rest(test_daemon: DaemonThread) -> None:
    fw = test_daemon.daemon.frontends
    assert fw is not None and len(fw.pids()) == 1 and all(_alive(p) for p in fw.pids())
    assert test_daemon.daemon.http is None and test_daemon.daemon.socket is None  # nothing listens here
    # statistics and metrics are the controller's: forwarded whole, and they count the workers' requests
    x = np.ones((1, 4), np.float32)
    with SocketClient(test_daemon.socket) as c:
        c.infer("tiny_pt2", {"INPUT__0": x})
        assert c.call({"op": "stats"})["controller"]["counters"]["succeeded"] >= 1
    status, _, body = raw(test_daemon, "GET", "/metrics")
    assert status == 200 and b"escapement_" in body
    assert orjson.loads(raw(test_daemon, "GET", "/v2/controller/stats")[2])["counters"]["succeeded"] >= 1


def test_workers_serve_shared_memory_requests_themselves(test_daemon: DaemonThread,
                                                        regions: list[shm.SharedMemoryRegion]) -> None:  # noqa: F811
    """A request naming regions is read and written by the worker (its replica of the registry): the
    controller process sees an ordinary SUBMIT, no forwarded call; an unregistered region is gone
    for the next request."""
    fw = test_daemon.daemon.frontends
    assert fw is not None
    key_in, key_out = _key("w_in"), _key("w_out")
    hin = shm.create_shared_memory_region("w_in", key_in, 16)
    regions.append(hin)
    hout = shm.create_shared_memory_region("w_out", key_out, 16)
    regions.append(hout)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    shm.set_shared_memory_region(hin, [x])
    hc = th.InferenceServerClient(test_daemon.http)
    with SocketClient(test_daemon.socket) as c:
        c.register_shared_memory("w_in", key_in, 16)
        c.register_shared_memory("w_out", key_out, 16)
        try:
            want = c.infer("tiny_pt2", {"INPUT__0": x}).outputs["OUTPUT__0"]
            before = test_daemon.call(lambda: fw.forwarded)
            for _ in range(3):
                r = c.infer("tiny_pt2", {"INPUT__0": ShmInput("w_in", 16, "FP32", [1, 4])},
                            outputs=[ShmOutput("OUTPUT__0", "w_out", 16)])
                assert r.outputs == {} and r.in_regions["OUTPUT__0"]["shape"] == list(want.shape)
                got = shm.get_contents_as_numpy(hout, np.float32, list(want.shape))
                np.testing.assert_array_equal(got, want)
            inp = th.InferInput("INPUT__0", [1, 4], "FP32")
            inp.set_shared_memory("w_in", 16)
            np.testing.assert_array_equal(hc.infer("tiny_pt2", [inp]).as_numpy("OUTPUT__0"), want)
            assert test_daemon.call(lambda: fw.forwarded) == before  # none of them went to the controller whole
            c.unregister_shared_memory("w_in")
            with pytest.raises(InferenceServerError, match="no shared-memory region named 'w_in'") as e:
                c.infer("tiny_pt2", {"INPUT__0": ShmInput("w_in", 16, "FP32", [1, 4])})
            assert e.value.status == 404
        finally:
            c.unregister_shared_memory()
            hc.close()


@pytest.mark.expect_errors(r"frontend worker \d \(pid \d+\) exited")
def test_a_worker_killed_under_load_is_restarted_and_nothing_leaks(demo_repo: Path) -> None:
    with _workers(demo_repo, 2) as d:
        fw = d.daemon.frontends
        assert fw is not None
        victim = fw.pids()[0]
        x = np.zeros((1, 64), np.float32)
        stop = threading.Event()
        outcomes: dict[str, int] = {"ok": 0}
        odd: list[BaseException] = []  # anything but a 503 or a reset connection

        def load() -> None:
            while not stop.is_set():
                try:
                    c = th.InferenceServerClient(d.http, network_timeout=30)
                    for _ in range(20):
                        inp = th.InferInput("INPUT__0", [1, 64], "FP32")
                        inp.set_data_from_numpy(x)
                        c.infer("digits_mlp", [inp])
                        outcomes["ok"] += 1
                    c.close()
                except InferenceServerException as e:
                    if e.status() not in ("503", None):  # an answer must say why: only 503 may come of it
                        odd.append(e)
                except Exception as e:  # the killed worker's connections reset: a clean failure
                    if not _reset(e):
                        odd.append(e)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        _until(lambda: outcomes["ok"] >= 50)
        os.kill(victim, signal.SIGKILL)
        _until(lambda: fw.restarts >= 1 and victim not in fw.pids())
        _until(lambda: all(w is not None and w.ready.done() and w.ready.exception() is None for w in fw.workers))
        before = outcomes["ok"]
        _until(lambda: outcomes["ok"] >= before + 50)  # still serving, through both workers
        stop.set()
        for t in threads:
            t.join(30)
        assert not odd, odd
        assert not _alive(victim)
        assert d.wait_idle() == 0  # what the dead worker had in flight was cancelled: nothing pending
        # the restarted worker serves (a fresh connection may land on either)
        for _ in range(10):
            c = th.InferenceServerClient(d.http)
            inp = th.InferInput("INPUT__0", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            assert c.infer("digits_mlp", [inp]).as_numpy("OUTPUT__0").shape == (1, 10)
            c.close()


BROKEN_MODELS = "is not served"  # the test repository's broken entries, logged when a daemon starts


@pytest.mark.expect_errors(BROKEN_MODELS)
def test_full_shared_memory_slots_refuse_with_503(test_repo: Path) -> None:
    # one worker with 2 slots (one of 16 KiB, one of 1 MiB); every INFER takes 300 ms longer
    with _workers(test_repo, 1, frontend_slots=1, max_body_bytes=256 * 1024) as d:
        _fault(d, add_ms=300.0)
        xs = [np.full((1, 4), i, np.float32) for i in range(8)]

        async def main() -> list[object]:
            async with AsyncSocketClient(d.socket) as c:
                return await asyncio.gather(*(c.infer("tiny_pt2", {"INPUT__0": x}) for x in xs),
                                            return_exceptions=True)

        answers = asyncio.run(main())
        refused = [a for a in answers if isinstance(a, InferenceServerError)]
        assert len(refused) == 6, answers  # two held the slots for 300 ms; the others found none
        assert all(e.status == 503 and "shared-memory slots" in e.message for e in refused)
        assert sum(1 for a in answers if not isinstance(a, BaseException)) == 2
        status, _, _ = raw(d, "DELETE", "/v2/admin/faults/cpu:0")
        assert status == 200
        with SocketClient(d.socket) as c:  # the slots were freed: served again
            assert c.infer("tiny_pt2", {"INPUT__0": xs[0]}).outputs["OUTPUT__0"].shape == (1, 3)
        assert d.wait_idle() == 0


@pytest.mark.expect_errors(BROKEN_MODELS)
@pytest.mark.slow  # bounds the drain in wall-clock time
def test_shutdown_with_workers_answers_what_was_accepted_and_is_bounded(test_repo: Path) -> None:
    d_dir = short_tmpdir()
    d = DaemonThread(settings(test_repo, d_dir, server={"frontend_workers": 2})).start()
    try:
        fw = d.daemon.frontends
        assert fw is not None
        pids = fw.pids()
        _fault(d, add_ms=200.0)
        answers: list[object] = []

        async def main() -> None:
            async with AsyncSocketClient(d.socket) as c:
                tasks = [asyncio.ensure_future(c.infer("tiny_pt2", {"INPUT__0": np.ones((1, 4), np.float32)}))
                         for _ in range(4)]
                await asyncio.sleep(0)
                answers.extend(await asyncio.gather(*tasks, return_exceptions=True))

        t = threading.Thread(target=lambda: asyncio.run(main()))
        t.start()
        # all four accepted before the stop (one pending was not enough: on a loaded machine the
        # others were still in a worker, and were rightly refused as the daemon shut down)
        _until(lambda: d.call(lambda: d.daemon.controller.scheduler.counters["admitted"]) >= 4)
        begun = time.monotonic()
        d.stop()
        took = time.monotonic() - begun
        t.join(30)
        assert took < 10.0  # drain (requests of 200 ms) + workers' exit, not a timeout
        assert len(answers) == 4 and all(not isinstance(a, BaseException) for a in answers), answers
        assert not any(_alive(p) for p in pids)
        assert not Path(d.socket).exists()
    finally:
        d.stop()
        shutil.rmtree(d_dir, ignore_errors=True)
