"""ParM end to end: a CPU device hangs, and requests it holds come back reconstructed in time."""

from __future__ import annotations

import asyncio
import http.client
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from daemon.client import AsyncSocketClient
from daemon.parity.datasets import digits_split
from tests.support import DaemonThread, parity_daemon_on_three_cpus


@pytest.fixture
def parity_daemon(demo_repo: Path) -> Iterator[DaemonThread]:
    """digits_mlp (with its k=2 parity model) preloaded on cpu:0 and cpu:1, the parity on cpu:2.
    A daemon per test: a hang leaves a device looking slow for a while, as it should."""
    with parity_daemon_on_three_cpus(demo_repo) as dt:
        yield dt


def call(dt: DaemonThread, method: str, path: str, body: object = None) -> tuple[int, object]:
    host, port = dt.http.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request(method, path, body=orjson.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, orjson.loads(r.read() or b"null")
    finally:
        c.close()


def test_requests_on_a_hung_device_come_back_reconstructed(parity_daemon: DaemonThread) -> None:
    dt = parity_daemon
    _, stats = call(dt, "GET", "/v2/controller/stats")
    assert stats["devices"]["cpu:2"]["models"] == ["digits_mlp.parity:1"]
    assert sorted(stats["devices"]["cpu:0"]["models"] + stats["devices"]["cpu:1"]["models"]) == ["digits_mlp:1"] * 2
    _, _, x, y = digits_split()
    status, _ = call(dt, "POST", "/v2/admin/faults", {"device": "cpu:0", "hang": True})
    assert status == 200

    async def load() -> list[object]:
        async with AsyncSocketClient(dt.socket) as c:
            async def one(i: int) -> object:
                await asyncio.sleep(i * 0.004)  # the first batch goes to cpu:0 (both free: by name)
                return await c.infer("digits_mlp", {"INPUT__0": x[i : i + 1]}, timeout_us=150_000)
            return await asyncio.gather(*(one(i) for i in range(40)), return_exceptions=True)

    results = asyncio.run(load())
    call(dt, "DELETE", "/v2/admin/faults/cpu:0")
    answered = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
    rebuilt = [(i, r) for i, r in answered if r.reconstructed]
    assert rebuilt, "requests stuck on the hung device were reconstructed"
    assert len(answered) >= 0.9 * len(results)
    # reconstructions are real predictions: mostly the right digit
    hits = sum(int(r.outputs["OUTPUT__0"].argmax() == y[i]) for i, r in rebuilt)
    assert hits >= 0.8 * len(rebuilt)
    assert dt.wait_idle() == 0
    _, stats = call(dt, "GET", "/v2/controller/stats")
    # decoded from the parity, or (for a group that did not fill in time) answered by a replica
    counters = stats["counters"]
    assert counters.get("reconstructions", 0) + counters.get("replica_answers", 0) == len(rebuilt)
    assert stats["coding"]["live_groups"] == 0 and stats["coding"]["tracked_actions"] == 0  # nothing leaked
    assert stats["telemetry"]["decode_time_ms"]["count"] == counters.get("reconstructions", 0)


def test_http_answers_say_when_they_were_reconstructed(parity_daemon: DaemonThread) -> None:
    dt = parity_daemon
    call(dt, "POST", "/v2/admin/faults", {"device": "cpu:0", "hang": True})
    _, _, x, _ = digits_split()
    body = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 64], "data": x[0].tolist()}],
            "parameters": {"timeout": 150_000}}

    async def burst() -> list[tuple[int, dict[str, object]]]:
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.run_in_executor(None, call, dt, "POST", "/v2/models/digits_mlp/infer",
                                                            body) for _ in range(40)))

    replies = asyncio.run(burst())
    call(dt, "DELETE", "/v2/admin/faults/cpu:0")
    flagged = [r for s, r in replies if s == 200 and (r.get("parameters") or {}).get("reconstructed") is True]
    _, stats = call(dt, "GET", "/v2/controller/stats")
    assert flagged, orjson.dumps([stats, [s for s, _ in replies]]).decode()
    assert sum(s == 200 for s, _ in replies) >= 0.9 * len(replies)
    assert all(np.argmax(r["outputs"][0]["data"]) == np.argmax(flagged[0]["outputs"][0]["data"]) for r in flagged)
    assert dt.wait_idle() == 0
