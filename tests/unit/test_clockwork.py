"""The Clockwork policy, rule by rule, with a fake clock and hand-made results."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from daemon.actions import Action, ActionKind, ResultStatus
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.controller.timeline import LaneTimeline
from daemon.errors import DeadlineExceeded, Overloaded
from daemon.model import ModelSpec
from daemon.observability.stats import Histogram
from daemon.request import InferenceRequest, RequestStatus
from tests.unit.harness import MS, Harness, kinds, make_spec


def cw(**kw: float) -> Harness:
    horizon = kw.pop("horizon", 5 * MS)
    return Harness(policy=ClockworkPolicy(schedule_ahead=horizon), **kw)  # type: ignore[arg-type]


def add(h: Harness, name: str, max_batch: int = 8, profile: dict[int, float] | None = None, nbytes: int = 100,
        slo: float = 0.1) -> ModelSpec:
    spec = make_spec(name, max_batch=max_batch, slo=slo)
    prof = profile or {1: 1 * MS, max_batch: 8 * MS}
    h.sched.add_model(spec, nbytes, prof, "cpu")
    return spec


def test_the_most_urgent_model_runs_first() -> None:
    h = cw()
    a, b = add(h, "a"), add(h, "b")
    h.use(a)
    h.use(b)
    h.request(a, timeout=90 * MS)
    urgent = h.request(b, timeout=30 * MS)
    (first, *_) = h.step()
    assert first.requests == [urgent]


def test_priority_comes_before_deadline() -> None:
    h = cw()
    a, b = add(h, "a"), add(h, "b")
    h.use(a)
    h.use(b)
    h.request(a, timeout=20 * MS, rank=10)
    important = h.request(b, timeout=90 * MS, rank=1)
    (first, *_) = h.step()
    assert first.requests == [important]


def test_the_largest_batch_that_meets_every_deadline() -> None:
    h = cw()
    spec = add(h, "m", max_batch=8, profile={1: 1 * MS, 2: 2 * MS, 4: 4 * MS, 8: 30 * MS})
    h.use(spec)
    reqs = [h.request(spec, timeout=20 * MS) for _ in range(8)]
    first = h.step()[0]
    # A CPU runs exactly the rows filled: 6 rows take 4 + 26 * 2/4 = 17 ms (interpolated), 7 take
    # 23.5 ms > 20 ms. The batch size (the IO buffers used) is the next power of two.
    assert first.requests == reqs[:6] and first.batch_size == 8
    assert first.expected_duration == pytest.approx(17 * MS)
    assert first.latest == pytest.approx(reqs[0].deadline - 17 * MS)  # the last start that meets them all


def test_work_is_planned_only_a_horizon_ahead() -> None:
    h = cw(horizon=5 * MS)
    spec = add(h, "m", max_batch=1, profile={1: 4 * MS})
    h.use(spec)
    reqs = [h.request(spec, timeout=1.0) for _ in range(5)]
    planned = h.step()
    # free at now, now+4, now+8 ms: the two that start within 5 ms are planned
    assert len(planned) == 2
    assert [a.expected_start - h.now for a in planned] == pytest.approx([0.0, 4 * MS])
    assert h.sched.next_wakeup(h.now) == pytest.approx(h.now + 8 * MS - 5 * MS)
    assert all(r.status == RequestStatus.QUEUED for r in reqs[2:])


def test_a_request_no_device_can_finish_in_time_is_answered_at_once() -> None:
    h = cw()
    spec = add(h, "m", max_batch=1, profile={1: 50 * MS})
    h.use(spec)
    h.request(spec, timeout=1.0)
    h.step()  # the device is busy for 50 ms
    hopeless = h.request(spec, timeout=60 * MS)  # could start at +50 ms and finish at +100 ms
    h.step()
    assert isinstance(hopeless.error, DeadlineExceeded)
    assert hopeless.finished_at == h.now  # at once, not at its deadline


def test_admission_refuses_what_even_an_idle_device_cannot_do() -> None:
    h = cw()
    spec = add(h, "m", profile={1: 10 * MS, 8: 20 * MS})
    with pytest.raises(DeadlineExceeded):
        h.request(spec, timeout=5 * MS)


def test_a_refused_action_is_retried_if_its_requests_still_can_make_it() -> None:
    h = cw()
    spec = add(h, "m")
    h.use(spec)
    r = h.request(spec, timeout=50 * MS)
    (infer,) = h.step()
    (retry,) = h.result(infer, ResultStatus.TOO_LATE, duration=0.0)
    assert retry.requests == [r]
    h.result(retry)
    assert r.ok


def test_the_timeline_learns_from_results() -> None:
    h = cw()
    spec = add(h, "m", max_batch=1, profile={1: 4 * MS})
    h.use(spec)
    h.request(spec, timeout=1.0)
    (infer,) = h.step()
    lane = h.sched.devices["cpu:0"].timeline.exec
    assert lane.free_at(h.now) == pytest.approx(h.now + 4 * MS)
    h.result(infer, duration=1 * MS)  # it ran faster than planned
    assert lane.free_at(h.now) == pytest.approx(h.now)
    assert h.sched.estimator.infer(spec.key, 1, "cpu", "cpu:0") < 4 * MS  # and that device's estimate moved


def test_loads_follow_demand() -> None:
    h = cw(budget=1000)
    a, b = add(h, "a", nbytes=100), add(h, "b", nbytes=100)
    h.request(a)
    for _ in range(3):
        h.request(b)
    loads = [x for x in h.step() if x.kind == ActionKind.LOAD]
    assert loads[0].model.name == "b"  # equally urgent: the most queued work first


def test_the_most_urgent_cold_model_is_loaded_first() -> None:
    h = cw(budget=10**8)
    a, b = add(h, "a", nbytes=4 * 10**6), add(h, "b", nbytes=4 * 10**6)  # ~1 ms each at the first guess
    for _ in range(3):
        h.request(b, timeout=90 * MS)
    h.request(a, timeout=30 * MS)
    loads = [x for x in h.step() if x.kind == ActionKind.LOAD]
    assert loads[0].model.name == "a"  # its request expires first


def test_eviction_takes_the_least_recently_used_idle_model() -> None:
    h = cw(budget=250)
    a, b, c = (add(h, n, nbytes=100) for n in "abc")
    h.use(a)
    h.use(b)
    h.request(c)
    acts = h.step()
    assert kinds(acts)[:2] == ["UNLOAD", "LOAD"]
    assert acts[0].model.name == "a" and acts[1].model.name == "c"


def test_a_model_with_waiting_requests_is_not_evicted_for_one_in_less_demand() -> None:
    h = cw(budget=150)
    a, b = add(h, "a", max_batch=1, profile={1: 50 * MS}, nbytes=100), add(h, "b", nbytes=100)
    h.use(a)
    h.request(a, timeout=1.0)
    h.step()  # a is running
    for _ in range(4):  # and busy for a while: these wait
        h.request(a, timeout=1.0)
    h.request(b, timeout=1.0)
    assert "LOAD" not in kinds(h.step())  # a has more demand: b waits rather than evicting it


def test_a_load_passes_over_the_least_loaded_device_when_nothing_there_may_go() -> None:
    """Devices are ordered before any victim search (least load first); one whose models may not
    go (busy) is passed over for the next, where the idle model is evicted."""
    h = cw(devices=2, budget=150)
    a, c = add(h, "a", nbytes=100), add(h, "c", nbytes=100)
    b = add(h, "b", max_batch=1, profile={1: 50 * MS}, nbytes=100)
    h.use(a)
    h.use(b)
    placed = {m.name: d for m in (a, b) for d, dev in h.sched.devices.items() if dev.memory.state(m.key)}
    assert placed == {"a": "cpu:0", "b": "cpu:1"}
    for _ in range(200):  # a brings its device more work per second than b brings its own
        h.use(a)
    h.request(b, timeout=1.0)
    assert kinds(h.step()) == ["INFER"]  # b runs on cpu:1 for 50 ms: busy, it may not be evicted
    h.request(c, timeout=1.0)
    acts = h.step()
    assert [(x.kind.name, x.model.name, x.device) for x in acts[:2]] == [("UNLOAD", "a", "cpu:0"),
                                                                        ("LOAD", "c", "cpu:0")]


def test_a_hot_model_is_replicated_onto_another_device() -> None:
    h = cw(devices=2, budget=1000)
    spec = add(h, "hot", max_batch=4, profile={1: 5 * MS, 4: 20 * MS})  # 200 samples/s per device
    h.use(spec)
    for _ in range(5):  # ~450 samples/s arriving
        for _ in range(45):
            try:
                h.request(spec, timeout=1.0)
            except Overloaded:  # past what the device can do by the deadline: refused at once
                pass
        h.clock.advance(0.1)
    loads = [a for a in h.step() if a.kind == ActionKind.LOAD]
    assert [a.device for a in loads] == ["cpu:1"]


def test_cold_requests_a_load_cannot_save_are_answered_at_once() -> None:
    h = cw(budget=10**9)
    spec = add(h, "m", nbytes=4 * 10**8)  # ~100 ms to load at the first guess of 4 GB/s
    r = h.request(spec, timeout=50 * MS)
    h.step()
    assert isinstance(r.error, DeadlineExceeded) and r.finished_at == h.now



def _busy_and_hot(h: Harness) -> tuple[ModelSpec, ModelSpec]:
    """cpu:0 running a long batch of `slow` (little demand), cpu:1 holding `hot` with many arrivals."""
    slow = add(h, "slow", max_batch=64, profile={1: 300 * MS, 64: 640 * MS})
    hot = add(h, "hot", profile={1: 10 * MS, 8: 80 * MS})
    h.use(slow)  # loaded on cpu:0 (the devices tie: the first by name)
    h.request(slow, timeout=1.0)
    assert [(a.kind.name, a.device) for a in h.step()] == [("INFER", "cpu:0")]  # running ~300 ms
    h.use(hot)  # cpu:1: cpu:0's batch would hold its first run back
    assert h.sched.placed_on[hot.key] == {"cpu:1"}
    return slow, hot


def test_among_devices_of_equal_load_a_load_goes_where_its_first_run_ends_soonest() -> None:
    h = cw(devices=2, budget=1000)
    _busy_and_hot(h)
    c = add(h, "c")
    h.request(c, timeout=1.0)
    loads = [a for a in h.step() if a.kind == ActionKind.LOAD]
    assert [a.device for a in loads] == ["cpu:1"]  # both idle in demand; cpu:0 is running for ~300 ms


def test_a_cold_head_is_kept_when_a_device_not_searched_could_serve_it_in_time() -> None:
    """The least loaded device takes the LOAD (it evicts nothing), though its first run would end
    after the head's deadline; a device further down the order (more demand, searched no further)
    could serve it in time, so the head is not answered at once."""
    h = cw(devices=2, budget=1000)
    _, hot = _busy_and_hot(h)
    for _ in range(40):  # many arrivals: cpu:1 has the higher demand
        h.request(hot, timeout=1.0)
    h.step()
    c = add(h, "c")
    r = h.request(c, timeout=150 * MS)  # cpu:0 frees in ~290 ms; cpu:1 (a batch of hot) in ~80
    acts = h.step()
    assert [(a.kind.name, a.device) for a in acts if a.model.name == "c"] == [("LOAD", "cpu:0")]
    assert not r.status.finished


# ------------------------------------------------------------------ timelines and histograms


def test_lane_timeline() -> None:
    lane = LaneTimeline(lag=0.010)
    assert lane.free_at(1.0) == 1.0
    assert lane.add(1, 0.004, 1.0) == 1.0
    assert lane.add(2, 0.006, 1.0) == pytest.approx(1.004)
    assert lane.free_at(1.0) == pytest.approx(1.010)
    lane.done(1, 1.005)  # ran 1 ms late: the rest starts from its real end
    assert lane.free_at(1.005) == pytest.approx(1.011)
    assert lane.free_at(1.030) == pytest.approx(1.040)  # the head overran by more than lag: it runs on
    lane.done(2, 1.031)
    assert lane.free_at(1.031) == 1.031 and len(lane) == 0


def test_lane_timeline_head_follows_what_is_done_out_of_order() -> None:
    # An action refused or cancelled leaves the lane before the one ahead of it: the head (whose
    # overrun counts) stays the first still outstanding, in the order issued.
    lane = LaneTimeline(lag=0.010)
    lane.add(1, 0.004, 1.0)
    lane.add(2, 0.020, 1.0)
    lane.add(3, 0.001, 1.0)
    lane.done(2, 1.0)  # not the head: the head is still 1 (4 ms)
    assert lane.free_at(1.0) == pytest.approx(1.005)
    assert lane.free_at(1.020) == pytest.approx(1.031)  # head 1 overran: runs on a lag, then 3
    lane.done(1, 1.020)  # the head is now 3, begun at 1.020
    assert lane.free_at(1.020) == pytest.approx(1.021)
    assert lane.free_at(1.040) == pytest.approx(1.050)  # 3 overran in its turn
    lane.done(3, 1.041)
    assert lane.free_at(1.041) == 1.041 and len(lane) == 0
    lane.add(4, 0.002, 2.0)  # an empty lane: the next action is its head
    assert lane.free_at(2.0) == pytest.approx(2.002) and lane.free_at(2.013) == pytest.approx(2.023)


@pytest.mark.parametrize("split", [False, True])
def test_due_heaps_give_entries_in_heapq_order(split: bool) -> None:
    # split: entries spread over two heaps popped in turn by `first_of` (the scheduler keeps the
    # INFER watches apart from the LOAD/UNLOAD ones) come out in the order one heap of both gives.
    import heapq
    import random

    from daemon.controller import due as dues
    from daemon.controller.due import Due, key_due

    rng = random.Random(11 if split else 7)
    a: list[Due] = []
    b: list[Due] = []
    ref: list[tuple[float, float, int]] = []
    out_ours: list[tuple[float, float, int]] = []
    out_ref: list[tuple[float, float, int]] = []

    def pop_both() -> None:
        e = dues.pop(dues.first_of(a, b) if split else a)
        out_ours.append((e.at, e.then, e.seq))
        out_ref.append(heapq.heappop(ref))

    for seq in range(5000):
        if ref and rng.random() < 0.45:
            pop_both()
            continue
        # few distinct times: most order is settled by the second time or by seq
        key = (float(rng.randrange(20)), float(rng.randrange(3)), seq)
        dues.push(b if split and rng.random() < 0.7 else a, key_due(key[0], key[1], key[2], "m"))
        heapq.heappush(ref, key)
        first = dues.first_of(a, b)[0]
        assert (first.at, first.then, first.seq) == ref[0]
    while ref:
        pop_both()
    assert out_ours == out_ref and not a and not b
    assert dues.first_of(a, b) is b  # both empty: the second (the caller finds it empty)


def test_histogram_percentiles_are_close_and_never_above_max() -> None:
    h = Histogram()
    for i in range(1, 1001):
        h.add(i * 1e-6)  # 1 µs .. 1 ms
    assert h.count == 1000
    assert h.percentile(50) == pytest.approx(500e-6, rel=0.3)
    assert h.percentile(99) == pytest.approx(990e-6, rel=0.3)
    assert h.percentile(100) == pytest.approx(1e-3)
    s = Histogram()
    for x in (-0.002, -0.001, 0.0, 0.001):
        s.add(x)
    assert s.percentile(1) < 0 < s.percentile(99)
    s.merge(h)
    assert s.count == 1004 and math.isclose(s.max, 0.001)


def test_under_overload_the_largest_feasible_batch_skips_requests_too_urgent_for_it() -> None:
    h = cw()
    spec = add(h, "m", max_batch=8, profile={1: 2 * MS, 8: 16 * MS})  # 2 ms per sample
    h.use(spec)
    # (the urgent one comes last: admission counts the queue only for a request due after all of it)
    patient = [h.request(spec, timeout=16.5 * MS) for _ in range(8)]  # a full batch of 8 just fits now
    urgent = h.request(spec, timeout=7 * MS)  # can only run in a batch of 3 or fewer (6 ms)
    first = h.step()[0]
    # Serving the urgent one's batch first would leave room for only 5 of the 8: overload.
    assert urgent not in first.requests and first.requests == patient
    # after that batch nothing can finish it in time: answered at once, not left to expire
    assert isinstance(urgent.error, DeadlineExceeded) and urgent.finished_at == h.now


def test_the_head_rides_in_the_largest_batch_when_it_can_wait_for_it() -> None:
    h = cw()
    spec = add(h, "m", max_batch=8, profile={1: 2 * MS, 8: 16 * MS})
    h.use(spec)
    head = h.request(spec, timeout=20 * MS)  # a full batch (16 ms) still meets it
    rest = [h.request(spec, timeout=90 * MS) for _ in range(8)]
    first = h.step()[0]
    assert first.requests == [head, *rest[:7]]


def test_a_straggling_device_does_not_make_its_peers_look_slow() -> None:
    h = cw(devices=2)
    spec = add(h, "m", max_batch=1, profile={1: 1 * MS})
    est = h.sched.estimator
    est.now = h.now
    est.observe_infer(spec.key, 1, "cpu", 0.040, "cpu:0")  # one slow run on cpu:0
    assert h.sched.estimate(spec.key, 1, h.sched.devices["cpu:0"]) == pytest.approx(0.040)
    assert h.sched.estimate(spec.key, 1, h.sched.devices["cpu:1"]) == pytest.approx(1 * MS)  # the profile
    r = h.request(spec, timeout=30 * MS)  # admitted: an idle cpu:1 can make it
    assert r.status == RequestStatus.QUEUED
    est.now = h.now + 1.5  # the slow sample ages out: cpu:0 is back to its profile
    assert h.sched.estimate(spec.key, 1, h.sched.devices["cpu:0"]) == pytest.approx(1 * MS)


def test_a_device_running_slow_leaves_work_to_one_that_finishes_it_sooner() -> None:
    h = cw(devices=2, horizon=10 * MS)
    spec = add(h, "m", max_batch=1, profile={1: 1 * MS})
    h.preload(spec, 2)
    est = h.sched.estimator
    est.now = h.now
    for _ in range(3):
        est.observe_infer(spec.key, 1, "cpu", 0.020, "cpu:0")  # cpu:0 runs 20x its profile just now
    busy = h.request(spec, timeout=90 * MS)
    (first,) = h.step()
    assert first.device == "cpu:1" and first.requests == [busy]  # the fast device, though both are idle
    r = h.request(spec, timeout=90 * MS)
    (second,) = h.step()
    # cpu:1 is busy for 1 ms more, cpu:0 is idle but would take 20 ms: wait for cpu:1
    assert second.device == "cpu:1" and second.requests == [r]
    h.clock.advance(1.5)  # the slow samples age out: cpu:0 is back to its profile
    est.now = h.now
    h.result(first)
    h.result(second)
    a, b = h.request(spec, timeout=90 * MS), h.request(spec, timeout=90 * MS)
    assert {x.device for x in h.step()} == {"cpu:0", "cpu:1"} and a.status == b.status == RequestStatus.RUNNING


def test_a_request_too_slow_for_the_first_free_device_goes_to_one_that_can_make_it() -> None:
    h = cw(devices=2, horizon=10 * MS)
    spec = add(h, "m", max_batch=1, profile={1: 1 * MS})
    h.preload(spec, 2)
    est = h.sched.estimator
    est.now = h.now
    est.observe_infer(spec.key, 1, "cpu", 0.400, "cpu:0")  # cpu:0 took 400 ms a run just now
    r = h.request(spec, timeout=150 * MS)  # impossible on cpu:0, easy on cpu:1
    (act,) = h.step()
    assert act.device == "cpu:1" and r.status == RequestStatus.RUNNING


def test_requests_batched_on_a_device_that_never_answers_are_each_failed_by_their_own_deadline() -> None:
    h = cw(devices=1)
    spec = add(h, "m", max_batch=2, profile={1: 1 * MS, 2: 2 * MS})
    h.use(spec)
    h.clock.advance(1.5)
    soon, later = h.request(spec, timeout=20 * MS), h.request(spec, timeout=80 * MS)
    (act,) = h.step()  # one batch with both; the device never answers it
    assert act.requests == [soon, later]
    h.clock.set(soon.deadline + 0.006)
    h.step()
    assert soon.status == RequestStatus.FAILED and later.status == RequestStatus.RUNNING
    assert h.sched.next_wakeup(h.now) == pytest.approx(later.deadline + 0.005)
    h.clock.set(later.deadline + 0.006)
    h.step()
    assert later.status == RequestStatus.FAILED and "did not answer in time" in later.error.message


# ---------------------------------------------------------------- waiting for a fuller batch


def steady(h: Harness, spec: ModelSpec, rate: float, seconds: float) -> list[InferenceRequest]:
    """Requests of `spec` every 1/rate s for `seconds`, stepping the scheduler at each arrival and
    completing every INFER as soon as the clock reaches its expected end."""
    reqs: list[InferenceRequest] = []
    running: list[Action] = []
    end = h.now + seconds
    while h.now < end:
        reqs.append(h.request(spec, timeout=50 * MS))
        running += h.step()
        nxt = h.now + 1 / rate
        while True:  # results and timers due before the next arrival
            due = [(a.expected_start + a.expected_duration, a) for a in running]
            wake = h.sched.next_wakeup(h.now)
            first = min(due, key=lambda x: x[0]) if due else None
            if first is not None and first[0] <= nxt and (wake is None or first[0] <= wake):
                running.remove(first[1])
                h.clock.set(max(h.now, first[1].expected_start))
                running += h.result(first[1])
            elif wake is not None and wake <= nxt:
                h.clock.set(max(h.now, wake))
                running += h.step()
            else:
                break
        h.clock.set(max(h.now, nxt))
    return reqs


def batch_wait(wait: float) -> Harness:
    return Harness(policy=ClockworkPolicy(schedule_ahead=5 * MS, batch_wait=wait))


def test_a_fast_arriving_model_waits_for_a_fuller_batch() -> None:
    fast = {1: 0.2 * MS, 32: 2 * MS}
    sizes = {}
    for wait in (0.0, 4 * MS):
        h = batch_wait(wait)
        spec = add(h, "m", max_batch=32, profile=fast)
        h.use(spec)
        reqs = steady(h, spec, rate=4000, seconds=1.5)
        assert all(r.ok and r.finished_at <= r.deadline for r in reqs[:-50])
        infers = [a for a in h.actions if a.kind == ActionKind.INFER]
        late = infers[-100:]  # once the rate estimate (1 s time constant) has risen
        sizes[wait] = sum(a.samples for a in late) / len(late)
        waited = [a.issued_at - min(r.arrival for r in a.requests) for a in infers]
        assert max(waited) <= wait + 1 * MS  # nobody waits longer than batch_wait (+ a device's run)
    # work-conserving: a fast device runs what is there (~1-2); waiting: ~a wait's worth of arrivals
    assert sizes[0.0] < 2.5 and sizes[4 * MS] > 8


def test_at_a_low_rate_nothing_waits() -> None:
    h = batch_wait(4 * MS)
    spec = add(h, "m", max_batch=32, profile={1: 0.2 * MS, 32: 2 * MS})
    h.use(spec)
    steady(h, spec, rate=100, seconds=0.5)  # < one request per wait
    infers = [a for a in h.actions if a.kind == ActionKind.INFER][1:]
    assert all(a.issued_at == a.requests[0].arrival for a in infers)


def test_waiting_never_costs_a_deadline() -> None:
    h = batch_wait(40 * MS)
    spec = add(h, "m", max_batch=32, profile={1: 1 * MS, 32: 10 * MS})
    h.use(spec)
    steady(h, spec, rate=1000, seconds=0.3)
    urgent = h.request(spec, timeout=15 * MS)  # a full batch (10 ms) must start within 5 ms
    h.run_until(urgent)
    assert urgent.ok and urgent.finished_at <= urgent.deadline


def test_a_lone_request_on_an_idle_device_is_planned_without_a_pass() -> None:
    h = cw()
    a = add(h, "a")
    h.use(a)
    req = h.request(a, timeout=50 * MS)
    policy = h.sched.policy
    assert isinstance(policy, ClockworkPolicy)
    (infer,) = h.step()
    assert infer.requests == [req] and infer.batch_size == 1
    # as the pass plans it: its latest start is its deadline less its run, from now
    assert infer.latest == pytest.approx(req.deadline - 1 * MS)
    assert not policy.work or not any(w.live for w in policy.work.values())  # never indexed


def test_a_lone_request_behind_another_models_work_waits_for_the_pass() -> None:
    h = cw()
    a, b = add(h, "a"), add(h, "b")
    h.use(a)
    h.use(b)
    h.request(a, timeout=90 * MS)
    h.request(a, timeout=90 * MS)  # a's queue holds two: indexed for the pass
    urgent = h.request(b, timeout=30 * MS)  # lone, but the device has a's work: the pass chooses
    (first, *_) = h.step()
    assert first.requests == [urgent]


class _Recording:
    """A simulation's driver, every step's decisions recorded (each step's sorted: lone requests
    planned without a pass come first in their step), to compare two ways of deciding."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.steps: list[list[str]] = []

    def submit(self, req: Any, now: float) -> None:
        self.driver.submit(req, now)

    def next_wakeup(self, now: float) -> float | None:
        return self.driver.next_wakeup(now)

    def step(self, now: float, results: Any = (), on_error: Any = None) -> Any:
        d = self.driver.step(now, results, on_error)
        self.steps.append(sorted([repr((x.kind.name, x.model.key, x.device, x.earliest, x.latest, x.batch_size,
                                        x.expected_start, [r.arrival for r in x.requests])) for x in d.actions] +
                                 [repr((r.arrival, r.status.name, r.finished_at)) for r in d.finished]))
        return d


