"""A real daemon serving plain (single-program) variants of one backbone: it finds their shared
leading stage at load (runtime.detect_shared_prefix), runs it once for several variants' requests
(cross-model batches) and keeps its outputs by input (the prefix cache, on /metrics and in the
statistics), and every answer is the one the variant's whole program gives alone."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from daemon import variants
from daemon.client import AsyncSocketClient
from daemon.repository import scan
from daemon.runtime import shared_prefix
from daemon.runtime.faults import FaultSpec
from daemon.runtime.objstore import ObjectStore
from daemon.runtime.program import load_program
from tests.support import DaemonThread, settings, short_tmpdir

NAMES = ["digits_head_identity", "digits_head_parity", "digits_head_ge5"]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plain") / "v"
    variants.build(out, 3)
    return out  # (the monolithic form: one model.pt2 per variant)


@pytest.fixture
def daemon_of(family: Path) -> Iterator[Any]:
    started: list[tuple[DaemonThread, Path]] = []

    def start(**runtime: Any) -> DaemonThread:
        d = short_tmpdir()
        dt = DaemonThread(settings(family, d, controller={"batch_wait_ms": 0.0}, runtime=runtime)).start()
        started.append((dt, d))
        return dt

    yield start
    for dt, d in started:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


def _alone(family: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for spec in scan(family).models:
        with torch.inference_mode():
            out[spec.name] = load_program(spec, ObjectStore()).host_runner([torch.from_numpy(x)])[0].numpy()
    return out


def _prefixes(dt: DaemonThread) -> set[str]:
    sched = dt.daemon.controller.scheduler
    return dt.call(lambda: {sched.models[f"{n}:1"].prefix for n in NAMES})


def _metrics(dt: DaemonThread, prefix: str = "escapement_prefix_cache_") -> dict[str, float]:
    with urllib.request.urlopen(f"http://{dt.http}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix) and 'device="cpu:0"' in line}


def _statistics(dt: DaemonThread) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{dt.http}/v2/controller/stats", timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


async def _each(dt: DaemonThread, pairs: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
    """One request after another (each answered before the next is sent)."""
    async with AsyncSocketClient(dt.socket) as c:
        return [(await c.infer(n, {"INPUT__0": x})).outputs["OUTPUT__0"] for n, x in pairs]


def test_plain_variants_share_their_backbone_found_at_load(family: Path, daemon_of: Any) -> None:
    dt = daemon_of()
    prefixes = _prefixes(dt)
    assert len(prefixes) == 1 and "" not in prefixes  # one leading stage, found in the whole programs
    rng = np.random.default_rng(1)
    # 8 rows a request (see test_staged_variants), 16 a model: room in one batch (32) for another model's
    xs = [rng.uniform(0, 16, (8, 64)).astype(np.float32) for _ in range(2)]
    want = [_alone(family, x) for x in xs]
    ex = dt.daemon.executors["cpu:0"]

    async def go() -> list[dict[str, np.ndarray]]:
        async with AsyncSocketClient(dt.socket) as c:
            for n in NAMES:
                await c.infer(n, {"INPUT__0": xs[0]})
            dt.call(ex.faults.set, FaultSpec(add_ms=40.0))  # a slow device: the rest queue behind one batch
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
    assert _statistics(dt)["counters"]["cross_model_batches"] >= 1
    assert not dt.errors


def test_prefix_cache_counts_on_metrics_and_in_statistics(family: Path, daemon_of: Any) -> None:
    dt = daemon_of(prefix_cache_entries=2)
    rng = np.random.default_rng(5)
    x, y, z = (rng.uniform(0, 16, (8, 64)).astype(np.float32) for _ in range(3))
    before = _metrics(dt)
    assert before["escapement_prefix_cache_hits_total"] == 0 and before["escapement_prefix_cache_entries"] == 0
    got = asyncio.run(_each(dt, [(n, x) for n in NAMES]))  # one input to each variant: computed once
    alone = _alone(family, x)
    for n, out in zip(NAMES, got, strict=True):
        np.testing.assert_array_equal(out, alone[n])
    m = _metrics(dt)
    assert m["escapement_prefix_cache_hits_total"] == len(NAMES) - 1
    assert m["escapement_prefix_cache_misses_total"] == 1
    assert m["escapement_prefix_cache_entries"] == 1
    assert m["escapement_prefix_cache_bytes"] == 8 * 256 * 4  # the backbone's 8 x 256 FP32 outputs
    assert m["escapement_prefix_cache_evictions_total"] == 0
    asyncio.run(_each(dt, [(NAMES[0], y), (NAMES[0], z)]))  # two more inputs: the cache holds 2
    m = _metrics(dt)
    assert m["escapement_prefix_cache_entries"] == 2 and m["escapement_prefix_cache_evictions_total"] == 1
    assert m["escapement_prefix_cache_misses_total"] == 3
    st = _statistics(dt)["prefix_cache"]["cpu:0"]
    assert (st["hits"], st["misses"], st["evictions"], st["entries"], st["max_entries"]) == (2, 3, 1, 2, 2)
    assert not dt.errors


def test_detection_off_serves_the_whole_programs(daemon_of: Any) -> None:
    dt = daemon_of(detect_shared_prefix=False)
    assert _prefixes(dt) == {""}
    assert "escapement_prefix_cache_hits_total" in _metrics(dt)  # (the cache is there, with nothing to keep)


def test_a_variant_loaded_later_splits_the_one_served_before(family: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first variant, alone in its repository, is served whole; once a second appears, both
    are served as plans with one leading stage, and batch together."""
    # a process's index remembers the cuts of every model it read (the other tests' variants too)
    monkeypatch.setattr(shared_prefix, "INDEX", shared_prefix.PrefixIndex())
    repo = short_tmpdir() / "repo"
    repo.mkdir(parents=True)
    shutil.copytree(family / NAMES[0], repo / NAMES[0])
    d = short_tmpdir()
    dt = DaemonThread(settings(repo, d, controller={"batch_wait_ms": 0.0})).start()
    try:
        sched = dt.daemon.controller.scheduler
        first = f"{NAMES[0]}:1"
        assert dt.call(lambda: sched.models[first].prefix) == ""  # nothing to share with yet
        shutil.copytree(family / NAMES[1], repo / NAMES[1])
        changes = dt.on_loop(dt.daemon.models.reload_repository(), 120)
        assert changes["loaded"] == [f"{NAMES[1]}:1"] and changes["reloaded"] == [first]
        prefixes = dt.call(lambda: {sched.models[f"{n}:1"].prefix for n in NAMES[:2]})
        assert len(prefixes) == 1 and "" not in prefixes
        x = np.random.default_rng(3).uniform(0, 16, (8, 64)).astype(np.float32)
        alone = _alone(family, x)
        got = asyncio.run(_each(dt, [(n, x) for n in NAMES[:2]]))
        for n, out in zip(NAMES[:2], got, strict=True):
            np.testing.assert_array_equal(out, alone[n])
        assert not dt.errors
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(repo.parent, ignore_errors=True)
