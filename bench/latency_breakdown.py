"""Where a lone request's time goes at light load: the socket round trip of a null model at
100 req/s, one request at a time, with inclusive timers on the daemon's request path.

    python -m bench.latency_breakdown [--rate 100] [--seconds 4] [--workers 0] [--latency-path true]
        [--keep-warm off|spin|sleep]
    python -m bench.latency_breakdown --idle     (the same INFER in-process: hot, after sleeping, after spinning)

The daemon runs with bench/scenarios/_profile_hook on its path: each function of `TIMED` gets an
inclusive timer (perf_counter_ns; they run on the loop without blocking, so this is their CPU),
zeroed after a warm-up and read after the window. Prints, per function, calls and µs per request,
beside the round trip's p50 and the loop thread's CPU per request (from /proc schedstat). The
timers cost ~1 µs a call; the figures are shares of one path, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from bench import loadgen, results
from bench.scenarios.common import measure, spec_of
from bench.scenarios.ingest import MODEL, _build_repo
from bench.servers import Escapement

ROOT = Path(__file__).resolve().parent.parent
TIMED = (
    "daemon.api.uds:SocketConnection.data_received",
    "daemon.api.uds:parse_infer",
    "daemon.gateway:Gateway.new_request",
    "daemon.gateway:Gateway.submit",
    "daemon.controller.service:ControllerService._step",
    "daemon.controller.service:ControllerService._run_here",
    "daemon.controller.service:ControllerService._deliver",
    "daemon.runtime.executor:Executor.run_here",
    "daemon.runtime.backend:CpuBackend.infer",
    "daemon.api.uds:SocketConnection._finished",
    "daemon.overload:LoopMonitor._tick",
)


def _loop_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])


def idle_effect() -> None:
    """The null model's INFER through the CPU backend in this process: back to back, then after
    sleeping 1 and 10 ms, after spinning 10 ms, and after 10 ms in which the same INFER ran every
    0.1 or 1 ms (kept warm: what keeping the path hot between requests would buy, and cost);
    median µs each: what idleness alone costs."""
    import numpy as np

    from daemon.repository import scan
    from daemon.request import InferenceRequest
    from daemon.runtime.backend import CpuBackend
    from daemon.runtime.devices import Device
    from daemon.runtime.program import load_program

    repo = _build_repo(Path(tempfile.mkdtemp(prefix="latency-idle-")) / "repo")
    spec = next(s for s in scan(repo).models if s.name == MODEL)
    be = CpuBackend(Device("cpu:0", "cpu", 0, 1 << 30))
    be.thread_setup("here")
    res, _ = be.load(spec.key, load_program(spec), float("inf"))
    req = InferenceRequest(spec, (np.zeros((1, 784), np.float32),), 1, 0.0, 0.0)

    def one() -> int:
        t0 = time.perf_counter_ns()
        be.infer(res, res.io[1], lambda b: b.fill([req]), float("inf"))
        return time.perf_counter_ns() - t0

    def spin(s: float) -> None:
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            pass

    def kept_warm(period_s: float, total_s: float = 0.01) -> None:
        end = time.perf_counter() + total_s
        while time.perf_counter() < end:
            one()
            spin(period_s)

    for _ in range(300):
        one()
    cases = {"back to back": lambda: None, "after sleeping 1 ms": lambda: time.sleep(0.001),
             "after sleeping 10 ms": lambda: time.sleep(0.01), "after spinning 10 ms": lambda: spin(0.01),
             "after 10 ms running it every 0.1 ms": lambda: kept_warm(1e-4),
             "after 10 ms running it every 1 ms": lambda: kept_warm(1e-3)}
    for label, before in cases.items():
        times = []
        for _ in range(200):
            before()
            times.append(one())
        print(f"| {label} | {sorted(times)[len(times) // 2] / 1e3:.1f} µs |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.latency_breakdown")
    ap.add_argument("--idle", action="store_true", help="only the in-process INFER after idleness")
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--latency-path", default="true")
    ap.add_argument("--keep-warm", choices=("off", "spin", "sleep"), default="off",
                    help="controller.keep_warm_ms 100 (touch every 1 ms), spinning or sleeping between touches")
    a = ap.parse_args(argv)
    if a.idle:
        idle_effect()
        return
    out = Path(tempfile.mkdtemp(prefix="latency-breakdown-"))
    repo = _build_repo(out / "repo")
    spec = spec_of(repo, MODEL)
    env = {"ESCAPEMENT_TIMERS": str(out), "ESCAPEMENT_TIMED": ",".join(TIMED),
           "PYTHONPATH": f"{ROOT / 'bench' / 'scenarios' / '_profile_hook'}:{ROOT}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the daemon inherits them
    try:
        warm = {} if a.keep_warm == "off" else {"keep_warm_ms": 100.0, "keep_warm_touch_ms": 1.0,
                                                  "keep_warm_spin": a.keep_warm == "spin"}
        server = Escapement(repo, server={"frontend_workers": a.workers},
                            controller={"latency_path": a.latency_path == "true", **warm})
        server.__enter__()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        measure(loadgen.constant(a.rate, 1.0, 1), "socket", server.pid, [MODEL], socket_path=server.socket,
                specs=[spec], warmup=0.2)
        os.kill(server.pid, signal.SIGUSR1)
        loop0 = _loop_ns(server.pid)
        m = measure(loadgen.constant(a.rate, a.seconds, 1), "socket", server.pid, [MODEL],
                    socket_path=server.socket, specs=[spec], warmup=0.0)
        loop_ns = _loop_ns(server.pid) - loop0
        os.kill(server.pid, signal.SIGUSR2)
        dump = out / f"{server.pid}.timers.json"
        for _ in range(100):
            if dump.exists():
                break
            time.sleep(0.05)
        timers = json.loads(dump.read_text())
    finally:
        server.__exit__(None, None, None)
    row = results.row(m.run, "x", 0.1)
    n = int(a.rate * a.seconds)
    print(f"{n} requests at {a.rate:g} req/s, workers {a.workers}, latency path {a.latency_path}, "
          f"keep-warm {a.keep_warm}: "
          f"p50 {row['p50_ms']:.3f} ms, p99 {row['p99_ms']:.3f} ms; loop thread {loop_ns / n / 1e3:.0f} µs/request")
    print("| function (inclusive) | calls/request | µs/request | µs/call |")
    print("|---|---|---|---|")
    for name in TIMED:
        t = timers.get(name, {"calls": 0, "ns": 0})
        per_call = t["ns"] / t["calls"] / 1e3 if t["calls"] else 0.0
        print(f"| `{name}` | {t['calls'] / n:.2f} | {t['ns'] / n / 1e3:.1f} | {per_call:.1f} |")


if __name__ == "__main__":
    main()