def _decisions_per_step(policy: ClockworkPolicy, ms: list[Any], devices: int, rate: float,
                        seconds: float) -> list[list[str]]:
    from daemon.sim import Simulation

    times = np.cumsum(np.random.default_rng(5).exponential(1 / rate, int(rate * seconds)))
    targets = np.random.default_rng(6).integers(0, len(ms), len(times))
    sim = Simulation(ms, devices, policy, weight_budget=8 * 2**30, seed=1)
    if len(ms) == 1:
        sim.place(ms[0][0].key, ["sim:0"])
    rec = sim.driver = _Recording(sim.driver)  # type: ignore[assignment]
    sim.run(times, targets, [m[0].key for m in ms], drain_s=1.0)
    return rec.steps


@pytest.mark.parametrize("rate", [2000.0, 9000.0])
def test_planning_lone_requests_without_a_pass_decides_what_the_pass_decides(rate: float) -> None:
    from daemon.sim import clockwork_models

    policy = ClockworkPolicy()
    fast = _decisions_per_step(policy, clockwork_models(100), 4, rate, 0.5)
    full = _decisions_per_step(ClockworkPolicy(shortcuts=False), clockwork_models(100), 4, rate, 0.5)
    assert policy.planned_alone > 0  # the path under test was taken
    assert len(fast) == len(full) and sum(map(len, fast)) > 500
    assert fast == full


