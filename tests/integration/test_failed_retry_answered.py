"""A request whose INFER failed goes back to wait (retried on time, or in the best-effort lane), and
must still be answered with nothing else arriving to wake the controller: the watches that answer it
(its deadline's, the lane's give-up) are armed again when it returns. Before, they were dropped while
it ran, and with the device cooling off after the failure nothing woke the controller: the request
waited forever, holding its frontend worker's shared-memory slot (the many-models GPU bench lost every
slot that fits an image this way)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest

from daemon.client import AsyncSocketClient, InferenceServerError
from tests.integration.test_http import raw
from tests.support import DaemonThread, settings, short_tmpdir

BROKEN_MODELS = "is not served"  # the test repository's broken entries, logged when a daemon starts
ANSWER_BOUND_S = 30.0  # a bound for the test only: the answer is due after about a second


def _fault(d: DaemonThread, **spec: object) -> None:
    status, _, body = raw(d, "POST", "/v2/admin/faults", orjson.dumps({"device": "cpu:0", **spec}),
                          {"Content-Type": "application/json"})
    assert status == 200, body


@pytest.mark.expect_errors(BROKEN_MODELS, r"INFER .* failed")
@pytest.mark.parametrize("workers", [0, 1])
# on time (no timeout: the SLO is its target), a hard deadline, late from the start (a timeout of 1 µs
# that delays: the best-effort lane)
@pytest.mark.parametrize(("timeout_us", "action"), [(None, "reject"), (900_000, "reject"), (1, "delay")])
def test_a_request_whose_infer_failed_is_still_answered(test_repo: Path, workers: int, timeout_us: int | None,
                                                        action: str) -> None:
    d_dir = short_tmpdir()
    s = settings(test_repo, d_dir, server={"frontend_workers": workers},
                 controller={"best_effort_max_wait_s": 1.5, "timeout_action": action})
    try:
        with DaemonThread(s) as d:
            _fault(d, fail_probability=1.0)  # every INFER fails: only the watches can answer it

            async def one() -> InferenceServerError:
                async with AsyncSocketClient(d.socket) as c:
                    with pytest.raises(InferenceServerError) as e:
                        await asyncio.wait_for(c.infer("tiny_pt2", {"INPUT__0": np.ones((1, 4), np.float32)},
                                                       timeout_us=timeout_us), ANSWER_BOUND_S)
                    return e.value

            err = asyncio.run(one())
            assert err.status in (500, 504), err  # failed again, or its deadline / lane wait passed
            assert d.wait_idle() == 0
            fw = d.daemon.frontends
            if fw is not None:  # its DONE went back: the worker freed the slot
                assert d.call(lambda: [len(w.requests) for w in fw.workers if w is not None]) == [0]
    finally:
        shutil.rmtree(d_dir, ignore_errors=True)
