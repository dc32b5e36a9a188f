"""The CUDA path on a real GPU: streams, pinned weights, event timings. Skipped without CUDA."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.clock import MonotonicClock
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.devices import resolve_devices
from daemon.runtime.executor import Executor, make_backend
from daemon.runtime.program import Program, load_program
from tests.support import TinyLinear

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def program(test_repo: Path) -> Program:
    spec = next(m for m in scan(test_repo).models if m.key == "tiny_pt2:1")
    return load_program(spec)


def test_load_infer_unload_on_cuda(program: Program) -> None:
    (dev,) = resolve_devices(["cuda:0"], 64 << 20, 16 << 20)
    results: queue.Queue[Result] = queue.Queue()
    clock = MonotonicClock()
    ex = Executor(dev, make_backend(dev, 1), clock, results.put, {program.spec.key: program})
    ex.start()
    try:
        now = clock.now()
        ex.submit(Action(ActionKind.LOAD, program.spec, dev.name, now, now + 10))
        load = results.get(timeout=60)
        assert load.ok and load.duration > 0  # measured with CUDA events
        assert ex.resident[program.spec.key].state.weights.buffer.tensor.device.type == "cuda"
        assert ex.backend.api.pinned_bytes > 0  # the host block, registered in place
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        req = InferenceRequest(program.spec, (x,), 2, now, now + 10)
        now = clock.now()
        ex.submit(Action(ActionKind.INFER, program.spec, dev.name, now, now + 10, batch_size=2, requests=[req]))
        res = results.get(timeout=60)
        assert res.ok and res.duration > 0
        with torch.no_grad():
            want = TinyLinear()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(res.outputs[0], want, rtol=1e-4)
        before = torch.cuda.memory_allocated(0)
        now = clock.now()
        ex.submit(Action(ActionKind.UNLOAD, program.spec, dev.name, now, now + 10))
        assert results.get(timeout=60).status == ResultStatus.OK
        assert ex.used_bytes == dev.workspace  # the arena stays; the reserve is charged once
        assert torch.cuda.memory_allocated(0) <= before
    finally:
        ex.stop()