def test_arrivals_behind_an_indexed_head_keep_its_entries_and_decide_alike() -> None:
    """Under load most arrivals join a queue whose model is already indexed on its devices at
    least as urgently (`on_queued` keeps the entries without estimating or pushing again). With
    noisy run times (estimates move) and queues deep enough for many arrivals per entry, the
    decisions are those of indexing every arrival, step by step."""
    policy, steps, arrivals = _with_and_without_shortcuts(50, 1.0, 4, 8, seeds=(7, 8, 1))
    assert policy.index_kept > arrivals // 4  # the path under test was taken, often
    assert sum(1 for s in steps[1] for x in s if x.startswith("('INFER'")) > 300
    assert steps[0] == steps[1]


def _with_and_without_shortcuts(n_models: int, zipf_s: float, devices: int, gib: int, seeds: tuple[int, int, int]
                                ) -> tuple[ClockworkPolicy, list[list[str]], int]:
    """The same noisy second of 2,500 req/s (zipf popularity) decided by the clockwork policy with
    its shortcuts and without: the policy that had them, each run's steps, the arrivals."""
    from daemon.sim import Simulation, clockwork_models

    ms = clockwork_models(n_models)
    rate, seconds = 2500.0, 1.0
    times = np.cumsum(np.random.default_rng(seeds[0]).exponential(1 / rate, int(rate * seconds)))
    zipf = np.arange(1, len(ms) + 1, dtype=float) ** -zipf_s
    targets = np.random.default_rng(seeds[1]).choice(len(ms), len(times), p=zipf / zipf.sum())
    steps = []
    policy = ClockworkPolicy()
    for p in (policy, ClockworkPolicy(shortcuts=False)):
        sim = Simulation(ms, devices, p, weight_budget=gib * 2**30, noise=0.05, seed=seeds[2])
        rec = sim.driver = _Recording(sim.driver)  # type: ignore[assignment]
        sim.run(times, targets, [m[0].key for m in ms], drain_s=1.0)
        steps.append(rec.steps)
    return policy, steps, len(times)


