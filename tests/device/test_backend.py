"""The CUDA backend on the stand-in (eager, lazy, three random seeds) and on CUDA when present.

Each defect found by reading the CUDA path has a test named after it (`test_defect<N>_...`)
that fails on the code before its fix.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from daemon.errors import ConfigError
from daemon.model import ModelSpec
from daemon.request import InferenceRequest
from daemon.runtime.backend import NoMemory, Resident
from daemon.runtime.cuda import LOAD_CHUNK, LOAD_INFLIGHT, OUTPUT_RING, CudaBackend
from daemon.runtime.devapi import DeviceFault, DeviceHang, Region
from daemon.runtime.devices import resolve_devices
from daemon.runtime.emucuda import EmuCuda, EmuSettings
from daemon.runtime.program import Program
from daemon.runtime.retarget import check_runs_on
from tests.device.conftest import backend_on, want


def soon() -> float:
    return time.monotonic() + 5.0


def load(be: CudaBackend, program: Program, key: str = "") -> Resident:
    res, _ = be.load(key or program.spec.key, program, soon())
    return res


def sample(spec: ModelSpec, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    g = np.random.default_rng(seed)
    out = []
    for t in spec.inputs:
        shape = (n, *t.sample_shape)
        out.append((g.standard_normal(shape) if t.datatype.numpy.kind == "f" else g.integers(0, 2, shape))
                   .astype(t.datatype.numpy))
    return tuple(out)


def infer(be: CudaBackend, res: Resident, xs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    spec = res.program.spec
    n = len(xs[0])
    req = InferenceRequest(spec, xs, n, 0.0, 0.0)
    b = spec.batch_size_for(n)
    outs, duration = be.infer(res, res.io[b], lambda io: io.fill([req]), soon())
    assert duration >= 0
    return outs


def check(be: CudaBackend, res: Resident, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    xs = sample(res.program.spec, n, seed)
    outs = infer(be, res, xs)
    ref = want(res.program, *[torch.from_numpy(x) for x in xs])
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref, strict=True):
        assert o.shape == tuple(r.shape)
        # a GPU's float32 kernels sum in another order than the CPU reference (seen on an H200:
        # 1.9e-6 apart at 0.011); the stand-in computes on the CPU and must match it closely
        tol = (1e-4, 1e-5) if be.device.kind == "cuda" else (1e-5, 1e-6)
        np.testing.assert_allclose(o, r.numpy(), rtol=tol[0], atol=tol[1])
    return outs


def emu(be: CudaBackend) -> EmuCuda | None:
    return be.api if isinstance(be.api, EmuCuda) else None


# ------------------------------------------------------------------ the defects


@pytest.mark.parametrize("key", ["tiny_pt2:1", "tiny_ts:1", "all_types:1", "two_inputs:1"])
def test_defect1_a_load_makes_io_buffers_and_serves(backend: CudaBackend, programs: dict[str, Program],
                                                    key: str) -> None:
    res = load(backend, programs[key])
    for n in (1, 3, programs[key].spec.max_batch_size):
        check(backend, res, n, seed=n)
    backend.unload(res)


def test_defect2_an_exported_graph_with_baked_cpu_devices_runs_on_the_device(
        backend: CudaBackend, programs: dict[str, Program]) -> None:
    p = programs["converts:1"]
    res = load(backend, p)  # checks the moved graph on fake CUDA tensors, then runs it
    check(backend, res, 5)
    backend.unload(res)


def test_defect2_the_graph_as_exported_would_not_run_on_cuda(programs: dict[str, Program]) -> None:
    p = programs["converts:1"]
    assert p.graph is not None
    cuda = torch.device("cuda", 0)
    args = [(e.dtype, e.shape) for e in p.layout.entries] + [(torch.float16, (8, 4))]
    with pytest.raises(Exception, match="device"):
        check_runs_on(p.graph, cuda, args)  # as exported: cpu baked in
    p.check_device(cuda, 8)  # moved (retarget.to_device): runs


def test_defect3_every_charged_byte_counts_and_never_exceeds_the_budget(programs: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=20 << 20, workspace=8 << 20)
    assert be.charged == 8 << 20  # the workspace reserve, charged once
    assert api.device_bytes == be.arena.size  # the arena: the only device allocation
    wide = programs["wide:1"]
    a = load(be, wide, "a")
    b = load(be, wide, "b")
    assert be.charged == (8 << 20) + a.charged + b.charged
    assert a.charged >= wide.weight_bytes + 8 * (16 + 4) * 4  # weights and IO buffers
    with pytest.raises(NoMemory, match="budget"):
        load(be, wide, "c")  # 8 MiB + 3 x 4.3 MB > 20 MiB
    assert be.charged <= be.device.weight_budget
    assert api.graph_pool_bytes <= be.device.workspace
    assert api.device_bytes == be.arena.size + api.graph_pool_bytes
    assert api.pinned_bytes == be.host.used  # every pinned byte is charged: blocks, IO, staging
    be.unload(a)
    be.unload(b)
    assert be.charged == 8 << 20
    assert api.pinned_bytes == be.host.used  # the weights stay pinned (the program is still served)
    be.close()


def test_defect3_the_default_budget_is_free_memory_and_a_larger_one_stops_the_start() -> None:
    settings = EmuSettings(capacity=256 << 20, seed=31)
    from daemon.runtime import emucuda

    dev = emucuda.device(5, settings)
    held = dev.alloc(100 << 20, "someone else")
    try:
        (d,) = resolve_devices(["emucuda:5"], 0, 0, settings)
        assert d.weight_budget == int((156 << 20) * 0.9)  # of the free memory, not the total
        assert d.workspace == d.weight_budget // 2  # at least 256 MiB, at most half
        with pytest.raises(ConfigError, match="free"):
            resolve_devices(["emucuda:5"], 200 << 20, 0, settings)
    finally:
        dev.free(held)
        dev.close()


def test_defect4_the_caching_allocator_is_off_the_data_path(backend: CudaBackend,
                                                            programs: dict[str, Program]) -> None:
    api = emu(backend)
    if api is None:
        pytest.skip("counts the stand-in's device allocations")
    before = api.device_bytes - api.graph_pool_bytes
    for _ in range(3):
        res = load(backend, programs["wide:1"])
        check(backend, res, 2)
        backend.unload(res)
    held: list[Resident] = []

    def fill() -> None:
        for i in range(backend.device.weight_budget // backend.footprint(programs["wide:1"]) + 1):
            held.append(load(backend, programs["wide:1"], f"wide#{i}"))

    with pytest.raises(NoMemory):  # LOADs until the budget is full: the refused one touches nothing
        fill()
    assert held  # some fitted
    assert api.device_bytes - api.graph_pool_bytes == before  # weights, IO: all in the arena
    for res in held:
        backend.unload(res)


def test_defect6_input_copies_do_not_wait_behind_a_whole_staged_load(programs: dict[str, Program]) -> None:
    """Copies on one engine run in the order they start: an INFER's input copy issued during a LOAD
    through the staging ring (a pageable block) waits for the chunks queued before it, at most two
    (in modelled device time), not the model. (A pinned block is one copy: see the next test.)"""
    api = EmuCuda(0, EmuSettings(capacity=256 << 20, timed=True, h2d_gbps=0.25, d2h_gbps=50.0))
    api.trace = []
    # the pinned budget holds the staging ring and the small model, not the wide one's weights
    be = backend_on(api, budget=128 << 20, workspace=16 << 20, pinned=LOAD_CHUNK * LOAD_INFLIGHT + (1 << 20))
    chunk = be.load_chunk = 256 << 10  # ~1 ms a chunk at 0.25 GB/s; the model is ~17 ms of copies
    assert programs["wide:1"].weight_bytes > (1 << 20)
    tiny = load(be, programs["tiny_pt2:1"])
    copying = threading.Event()
    real_copy = api.copy

    def copy(dst: Region, src: Region, stream: object) -> None:
        real_copy(dst, src, stream)  # type: ignore[arg-type]
        if "staging" in src.buffer.label:
            copying.set()  # the LOAD's copies have started: the INFER goes now

    api.copy = copy  # type: ignore[method-assign]
    failed: list[BaseException] = []

    def load_wide() -> None:
        try:
            be.unload(load(be, programs["wide:1"]))
        except BaseException as e:  # pragma: no cover - reported below
            failed.append(e)
            copying.set()
    t = threading.Thread(target=load_wide)
    t.start()
    assert copying.wait(10)
    assert not failed, failed
    check(be, tiny, 2)
    t.join()
    assert not failed, failed
    (inputs,) = [op for op in api.trace if op.what.startswith("copy tiny_pt2:1 inputs")][-1:]
    weights = [op for op in api.trace if op.what.startswith("copy emucuda:0 staging")]
    assert len(weights) > 8
    assert weights[-1].end > inputs.end  # the INFER ran in the middle of the LOAD
    waited = inputs.start - inputs.submitted
    assert waited <= 2 * chunk / 0.25e9 + 1e-4, f"an input copy waited {waited * 1e3:.2f} ms behind the LOAD"
    assert weights[-1].end - weights[0].start > 8 * chunk / 0.25e9  # the whole LOAD: many times that
    be.close()


def test_a_pinned_load_is_one_copy_with_no_host_wait_inside_it(programs: dict[str, Program]) -> None:
    """A pinned block goes in one copy, queued whole: its measured duration is the copy's, whatever
    the host does meanwhile (chunks paced by host waits idle the engine while the LOAD thread waits
    for the GIL). An input copy issued meanwhile may wait behind it where one engine serves both
    streams, as the stand-in models; bench.gpu.figures measures whether the GPU does."""
    api = EmuCuda(0, EmuSettings(capacity=256 << 20, timed=True, h2d_gbps=0.25, d2h_gbps=50.0))
    api.trace = []
    be = backend_on(api, budget=128 << 20, workspace=16 << 20)
    be.load_chunk = 256 << 10
    waits = 0
    real_wait = api.event(timing=False).__class__.wait

    def counting_wait(self: object, deadline: float | None) -> None:
        nonlocal waits
        waits += 1
        real_wait(self, deadline)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(api.event(timing=False)), "wait", counting_wait)
        res, seconds = be.load("wide:1", programs["wide:1"], soon())
    weights = [op for op in api.trace if op.what.startswith("copy wide:1 weights")]
    assert len(weights) == 1 and waits == 2  # one copy; the host waits for its end and the captures'
    n = programs["wide:1"].weight_bytes
    assert seconds == pytest.approx(n / 0.25e9, rel=0.05)  # the copy's modelled time alone
    check(be, res, 2)
    be.unload(res)
    be.close()


@pytest.mark.expect_errors('device-side assert')
def test_defect7_a_sticky_error_fails_the_device_for_good(programs: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=32 << 20, workspace=8 << 20)
    res = load(be, programs["tiny_pt2:1"])
    api.fail_next_kernel("device-side assert triggered")
    with pytest.raises(DeviceFault, match="device-side assert"):
        check(be, res, 2)
    assert "device-side assert" in be.failed
    with pytest.raises(DeviceFault):
        load(be, programs["tiny_ts:1"])  # at once, without touching the device
    be.unload(res)
    be.close()


@pytest.mark.slow  # asserts in wall-clock time
@pytest.mark.expect_errors('did not finish by its deadline')
def test_defect7_a_hung_kernel_fails_the_device_by_its_deadline(programs: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=32 << 20, workspace=8 << 20)
    res = load(be, programs["tiny_pt2:1"])
    api.hang_next_kernel()
    spec = res.program.spec
    req = InferenceRequest(spec, sample(spec, 1), 1, 0.0, 0.0)
    t0 = time.monotonic()
    with pytest.raises(DeviceHang):
        be.infer(res, res.io[1], lambda io: io.fill([req]), t0 + 0.05)
    assert time.monotonic() - t0 < 2.0
    assert be.failed
    api.release()
    be.close()


def test_defect8_a_failed_load_leaves_nothing_behind(programs: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=32 << 20, workspace=8 << 20)
    p = programs["tiny_ts:1"]
    ok = load(be, p, "first")  # pins the host block once, for good
    charged, pinned, used = be.charged, api.pinned_bytes, be.arena.used
    for after in range(0, 4):  # an allocation failing at each step of the LOAD
        api.fail_allocation(after=after)
        with pytest.raises((torch.OutOfMemoryError, NoMemory)):
            load(be, p, f"broken{after}")
        assert (be.charged, api.pinned_bytes, be.arena.used) == (charged, pinned, used)
        assert api.pinned_bytes == be.host.used
    check(be, ok, 2)  # the TorchScript instance still points at its own weights
    be.unload(ok)
    be.close()


def test_defect9_pinned_host_memory_stays_within_its_budget(programs: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=48 << 20, workspace=8 << 20, pinned=(8 << 20) + (1 << 20))
    wide = programs["wide:1"]  # 4.3 MB: more than the budget leaves after the staging ring
    staging = api.pinned_bytes
    res = load(be, wide)  # pageable: through the staging ring
    assert be.host.used <= be.host.budget
    assert api.pinned_bytes - staging < 1 << 20  # IO buffers only
    check(be, res, 4)
    be.unload(res)
    small = load(be, programs["tiny_pt2:1"])  # fits: pinned in place, exactly
    assert be.host.blocks == 1
    be.unload(small)
    be.close()


def test_defect10_infer_allocates_nothing_and_held_outputs_stay(backend: CudaBackend,
                                                               programs: dict[str, Program]) -> None:
    res = load(backend, programs["tiny_pt2:1"])
    check(backend, res, 2)  # warm
    before = backend.api.allocations
    held = [check(backend, res, 2, seed=i) for i in range(OUTPUT_RING)]
    copies = [tuple(o.copy() for o in h) for h in held]
    for i in range(3):  # every slot is held by a response not yet written: the spare slot serves
        check(backend, res, 2, seed=100 + i)
    for h, c in zip(held, copies, strict=True):
        np.testing.assert_array_equal(h[0], c[0])  # nothing overwrote what responses hold
    assert backend.api.allocations == before
    assert res.state.ring.overflows == 3
    del held, h
    assert res.state.ring.lent == 0
    backend.unload(res)


# ------------------------------------------------------------------ graphs


def test_graph_replay_equals_eager(kind: tuple[str, str, int], programs: dict[str, Program]) -> None:
    from tests.device.conftest import make_api

    k, mode, seed = kind
    api = make_api(k, mode, seed=seed) if k != "cuda" else make_api(k, mode)
    graphs = backend_on(api)
    p = programs["wide:1"]
    res = load(graphs, p)
    assert sorted(res.state.graphs) == list(p.spec.batch_sizes) and not res.notes
    xs = sample(p.spec, 6, seed=4)
    replayed = [o.copy() for o in infer(graphs, res, xs)]
    graphs.unload(res)
    graphs.graphs_enabled = False
    res = load(graphs, p)
    assert not res.state.graphs and "off" in res.notes
    np.testing.assert_allclose(replayed[0], infer(graphs, res, xs)[0], rtol=1e-6)
    graphs.unload(res)
    graphs.close()


def test_a_model_that_cannot_be_captured_runs_eagerly_and_says_why(backend: CudaBackend,
                                                                  programs: dict[str, Program]) -> None:
    res = load(backend, programs["branchy:1"])
    assert not res.state.graphs
    assert "capture" in res.notes
    check(backend, res, 3)
    check(backend, res, 3, seed=9)
    backend.unload(res)


def test_graph_memory_is_charged_to_the_workspace(programs: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=24 << 20, workspace=16 << 10)  # 16 KiB: no room for wide's activations
    res = load(be, programs["wide:1"])
    assert not res.state.graphs and "workspace" in res.notes
    assert api.graph_pool_bytes <= be.device.workspace
    check(be, res, 8)
    be.unload(res)
    assert api.graphs == 0  # graphs dropped before their extent was freed
    be.close()


# ------------------------------------------------------------------ the arena


def test_compaction_moves_idle_models_and_they_still_serve(kind: tuple[str, str, int],
                                                           programs: dict[str, Program]) -> None:
    from tests.device.conftest import make_api

    k, mode, seed = kind
    if k == "cuda":
        pytest.skip("sized for the stand-in")
    api = make_api(k, mode, seed=seed)
    wide = programs["wide:1"]
    need = backend_on(EmuCuda(0, EmuSettings(capacity=64 << 20))).footprint(wide)
    be = backend_on(api, budget=(1 << 20) + 3 * need + need // 2, workspace=1 << 20)
    a, b, c = (load(be, wide, key) for key in "abc")
    be.unload(b)  # a hole of one model in the middle, half a model at the end
    small = load(be, programs["tiny_pt2:1"], "s")  # takes the start of the hole
    assert be.arena.largest_free < need
    d = load(be, wide, "d")  # fits only once c slides down
    be.arena.check()
    assert be.compactions == 1 and c.state.extent.offset < 2 * need
    for res in (a, c, d):
        check(be, res, 3)
    check(be, small, 2)
    for res in (a, c, d, small):
        be.unload(res)
    be.arena.check()
    be.close()


def test_an_infer_sleeps_through_a_low_estimate_of_its_device_time() -> None:
    """The estimate an INFER sleeps through (SLEEP_THROUGH of it) before polling for its end: a
    faster run lowers it at once, a slower one raises it by 10% a run, an outlier never sets it."""
    from daemon.runtime.cuda import low_estimate

    est = low_estimate(0.0, 500e-6)
    assert est == 500e-6
    est = low_estimate(est, 0.2)  # one INFER of 200 ms (a stall): the next sleep stays short
    assert est == pytest.approx(550e-6)
    est = low_estimate(est, 400e-6)  # faster: followed at once
    assert est == 400e-6
    for _ in range(3):  # slower for good: followed 10% a run
        est = low_estimate(est, 1e-3)
    assert est == pytest.approx(400e-6 * 1.1**3)
