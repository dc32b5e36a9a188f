"""Many clients on both frontends at once, and one misbehaving: every good request gets its own answer."""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import tritonclient.http as th

from daemon.client import AsyncHttpClient, AsyncSocketClient, SocketClient
from tests.support import DaemonThread, TinyLinear, settings, short_tmpdir


@pytest.fixture(scope="module")
def test_daemon(test_repo: Path) -> Iterator[DaemonThread]:
    """The daemon in this process, beside a dozen client threads that share its GIL: they, not the
    daemon, hold its loop back now and then, so load shedding (a 503 at 25 ms of loop lag) is off
    here; what is tested is that every answer is the right one."""
    d = short_tmpdir()
    try:
        with DaemonThread(settings(test_repo, d, server={"max_body_bytes": 256 * 1024, "shed_lag_ms": 0})) as dt:
            yield dt
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _frame(obj: object) -> bytes:
    p = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(p)) + p


def reference(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return TinyLinear()(torch.from_numpy(x)).numpy()


def test_concurrent_clients_on_both_frontends(test_daemon: DaemonThread) -> None:
    rng = np.random.default_rng(1)
    errors: list[BaseException] = []

    def check(x: np.ndarray, y: np.ndarray) -> None:
        np.testing.assert_allclose(y, reference(x), rtol=1e-4, atol=1e-5)

    def sync_socket_worker(seed: int) -> None:
        try:
            r = np.random.default_rng(seed)
            with SocketClient(test_daemon.socket) as c:
                for _ in range(40):
                    x = r.standard_normal((int(r.integers(1, 4)), 4)).astype(np.float32)
                    check(x, c.infer("tiny_ts", {"INPUT__0": x}).outputs["OUTPUT__0"])
        except BaseException as e:
            errors.append(e)

    def tritonclient_worker(seed: int) -> None:
        try:
            r = np.random.default_rng(seed)
            c = th.InferenceServerClient(test_daemon.http)
            for _ in range(40):
                x = r.standard_normal((int(r.integers(1, 4)), 4)).astype(np.float32)
                inp = th.InferInput("INPUT__0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=bool(seed % 2))
                check(x, c.infer("tiny_pt2", [inp]).as_numpy("OUTPUT__0"))
            c.close()
        except BaseException as e:
            errors.append(e)

    async def async_mix() -> None:
        xs = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(200)]
        async with AsyncSocketClient(test_daemon.socket) as s, AsyncHttpClient(test_daemon.http) as h:
            outs = await asyncio.gather(*(
                (s if i % 2 else h).infer("tiny_pt2", {"INPUT__0": x}) for i, x in enumerate(xs)))
        for x, r in zip(xs, outs, strict=True):
            check(x, r.outputs["OUTPUT__0"])

    stop = threading.Event()
    sabotage_rounds = [0]

    def saboteur() -> None:
        """Misbehaves on both frontends while the good clients have requests in flight."""
        host, port = test_daemon.http.split(":")
        good = _frame({"id": 1, "model": "tiny_pt2", "inputs": [
            {"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": b"\0" * 16}]})
        try:
            while not stop.is_set():
                for payload in (b"\x00\x00\x00\x03\xc1\xc1\xc1",        # not msgpack
                                b"\x00\x00\x10\x00" + b"\x80" * 10,       # lies about its length
                                b"\xff\xff\xff\xff",                       # over the limit
                                good * 10):                                  # then vanishes
                    s = socket.socket(socket.AF_UNIX)
                    s.connect(test_daemon.socket)
                    s.sendall(payload)
                    s.close()
                h = socket.create_connection((host, int(port)))
                h.sendall(b"POST /v2/models/tiny_pt2/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n{")
                h.close()
                h = socket.create_connection((host, int(port)))
                h.sendall(b"POST /v2/models/tiny_pt2/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{]]]]")
                h.recv(4096)
                h.close()
                sabotage_rounds[0] += 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=saboteur)]
    threads += [threading.Thread(target=sync_socket_worker, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=tritonclient_worker, args=(10 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    asyncio.run(async_mix())
    for t in threads[1:]:
        t.join(120)
    stop.set()
    threads[0].join(60)
    assert not errors, errors[0]
    assert sabotage_rounds[0] >= 1
    assert test_daemon.wait_idle() == 0  # every request answered or cancelled: none leaked
