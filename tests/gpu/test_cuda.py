"""The CUDA path on a real GPU (or, with ESCAPEMENT_TEST_GPU=emucuda, on the stand-in): a daemon
serving the demo models, the executor's LOAD/INFER/UNLOAD with device timings, and a device-side
error. Skipped without CUDA. The seam and backend tests in tests/device run on CUDA too."""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon.actions import Action, ActionKind, Failure, Result, ResultStatus
from daemon.clock import MonotonicClock
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.devices import resolve_devices
from daemon.runtime.executor import Executor, make_backend
from daemon.runtime.program import Program, load_program
from tests.integration.test_emucuda import serve_and_compare
from tests.support import DaemonThread, TinyLinear, gpu_device, settings, short_tmpdir

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def program(test_repo: Path) -> Program:
    spec = next(m for m in scan(test_repo).models if m.key == "tiny_pt2:1")
    return load_program(spec)


def test_load_infer_unload_with_device_timings(program: Program) -> None:
    (dev,) = resolve_devices([gpu_device()], 192 << 20, 128 << 20)
    results: queue.Queue[Result] = queue.Queue()
    clock = MonotonicClock()
    ex = Executor(dev, make_backend(dev, 1), clock, results.put, {program.spec.key: program})
    ex.start()
    try:
        now = clock.now()
        ex.submit(Action(ActionKind.LOAD, program.spec, dev.name, now, now + 10))
        load = results.get(timeout=60)
        assert load.ok and load.duration > 0, load.error  # measured with events
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        req = InferenceRequest(program.spec, (x,), 2, now, now + 10)
        now = clock.now()
        ex.submit(Action(ActionKind.INFER, program.spec, dev.name, now, now + 10, batch_size=2, requests=[req]))
        res = results.get(timeout=60)
        assert res.ok and res.duration > 0, res.error
        with torch.no_grad():
            want = TinyLinear()(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(res.outputs[0], want, rtol=1e-4)
        now = clock.now()
        ex.submit(Action(ActionKind.UNLOAD, program.spec, dev.name, now, now + 10))
        assert results.get(timeout=60).status == ResultStatus.OK
        assert ex.used_bytes == dev.workspace  # the arena stays; the reserve is charged once
    finally:
        ex.stop()


def test_a_daemon_on_the_gpu_serves_every_demo_model(demo_repo: Path) -> None:
    d = short_tmpdir()
    repo = d / "repo"
    shutil.copytree(demo_repo, repo)
    for f in repo.glob("*/*/profile.json"):
        f.unlink()  # measured on this device, in the warm-up
    s = settings(repo, d, runtime={"devices": [gpu_device()], "weight_budget": "1GiB",
                                   "device_workspace": "256MiB"})
    dt = DaemonThread(s).start()
    try:
        serve_and_compare(dt, repo, sorted(m.name for m in scan(repo).models if not m.name.endswith("parity")))
        assert not dt.errors
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_a_device_side_error_fails_the_device(tmp_path: Path) -> None:
    """A real device-side assert (an out-of-range gather) leaves the context unusable: the backend
    says so and every later action fails at once. In a subprocess: the error poisons the process."""
    script = textwrap.dedent(f"""
        import queue, sys, numpy as np, torch
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from daemon.actions import Action, ActionKind
        from daemon.clock import MonotonicClock
        from daemon.demo import save_model
        from daemon.repository import scan
        from daemon.request import InferenceRequest
        from daemon.runtime.devices import resolve_devices
        from daemon.runtime.executor import Executor, make_backend
        from daemon.runtime.program import load_program

        class Gather(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.table = torch.nn.Parameter(torch.arange(12.0).reshape(4, 3))
            def forward(self, idx):
                return self.table[idx.to(torch.int64).clamp(min=0)]  # no upper bound: an index of 9 asserts

        root = Path({str(tmp_path)!r}) / "repo"
        save_model(Gather().eval(), "pt2", torch.zeros(2, dtype=torch.int32), 4, root / "g" / "1" / "model.pt2")
        (root / "g" / "config.toml").write_text('max_batch_size = 4\\n[[inputs]]\\nname = "i"\\ndatatype = "INT32"\\n'
                                                'shape = [-1]\\n[[outputs]]\\nname = "o"\\ndatatype = "FP32"\\n'
                                                'shape = [-1, 3]\\n')
        program = load_program(scan(root).models[0])
        (dev,) = resolve_devices([{gpu_device()!r}], 192 << 20, 128 << 20)
        backend = make_backend(dev, 1)
        results = queue.Queue()
        clock = MonotonicClock()
        ex = Executor(dev, backend, clock, results.put, {{program.spec.key: program}})
        ex.start()
        def act(kind, **kw):
            now = clock.now()
            ex.submit(Action(kind, program.spec, dev.name, now, now + 30, **kw))
            return results.get(timeout=60)
        assert act(ActionKind.LOAD).ok
        bad = InferenceRequest(program.spec, (np.array([9], np.int32),), 1, 0.0, 0.0)
        if dev.kind == "emucuda":
            backend.api.fail_next_kernel("device-side assert triggered")
        r = act(ActionKind.INFER, batch_size=1, requests=[bad])
        print("INFER", r.status.name, r.failure.name, r.error)
        r = act(ActionKind.UNLOAD)
        print("UNLOAD", r.status.name, r.failure.name, backend.failed)
        ex.stop()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("INFER", "UNLOAD")))
    assert lines["INFER"].startswith(f"FAILED {Failure.DEVICE.name}"), out.stdout
    assert lines["UNLOAD"].startswith(f"FAILED {Failure.DEVICE.name}"), out.stdout
