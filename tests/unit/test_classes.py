"""Request classes and the best-effort lane: late rather than lost, on the fake clock and in
virtual time (the real scheduler and policies over simulated devices)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from daemon.config import ControllerSettings
from daemon.controller.classes import classify, max_queue, priority_rank
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.policy import Policy
from daemon.errors import DeadlineExceeded, ModelConfigError, Overloaded
from daemon.model import ModelSpec
from daemon.model_config import parse_model_config
from daemon.request import RequestClass, RequestStatus
from daemon.sim import CLOCKWORK_V100, Simulation, sim_spec
from tests.support import tiny_config
from tests.unit.harness import MS, Harness, make_spec


def burst(policy: Policy, klass: RequestClass, seconds: float = 0.5, factor: float = 2.0,
          seed: int = 0) -> np.ndarray:
    """Statuses of a Poisson burst at `factor` times one device's batched capacity of a ResNet-50."""
    spec = sim_spec("r50", 16)
    prof = CLOCKWORK_V100["resnet50"]
    rate = factor * 16 / prof.infer(16)
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, int(rate * seconds)))
    sim = Simulation([(spec, prof)], 1, policy, ControllerSettings(max_pending=10**6, max_pending_per_model=10**6),
                     seed=seed)
    sim.place(spec.key, ["sim:0"])
    res = sim.run(times, np.zeros(len(times), dtype=int), [spec.key], drain_s=10.0,
                  classes=np.full(len(times), int(klass)))
    assert not np.isnan(res.records.finish).any()  # every request was answered, one way or another
    return res.records.status, res.records.finish > res.records.deadline


@pytest.mark.parametrize("policy", [ClockworkPolicy, DynamicBatchingPolicy])
def test_a_burst_without_client_timeouts_is_answered_late_not_lost(policy: type) -> None:
    status, late = burst(policy(), RequestClass.TARGET)
    assert (status == 200).all()  # no 504, no 503: the lane holds what the devices cannot do in time
    assert late.sum() > len(status) // 4  # twice the capacity: many answered late (and counted so)


def test_the_same_burst_with_hard_deadlines_refuses_and_drops_as_before() -> None:
    status, _ = burst(ClockworkPolicy(), RequestClass.HARD)
    assert (status == 200).mean() < 0.8 and set(np.unique(status)) <= {200, 503, 504}


def test_a_best_effort_flood_leaves_the_hard_stream_s_attainment_unchanged() -> None:
    """Hard requests of one model at 70% of a device, beside a flood of best-effort requests of
    another on the same device: the lane runs only in time no on-time work needs."""
    hard, flood = sim_spec("hard", 16), sim_spec("flood", 16)
    ph, pf = CLOCKWORK_V100["resnet18"], CLOCKWORK_V100["resnet50"]
    rng = np.random.default_rng(3)
    rate = 0.7 * 16 / ph.infer(16)
    t_hard = np.cumsum(rng.exponential(1 / rate, int(rate * 1.0)))
    t_flood = np.sort(rng.uniform(0, 1.0, 3000))

    def run(with_flood: bool) -> tuple[float, int, int]:
        sim = Simulation([(hard, ph), (flood, pf)], 1, ClockworkPolicy(),
                         ControllerSettings(max_pending=10**6, max_pending_per_model=10**6), seed=3)
        sim.place(hard.key, ["sim:0"])
        sim.place(flood.key, ["sim:0"])
        times = np.concatenate([t_hard, t_flood]) if with_flood else t_hard
        targets = np.concatenate([np.zeros(len(t_hard), int), np.ones(len(t_flood), int)]) if with_flood \
            else np.zeros(len(t_hard), int)
        classes = np.concatenate([np.zeros(len(t_hard), int), np.full(len(t_flood), 2)]) if with_flood \
            else np.zeros(len(t_hard), int)
        order = np.argsort(times, kind="stable")
        res = sim.run(times[order], targets[order], [hard.key, flood.key], drain_s=60.0, classes=classes[order])
        rec = res.records
        is_hard = (targets[order] == 0)
        served_flood = int(((rec.status == 200) & ~is_hard).sum())
        return float(rec.met[is_hard].mean()), served_flood, int(((rec.status != 200) & ~is_hard).sum())

    alone, _, _ = run(False)
    mixed, served, lost = run(True)
    assert alone > 0.99
    assert abs(mixed - alone) <= 0.001, (alone, mixed)  # within 0.1 point
    assert served == 3000 and lost == 0  # the whole flood is answered, in the gaps