def test_work_index_entries_say_when_they_stop_being_live() -> None:
    """A kept entry is trusted only while it is its model's live one: popped, discarded or
    replaced by a more urgent one, it says so."""
    from daemon.controller.policies.clockwork import WorkIndex

    w = WorkIndex()
    a = w.push("m", 1, 5.0)
    assert w.push("m", 1, 6.0) is a and not a.gone  # less urgent: the live entry stands
    b = w.push("m", 1, 4.0)
    assert b is not a and a.gone and not b.gone  # replaced
    c = w.push("n", 0, 9.0)
    popped = w.pop()
    assert popped is c and c.gone and not b.gone
    w.discard("m")
    assert b.gone and len(w) == 0 and w.pop() is None


def test_arrivals_to_a_filling_batch_are_handled_as_the_pass_would() -> None:
    """One hot model with batch_wait: arrivals behind the head skip the pass (_still_filling), with
    the same batches, at the same times, as when every arrival runs one."""
    from daemon.runtime.simdevice import SimProfile
    from daemon.sim import sim_spec

    ms = [(sim_spec("hot", 32, 0.1), SimProfile(2**20, 1e-3, {1: 60e-6, 8: 130e-6, 32: 350e-6}))]
    policy = ClockworkPolicy(batch_wait=0.004)
    fast = _decisions_per_step(policy, ms, 1, 4000.0, 1.5)
    full = _decisions_per_step(ClockworkPolicy(batch_wait=0.004, shortcuts=False), ms, 1, 4000.0, 1.5)
    assert policy.filling_kept > 1000  # it took most arrivals behind a head
    assert sum(1 for s in full for x in s if x.startswith("('INFER'")) > 300
    assert fast == full


