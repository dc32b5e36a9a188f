"""Lost devices, LOADs refused for memory, failed LOADs and warm-up room: the controller's side."""

from __future__ import annotations

import pytest

from daemon.actions import Action, ActionKind, Failure, ResultStatus
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.policy import Policy
from daemon.controller.scheduler import LOAD_BACKOFF, NO_MEMORY_RETRIES
from daemon.errors import Unavailable
from daemon.request import InferenceRequest
from tests.unit.harness import MS, Harness, kinds, make_spec


def drain(h: Harness, todo: list[Action], r: InferenceRequest) -> None:
    """Complete actions in order until `r` is finished."""
    while not r.status.finished:
        assert todo, "the request is stuck"
        todo = todo[1:] + h.result(todo[0])


POLICIES = [pytest.param(lambda: DynamicBatchingPolicy(0.0), id="dynamic"),
            pytest.param(lambda: ClockworkPolicy(5 * MS, 0.0), id="clockwork")]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.expect_errors('device-side assert')
def test_defect7_a_lost_device_gets_no_more_work_and_its_requests_move(policy: type[Policy]) -> None:
    h = Harness(devices=2, policy=policy())
    spec = h.add(make_spec())
    h.preload(spec, 2)
    r = h.request(spec, timeout=1.0)
    (infer,) = h.step()
    lost = infer.device
    todo = h.result(infer, ResultStatus.FAILED, error="DeviceFault: device-side assert", failure=Failure.DEVICE)
    dev = h.sched.devices[lost]
    assert dev.failed and dev.memory.budget == 0 and not dev.memory.models()
    assert lost not in h.sched.ready_on.get(spec.key, set())
    assert all(a.device != lost for a in todo)
    drain(h, todo, r)
    assert r.ok
    for _ in range(5):  # later work too stays off it
        h.run_until(h.request(spec, timeout=1.0))
    assert all(a.device != lost for a in h.actions if a.issued_at > infer.issued_at)
    assert h.sched.statistics()["devices"][lost]["failed"]


@pytest.mark.expect_errors('a kernel hangs')
def test_defect7_when_every_device_is_lost_requests_are_refused_at_once() -> None:
    h = Harness(devices=1)
    spec = h.add(make_spec())
    h.preload(spec, 1)
    queued = [h.request(spec, timeout=1.0) for _ in range(3)]
    infer, *_ = h.step()
    h.result(infer, ResultStatus.FAILED, error="DeviceHang: a kernel hangs", failure=Failure.DEVICE)
    assert all(r.status.finished and not r.ok for r in queued)
    assert all(isinstance(r.error, Unavailable) for r in queued if r not in infer.requests)
    with pytest.raises(Unavailable, match="every device"):
        h.request(spec)


@pytest.mark.parametrize("policy", POLICIES)
def test_defect8_a_load_refused_for_memory_evicts_and_tries_again(policy: type[Policy]) -> None:
    h = Harness(devices=1, budget=300, policy=policy())
    a, b, c = (h.add(make_spec(name)) for name in "abc")
    h.use(a)
    h.use(b)  # 200 of 300 used: c fits on paper
    r = h.request(c, timeout=1.0)
    (load,) = h.step()
    assert load.model is c
    todo = h.result(load, ResultStatus.FAILED, error="NoMemory: fragmented", failure=Failure.NO_MEMORY)
    assert not r.status.finished  # still queued
    evicted = [x for x in h.actions if x.kind == ActionKind.UNLOAD and x.issued_at == h.now]
    assert [x.model for x in evicted] == [a]  # the least recently used goes
    assert kinds(todo) == ["LOAD"] and todo[0].model is c  # and the load is tried again
    drain(h, todo, r)
    assert r.ok
    assert h.sched.counters["load_retries"] == 1


@pytest.mark.expect_errors('load of m:1 on cpu:0 failed: NoMemory')
def test_defect8_loads_refused_for_memory_too_often_back_off() -> None:
    h = Harness(devices=1, budget=1000)
    spec = h.add(make_spec())
    r = h.request(spec, timeout=10.0)
    todo = h.step()
    for _ in range(NO_MEMORY_RETRIES + 1):
        (load,) = [a for a in todo if a.kind == ActionKind.LOAD]
        todo = h.result(load, ResultStatus.FAILED, error="NoMemory: pinned budget", failure=Failure.NO_MEMORY)
    assert r.status.finished and isinstance(r.error, Unavailable)
    assert h.sched.devices["cpu:0"].load_backoff[spec.key] > h.now


@pytest.mark.expect_errors('load of m:1 on cpu:0 failed: RuntimeError: broken kernel')
def test_defect8_a_failed_load_backs_off_that_device_and_another_serves() -> None:
    h = Harness(devices=2)
    spec = h.add(make_spec())
    r = h.request(spec, timeout=5.0)
    (load,) = h.step()
    bad = load.device
    todo = h.result(load, ResultStatus.FAILED, error="RuntimeError: broken kernel")
    assert not r.status.finished  # the other device may load it
    assert not h.sched.devices[bad].can_load(spec.key, h.now)
    (again,) = [a for a in todo if a.kind == ActionKind.LOAD]
    assert again.device != bad
    drain(h, todo, r)
    assert r.ok
    h.clock.advance(LOAD_BACKOFF[0])
    assert h.sched.devices[bad].can_load(spec.key, h.now)