def test_a_lane_request_that_waits_past_its_maximum_gets_504_saying_why() -> None:
    h = Harness(policy=ClockworkPolicy())
    spec = h.add(make_spec(), b1=1 * MS)
    h.preload(spec, 1)
    blocker = h.request(spec, timeout=10 * MS)
    (infer,) = h.step()
    assert blocker in infer.requests
    waiting = h.request(spec, klass=RequestClass.BEST_EFFORT, max_wait=50 * MS)
    assert h.step() == []  # the device is busy: nothing for the lane
    assert waiting.late and waiting.status == RequestStatus.QUEUED
    h.clock.set(h.now + 51 * MS)  # the blocking INFER never returns
    h.step()
    assert waiting.status == RequestStatus.FAILED and isinstance(waiting.error, DeadlineExceeded)
    assert "best_effort_max_wait_s" in str(waiting.error)
    assert h.sched.pending == 0 and h.sched.soft_bytes == 0


def test_the_lane_is_bounded_in_bytes_and_refuses_at_arrival_with_503() -> None:
    h = Harness(policy=ClockworkPolicy(), best_effort_bytes=3 * 8)  # three 1-sample requests of 2 floats
    spec = h.add(make_spec())
    kept = [h.request(spec, klass=RequestClass.BEST_EFFORT) for _ in range(3)]
    with pytest.raises(Overloaded, match="best_effort_bytes"):
        h.request(spec, klass=RequestClass.TARGET)
    h.request(spec, timeout=1.0)  # a hard request does not wait there: admitted
    for r in kept:
        h.run_until(r)
        assert r.ok
    assert h.sched.soft_bytes == 0


def test_a_target_request_is_scheduled_like_a_hard_one_while_it_can_make_it() -> None:
    h = Harness(policy=ClockworkPolicy())
    spec = h.add(make_spec())
    h.preload(spec, 1)
    r = h.request(spec, klass=RequestClass.TARGET)
    (infer,) = h.step()
    assert not infer.best_effort and not r.late and infer.latest < float("inf")
    h.result(infer)
    assert r.ok and h.sched.counters["met_deadline"] == 1 and h.sched.counters["moved_late"] == 0


def test_the_queue_policy_decides_the_class() -> None:
    spec = make_spec(slo=0.1)
    default = ControllerSettings()
    a = classify(spec, 5.0, None, 10, default)
    assert a.klass == RequestClass.TARGET and a.deadline == pytest.approx(5.1) and a.give_up_at == 35.0
    assert classify(spec, 5.0, 20_000, 10, default).klass == RequestClass.HARD
    delay = ControllerSettings(timeout_action="delay")
    assert classify(spec, 5.0, 20_000, 10, delay).klass == RequestClass.TARGET
    pinned = ControllerSettings(default_timeout_ms=50.0, allow_timeout_override=False)
    b = classify(spec, 5.0, 1_000_000, 10, pinned)
    assert b.klass == RequestClass.HARD and b.deadline == pytest.approx(5.05)  # the client's 1 s is ignored
    low = ControllerSettings(best_effort_priority=20)
    assert classify(spec, 5.0, 20_000, 25, low).klass == RequestClass.BEST_EFFORT
    assert classify(spec, 5.0, 20_000, 19, low).klass == RequestClass.HARD


