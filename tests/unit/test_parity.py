"""ParM serving in the controller: coding groups, reconstructions, replicas, races, no leaks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from daemon.actions import Action, ActionKind, ResultStatus
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.model import ModelSpec, ParitySpec
from daemon.parity.groups import DECODE_MARGIN, Coding
from daemon.parity.spec import parity_model
from daemon.request import InferenceRequest, RequestStatus
from tests.unit.harness import MS, Harness, make_spec


def setup(k: int = 2, devices: int = 3, flush_ms: float = 25.0) -> tuple[Harness, ModelSpec]:
    """A model with parity on cpu:0..cpu:(k-1) and its parity model on the last device."""
    h = Harness(devices=devices, policy=ClockworkPolicy(), budget=1000)
    spec = replace(make_spec("m", max_batch=4), parity=ParitySpec(k, "sum", "parity.pt2", flush_ms))
    h.sched.add_model(spec, 100, {1: 2 * MS, 4: 5 * MS}, "cpu")
    pspec = parity_model(spec)
    h.sched.add_model(pspec, 100, {1: 2 * MS, 4: 5 * MS}, "cpu")
    placed = h.sched.preload(spec.key, k, h.now)
    h.sched.preload(pspec.key, 1, h.now, avoid=set(placed))
    for load in h.step():  # the preloads' LOADs
        h.result(load)
    return h, spec


def two_members(h: Harness, spec: ModelSpec) -> tuple[Action, Action, Action, InferenceRequest, InferenceRequest]:
    """Two single-request batches, one per data device, and the group's parity batch."""
    a = h.request(spec, timeout=50 * MS)
    (m0,) = [x for x in h.step() if x.kind == ActionKind.INFER]
    b = h.request(spec, timeout=50 * MS)
    acts = [x for x in h.step() if x.kind == ActionKind.INFER]
    (m1,) = [x for x in acts if x.coded is None]
    (parity,) = [x for x in acts if x.coded is not None]
    return m0, m1, parity, a, b


def out(v: float) -> tuple[np.ndarray, ...]:
    return (np.array([[v]], dtype=np.float32),)


def assert_no_state(h: Harness) -> None:
    stats = h.sched.coding.statistics()
    assert stats["live_groups"] == 0 and stats["tracked_actions"] == 0 and stats["replicas_in_flight"] == 0
    assert h.sched.pending == 0


def test_k_batches_form_a_group_and_its_parity_runs_on_another_device() -> None:
    h, spec = setup()
    m0, m1, parity, a, b = two_members(h, spec)
    assert {m0.device, m1.device} == {"cpu:0", "cpu:1"}
    assert parity.device == "cpu:2" and parity.model.name == "m.parity"
    assert parity.coded == [[a], [b]] and parity.encoder == "sum" and parity.samples == 1
    assert h.sched.counters["coding_groups"] == 1 and h.sched.counters["parities_issued"] == 1


def test_a_failed_member_is_reconstructed_from_the_parity_and_the_others() -> None:
    h, spec = setup()
    m0, m1, parity, a, b = two_members(h, spec)
    h.result(m0, ResultStatus.FAILED, duration=1 * MS, error="device error")
    assert a.status == RequestStatus.RUNNING  # held for a reconstruction, not failed
    h.result(m1, outputs=out(3.0))
    h.result(parity, outputs=out(10.0))
    assert a.ok and a.reconstructed and float(a.outputs[0][0, 0]) == 7.0  # 10 - 3
    assert b.ok and not b.reconstructed
    assert h.sched.counters["reconstructions"] == 1
    assert h.sched.telemetry.decode_time.count == 1
    assert_no_state(h)


def test_a_refused_member_is_reconstructed_too() -> None:
    h, spec = setup()
    m0, m1, parity, a, _b = two_members(h, spec)
    h.result(m1, outputs=out(1.0))
    h.result(parity, outputs=out(5.0))
    h.result(m0, ResultStatus.TOO_LATE, duration=0.0)
    assert a.ok and a.reconstructed and float(a.outputs[0][0, 0]) == 4.0
    assert_no_state(h)


