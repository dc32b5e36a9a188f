"""Cross-model batching under the baseline policies (`dynamic`, `aimd`): the same rule as under
`clockwork` (controller/sharing.py): other models' requests join a batch of a model whose leading
stage they share only while every request still meets its deadline, each with at most the rows
the policy would run for it alone, and each model's requests are answered and retried as its own."""

from __future__ import annotations

import numpy as np
import pytest

from daemon.actions import Action, Result, ResultStatus
from daemon.config import ControllerSettings
from daemon.controller.driver import Driver
from daemon.controller.policies.aimd import AimdPolicy
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.policy import make_policy
from daemon.controller.scheduler import Scheduler
from daemon.model import ModelSpec
from daemon.request import RequestStatus
from daemon.runtime.devices import Device
from daemon.runtime.program import prefix_key, tail_key
from tests.unit.harness import MS, Harness, make_spec
from tests.unit.test_cross_model import STAGES, infers, staged


def behind_one(h: Harness, lead: ModelSpec, others: list[ModelSpec], timeout: float = 0.1,
               extra: int = 0) -> list[Action]:
    """A batch of `lead` running; a request of `lead` and of each other model (plus `extra` more of
    each other model) queued behind it; the batches planned when the running one completes."""
    h.request(lead, timeout=timeout)
    (running,) = infers(h.step())
    h.request(lead, timeout=timeout)
    for s in others:
        h.clock.advance(0.001 * MS)  # (the lead's request is the oldest: its model leads the batch)
        for _ in range(1 + extra):
            h.request(s, timeout=timeout)
    assert not infers(h.step())  # one batch at a time per device: they wait for it
    return infers(h.result(running))


@pytest.mark.parametrize("policy", [DynamicBatchingPolicy, AimdPolicy])
def test_requests_of_models_sharing_a_prefix_run_in_one_batch(policy: type[DynamicBatchingPolicy]) -> None:
    h = Harness(policy=policy())
    a, b, c = staged(h, "abc")
    (action,) = behind_one(h, a, [b, c])
    assert action.group is not None
    assert [(s.key, n) for s, n in action.group] == [(a.key, 1), (b.key, 1), (c.key, 1)]
    assert [r.model.key for r in action.requests] == [a.key, b.key, c.key]
    assert action.batch_size == a.batch_size_for(3)
    est = h.sched.estimator
    want = est.infer(prefix_key("bb"), 3, "cpu") + sum(est.infer(tail_key(s.key), 1, "cpu") for s in (a, b, c))
    assert action.expected_duration == pytest.approx(want)
    assert all(r.status == RequestStatus.RUNNING for r in action.requests)
    assert h.sched.counters["cross_model_batches"] == 1
    reqs = list(action.requests)
    parts = tuple((np.array([[float(i)]], np.float32),) for i in range(3))
    h.clock.advance(action.expected_duration)
    r = Result(action, ResultStatus.OK, h.now, h.now - 1 * MS, h.now, 1 * MS, parts[0], parts=parts,
               stage_runs=((prefix_key("bb"), 3, 2 * MS), *((tail_key(s.key), 1, 0.5 * MS) for s in (a, b, c))))
    h.collect(h.sched.on_result(r, h.now))
    assert [q.outputs[0].tolist() for q in reqs] == [[[0.0]], [[1.0]], [[2.0]]]  # each its own rows
    assert all(q.ok for q in reqs)


@pytest.mark.parametrize("policy", [DynamicBatchingPolicy, AimdPolicy])
def test_a_member_that_would_make_someone_late_is_left_out(policy: type[DynamicBatchingPolicy]) -> None:
    h = Harness(policy=policy())
    a, b = staged(h, "ab")
    est = h.sched.estimator
    alone = max(est.infer(prefix_key("bb"), 1, "cpu") + est.infer(tail_key(a.key), 1, "cpu"),
                est.infer(a.key, 1, "cpu"))
    h.request(a, timeout=0.1)
    (running,) = infers(h.step())
    h.clock.advance(running.expected_duration)
    # a's next request has room for its own batch, not for b's tail as well
    h.request(a, timeout=alone + 0.01 * MS)
    h.clock.advance(0.001 * MS)
    h.request(b, timeout=0.1)
    r = Result(running, ResultStatus.OK, h.now, h.now - running.expected_duration, h.now,
               running.expected_duration, (np.zeros((1, 1), np.float32),))
    nxt = infers(h.collect(h.sched.on_result(r, h.now)) + h.step())
    assert nxt and nxt[0].model.key == a.key and nxt[0].group is None  # b runs in a batch of its own
    assert h.sched.models[b.key].queue.requests == 1