def test_a_search_that_found_no_room_is_not_repeated_until_something_it_read_changed() -> None:
    """Memory thrash: every LOAD evicts, copy lanes are pressed, and cold models wait for a device
    whose models all cost more to keep cold. A victim search that found no room is passed over
    while nothing it read has changed (`_Blocked`); the decisions are those of searching every
    device at every pass, step by step."""
    from daemon.sim import Simulation, clockwork_models

    ms = clockwork_models(200)
    rate, seconds = 3000.0, 1.0
    times = np.cumsum(np.random.default_rng(5).exponential(1 / rate, int(rate * seconds)))
    zipf = np.arange(1, len(ms) + 1, dtype=float) ** -1.0
    targets = np.random.default_rng(6).choice(len(ms), len(times), p=zipf / zipf.sum())
    steps, cold = [], []
    policy = ClockworkPolicy()
    for p in (policy, ClockworkPolicy(shortcuts=False)):
        sim = Simulation(ms, 2, p, weight_budget=2**30, seed=1)
        rec = sim.driver = _Recording(sim.driver)  # type: ignore[assignment]
        sim.run(times, targets, [m[0].key for m in ms], drain_s=1.0)
        steps.append(rec.steps)
        cold.append(sim.scheduler.counters["cold_starts"])
    assert cold[0] > len(times) // 3  # thrashing
    assert policy.searches_spared > 5000  # the path under test was taken
    assert steps[0] == steps[1]