def test_a_straggling_member_is_reconstructed_and_the_late_original_ignored() -> None:
    h, spec = setup()
    m0, m1, parity, a, _b = two_members(h, spec)
    # the others run in parallel with m0 and come back quickly, while m0 is still on time
    h.result(m1, outputs=out(2.0), duration=0.2 * MS)
    h.result(parity, outputs=out(6.0), duration=0.2 * MS)
    assert a.status == RequestStatus.RUNNING  # predicted on time: wait for the original
    wake = h.sched.next_wakeup(h.now)
    # m0 planned 2 ms from its start: a straggler once it is 1 ms (and half its run) past that
    assert wake == pytest.approx(m0.expected_start + m0.expected_duration + max(1 * MS, m0.expected_duration / 2))
    assert wake < a.deadline - DECODE_MARGIN
    h.clock.set(wake)
    h.step()
    assert a.ok and a.reconstructed and float(a.outputs[0][0, 0]) == 4.0 and a.finished_at < a.deadline
    h.result(m0, outputs=out(99.0))  # the original, too late: it changes nothing
    assert float(a.outputs[0][0, 0]) == 4.0
    assert_no_state(h)


def test_the_original_wins_when_it_arrives_first() -> None:
    h, spec = setup()
    m0, m1, parity, a, b = two_members(h, spec)
    h.result(m0, outputs=out(1.0))
    h.result(m1, outputs=out(2.0))
    assert a.ok and not a.reconstructed and b.ok and not b.reconstructed
    h.result(parity, outputs=out(3.0))
    assert h.sched.counters["reconstructions"] == 0
    assert_no_state(h)


def test_a_lost_parity_releases_a_held_member_to_be_retried() -> None:
    h, spec = setup()
    m0, m1, parity, a, _b = two_members(h, spec)
    h.result(m0, ResultStatus.TOO_LATE, duration=0.0)
    assert a.status == RequestStatus.RUNNING
    acts = h.result(parity, ResultStatus.FAILED, duration=1 * MS)
    retry = [x for x in acts if x.kind == ActionKind.INFER and a in x.requests]
    assert retry, "the held request goes back to the queue and runs again"
    h.result(m1)
    h.result(retry[0])
    assert a.ok and not a.reconstructed
    h.clock.advance(30 * MS)  # the retry opened a group of its own: flushed, with nothing left to protect
    h.step()
    assert_no_state(h)


def test_a_partial_group_is_flushed_and_protected_by_a_replica() -> None:
    h, spec = setup(flush_ms=1.0)  # flushed before its member could be called a straggler
    a = h.request(spec, timeout=50 * MS)
    (m0,) = [x for x in h.step() if x.kind == ActionKind.INFER]
    assert h.sched.next_wakeup(h.now) == pytest.approx(h.now + 1 * MS)
    h.clock.advance(1 * MS)
    (replica,) = [x for x in h.step() if x.replica_of]
    assert replica.replica_of == m0.id and replica.device != m0.device and replica.requests == [a]
    assert h.sched.counters["groups_flushed"] == 1 and h.sched.counters["replicas"] == 1
    h.result(replica, outputs=out(8.0))
    assert a.ok and a.reconstructed and float(a.outputs[0][0, 0]) == 8.0
    h.result(m0, outputs=out(9.0))  # the original, later: ignored
    assert float(a.outputs[0][0, 0]) == 8.0
    assert_no_state(h)


def test_a_straggler_of_a_partial_group_gets_its_replica_without_waiting_for_the_flush() -> None:
    h, spec = setup(flush_ms=40.0)
    a = h.request(spec, timeout=50 * MS)
    (m0,) = [x for x in h.step() if x.kind == ActionKind.INFER]
    (member,) = [m for g in h.sched.coding.groups.values() for m in g.members]
    straggling_at = member.straggling_at()
    assert straggling_at < h.now + 40 * MS
    assert h.sched.next_wakeup(h.now) == pytest.approx(straggling_at)
    h.clock.set(straggling_at)
    (replica,) = [x for x in h.step() if x.replica_of]
    assert replica.replica_of == m0.id and replica.device != m0.device
    assert h.sched.counters["groups_flushed"] == 0 and h.sched.counters["replicas"] == 1
    h.result(replica, outputs=out(8.0))
    assert a.ok and a.reconstructed
    h.clock.advance(40 * MS)  # the flush comes and goes: no second replica
    assert not [x for x in h.step() if x.replica_of] and h.sched.counters["replicas"] == 1
    h.result(m0, outputs=out(9.0))
    assert float(a.outputs[0][0, 0]) == 8.0
    assert_no_state(h)


@pytest.mark.parametrize("status", [ResultStatus.TOO_LATE, ResultStatus.FAILED])
@pytest.mark.expect_errors('failed: boom')
def test_an_original_refused_or_failed_after_its_replica_answered_leaves_no_group(status: ResultStatus) -> None:
    h, spec = setup(flush_ms=10.0)
    a = h.request(spec, timeout=50 * MS)
    (m0,) = [x for x in h.step() if x.kind == ActionKind.INFER]
    h.clock.advance(10 * MS)
    (replica,) = [x for x in h.step() if x.replica_of]
    h.result(replica, outputs=out(8.0))
    assert a.ok and a.reconstructed
    h.result(m0, status=status, error="boom")
    assert a.ok and float(a.outputs[0][0, 0]) == 8.0
    assert_no_state(h)


