"""The executor over the CUDA backend on the stand-in: failures say why, a lost device fails fast."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from daemon.actions import Action, ActionKind, Failure, Result, ResultStatus
from daemon.clock import MonotonicClock
from daemon.request import InferenceRequest
from daemon.runtime.emucuda import EmuCuda, EmuSettings
from daemon.runtime.executor import Executor
from daemon.runtime.program import Program
from tests.device.conftest import backend_on


def run(ex: Executor, results: queue.Queue[Result], kind: ActionKind, program: Program, **kw: object) -> Result:
    clock = ex.clock
    now = clock.now()
    ex.submit(Action(kind, program.spec, ex.device.name, now, now + 10, program=program,
                     **kw))  # type: ignore[arg-type]
    return results.get(timeout=30)


@pytest.mark.expect_errors('illegal memory access')
def test_failures_say_why_and_a_lost_device_fails_every_later_action(programs: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    p, q = programs["tiny_pt2:1"], programs["wide:1"]
    results: queue.Queue[Result] = queue.Queue()
    be = backend_on(api, budget=16 << 20, workspace=8 << 20)
    ex = Executor(be.device, be, MonotonicClock(), results.put, {p.spec.key: p, q.spec.key: q})
    ex.start()
    try:
        assert run(ex, results, ActionKind.LOAD, p).ok
        assert run(ex, results, ActionKind.LOAD, q).ok
        r = run(ex, results, ActionKind.LOAD, q, resident="again")  # wide held twice: no room
        assert r.status == ResultStatus.FAILED and r.failure == Failure.NO_MEMORY, r.error
        req = InferenceRequest(p.spec, (np.ones((1, 4), np.float32),), 1, 0.0, 0.0)
        api.fail_next_kernel("an illegal memory access was encountered")
        r = run(ex, results, ActionKind.INFER, p, batch_size=1, requests=[req])
        assert r.failure == Failure.DEVICE and "illegal memory access" in r.error
        r = run(ex, results, ActionKind.UNLOAD, p)
        assert r.failure == Failure.DEVICE and ex.failed  # refused at once, without touching the device
    finally:
        ex.stop()
