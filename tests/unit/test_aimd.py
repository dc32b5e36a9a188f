"""Clipper's adaptive batching (`aimd`), on the fake clock: the batch size grows after full batches
within the SLO and backs off by 10% after a slow one."""

from __future__ import annotations

from daemon.config import ControllerSettings
from daemon.controller.policies.aimd import AimdPolicy
from daemon.controller.policy import make_policy
from daemon.request import RequestStatus
from tests.unit.harness import MS, Harness, make_spec


def test_the_batch_size_grows_additively_while_full_batches_run_within_the_slo() -> None:
    policy = AimdPolicy()
    h = Harness(policy=policy)
    spec = h.add(make_spec(max_batch=8, slo=0.1), b1=1 * MS, bmax=8 * MS)
    h.preload(spec, 1)
    reqs = [h.request(spec, timeout=1.0) for _ in range(60)]  # more queued than any cap takes
    sizes = []
    todo = h.step()
    while todo:
        sizes.append(todo[0].samples)
        todo = todo[1:] + h.result(todo[0])  # each as long as expected: within the SLO
    assert all(r.ok for r in reqs)
    assert sizes[:8] == [1, 2, 3, 4, 5, 6, 7, 8] and set(sizes[8:-1]) == {8}  # +1 per full batch, capped


def test_a_batch_slower_than_the_slo_cuts_the_size_by_ten_percent() -> None:
    policy = AimdPolicy()
    h = Harness(policy=policy)
    spec = h.add(make_spec(max_batch=32, slo=0.05), b1=1 * MS, bmax=8 * MS)
    h.preload(spec, 1)
    policy.caps[spec.key] = 20.0
    reqs = [h.request(spec, timeout=5.0) for _ in range(30)]
    (infer,) = h.step()
    assert infer.samples == 20
    (infer,) = h.result(infer, duration=0.08)  # over the 50 ms SLO; the next batch is planned at once
    assert policy.caps[spec.key] == 18.0
    assert infer.samples == 10  # the rest of the queue (18 would fit)
    h.result(infer, duration=0.01)  # not full: no increase
    assert policy.caps[spec.key] == 18.0
    assert all(r.status == RequestStatus.SUCCEEDED for r in reqs)


def test_the_first_request_runs_even_when_it_is_larger_than_the_cap() -> None:
    h = Harness(policy=AimdPolicy())
    spec = h.add(make_spec(max_batch=8))
    h.preload(spec, 1)
    r = h.request(spec, samples=4, timeout=1.0)
    (infer,) = h.step()
    assert infer.requests == [r] and infer.samples == 4


def test_the_setting_selects_it() -> None:
    p = make_policy(ControllerSettings(policy="aimd", aimd_step=2.0, aimd_backoff=0.5))
    assert isinstance(p, AimdPolicy) and p.step == 2.0 and p.backoff == 0.5