def test_defect5_warm_up_room_evicts_idle_models_and_is_never_a_victim() -> None:
    h = Harness(devices=1, budget=300)
    a, b = h.add(make_spec("a")), h.add(make_spec("b"))
    h.use(a)
    h.use(b)
    dev = h.sched.reserve("warmup:c:1", 200, "cpu", h.now)
    assert dev == "cpu:0"
    unloads = h.step()  # what the reservation decided
    assert kinds(unloads) == ["UNLOAD"] and unloads[0].model is a
    assert h.sched.reserve("warmup:d:1", 200, "cpu", h.now) is None  # b is all that could go: not enough
    assert h.step() == []
    h.use(a)  # serving goes on beside the warm-up: b makes room, the warm-up's bytes stay
    assert h.sched.devices["cpu:0"].memory.state("warmup:c:1") is not None
    h.sched.unreserve("warmup:c:1", "cpu:0", h.now)
    assert h.sched.devices["cpu:0"].memory.state("warmup:c:1") is None


@pytest.mark.parametrize("policy", POLICIES)
def test_a_warm_up_takes_the_device_with_the_least_live_work(policy: type[Policy]) -> None:
    h = Harness(devices=2, budget=1000, policy=policy())
    spec = h.add(make_spec())
    h.preload(spec, 2)  # both hold it, equally full
    h.request(spec, timeout=1.0)
    (infer,) = h.step()
    assert infer.device == "cpu:0"  # the first by name: what a choice by free memory alone would take too
    assert h.sched.reserve("warmup:n:1", 100, "cpu", h.now) == "cpu:1"  # not beside the live INFER


@pytest.mark.parametrize("policy", POLICIES)
def test_live_work_keeps_off_a_device_while_it_runs_a_warm_up(policy: type[Policy]) -> None:
    h = Harness(devices=2, budget=1000, policy=policy())
    spec = h.add(make_spec())
    h.preload(spec, 2)
    dev = h.sched.reserve("warmup:n:1", 100, "cpu", h.now)
    assert dev == "cpu:0" and h.sched.devices[dev].warming == "warmup:n:1"
    start = len(h.actions)
    for _ in range(6):
        h.run_until(h.request(spec, timeout=1.0))
    infers = [a for a in h.actions[start:] if a.kind == ActionKind.INFER]
    assert len(infers) == 6 and {a.device for a in infers} == {"cpu:1"}
    h.sched.unreserve("warmup:n:1", dev, h.now)
    assert h.sched.devices[dev].warming == ""
    h.run_until(h.request(spec, timeout=1.0))


# ------------------------------------------------------------------ actions that never come back


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.expect_errors("hung: INFER of m:1 has not returned")
def test_an_infer_that_never_returns_makes_its_device_hung_and_its_work_moves(policy: type[Policy]) -> None:
    h = Harness(devices=2, policy=policy())
    h.sched.hung_after_s = 2.0
    spec = h.add(make_spec())
    h.preload(spec, 2)
    r = h.request(spec, timeout=60.0)
    (infer,) = h.step()
    stuck = infer.device
    # nothing returns: the wake-ups the scheduler asks for bring the hung watch
    wake = h.sched.next_wakeup(h.now)
    assert wake is not None and wake <= infer.issued_at + 10 * infer.expected_duration + 2.0 + 1e-9
    h.clock.set(wake)
    todo = h.step()
    assert h.sched.devices[stuck].failed.startswith("hung: INFER of m:1 has not returned")
    assert stuck in h.sched.hung and h.sched.counters["actions_hung"] == 1
    assert all(a.device != stuck for a in todo)
    if not r.status.finished:
        h.run_until(r)
    later = h.request(spec, timeout=1.0)
    h.run_until(later)
    assert later.ok and all(a.device != stuck for a in h.actions if a.issued_at > infer.issued_at)


@pytest.mark.expect_errors("hung: LOAD of m:1 has not returned")
def test_a_load_that_never_returns_releases_its_placement_and_another_device_loads() -> None:
    h = Harness(devices=2, budget=1000)
    h.sched.hung_after_s = 5.0
    spec = h.add(make_spec(), nbytes=600)  # one device at a time could hold it: no replica
    placed = h.sched.preload(spec.key, 1, h.now)
    (load,) = h.step()
    assert load.kind == ActionKind.LOAD and h.sched.placed_on[spec.key] == set(placed)
    h.clock.set(load.issued_at + 5.0 + 600 / 1e9 + 1e-6)
    h.step()
    assert h.sched.devices[load.device].failed and load.device in h.sched.hung
    assert not h.sched.placed_on.get(spec.key)  # a preload waiting for it ("landed") ends
    r = h.request(spec, timeout=1.0)
    h.run_until(r)
    assert r.ok
    assert all(a.device != load.device for a in h.actions if a.issued_at > load.issued_at)


def test_actions_that_return_never_count_as_hung() -> None:
    h = Harness(devices=1)
    h.sched.hung_after_s = 0.5
    spec = h.add(make_spec())
    for _ in range(20):
        h.use(spec)
        h.clock.advance(0.3)
    h.clock.advance(100.0)
    h.step()
    assert not h.sched.hung and h.sched.counters["actions_hung"] == 0
    assert h.sched.next_wakeup(h.now) is None  # and nothing left to watch