def _acts(actions: list[Action]) -> list[tuple[str, str, str]]:
    return [(a.kind.name, a.model.name, a.device) for a in actions]


def _replica_case(shortcuts: bool) -> list[Any]:
    """A replica's queue emptied by a batch on its other device: on this one it may go now."""
    h = Harness(devices=2, budget=250, policy=ClockworkPolicy(schedule_ahead=5 * MS, shortcuts=shortcuts))

    def add(name: str, prof: dict[int, float]) -> ModelSpec:
        s = make_spec(name, max_batch=8, slo=1.0)
        h.sched.add_model(s, 100, prof, "cpu")
        return s
    hot = add("hot", {1: 1 * MS, 8: 2 * MS})
    g0 = add("g0", {1: 50 * MS, 8: 60 * MS})
    g1 = add("g1", {1: 200 * MS, 8: 210 * MS})
    a = add("a", {1: 1 * MS, 8: 2 * MS})
    h.preload(hot, 2)
    h.preload(g0, 1)
    h.preload(g1, 1)
    h.request(g0, timeout=1.0)
    h.request(g1, timeout=1.0)
    run0 = h.step()
    for _ in range(6):
        h.request(hot, timeout=0.3)
    h.request(g0, timeout=1.0)
    h.request(g0, timeout=1.0)
    h.request(a, timeout=0.9)
    s1 = h.step()
    s2 = h.result(next(x for x in run0 if x.model.name == "g0"))
    return [_acts(run0), _acts(s1), _acts(s2)]