def _model_with_policy(tmp_path: Path, policy: str) -> ModelSpec:
    d = tmp_path / "m"
    d.mkdir(parents=True)
    (d / "config.toml").write_text(tiny_config() + "\n" + policy)
    cfg = parse_model_config(d, 100.0)
    return ModelSpec(version=1, path=d / "1" / "model.pt2", format="pt2", **cfg)


def test_a_model_s_queue_policy_and_its_levels_override_the_daemon_s(tmp_path: Path) -> None:
    spec = _model_with_policy(tmp_path, """
[queue_policy]
default_timeout_ms = 250
timeout_action = "delay"
max_wait_s = 5
max_queue_size = 7
[queue_policy.levels.3]
timeout_action = "reject"
allow_timeout_override = false
[queue_policy.levels.30]
best_effort = true
""")
    daemon = ControllerSettings()  # reject, no default timeout, override allowed
    a = classify(spec, 0.0, None, 10, daemon)
    assert a.klass == RequestClass.TARGET and a.deadline == pytest.approx(0.25) and a.give_up_at == 5.0
    b = classify(spec, 0.0, 20_000, 3, daemon)  # level 3 rejects and ignores the client's timeout
    assert b.klass == RequestClass.HARD and b.deadline == pytest.approx(0.25)
    assert classify(spec, 0.0, None, 30, daemon).klass == RequestClass.BEST_EFFORT
    assert max_queue(spec, daemon) == (7, "queue_policy.max_queue_size of model m")
    h = Harness()
    h.add(spec)
    for _ in range(7):
        h.request(spec, timeout=1.0)
    with pytest.raises(Overloaded, match=r"queue_policy\.max_queue_size of model m"):
        h.request(spec, timeout=1.0)


@pytest.mark.parametrize(("policy", "needle"), [
    ("[queue_policy]\ntimeout_action = \"drop\"\n", "timeout_action = 'drop'"),
    ("[queue_policy]\ncolour = 1\n", "unknown keys ['colour']"),
    ("[queue_policy]\nmax_wait_s = 0\n", "max_wait_s = 0"),
    ("[queue_policy]\nbest_effort = true\n", "unknown keys ['best_effort']"),  # a level's key only
    ("[queue_policy.levels.x]\nbest_effort = true\n", "[queue_policy.levels.x]"),
    ("[queue_policy]\nallow_timeout_override = 1\n", "allow_timeout_override = 1"),
])
def test_a_bad_queue_policy_names_its_key(tmp_path: Path, policy: str, needle: str) -> None:
    with pytest.raises(ModelConfigError) as exc:
        _model_with_policy(tmp_path, policy)
    assert needle in str(exc.value)


def test_requests_are_counted_by_class_and_outcome() -> None:
    h = Harness(policy=ClockworkPolicy())
    spec = h.add(make_spec(), b1=1 * MS)
    h.preload(spec, 1)
    on_time = h.request(spec, klass=RequestClass.TARGET)
    h.run_until(on_time)
    with pytest.raises(DeadlineExceeded):
        h.request(spec, timeout=0.1 * MS)  # hard, infeasible: refused
    late = h.request(spec, timeout=0.1 * MS, klass=RequestClass.TARGET)  # infeasible target: late, answered
    h.run_until(late)
    assert late.ok and late.late
    classes = h.sched.telemetry.models[spec.key].classes
    assert classes == {("target", "on_time"): 1, ("hard", "refused"): 1, ("target", "late"): 1}


def test_priority_levels_map_as_triton_s(tmp_path: Path) -> None:
    spec = _model_with_policy(tmp_path, "[queue_policy]\npriority_levels = 3\ndefault_priority_level = 2\n")
    open_ = ControllerSettings(client_priorities=True)
    assert priority_rank(spec, 0, open_) == 2  # none given: the model's default level
    assert priority_rank(spec, 1, open_) == 1
    assert priority_rank(spec, 7, open_) == 2  # beyond its levels: the default, as Triton does
    closed = ControllerSettings()  # a client may lower its priority, never raise it above the default
    assert priority_rank(spec, 1, closed) == 2 and priority_rank(spec, 3, closed) == 3
    plain = make_spec()
    assert priority_rank(plain, 0, closed) == closed.default_priority
    with pytest.raises(ModelConfigError, match="default_priority_level = 4 is above priority_levels = 3"):
        _model_with_policy(tmp_path / "x", "[queue_policy]\npriority_levels = 3\ndefault_priority_level = 4\n")


