"""Programs and executors on real CPU devices: windows, budgets, weight copies, timings."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.clock import MonotonicClock
from daemon.errors import ProgramError
from daemon.model import ModelSpec
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.backend import CpuBackend
from daemon.runtime.devices import Device, resolve_devices
from daemon.runtime.executor import Executor
from daemon.runtime.program import Program, load_program
from tests.support import TinyLinear

MS = 1e-3


@pytest.fixture(scope="module")
def specs(test_repo: Path) -> dict[str, ModelSpec]:
    return {m.key: m for m in scan(test_repo).models}


@pytest.fixture(scope="module")
def programs(specs: dict[str, ModelSpec]) -> dict[str, Program]:
    return {k: load_program(specs[k]) for k in ("tiny_pt2:1", "tiny_ts:1", "all_types:1")}


def reference(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return TinyLinear()(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("key", ["tiny_pt2:1", "tiny_ts:1"])
def test_program_runs_the_model_from_its_own_weight_block(programs: dict[str, Program], key: str) -> None:
    p = programs[key]
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    (y,) = p.host_runner([torch.from_numpy(x)])
    np.testing.assert_allclose(y.numpy(), reference(x), rtol=1e-5)
    assert p.weight_bytes >= (12 + 3) * 4
    assert set(p.seed_timings) == {1, 2, 8}
    # A second binding over a copied block is independent of the host weights.
    block = p.host_block.clone()
    runner = p.bind(p.layout.views(block), native=True)
    block.zero_()
    (z,) = runner([torch.from_numpy(x)])
    assert not z.any()
    (y2,) = p.host_runner([torch.from_numpy(x)])
    np.testing.assert_allclose(y2.numpy(), y.numpy())


def test_exported_programs_get_a_native_runner_that_agrees_with_the_graph(programs: dict[str, Program]) -> None:
    p = programs["tiny_pt2:1"]
    assert p.bind_graph is not None and p.bind_native is not None
    views = p.layout.views(p.host_block)
    x = [torch.randn(5, 4)]
    np.testing.assert_allclose(p.bind(views, native=True)(x)[0].numpy(), p.bind(views, native=False)(x)[0].numpy(),
                               rtol=1e-6)
    # the TorchScript file has only a native runner, which serves every device
    ts = programs["tiny_ts:1"]
    assert ts.bind_graph is None and ts.bind(ts.layout.views(ts.host_block), native=False) is not None


def test_a_host_without_cpu_devices_reads_no_native_runner(specs: dict[str, ModelSpec],
                                                           programs: dict[str, Program]) -> None:
    from daemon.runtime.objstore import ObjectStore
    from daemon.runtime.shared_prefix import PrefixIndex

    lean = load_program(specs["tiny_pt2:1"], ObjectStore(), PrefixIndex(), native_runner=False)
    assert lean.bind_native is None and lean.bind_graph is not None
    x = [torch.randn(3, 4)]
    full = programs["tiny_pt2:1"]
    np.testing.assert_allclose(lean.host_runner(x)[0].numpy(), full.host_runner(x)[0].numpy(), rtol=1e-6)
    assert sorted(lean.seed_timings) == sorted(full.seed_timings)  # still checked at every probed size


def test_program_errors_say_what_is_wrong(specs: dict[str, ModelSpec]) -> None:
    with pytest.raises(ProgramError, match=r"wrong_shape:1: running a batch of 1 failed"):
        load_program(specs["wrong_shape:1"])
    with pytest.raises(ProgramError, match=r"garbage:1: cannot load model.pt2"):
        load_program(specs["garbage:1"])


def test_resolve_devices() -> None:
    (d,) = resolve_devices(["auto"]) if not torch.cuda.is_available() else resolve_devices(["cpu:0"])
    assert d.name == "cpu:0" and d.weight_budget == 1 << 30
    assert [x.name for x in resolve_devices(["cpu:0", "cpu:1"], 1234)] == ["cpu:0", "cpu:1"]


class Rig:
    """An executor on cpu:N whose results land in a queue the test reads."""

    def __init__(self, programs: dict[str, Program], budget: int = 1 << 20, index: int = 0) -> None:
        self.results: queue.Queue[Result] = queue.Queue()
        self.clock = MonotonicClock()
        self.device = Device(f"cpu:{index}", "cpu", index, budget)
        self.ex = Executor(self.device, CpuBackend(self.device), self.clock, self.results.put, programs)
        self.ex.start()

    def run(self, action: Action) -> Result:
        self.ex.submit(action)
        return self.next()

    def next(self) -> Result:
        return self.results.get(timeout=30)

    def load(self, spec: ModelSpec, **kw: float) -> Action:
        now = self.clock.now()
        return Action(ActionKind.LOAD, spec, self.device.name, kw.get("earliest", now), kw.get("latest", now + 10))

    def unload(self, spec: ModelSpec) -> Action:
        now = self.clock.now()
        return Action(ActionKind.UNLOAD, spec, self.device.name, now, now + 10)

    def infer(self, spec: ModelSpec, xs: list[np.ndarray], batch: int, **kw: float) -> Action:
        now = self.clock.now()
        reqs = [InferenceRequest(spec, (x,), len(x), now, now + 1) for x in xs]
        return Action(ActionKind.INFER, spec, self.device.name, kw.get("earliest", now), kw.get("latest", now + 10),
                      batch_size=batch, requests=reqs)


@pytest.fixture
def rig(programs: dict[str, Program]) -> Rig:
    r = Rig(programs)
    yield r
    r.ex.stop()


def test_load_infer_unload(rig: Rig, programs: dict[str, Program]) -> None:
    spec = programs["tiny_pt2:1"].spec
    res = rig.run(rig.load(spec))
    assert res.ok and res.weight_bytes == programs["tiny_pt2:1"].weight_bytes
    assert rig.ex.used_bytes == res.weight_bytes
    assert res.received <= res.begin <= res.end and res.duration >= 0
    x1 = np.ones((1, 4), np.float32)
    x2 = np.arange(8, dtype=np.float32).reshape(2, 4)
    res = rig.run(rig.infer(spec, [x1, x2], batch=4))
    assert res.ok
    (y,) = res.outputs
    assert y.shape == (3, 3)  # a CPU runs only the filled rows of the batch of 4
    np.testing.assert_allclose(y, reference(np.concatenate([x1, x2])), rtol=1e-5)
    res = rig.run(rig.infer(spec, [x1], batch=4))
    np.testing.assert_allclose(res.outputs[0], reference(x1), rtol=1e-5)
    assert rig.run(rig.unload(spec)).ok
    assert rig.ex.used_bytes == 0
    res = rig.run(rig.infer(spec, [x1], batch=1))
    assert res.status == ResultStatus.FAILED and "not on cpu:0" in res.error


def test_a_late_action_is_refused_without_doing_work(rig: Rig, programs: dict[str, Program]) -> None:
    spec = programs["tiny_pt2:1"].spec
    now = rig.clock.now()
    res = rig.run(rig.load(spec, earliest=now - 1, latest=now - 0.5))
    assert res.status == ResultStatus.TOO_LATE and "late by" in res.error
    assert rig.ex.used_bytes == 0 and not rig.ex.resident


def test_actions_start_in_order_of_earliest_and_never_before_it(rig: Rig, programs: dict[str, Program]) -> None:
    spec = programs["tiny_pt2:1"].spec
    assert rig.run(rig.load(spec)).ok
    now = rig.clock.now()
    later = rig.infer(spec, [np.ones((1, 4), np.float32)], 1, earliest=now + 0.04)
    sooner = rig.infer(spec, [np.ones((1, 4), np.float32)], 1, earliest=now + 0.02)
    rig.ex.submit(later)
    rig.ex.submit(sooner)
    first, second = rig.next(), rig.next()
    assert first.action is sooner and second.action is later
    for r in (first, second):
        assert r.ok and r.begin >= r.action.earliest
        assert r.lateness < 0.05  # generous: the machine is shared; figures come from bench/


def test_the_weight_budget_is_enforced(programs: dict[str, Program]) -> None:
    spec = programs["tiny_pt2:1"].spec
    rig = Rig(programs, budget=10)
    try:
        res = rig.run(rig.load(spec))
        assert res.status == ResultStatus.FAILED and "insufficient weight memory" in res.error
        assert rig.ex.used_bytes == 0
    finally:
        rig.ex.stop()


def test_each_device_holds_its_own_copy_of_the_weights(programs: dict[str, Program]) -> None:
    spec = programs["tiny_ts:1"].spec
    a, b = Rig(programs, index=0), Rig(programs, index=1)
    try:
        assert a.run(a.load(spec)).ok and b.run(b.load(spec)).ok
        for block, _ in a.ex.backend.blocks.values():  # only cpu:0's copy
            block.zero_()
        x = np.ones((1, 4), np.float32)
        assert not a.run(a.infer(spec, [x], 1)).outputs[0].any()
        np.testing.assert_allclose(b.run(b.infer(spec, [x], 1)).outputs[0], reference(x), rtol=1e-5)
    finally:
        a.ex.stop()
        b.ex.stop()


def test_stop_cancels_what_has_not_started(programs: dict[str, Program]) -> None:
    spec = programs["tiny_pt2:1"].spec
    rig = Rig(programs)
    far = rig.load(spec, earliest=rig.clock.now() + 60)
    rig.ex.submit(far)
    rig.ex.stop()
    res = rig.next()
    assert res.action is far and res.status == ResultStatus.CANCELLED
    rig.ex.submit(rig.unload(spec))  # after stop: refused at once
    assert rig.next().status == ResultStatus.CANCELLED


def test_every_datatype_runs(rig: Rig, programs: dict[str, Program]) -> None:
    spec = programs["all_types:1"].spec
    assert rig.run(rig.load(spec)).ok
    xs = [np.array([[1, 0, 1]], dtype=t.datatype.numpy) for t in spec.inputs]
    reqs = [InferenceRequest(spec, tuple(xs), 1, 0.0, 1.0)]
    now = rig.clock.now()
    res = rig.run(Action(ActionKind.INFER, spec, "cpu:0", now, now + 10, batch_size=1, requests=reqs))
    a, b, c, d, e, f = (o[0].tolist() for o in res.outputs)
    assert a == [False, True, False] and b == [2, 1, 2] and c == [2, 0, 2]
    assert d == [0, -1, 0] and e == [2.0, 0.0, 2.0] and f == [0.5, 0.0, 0.5]
    assert [o.dtype for o in res.outputs] == [t.datatype.numpy for t in spec.outputs]


def test_core_plan_gives_cpu_devices_their_own_cores() -> None:
    from daemon.runtime.devices import plan_cores

    cpu = [Device(f"cpu:{i}", "cpu", i, 1) for i in range(2)]
    assert plan_cores(cpu[:1], {0, 1}, True) == ({"cpu:0": 1}, {0})
    assert plan_cores(cpu, {0, 1, 2, 3}, True) == ({"cpu:0": 3, "cpu:1": 2}, {0, 1})
    assert plan_cores(cpu, {0, 1}, True) == ({}, None)  # no core would be left for the loop
    assert plan_cores(cpu[:1], {0, 1}, False) == ({}, None)
    assert plan_cores([Device("cuda:0", "cuda", 0, 1)], {0, 1}, True) == ({}, None)


def test_freed_blocks_are_reused_and_trimmed_to_the_budget() -> None:
    from daemon.runtime.backend import BlockPool

    pool = BlockPool()
    a = torch.empty(100, dtype=torch.uint8)
    pool.give(a)
    assert pool.take(50) is None
    assert pool.take(100) is a and pool.cached == 0
    pool.give(torch.empty(100, dtype=torch.uint8))
    pool.give(torch.empty(30, dtype=torch.uint8))
    pool.trim(40)  # largest first
    assert pool.cached == 30 and pool.take(100) is None


def test_profiling_measures_every_batch_size_and_round_trips(programs: dict[str, Program], tmp_path: Path) -> None:
    import shutil

    from daemon.repository import scan as scan_repo
    from daemon.runtime.profiler import profile_program, read_profile, seeds, write_profile

    p = programs["tiny_pt2:1"]
    dev = Device("cpu:0", "cpu", 0, 1 << 20)
    entry = profile_program(p, dev, CpuBackend(dev), MonotonicClock(), reps=3)
    assert set(entry["infer_ms"]) == {"1", "2", "4", "8"}
    assert all(v > 0 for v in entry["infer_ms"].values()) and entry["load_ms"] > 0
    # stored beside a copy of the model file, read back, turned into seeds
    shutil.copytree(p.spec.path.parent.parent, tmp_path / "tiny_pt2")
    (tmp_path / "tiny_pt2" / "1" / "profile.json").unlink(missing_ok=True)  # a daemon may have stored one
    (spec,) = [m for m in scan_repo(tmp_path).models]
    assert read_profile(spec) == {}
    assert write_profile(spec, "cpu", entry)
    assert read_profile(spec)["cpu"]["infer_ms"] == entry["infer_ms"]
    infer, load, _ = seeds(read_profile(spec)["cpu"])
    assert infer[8] == pytest.approx(entry["infer_ms"]["8"] / 1e3) and load == pytest.approx(entry["load_ms"] / 1e3)


def test_a_warm_up_over_weights_the_device_holds_seeds_a_partial_load(programs: dict[str, Program]) -> None:
    """Its LOADs copied only what the device lacked (here nothing: another holder has every block),
    so the profile says so and the estimate never takes that time for a full LOAD's."""
    import time

    from daemon.controller.estimates import Estimator
    from daemon.runtime.profiler import check_entry, profile_program, seeds

    p = programs["tiny_pt2:1"]
    dev = Device("cpu:0", "cpu", 0, 1 << 20)
    be = CpuBackend(dev)
    held, _ = be.load("another:1", p, time.monotonic() + 10)
    try:
        entry = profile_program(p, dev, be, MonotonicClock(), reps=3)
    finally:
        be.unload(held)
    assert 0 < entry["load_share"] < 1
    entry = check_entry(entry, p.spec.batch_sizes, "")  # stored and read back as it is
    _, load, share = seeds(entry)
    assert load is not None and share == entry["load_share"]
    est = Estimator()
    est.observe_load("m", "cpu", load, share=share)
    assert est.load("m", "cpu") is None  # no full LOAD seen yet
    full = Device("cpu:1", "cpu", 1, 1 << 20)  # a device holding none of it: a full LOAD, no share
    assert "load_share" not in profile_program(p, full, CpuBackend(full), MonotonicClock(), reps=3)
