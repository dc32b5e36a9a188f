"""Overload: offered several times its capacity, the daemon stays live, refuses fast, keeps its memory
and keeps serving about as much as it can.

The daemon runs as a subprocess (its RSS is its own, and the load generator does not share its
GIL) with one CPU device slowed by an injected 5 ms per INFER and batches of one, so its capacity
is ~190 requests/s whatever the CI machine's CPU: a device that sleeps leaves both cores to the
event loop and the load generator. Requests carry 64 KiB each, so buffering that is not bounded
would show in RSS. The queue per model is bounded at 16 (controller.max_pending_per_model): 16
requests wait at most ~85 ms, inside the 100 ms SLO, and the rest must be refused at once with 503.

The test measures first (closed loop, 4 in flight: the device always busy, never overloaded),
then offers 4x that rate for 1.5 s, open loop, 3/4 over the socket and 1/4 over HTTP, while
probing /v2/health/live. Assertions leave room for a noisy 2-core CI machine; the figures are
printed and written to $ESCAPEMENT_RELIABILITY_OUT when set.
"""

from __future__ import annotations

import asyncio
import http.client
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

from tests.harness import DaemonProcess
from tests.reliability.helpers import FrameConnection, percentile, record, wide_repo, write_config
from tests.support import short_tmpdir

# It asserts latency percentiles and goodput in wall-clock time: `make test` runs it second.
pytestmark = pytest.mark.slow

WIDTH = 16384  # FP32 values per request: 64 KiB
SLO_S = 0.100
DEVICE_MS = 5.0
MAX_QUEUE = 16
CAPACITY_S = 1.0  # the closed-loop measurement
OVERLOAD_S = 1.5
OVERLOAD_FACTOR = 4
PROBE_EVERY_S = 0.02
MiB = 2**20


@pytest.fixture(scope="module", params=["bounded_queue", "default_limits"])
def overload_daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """bounded_queue: the configuration overload is meant to meet (refusals are 503s);
    default_limits: the shipped queue limits (2000 per model), where deadlines do the refusing."""
    d = short_tmpdir()
    repo = wide_repo(d / "repo", width=WIDTH, max_batch=1, slo_ms=SLO_S * 1e3)
    controller = {"max_pending_per_model": MAX_QUEUE} if request.param == "bounded_queue" else {}
    cfg = write_config(d / "c.toml", {
        "server": {"http": "127.0.0.1:0", "socket": str(d / "d.sock"), "log_level": "info"},
        "models": {"repository": str(repo)},
        "runtime": {"devices": ["cpu:0"], "warmup_reps": 3},
        "controller": controller,
    }, faults=[{"device": "cpu:0", "add_ms": DEVICE_MS}])
    proc = DaemonProcess.with_config(cfg, socket_path=str(d / "d.sock"))
    proc.scenario = request.param
    try:
        yield proc.start()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(d, ignore_errors=True)