def test_without_a_parity_model_on_any_device_groups_go_unprotected_but_work() -> None:
    h = Harness(devices=2, policy=ClockworkPolicy(), budget=150)
    spec = replace(make_spec("m", max_batch=4), parity=ParitySpec(2, "sum", "parity.pt2", 25.0))
    h.sched.add_model(spec, 100, {1: 2 * MS, 4: 5 * MS}, "cpu")
    h.sched.add_model(parity_model(spec), 100, {1: 2 * MS, 4: 5 * MS}, "cpu")
    for _ in range(4):
        h.use(spec)
    assert h.sched.counters["parity_unavailable"] >= 1
    assert_no_state(h)


def test_requests_of_an_action_that_never_returns_are_answered_after_their_deadline() -> None:
    h, spec = setup()
    m0, m1, parity, a, _b = two_members(h, spec)
    h.result(m1, outputs=out(1.0))
    acts = h.result(parity, ResultStatus.FAILED, duration=1 * MS)  # no reconstruction possible
    (member,) = [m for g in h.sched.coding.groups.values() for m in g.members if m.action is m0]
    h.clock.set(max(h.now, member.straggling_at()))  # its group has no parity now: a straggler gets a replica
    (replica,) = [x for x in acts + h.step() if x.replica_of]
    h.result(replica, ResultStatus.FAILED, error="boom")  # which fails too
    h.clock.set(a.deadline + 0.006)  # m0's device never answers
    h.step()
    assert a.status == RequestStatus.FAILED and "did not answer in time" in a.error.message
    assert h.sched.counters["overdue"] == 1
    h.result(m0, outputs=out(5.0))  # it comes back at last: nothing changes
    assert a.status == RequestStatus.FAILED
    assert_no_state(h)


def _batch(spec: ModelSpec, device: str) -> Action:
    return Action(ActionKind.INFER, spec, device, 0.0, 1.0, 2 * MS, 1)


def test_a_group_takes_at_most_one_member_per_device_so_one_hung_device_costs_it_one_member() -> None:
    spec = replace(make_spec("m", max_batch=4), parity=ParitySpec(2, "sum", "parity.pt2", 25.0))
    c = Coding()
    a0, b0, a1, b1 = (_batch(spec, d) for d in ("cpu:0", "cpu:0", "cpu:1", "cpu:1"))
    assert c.add(a0, 0.0, 2) is None and c.add(b0, 0.0, 2) is None  # b0 opens a second group
    g1, g2 = c.add(a1, 0.0, 2), c.add(b1, 0.0, 2)
    assert g1 is not None and [m.action for m in g1.members] == [a0, a1]
    assert g2 is not None and [m.action for m in g2.members] == [b0, b1]
    assert c.statistics()["open_groups"] == 0


def test_on_a_single_device_groups_still_fill() -> None:
    spec = replace(make_spec("m", max_batch=4), parity=ParitySpec(2, "sum", "parity.pt2", 25.0))
    c = Coding()
    acts = [_batch(spec, "cpu:0") for _ in range(4)]
    done = [c.add(a, 0.0, 1) for a in acts]
    assert done[0] is None and done[2] is None
    assert done[1] is not None and [m.action for m in done[1].members] == acts[:2]
    assert done[3] is not None and [m.action for m in done[3].members] == acts[2:]


def test_a_straggler_whose_parity_is_not_back_gets_a_replica() -> None:
    h, spec = setup()
    m0, m1, parity, a, _b = two_members(h, spec)
    h.result(m1, outputs=out(2.0), duration=0.2 * MS)  # the other member is in; the parity is still running
    (member,) = [m for g in h.sched.coding.groups.values() for m in g.members if m.action is m0]
    h.clock.set(max(h.now, member.straggling_at()))
    (replica,) = [x for x in h.step() if x.replica_of]
    assert replica.replica_of == m0.id and replica.device != m0.device
    h.result(replica, outputs=out(7.0))
    assert a.ok and a.reconstructed and float(a.outputs[0][0, 0]) == 7.0
    h.result(parity, outputs=out(6.0))  # too late to matter
    h.result(m0, outputs=out(9.0))
    assert float(a.outputs[0][0, 0]) == 7.0
    assert_no_state(h)