@pytest.mark.parametrize("policy", [ClockworkPolicy, DynamicBatchingPolicy])
def test_a_random_mix_of_classes_under_slowdowns_leaves_nothing_behind(policy: type) -> None:
    """Many models on two devices that slow down at random, requests of every class at 1.5x capacity:
    every request is finished exactly once, target ones are all answered, hard ones only ever refused
    or dropped with 503/504, and the controller holds nothing afterwards (no pending request, no lane
    bytes, no lane entries)."""
    from daemon.sim import clockwork_models, random_bursts

    ms = clockwork_models(12, slo_s=0.05)
    rng = np.random.default_rng(7)
    sim = Simulation(ms, 2, policy(), ControllerSettings(max_pending=10**6, max_pending_per_model=10**6),
                     weight_budget=int(0.6 * 2**30), noise=0.2, seed=7,
                     slowdowns=random_bursts(["sim:0", "sim:1"], 2.0, 0.2, 0.05, 4.0, seed=7))
    rate = 1.5 * 2 * 16 / CLOCKWORK_V100["resnet50"].infer(16)
    times = np.sort(rng.uniform(0, 1.0, int(rate)))
    targets = rng.integers(0, len(ms), len(times))
    classes = rng.choice([0, 1, 2], len(times), p=[0.4, 0.4, 0.2])
    res = sim.run(times, targets, [s.key for s, _ in ms], drain_s=40.0, classes=classes, max_wait_s=30.0)
    st = res.records.status
    assert not np.isnan(res.records.finish).any()
    assert (st[classes == 1] == 200).all() and (st[classes == 2] == 200).all()
    assert set(np.unique(st[classes == 0])) <= {200, 503, 504}
    sched = sim.scheduler
    assert sched.pending == 0 and sched.soft_bytes == 0 and not sched.inflight
    assert all(e.queue.requests == 0 and e.late.requests == 0 for e in sched.models.values())



@pytest.mark.expect_errors("failed: injected")
@pytest.mark.parametrize("policy", [ClockworkPolicy, DynamicBatchingPolicy])
def test_a_lane_request_whose_batch_failed_runs_again_once_the_device_cools_off(policy: type) -> None:
    """A failed INFER keeps its model off the device for FAILURE_COOLDOWN (clockwork: even its
    best-effort lane); a lane request it held is retried by the time that ends, not left to wait
    out best_effort_max_wait_s with nothing to wake the controller."""
    from daemon.actions import ResultStatus
    from daemon.controller.state import FAILURE_COOLDOWN

    h = Harness(policy=policy())
    spec = h.add(make_spec())
    h.preload(spec, 1)
    req = h.request(spec, klass=RequestClass.BEST_EFFORT, max_wait=30.0)
    (infer,) = h.step()
    assert req in infer.requests and infer.best_effort
    failed_at = h.now
    again = h.result(infer, ResultStatus.FAILED, error="injected")
    if again:  # retried at once (dynamic: the lane runs where its model is)
        (retry,) = again
        h.result(retry)
    else:  # cooling off: the controller must wake when that ends
        assert req.status == RequestStatus.QUEUED and req.late
        wake = h.sched.next_wakeup(h.now)
        assert wake is not None and wake <= failed_at + FAILURE_COOLDOWN + 2 * MS
        h.run_until(req)
    assert req.ok and h.now < failed_at + FAILURE_COOLDOWN + 0.1  # not at 30 s
    assert h.sched.pending == 0 and h.sched.soft_bytes == 0
