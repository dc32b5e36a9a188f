"""An INFER replaying a CUDA graph is timed by events inside the graph, so its measured duration
is the graph's own device time: events recorded around the replay would also count the host's
launch of it (a gap of microseconds that varies, which made p99.99/p50 of replays 2-3 on an H100
where the kernels themselves barely vary)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from daemon.runtime.devapi import CaptureError, DeviceApi
from daemon.runtime.emucuda import EmuCuda, EmuSettings
from daemon.runtime.program import Program
from tests.device.conftest import backend_on, make_api
from tests.device.test_backend import load, sample, soon

KERNEL_S = 0.003  # the stand-in's modelled time of every kernel


def _kernel(dst: torch.Tensor, src: torch.Tensor):  # noqa: ANN202
    def step() -> None:
        dst.copy_(src * 2)
    return step


def test_a_graph_times_its_own_execution_not_its_launch(kind: tuple[str, str, int],
                                                        programs: dict[str, Program]) -> None:
    k, mode, seed = kind
    # timed: the host waits out modelled work, so the device is idle (as measured) before each INFER
    # (on a GPU `cuda` is the real device and these settings are the stand-in's only; under
    # check.sh --standin `cuda` is the stand-in too, and needs them)
    api = make_api(k, mode, seed=seed, kernel_s=KERNEL_S, timed=True)
    be = backend_on(api)
    p = programs["wide:1"]
    res = load(be, p)
    try:
        api.synchronize(soon())  # the warm-ups' modelled time is over
        assert sorted(res.state.graphs) == list(p.spec.batch_sizes)
        if api.graph_events:
            assert sorted(res.state.graph_timing) == sorted(res.state.graphs)
        xs = sample(p.spec, 4, seed=2)
        b = p.spec.batch_size_for(4)
        for _ in range(3):
            from daemon.request import InferenceRequest

            req = InferenceRequest(p.spec, xs, 4, 0.0, 0.0)
            _, duration = be.infer(res, res.io[b], lambda io, r=req: io.fill([r]), soon())
            if isinstance(api, EmuCuda):  # one kernel, launched with its graph: exactly its time
                assert duration == pytest.approx(KERNEL_S, abs=1e-9)
                api.synchronize(soon())
            else:
                assert 0 < duration < 1.0
    finally:
        be.unload(res)
        be.close()
        be.host.close()


def test_an_eager_model_is_timed_around_its_launch(programs: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=256 << 20, kernel_s=KERNEL_S))
    be = backend_on(api, graphs=False)
    p = programs["wide:1"]
    res = load(be, p)
    assert not res.state.graphs and not res.state.graph_timing
    from daemon.request import InferenceRequest

    xs = sample(p.spec, 2)
    req = InferenceRequest(p.spec, xs, 2, 0.0, 0.0)
    _, duration = be.infer(res, res.io[p.spec.batch_size_for(2)], lambda io: io.fill([req]), soon())
    assert duration >= KERNEL_S  # the kernel, and whatever the host took to launch it
    be.unload(res)
    be.close()
    be.host.close()


def test_only_an_external_event_is_recorded_inside_a_capture(api: DeviceApi) -> None:
    s = api.stream("capture")
    src = api.alloc(64, "src")
    dst = api.alloc(64, "dst")
    step = _kernel(dst.view(0, torch.float32, (16,)), src.view(0, torch.float32, (16,)))
    # written before any capture and synchronized: the capture stream's kernels read it, and the
    # sanitizer counts a capture's launches as accesses (a write after them on stream 0 is a race)
    src.view(0, torch.float32, (16,)).copy_(torch.arange(16, dtype=torch.float32, device=api.torch_device))
    api.synchronize(soon())
    plain = api.event()
    with pytest.raises(CaptureError, match="external"):
        api.capture(s, lambda: (api.record(plain, s), api.launch(s, step, [src.region()], [dst.region()])))
    if not api.graph_events:
        pytest.skip("this torch cannot record an event inside a graph")
    begin, end = api.event(external=True), api.event(external=True)
    g = api.capture(s, lambda: (api.record(begin, s), api.launch(s, step, [src.region()], [dst.region()]),
                                api.record(end, s)))
    for _ in range(2):  # each replay records both again
        outer = api.event()
        api.record(outer, s)
        g.replay(s)
        after = api.event()
        api.record(after, s)
        after.wait(soon())
        inner = begin.elapsed_s(end)
        assert inner <= outer.elapsed_s(after) + 1e-6
        if isinstance(api, EmuCuda) and api.settings.kernel_s is not None:
            assert inner == pytest.approx(api.settings.kernel_s, abs=1e-9)
    np.testing.assert_array_equal(dst.view(0, torch.float32, (16,)).cpu().numpy(), np.arange(16) * 2)
    g.close()
    api.free(src)
    api.free(dst)