def test_aimd_takes_a_member_with_no_more_rows_than_its_learned_size_and_teaches_each() -> None:
    policy = AimdPolicy()
    h = Harness(policy=policy)
    a, b = staged(h, "ab")
    policy.caps[a.key], policy.caps[b.key] = 4.0, 2.0
    (action,) = behind_one(h, a, [b], extra=3)  # b: 4 queued, its size is 2
    assert action.group is not None
    assert [(s.key, n) for s, n in action.group] == [(a.key, 1), (b.key, 2)]
    h.result(action)  # within the SLO: b ran a full batch of its size, a did not
    assert policy.caps[b.key] == 3.0 and policy.caps[a.key] == 4.0


@pytest.mark.parametrize("policy", ["dynamic", "aimd"])
def test_the_setting_turns_it_off(policy: str) -> None:
    p = make_policy(ControllerSettings(policy=policy, cross_model_batching=False))
    h = Harness(policy=p)
    a, b = staged(h, "ab")
    nxt = behind_one(h, a, [b])
    assert [(n.model.key, n.group) for n in nxt] == [(a.key, None)]  # b's turn comes after it
    assert h.sched.models[b.key].queue.requests == 1


def test_not_on_a_device_that_keeps_each_model_apart() -> None:
    h = Harness(policy=DynamicBatchingPolicy())
    a, b = staged(h, "ab")
    h.sched.devices["cpu:0"].memory.shares = False  # (as a CUDA arena)
    nxt = behind_one(h, a, [b])
    assert [(n.model.key, n.group) for n in nxt] == [(a.key, None)]


def test_a_lost_cross_model_batch_returns_each_request_to_its_own_queue() -> None:
    h = Harness(policy=DynamicBatchingPolicy())
    a, b = staged(h, "ab")
    h.request(a, timeout=0.1)
    (running,) = infers(h.step())
    h.request(a, timeout=0.1)
    h.clock.advance(0.001 * MS)
    h.request(b, timeout=0.1)
    (action,) = infers(h.result(running))
    assert action.group is not None
    r = Result(action, ResultStatus.TOO_LATE, h.now, h.now, h.now, error="late")
    h.collect(h.sched.on_result(r, h.now))
    assert h.sched.models[a.key].queue.requests == 1 and h.sched.models[b.key].queue.requests == 1
    assert all(q.status == RequestStatus.QUEUED for q in action.requests)


@pytest.mark.parametrize("stage", [True, False], ids=["stage-held-once", "held-apart"])
@pytest.mark.parametrize("policy", ["clockwork", "dynamic", "aimd"])
def test_a_cuda_device_forms_them_whether_it_holds_their_stage_once_or_apart(policy: str, stage: bool) -> None:
    """runtime/cuda.py runs the shared stage over the lead's weights: the controller batches the plans
    together whether the device holds their stage once (a stage block named) or each model apart
    (per-tensor blocks are not how a CUDA device shares: without a stage block, each in full)."""
    settings = ControllerSettings(policy=policy)  # type: ignore[arg-type]
    h = Harness(policy=make_policy(settings))
    h.sched = Scheduler([Device("emucuda:0", "emucuda", 0, 4000)], h.sched.policy, settings)
    h.driver = Driver(h.sched)
    specs = []
    for name in "ab":
        spec = make_spec(name)
        h.sched.add_model(spec, 650, {1: 1.2 * MS, 8: 2.4 * MS}, "emucuda", blocks=(("bb", 600), (f"h{name}", 50)),
                          prefix="bb", stage_blocks=(("stage:bb", 600),) if stage else ())
        h.sched.seed_stages(spec.key, "emucuda", STAGES)
        h.use(spec)
        specs.append(spec)
    dev = h.sched.devices["emucuda:0"]
    assert dev.memory.used == (650 + 50 if stage else 1300)
    a, b = specs
    h.request(a, timeout=0.1)
    (running,) = infers(h.step())
    h.request(a, timeout=0.1)
    h.clock.advance(0.001 * MS)
    h.request(b, timeout=0.1)
    nxt = infers(h.step()) or infers(h.result(running))
    groups = [x.group for x in nxt if x.group is not None]
    assert groups and [(s.key, n) for s, n in groups[0]] == [(a.key, 1), (b.key, 1)]
