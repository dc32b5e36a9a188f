"""A real daemon serving three variants declared as plans of stages (one shared backbone stage,
a head each): concurrent requests of all three run in cross-model batches, and every answer is
the one the variant's monolithic program gives alone."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon import variants
from daemon.client import AsyncSocketClient
from daemon.repository import scan
from daemon.runtime.faults import FaultSpec
from daemon.runtime.objstore import ObjectStore
from daemon.runtime.program import load_program
from tests.support import DaemonThread, settings, short_tmpdir

NAMES = ["digits_head_identity", "digits_head_parity", "digits_head_ge5"]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("family") / "v"
    variants.build(out, 3)
    return out


@pytest.fixture(scope="module")
def staged_daemon(family: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(variants.staged_out(family), d, controller={"batch_wait_ms": 0.0})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


def _alone(family: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """Each variant's monolithic program, loaded alone, on `x` (8 rows: one request's)."""
    out = {}
    for spec in scan(family).models:
        with torch.inference_mode():
            out[spec.name] = load_program(spec, ObjectStore()).host_runner([torch.from_numpy(x)])[0].numpy()
    return out


def test_three_staged_variants_share_their_backbone_and_answer_as_alone(family: Path,
                                                                        staged_daemon: DaemonThread) -> None:
    dt = staged_daemon
    sched = dt.daemon.controller.scheduler
    prefixes = dt.call(lambda: {sched.models[f"{n}:1"].prefix for n in NAMES})
    assert len(prefixes) == 1 and "" not in prefixes  # one shared leading stage, found by content
    rng = np.random.default_rng(1)
    # 8 samples a request: a BLAS kernel computes 1-3 rows otherwise than more, with or without sharing
    xs = [rng.uniform(0, 16, (8, 64)).astype(np.float32) for _ in range(6)]
    want = [_alone(family, x) for x in xs]
    ex = dt.daemon.executors["cpu:0"]

    async def go() -> list[dict[str, np.ndarray]]:
        async with AsyncSocketClient(dt.socket) as c:
            for n in NAMES:  # every variant resident, every stage estimated
                await c.infer(n, {"INPUT__0": xs[0]})
            # a slow device: requests of all three queue behind the first and then run together
            dt.call(ex.faults.set, FaultSpec(add_ms=40.0))
            first = asyncio.ensure_future(c.infer(NAMES[0], {"INPUT__0": xs[0]}))
            await asyncio.sleep(0.01)  # (only so that `first` is running when the others arrive)
            dt.call(ex.faults.set, None)
            rest = [c.infer(n, {"INPUT__0": x}) for x in xs for n in NAMES]
            answers = await asyncio.gather(first, *rest)
        return [{n: answers[1 + i * len(NAMES) + j].outputs["OUTPUT__0"] for j, n in enumerate(NAMES)}
                for i in range(len(xs))]

    got = asyncio.run(go())
    for g, w in zip(got, want, strict=True):
        for n in NAMES:
            # a cross-model batch has more rows than alone, which a BLAS kernel may block otherwise
            # (an AVX-512 Xeon: up to 1.5e-6 apart): close, not bit for bit
            np.testing.assert_allclose(g[n], w[n], rtol=1e-5, atol=1e-5)
    counters = dt.call(lambda: dict(sched.counters))
    assert counters["cross_model_batches"] >= 1
    assert counters["cross_model_members"] >= 2 * counters["cross_model_batches"]
    # one new input sent to each variant in turn: the backbone runs for the first, the prefix
    # cache serves the other two (answers still as alone)
    cache = ex.backend.prefix_cache  # type: ignore[attr-defined]
    hits = cache.hits
    x = rng.uniform(0, 16, (8, 64)).astype(np.float32)
    alone = _alone(family, x)

    async def one_by_one() -> list[np.ndarray]:
        async with AsyncSocketClient(dt.socket) as c:
            return [(await c.infer(n, {"INPUT__0": x})).outputs["OUTPUT__0"] for n in NAMES]

    for n, y in zip(NAMES, asyncio.run(one_by_one()), strict=True):
        np.testing.assert_array_equal(y, alone[n])
    assert cache.hits - hits == len(NAMES) - 1
    # the backbone's blocks are held once, in the controller's map and on the device alike
    assert dt.call(lambda: sched.devices["cpu:0"].memory.used) == ex.used_bytes
    assert not dt.errors


def test_staged_variants_share_their_backbone_stage_on_the_cuda_backend(family: Path) -> None:
    """The CUDA backend (here over its CPU stand-in) holds the backbone stage once for every variant
    (an extent of its own; the controller counts it once too) and runs a cross-model batch: the
    backbone stage once, each head over its own weights (runtime/cuda.py infer_staged); a lone
    request runs its plan whole. The same answers."""
    d = short_tmpdir()
    emu = {"capacity": "256MiB", "mode": "random", "seed": 11}
    dt = DaemonThread(settings(variants.staged_out(family), d, controller={"batch_wait_ms": 0.0}, runtime={
        "devices": ["emucuda:0"], "weight_budget": "64MiB", "device_workspace": "16MiB", "emucuda": emu})).start()
    try:
        rng = np.random.default_rng(2)
        xs = [rng.uniform(0, 16, (8, 64)).astype(np.float32) for _ in range(2)]
        want = [_alone(family, x) for x in xs]
        ex = dt.daemon.executors["emucuda:0"]
        held: list[tuple[dict[str, tuple[int, int]], int, int]] = []

        async def go() -> list[dict[str, np.ndarray]]:
            async with AsyncSocketClient(dt.socket) as c:
                for n in NAMES:  # every variant resident
                    await c.infer(n, {"INPUT__0": xs[0]})
                held.append(dt.call(lambda: (ex.backend.shared_stages(), ex.used_bytes,
                                             dt.daemon.controller.scheduler.devices["emucuda:0"].memory.used)))
                dt.call(ex.faults.set, FaultSpec(add_ms=40.0))  # the rest queue behind one slow batch
                first = asyncio.ensure_future(c.infer(NAMES[0], {"INPUT__0": xs[0]}))
                await asyncio.sleep(0.01)  # (only so that `first` is running when the others arrive)
                dt.call(ex.faults.set, None)
                answers = await asyncio.gather(first, *(c.infer(n, {"INPUT__0": x}) for x in xs for n in NAMES))
            return [{n: answers[1 + i * len(NAMES) + j].outputs["OUTPUT__0"] for j, n in enumerate(NAMES)}
                    for i in range(len(xs))]

        for g, w in zip(asyncio.run(go()), want, strict=True):
            for n in NAMES:
                # a cross-model batch has more rows than alone, which a BLAS kernel may block otherwise
                # (an AVX-512 Xeon: up to 1.5e-6 apart): close, not bit for bit
                np.testing.assert_allclose(g[n], w[n], rtol=1e-5, atol=1e-5)
        assert dt.call(lambda: dt.daemon.controller.scheduler.counters["cross_model_batches"]) >= 1
        (stages, charged, counted), = held
        # one backbone and one input buffer, every variant's
        assert [holders for _, holders in stages.values()] == [len(NAMES), len(NAMES)]
        assert counted + 16 * 2**20 == charged  # the controller counts what the device holds (and its workspace)
        assert not dt.errors
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)
