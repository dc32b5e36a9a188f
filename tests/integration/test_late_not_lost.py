"""Late rather than lost, on a real daemon: a burst far past a slowed device's capacity, from
clients that set no timeout, is answered whole (late ones counted); the same burst with client
timeouts is refused and dropped as a hard deadline asks."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from daemon.client import AsyncSocketClient, InferenceServerError
from daemon.runtime.faults import FaultSpec
from tests.support import DaemonThread, settings, short_tmpdir

BURST = 120  # requests at once: 15 batches of 8 at >= 100 ms each (the fault), past the 1 s SLO
MODEL = "tiny_pt2"


def _by_class(dt: DaemonThread) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://{dt.http}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("escapement_requests_by_class_total{") and f'model="{MODEL}"' in line:
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["class"].strip('"'), labels["outcome"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


async def _burst(path: str, timeout_us: int | None) -> list[str]:
    async with AsyncSocketClient(path) as c:
        x = np.ones((1, 4), np.float32)

        async def one() -> str:
            try:
                await c.infer(MODEL, {"INPUT__0": x}, timeout_us=timeout_us)
                return "ok"
            except InferenceServerError as e:
                return str(e.status)

        return await asyncio.gather(*(one() for _ in range(BURST)))


@pytest.mark.expect_errors("is not served")  # (the test repository holds broken models on purpose)
def test_a_burst_without_timeouts_is_answered_whole_and_with_timeouts_is_refused(test_repo: Path) -> None:
    d = short_tmpdir()
    # the burst takes ~1.5 s of device time: the last requests cannot make the model's 1 s SLO
    dt = DaemonThread(settings(test_repo, d, controller={"batch_wait_ms": 0.0}))
    dt.start()
    try:
        dt.call(dt.daemon.gateway.set_fault, "cpu:0", FaultSpec(add_ms=100))
        soft = asyncio.run(_burst(dt.socket, None))
        assert soft == ["ok"] * BURST  # nobody lost: the ones that missed the SLO were answered late
        counts = _by_class(dt)
        assert counts.get(("target", "on_time"), 0) + counts.get(("target", "late"), 0) == BURST
        assert counts.get(("target", "late"), 0) > 0, counts  # the burst did outrun the SLO
        hard = asyncio.run(_burst(dt.socket, 50_000))  # 50 ms: a hard deadline most of the burst cannot meet
        assert hard.count("ok") < BURST and set(hard) <= {"ok", "503", "504"}
        assert _by_class(dt).get(("hard", "on_time"), 0) == hard.count("ok")
    finally:
        dt.stop()
