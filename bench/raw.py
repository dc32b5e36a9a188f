"""The hardware limit: the raw torch call of a model, with no server in the way.

Measured in the benchmark process with the same number of intra-op threads as one daemon CPU
device, on the same program the daemon serves (the lifted torch.export graph).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from daemon.repository import scan
from daemon.runtime.program import Program, load_program


def program(repo: str | Path, name: str) -> Program:
    spec = next((m for m in scan(repo).models if m.name == name), None)
    if spec is None:
        raise SystemExit(f"model {name} is not in {repo}; run `escapement demo --out {repo}`")
    return load_program(spec)


def inputs(p: Program, batch: int, seed: int = 0) -> list[torch.Tensor]:
    """Random inputs like the load generator's: on a CPU, all-zero inputs run up to 16% faster."""
    rng = np.random.default_rng(seed)
    out = []
    for t in p.spec.inputs:
        shape = (batch, *t.sample_shape)
        dt = t.datatype.numpy
        a = rng.random(shape) if dt.kind == "f" else rng.integers(0, 2, shape)
        out.append(torch.from_numpy(np.ascontiguousarray(a.astype(dt))))
    return out


def latencies(p: Program, n: int, batch: int = 1, pace_rps: float | None = None, threads: int = 1,
              seed: int = 0) -> np.ndarray:
    """Seconds per call; with `pace_rps`, calls are spaced by Poisson gaps, as a server at low load sees them."""
    torch.set_num_threads(threads)
    xs = inputs(p, batch, seed)
    rng = np.random.default_rng(seed)
    out = np.empty(n)
    with torch.inference_mode():
        for _ in range(min(100, n)):
            p.host_runner(xs)
        for i in range(n):
            if pace_rps:
                time.sleep(rng.exponential(1.0 / pace_rps))
            t = time.perf_counter()
            p.host_runner(xs)
            out[i] = time.perf_counter() - t
    return out


def batched_limit(p: Program, threads: int = 1, seconds_per_size: float = 1.0) -> tuple[float, int, dict[int, float]]:
    """The best samples/s over the model's batch sizes, the size that gives it, and samples/s per size.

    Each size's rate is its batch over the median time of back-to-back calls: a stall of the
    shared machine during the measurement (tens of ms, every process at once) would pull a
    calls-per-elapsed-time figure down and make the server look faster than the hardware.
    """
    torch.set_num_threads(threads)
    per_size: dict[int, float] = {}
    with torch.inference_mode():
        for b in p.spec.batch_sizes:
            xs = inputs(p, b)
            for _ in range(3):
                p.host_runner(xs)
            times: list[float] = []
            end = time.perf_counter() + seconds_per_size
            while (t := time.perf_counter()) < end or len(times) < 5:
                p.host_runner(xs)
                times.append(time.perf_counter() - t)
            per_size[b] = b / float(np.median(times))
    best = max(per_size, key=lambda k: per_size[k])
    return per_size[best], best, per_size


def wake_round_trips(n: int = 200, gap_s: float = 0.005, cross_core: bool = True) -> np.ndarray:
    """Seconds for one thread to wake another and be woken back, after `gap_s` idle (as at low
    load): the price of each hand-off between the event loop and an executor thread, and between
    a client and the server, on this machine. With `cross_core` the two threads are pinned to
    different cores (a wake-up of an idle core), else to the same one."""
    import os
    import threading

    cores = sorted(os.sched_getaffinity(0))
    if cross_core and len(cores) < 2:
        return np.array([np.nan])
    here, there = cores[0], (cores[1] if cross_core else cores[0])
    go, back = threading.Event(), threading.Event()
    stop = False

    def echo() -> None:
        os.sched_setaffinity(0, {there})
        while True:
            go.wait()
            go.clear()
            if stop:
                return
            back.set()

    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {here})
    t = threading.Thread(target=echo, daemon=True)
    t.start()
    out = np.empty(n)
    try:
        for i in range(n):
            time.sleep(gap_s)
            t0 = time.perf_counter()
            go.set()
            back.wait()
            back.clear()
            out[i] = time.perf_counter() - t0
    finally:
        stop = True
        go.set()
        t.join(5)
        os.sched_setaffinity(0, saved)
    return out