class Tally:
    """Answers of one phase: (sent, answered, status) per request, from both frontends."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, float, int, str]] = []
        self.retry_after_missing = 0
        self.lost = 0  # sent, never answered
        self.doubled = 0  # answered more than once

    def add(self, sent: float, answered: float, status: int, frontend: str) -> None:
        self.rows.append((sent, answered, status, frontend))

    def goodput(self, window_s: float) -> float:
        """Answers that were successes within the deadline, per second of the window."""
        return sum(1 for s, a, st, _ in self.rows if st == 200 and a - s <= SLO_S) / window_s

    def latencies(self, status: int) -> list[float]:
        return [a - s for s, a, st, _ in self.rows if st == status]

    def statuses(self) -> dict[str, int]:
        return dict(Counter(f"{fe}_{st}" for _, _, st, fe in self.rows))


def socket_message(x: bytes) -> dict[str, Any]:
    return {"model": "wide", "timeout_us": int(SLO_S * 1e6), "inputs": [
        {"name": "INPUT__0", "datatype": "FP32", "shape": [1, WIDTH], "data": x}]}


def http_body(x: bytes) -> tuple[bytes, str]:
    header = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, WIDTH],
                                       "parameters": {"binary_data_size": len(x)}}],
                           "parameters": {"timeout": int(SLO_S * 1e6)}})
    return header + x, str(len(header))


async def closed_loop(path: str, x: bytes, in_flight: int, seconds: float) -> Tally:
    """`in_flight` requests at all times for `seconds`: the device is kept busy, never overloaded."""
    tally = Tally()
    conn = await FrameConnection().connect(path)
    end = time.monotonic() + seconds
    ids = iter(range(10**9))

    async def worker() -> None:
        while time.monotonic() < end:
            rid = next(ids)
            t = time.monotonic()
            a = await conn.call(rid, socket_message(x))
            tally.add(t, time.monotonic(), a["status"], "socket")

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    await conn.close()
    return tally


async def overload(dp: DaemonProcess, path: str, x: bytes, rate: float, seconds: float) -> tuple[Tally, list[float],
                                                                                                 list[int]]:
    """Open loop at `rate` requests/s for `seconds`; returns the answers, the liveness probes'
    latencies and RSS samples."""
    tally = Tally()
    conns = [await FrameConnection().connect(path) for _ in range(2)]
    body, header_len = http_body(x)
    url = f"http://{dp.http}/v2/models/wide/infer"
    probes: list[float] = []
    rss: list[int] = []
    n = int(rate * seconds)
    n_socket = sum(1 for i in range(n) if i % 4 != 3)  # every 4th request goes over HTTP
    done = asyncio.Event()
    answered = [0]

    def count(rid: Any, answer: dict[str, Any]) -> None:
        answered[0] += 1
        if answered[0] >= n_socket:
            done.set()

    for c in conns:
        c.on_answer = count

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as load, \
            aiohttp.ClientSession() as probe_session:
        stop = asyncio.Event()

        async def http_one() -> None:
            t = time.monotonic()
            async with load.post(url, data=body, headers={"Inference-Header-Content-Length": header_len}) as r:
                await r.read()
                if r.status == 503 and not r.headers.get("Retry-After"):
                    tally.retry_after_missing += 1
                tally.add(t, time.monotonic(), r.status, "http")

        async def prober() -> None:
            while not stop.is_set():
                t = time.monotonic()
                async with probe_session.get(f"http://{dp.http}/v2/health/live") as r:
                    assert r.status == 200
                    await r.read()
                probes.append(time.monotonic() - t)
                rss.append(dp.rss_bytes())
                try:
                    await asyncio.wait_for(stop.wait(), PROBE_EVERY_S)  # the probe's period
                except TimeoutError:
                    pass

        loop = asyncio.get_running_loop()
        probe_task = loop.create_task(prober())
        tasks: list[asyncio.Task[None]] = []
        t0 = loop.time()
        s = 0
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - loop.time()))  # pacing the offered load
            if i % 4 == 3:
                tasks.append(loop.create_task(http_one()))
            else:
                conns[s % 2].send(s, socket_message(x))
                s += 1
        await asyncio.gather(*tasks)
        await asyncio.wait_for(done.wait(), 30)
        stop.set()
        await probe_task
    for c in conns:
        tally.lost += len(set(c.sent) - set(c.answers))
        tally.doubled += sum(1 for got in c.answers.values() if len(got) > 1)
        for rid, got in c.answers.items():
            for t, a in got:
                tally.add(c.sent[rid], t, a["status"], "socket")
                if a["status"] == 503 and "retry_after_s" not in a:
                    tally.retry_after_missing += 1
        await c.close()
    return tally, probes, rss


def test_overload_keeps_the_daemon_live_fast_to_refuse_bounded_and_serving(overload_daemon: DaemonProcess) -> None:
    dp = overload_daemon
    path = dp.socket
    x = np.linspace(0, 1, WIDTH, dtype=np.float32).tobytes()

    async def run() -> dict[str, Any]:
        warm = await closed_loop(path, x, 1, 0.3)  # estimates learn the slowed device
        assert set(warm.statuses()) <= {"socket_200", "socket_504"}, warm.statuses()
        cap = await closed_loop(path, x, 4, CAPACITY_S)
        rss_before = dp.rss_bytes()
        log_before = len(dp.lines)
        rate = OVERLOAD_FACTOR * max(cap.goodput(CAPACITY_S), 50.0)
        over, probes, rss = await overload(dp, path, x, rate, OVERLOAD_S)
        return {"cap": cap, "rate": rate, "over": over, "probes": probes, "rss": rss, "rss_before": rss_before,
                "log_lines": len(dp.lines) - log_before}

    r = asyncio.run(run())
    cap: Tally = r["cap"]
    over: Tally = r["over"]
    assert dp.proc.poll() is None, "the daemon died under load:\n" + dp.log()[-4000:]
    rss_after = dp.rss_bytes()
    stats = get_json(dp, "/v2/controller/stats")
    shed = stats["loop"]["shed"]
    refused = stats["counters"].get("refused_overload", 0)
    refusals = over.latencies(503)
    goodput_cap = cap.goodput(CAPACITY_S)
    goodput_over = over.goodput(OVERLOAD_S)
    bounded = dp.scenario == "bounded_queue"
    figures = {
        "device_ms": DEVICE_MS, "slo_ms": SLO_S * 1e3, "max_queue_per_model": MAX_QUEUE if bounded else "default",
        "request_kib": WIDTH * 4 // 1024,
        "capacity_goodput_rps": round(goodput_cap, 1), "offered_rps": round(r["rate"], 1),
        "offered_requests": int(r["rate"] * OVERLOAD_S), "answered": len(over.rows), "lost": over.lost,
        "overload_s": OVERLOAD_S,
        "overload_goodput_rps": round(goodput_over, 1), "goodput_ratio": round(goodput_over / goodput_cap, 3),
        "statuses": over.statuses(), "refused_queue_full": refused, "shed_for_loop_lag": shed,
        "daemon_met_deadline_all_phases": stats["counters"].get("met_deadline", 0),
        "daemon_missed_deadline_all_phases": stats["counters"].get("missed_deadline", 0),
        "refusal_ms_p50": round(percentile(refusals, 0.5) * 1e3, 2),
        "refusal_ms_p99": round(percentile(refusals, 0.99) * 1e3, 2),
        "refusal_ms_max": round(max(refusals, default=float("nan")) * 1e3, 2),
        "deadline_504_ms_p50": round(percentile(over.latencies(504), 0.5) * 1e3, 2),
        "deadline_504_ms_p99": round(percentile(over.latencies(504), 0.99) * 1e3, 2),
        "ok_but_late": sum(1 for lat in over.latencies(200) if lat > SLO_S),
        "live_probes": len(r["probes"]), "live_ms_p50": round(percentile(r["probes"], 0.5) * 1e3, 2),
        "live_ms_p99": round(percentile(r["probes"], 0.99) * 1e3, 2),
        "live_ms_max": round(max(r["probes"]) * 1e3, 2),
        "rss_mib_before": round(r["rss_before"] / MiB, 1), "rss_mib_peak_sampled": round(max(r["rss"]) / MiB, 1),
        "rss_mib_after": round(rss_after / MiB, 1), "offered_mib": round(len(over.rows) * WIDTH * 4 / MiB, 1),
        "daemon_log_lines_during_overload": r["log_lines"],
    }
    record(f"overload_{dp.scenario}", figures)

    # Every request got exactly one answer, and only these kinds of answer.
    assert over.lost == 0 and over.doubled == 0 and len(over.rows) == int(r["rate"] * OVERLOAD_S)
    assert {k.split("_")[1] for k in over.statuses()} <= {"200", "503", "504"}, over.statuses()
    # Overload happened (most requests could not be served), and was answered explicitly.
    assert sum(1 for *_, st, _ in over.rows if st != 200) >= 0.3 * len(over.rows), "the load did not overload"
    assert over.retry_after_missing == 0  # every 503 says when to come back
    if bounded:
        # Refusing is cheap: far quicker than serving (a 5 ms device and a queue of up to ~85 ms).
        assert len(refusals) >= 0.3 * len(over.rows)
        assert percentile(refusals, 0.5) <= 0.025 and percentile(refusals, 0.99) <= 0.25
    # With the default limits the refusals are 504s that come only as each deadline nears (see
    # the figures): the queue bound is what makes refusals fast, so no latency bound is asserted.
    # Live all along, and answering quickly.
    assert len(r["probes"]) >= OVERLOAD_S / (PROBE_EVERY_S * 4)
    assert percentile(r["probes"], 0.5) <= 0.025 and max(r["probes"]) <= 0.5
    # Goodput does not collapse: at least half of what the daemon serves at its capacity.
    assert goodput_over >= 0.5 * goodput_cap, figures
    # Memory stays bounded: growth well under what was offered (a bounded queue holds 16 x 64 KiB).
    assert rss_after - r["rss_before"] <= 64 * MiB and max(r["rss"]) - r["rss_before"] <= 96 * MiB, figures


def get_json(dp: DaemonProcess, path: str) -> Any:
    c = http.client.HTTPConnection("127.0.0.1", dp.http_port or 0, timeout=30)
    try:
        c.request("GET", path)
        resp = c.getresponse()
        assert resp.status == 200
        return orjson.loads(resp.read())
    finally:
        c.close()


def test_after_overload_a_plain_request_succeeds(overload_daemon: DaemonProcess) -> None:
    """Runs after the overload test (same daemon): it has recovered, and serves right values."""
    x = np.linspace(0, 1, WIDTH, dtype=np.float32).tobytes()
    body, header_len = http_body(x)
    c = http.client.HTTPConnection("127.0.0.1", overload_daemon.http_port or 0, timeout=30)
    try:
        c.request("POST", "/v2/models/wide/infer", body=body, headers={"Inference-Header-Content-Length": header_len})
        resp = c.getresponse()
        out = orjson.loads(resp.read())
        assert resp.status == 200, out
        want = float(np.frombuffer(x, np.float32).mean())  # weights 1/width, bias 0: each output is the mean
        np.testing.assert_allclose(out["outputs"][0]["data"], [want] * 4, rtol=1e-4)
    finally:
        c.close()

