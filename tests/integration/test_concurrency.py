"""Many clients on both frontends at once against one daemon: every answer is the right one."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch
import tritonclient.http as th

from daemon.client import AsyncHttpClient, AsyncSocketClient, SocketClient
from tests.support import DaemonThread, TinyLinear


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

    threads = [threading.Thread(target=sync_socket_worker, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=tritonclient_worker, args=(10 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    asyncio.run(async_mix())
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    sched = test_daemon.daemon.controller.scheduler
    assert test_daemon.call(lambda: sched.pending) == 0