def _blocks_case(shortcuts: bool) -> list[Any]:
    """A model sharing a block with the cold one lands: the cold one lacks less, and fits."""
    h = Harness(devices=1, budget=300, policy=ClockworkPolicy(schedule_ahead=5 * MS, shortcuts=shortcuts))

    def add(name: str, prof: dict[int, float], nbytes: int, blocks: Any = ()) -> ModelSpec:
        s = make_spec(name, max_batch=8, slo=1.0)
        h.sched.add_model(s, nbytes, prof, "cpu", blocks=blocks)
        return s
    fast = {1: 1 * MS, 8: 2 * MS}
    a = add("a", fast, 120, (("X", 100),))
    b = add("b", fast, 110, (("X", 100),))
    v = add("v", fast, 100)
    w = add("w", {1: 300 * MS, 8: 310 * MS}, 100)
    h.sched.seed(b.key, "cpu", fast, 0.001)
    for spec, dur in ((v, 0.01), (w, 0.001)):
        h.sched.preload(spec.key, 1, h.now)
        (ld,) = h.step()
        h.result(ld, duration=dur)
    h.request(w, timeout=2.0)
    s0 = h.step()
    for _ in range(3):
        h.request(v, timeout=1.5)
    h.request(a, timeout=0.8)  # cold; v costs more to keep cold, w is busy: no room
    s1 = h.step()
    for _ in range(40):
        h.request(b, timeout=0.9)  # cold, dearer than v: evicts it; shares X with a
    s2 = h.step()
    h.clock.advance(0.0005)
    return [_acts(s0), _acts(s1), _acts(s2), _acts(h.step())]


