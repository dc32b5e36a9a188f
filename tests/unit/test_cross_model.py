"""Cross-model batching (controller/sharing.py): requests of models that share a leading stage
join one batch when every request still meets its deadline, and each model's requests are
answered, retried or estimated as its own."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.model import ModelSpec
from daemon.request import RequestStatus
from daemon.runtime.program import prefix_key, tail_key
from tests.unit.harness import MS, Harness, make_spec

STAGES = {1: (1.0 * MS, 0.2 * MS), 8: (2.0 * MS, 0.4 * MS)}  # batch -> (prefix s, tail s)


def staged(h: Harness, names: str, prefix: str = "bb") -> list[ModelSpec]:
    """Models whose plans share `prefix`, each resident on cpu:0 (one request served)."""
    specs = []
    for name in names:
        spec = make_spec(name)
        h.sched.add_model(spec, 650, {1: 1.2 * MS, 8: 2.4 * MS}, "cpu", blocks=((prefix, 600), (f"h{name}", 50)),
                          prefix=prefix)
        h.sched.seed_stages(spec.key, "cpu", STAGES)
        h.use(spec)
        specs.append(spec)
    return specs


def infers(actions: list[Action]) -> list[Action]:
    return [a for a in actions if a.kind == ActionKind.INFER]


def busy_then_queue(h: Harness, lead: ModelSpec, others: list[ModelSpec], timeout: float = 0.1) -> list[Action]:
    """An INFER of `lead` in flight; then a request of `lead` and of each other model queued behind
    it; returns the batches planned next (the device frees within the schedule-ahead horizon)."""
    assert not infers(h.step())  # (nothing to run yet)
    h.request(lead, timeout=timeout)
    running = infers(h.step())
    assert len(running) == 1
    h.request(lead, timeout=timeout)
    for s in others:
        h.request(s, timeout=timeout)
    return infers(h.step())


def one_batch(h: Harness, lead: ModelSpec, others: list[ModelSpec]) -> Action:
    nxt = busy_then_queue(h, lead, others)
    assert len(nxt) == 1
    return nxt[0]


def test_requests_of_models_sharing_a_prefix_run_in_one_batch() -> None:
    h = Harness(policy=ClockworkPolicy(batch_wait=0.0))
    a, b, c = staged(h, "abc")
    action = one_batch(h, a, [b, c])
    assert action.group is not None
    assert [(s.key, n) for s, n in action.group] == [(a.key, 1), (b.key, 1), (c.key, 1)]
    assert [r.model.key for r in action.requests] == [a.key, b.key, c.key]
    assert action.batch_size == a.batch_size_for(3)
    est = h.sched.estimator
    want = est.infer(prefix_key("bb"), 3, "cpu") + sum(est.infer(tail_key(s.key), 1, "cpu") for s in (a, b, c))
    assert action.expected_duration == pytest.approx(want)
    assert all(r.status == RequestStatus.RUNNING for r in action.requests)
    assert all(h.sched.models[s.key].queue.requests == 0 for s in (a, b, c))
    assert h.sched.counters["cross_model_batches"] == 1
    dev = h.sched.devices["cpu:0"]
    assert dev.busy[b.key] == 1 and dev.busy[c.key] == 1


def test_each_member_gets_its_own_rows_and_stage_estimates_learn() -> None:
    h = Harness(policy=ClockworkPolicy(batch_wait=0.0))
    a, b = staged(h, "ab")
    action = one_batch(h, a, [b])
    reqs = list(action.requests)
    parts = ((np.array([[1.0]], np.float32),), (np.array([[2.0], [2.5]], np.float32)[:1],))
    h.clock.advance(action.expected_duration)
    r = Result(action, ResultStatus.OK, h.now, h.now - 1 * MS, h.now, 1 * MS, parts[0], parts=parts,
               stage_runs=((prefix_key("bb"), 2, 5 * MS), (tail_key(a.key), 1, 3 * MS), (tail_key(b.key), 1, 3 * MS)))
    h.collect(h.sched.on_result(r, h.now))
    assert [q.outputs[0].tolist() for q in reqs] == [[[1.0]], [[2.0]]]
    assert all(q.ok for q in reqs)
    est = h.sched.estimator
    assert est.infer(prefix_key("bb"), 2, "cpu", "cpu:0") == pytest.approx(5 * MS)  # measured, per stage
    assert est.infer(tail_key(b.key), 1, "cpu", "cpu:0") == pytest.approx(3 * MS)
    assert h.sched.devices["cpu:0"].busy[b.key] == 0 and h.sched.models[b.key].running == 0


def test_a_member_that_would_make_someone_late_is_left_out() -> None:
    h = Harness(policy=ClockworkPolicy(batch_wait=0.0))
    a, b = staged(h, "ab")
    # the lead's deadline leaves room for its own batch (busy device, then prefix + its tail) but
    # not for a second model's tail as well
    h.request(a, timeout=0.1)
    running = infers(h.step())
    free_at = h.now + running[0].expected_duration
    est = h.sched.estimator
    alone = est.infer(prefix_key("bb"), 1, "cpu") + est.infer(tail_key(a.key), 1, "cpu")
    whole = est.infer(a.key, 1, "cpu")
    tight = free_at - h.now + max(alone, whole) + 0.01 * MS
    h.request(a, timeout=tight)
    h.request(b, timeout=0.1)
    nxt = infers(h.step())
    assert nxt and nxt[0].model.key == a.key and nxt[0].group is None  # b waits for its own batch


def test_models_with_other_prefixes_are_not_batched_together() -> None:
    h = Harness(budget=2000, policy=ClockworkPolicy(batch_wait=0.0))  # room for both backbones
    (a,) = staged(h, "a", prefix="bb")
    (x,) = staged(h, "x", prefix="other")
    nxt = busy_then_queue(h, a, [x])
    assert [(n.model.key, n.group) for n in nxt] == [(a.key, None), (x.key, None)]


@pytest.mark.parametrize("why", ["setting", "device"])
def test_no_cross_model_batch_when_off_or_on_a_device_that_does_not_share(why: str) -> None:
    h = Harness(policy=ClockworkPolicy(batch_wait=0.0, cross_model=why != "setting"))
    a, b = staged(h, "ab")
    if why == "device":
        h.sched.devices["cpu:0"].memory.shares = False  # (as a CUDA arena: each model apart)
    nxt = busy_then_queue(h, a, [b])
    assert [(n.model.key, n.group) for n in nxt] == [(a.key, None), (b.key, None)]


def test_a_lost_cross_model_batch_returns_each_request_to_its_own_queue() -> None:
    h = Harness(policy=ClockworkPolicy(batch_wait=0.0))
    a, b = staged(h, "ab")
    action = one_batch(h, a, [b])
    assert action.group is not None
    r = Result(action, ResultStatus.TOO_LATE, h.now, h.now, h.now, error="late")
    h.collect(h.sched.on_result(r, h.now))
    assert h.sched.models[a.key].queue.requests == 1 and h.sched.models[b.key].queue.requests == 1
    assert all(q.status == RequestStatus.QUEUED for q in action.requests)
    assert h.sched.devices["cpu:0"].busy[a.key] == 1  # only the first batch, still running


def test_a_member_joins_with_no_more_rows_than_its_own_largest_batch() -> None:
    """Its tail runs on its rows alone: the lead's larger limit must not stretch it."""
    h = Harness(policy=ClockworkPolicy(batch_wait=0.0))
    (a,) = staged(h, "a")
    b = make_spec("b", max_batch=2)
    h.sched.add_model(b, 650, {1: 1.2 * MS, 2: 1.4 * MS}, "cpu", blocks=(("bb", 600), ("hb", 50)), prefix="bb")
    h.sched.seed_stages(b.key, "cpu", STAGES)  # estimates up to 8 rows: only its limit holds it to 2
    h.use(b)
    assert not infers(h.step())
    h.request(a, timeout=0.1)
    assert len(infers(h.step())) == 1  # a's batch in flight; the rest queue behind it
    h.request(a, timeout=0.1)
    for _ in range(4):
        h.request(b, timeout=0.1)
    nxt = infers(h.step())
    groups = [dict((s.key, n) for s, n in x.group) for x in nxt if x.group is not None]
    assert groups and all(g.get(b.key, 0) <= 2 for g in groups)