def _reloaded_case(shortcuts: bool) -> list[Any]:
    """A replica's LOAD measured faster on another device: its cold cost falls here too."""
    from daemon.actions import Result
    from daemon.clock import FakeClock
    from daemon.config import ControllerSettings
    from daemon.controller.driver import Driver
    from daemon.controller.scheduler import Scheduler
    from daemon.runtime.devices import Device

    g = 10**7
    h = Harness.__new__(Harness)
    h.clock = FakeClock()
    h.sched = Scheduler([Device("cpu:0", "cpu", 0, 250 * g), Device("cpu:1", "cpu", 1, 110 * g)],
                        ClockworkPolicy(schedule_ahead=5 * MS, shortcuts=shortcuts), ControllerSettings())
    h.driver = Driver(h.sched)
    h.actions, h.finished = [], []

    def add(name: str, prof: dict[int, float], nbytes: int) -> ModelSpec:
        s = make_spec(name, max_batch=8, slo=1.0)
        h.sched.add_model(s, nbytes, prof, "cpu")
        return s

    def landed(act: Action, took: float, set_up: bool = False) -> list[Action]:
        begin = h.now
        h.clock.advance(took)
        return h.collect(h.sched.on_result(Result(act, ResultStatus.OK, begin, begin, h.now, took, set_up=set_up),
                                           h.now)) + h.step()
    k = add("k", {1: 1 * MS, 8: 2 * MS}, 100 * g)
    g0 = add("g0", {1: 300 * MS, 8: 310 * MS}, 100 * g)
    a = add("a", {1: 1 * MS, 8: 2 * MS}, 120 * g)
    h.sched.preload(k.key, 1, h.now)
    (ld,) = h.step()
    landed(ld, 0.8, set_up=True)  # a first LOAD that set things up: slow
    h.sched.preload(g0.key, 1, h.now)
    (ld,) = h.step()
    landed(ld, 0.001)
    h.request(g0, timeout=2.0)
    s0 = h.step()
    for _ in range(6):
        h.request(k, timeout=1.0)
    h.request(a, timeout=1.0)
    s1 = h.step()
    h.sched.preload(k.key, 1, h.now)
    (ld,) = h.step()
    return [_acts(s0), _acts(s1), _acts(landed(ld, 0.001))]


@pytest.mark.parametrize("case", [_replica_case, _blocks_case, _reloaded_case])
def test_a_remembered_search_is_searched_again_when_room_may_have_been_made(case: Any) -> None:
    """What a review of the remembered searches found could make room unseen: a replica's queue
    emptied by a batch on its other device, a model sharing blocks with the cold one landing, a
    replica's LOAD measured faster elsewhere. The decisions are those of searching every time."""
    assert case(True) == case(False)


def test_a_models_memos_outlive_other_models_loads_and_not_its_own() -> None:
    """`best_case` keeps its answer on the model while the devices holding that model ready stay
    the same: another model's LOAD leaves it standing, a LOAD of the model itself voids it, and a
    kept answer is always the one made afresh."""
    h = Harness(devices=2, budget=1000, policy=ClockworkPolicy())
    a, b = h.add(make_spec("a")), h.add(make_spec("b"))
    h.preload(a, 1)
    sched = h.sched
    entry_a = sched.models[a.key]

    def fresh(req: InferenceRequest) -> float:
        entry_a.best_version = -2  # (what a memo miss does: made from the estimates and devices now)
        return sched.best_case(req)

    first = h.use(a)
    kept = sched.best_case(first)
    stamp = entry_a.ready_changes
    assert entry_a.best_ready == stamp
    h.use(b)  # b's LOAD: a ready change, not a's
    assert sched.ready_on[b.key] and entry_a.ready_changes == stamp
    assert entry_a.best_ready == stamp and sched.best_case(first) == kept == fresh(first)
    sched.preload(a.key, 2, h.now)  # a onto the second device too: its own ready set changes
    for load in h.step():
        h.result(load)
    assert len(sched.ready_on[a.key]) == 2 and entry_a.ready_changes > stamp
    assert entry_a.best_ready != entry_a.ready_changes  # void until asked again
    answer = sched.best_case(first)
    assert entry_a.best_ready == entry_a.ready_changes  # made again, not the kept one
    assert answer == fresh(first)


def test_arrivals_keep_index_entries_through_other_models_loads_and_decide_alike() -> None:
    """As above, with memory too small for every model (LOADs and UNLOADs throughout): an index
    entry is kept across other models' LOADs, never across its own model's, and the decisions
    are those of indexing every arrival."""
    policy, steps, arrivals = _with_and_without_shortcuts(60, 0.6, 2, 2, seeds=(3, 4, 2))
    assert sum(1 for s in steps[1] for x in s if x.startswith("('LOAD'")) > 50  # memory churned
    assert policy.index_kept > arrivals // 10
    assert steps[0] == steps[1]
