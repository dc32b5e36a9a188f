"""The controller at scale on simulated devices, in virtual time: 1,000 models on 8 devices."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from daemon.actions import Action
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.sim import CLOCKWORK_V100, SimProfile, Simulation, Slowdown, clockwork_models, load_profiles

GIB = 2**30


def poisson(rate: float, seconds: float, n: int, seed: int = 0, s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / rate, int(rate * seconds)))
    w = 1 / np.arange(1, n + 1) ** s
    return times, rng.choice(n, size=len(times), p=w / w.sum())


def run(policy: str, models: int = 1000, devices: int = 8, rate: float = 2000, seconds: float = 2.0,
        budget: int = int(21.5 * GIB), seed: int = 0, **kw: object) -> Simulation:
    ms = clockwork_models(models)
    sim = Simulation(ms, devices, ClockworkPolicy() if policy == "clockwork" else DynamicBatchingPolicy(),
                     weight_budget=budget, seed=seed, **kw)  # type: ignore[arg-type]
    times, targets = poisson(rate, seconds, models, seed)
    sim.result = sim.run(times, targets, [m[0].key for m in ms])  # type: ignore[attr-defined]
    return sim


def test_a_thousand_models_on_eight_devices_every_request_answered_once() -> None:
    # ~half the devices' capacity: most of the 1000 models see a request at a time (batch 1)
    sim = run("clockwork", rate=1000, seconds=3.0, budget=32 * GIB)
    r = sim.result.records  # type: ignore[attr-defined]
    assert len(r.arrival) > 2500
    assert not np.isnan(r.finish).any()  # every request got its one answer
    assert set(np.unique(r.status)) <= {200, 504}
    assert sim.result.slo_attainment > 0.99  # type: ignore[attr-defined]
    assert sim.scheduler.pending == 0 and not sim.scheduler.inflight
    assert sim.result.controller_s > 0  # type: ignore[attr-defined]
    # Everything fits (~185 GB of weights, 8 x 32 GiB): each model is loaded once, where needed.
    assert sim.scheduler.counters["unloads"] == 0


def test_controller_cpu_is_counted_from_the_warm_up_on() -> None:
    # A warm-up's controller CPU is left out (a steady-state figure); the decisions are the same.
    ms = clockwork_models(50)
    times, targets = poisson(500, 0.5, 50, 1)
    runs = []
    for count_from in (0.0, 10.0):  # 10 s: after every arrival and the drain
        sim = Simulation(ms, 2, ClockworkPolicy(), weight_budget=32 * GIB, seed=1)
        runs.append(sim.run(times, targets, [m[0].key for m in ms], drain_s=1.0, count_from=count_from))
    assert runs[0].controller_s > 0 and runs[1].controller_s == 0.0
    np.testing.assert_array_equal(runs[0].records.finish, runs[1].records.finish)


def test_a_run_is_deterministic_for_a_seed() -> None:
    a, b = run("clockwork", models=200, seed=3, noise=0.05), run("clockwork", models=200, seed=3, noise=0.05)
    ra, rb = a.result.records, b.result.records  # type: ignore[attr-defined]
    np.testing.assert_array_equal(ra.status, rb.status)
    np.testing.assert_array_equal(ra.finish, rb.finish)
    assert a.scheduler.counters == b.scheduler.counters


class CountingDriver:
    """The simulation's driver, with its steps counted."""

    def __init__(self, driver: object) -> None:
        self.driver = driver
        self.steps: list[float] = []

    def submit(self, *a: object) -> object:
        return self.driver.submit(*a)  # type: ignore[attr-defined]

    def next_wakeup(self, *a: object) -> object:
        return self.driver.next_wakeup(*a)  # type: ignore[attr-defined]

    def step(self, now: float, *a: object) -> object:
        self.steps.append(now)
        return self.driver.step(now, *a)  # type: ignore[attr-defined]


@pytest.mark.parametrize("quantum", [0.0, 20e-6])
def test_a_step_quantum_handles_what_came_within_it_in_one_step(quantum: float) -> None:
    """As an event loop steps the controller once for what came in while it was busy: arrivals 5 us
    apart are one step with a 20 us quantum (at the last one's time), each its own without; their
    arrival times are their own either way, and a run stays deterministic."""
    ms = clockwork_models(4)
    times = np.array([0.010, 0.010005, 0.01001, 0.0105])
    outs = []
    for _ in range(2):
        sim = Simulation(ms, 1, ClockworkPolicy(), weight_budget=32 * GIB, step_quantum=quantum)
        for spec, _ in ms:
            sim.place(spec.key, ["sim:0"])
        counting = CountingDriver(sim.driver)
        sim.driver = counting  # type: ignore[assignment]
        res = sim.run(times, np.array([0, 1, 2, 3]), [m[0].key for m in ms])
        arrivals = [t for t in counting.steps if t <= 0.0105]
        outs.append((arrivals, res.records.finish.tolist()))
        np.testing.assert_array_equal(res.records.arrival, times)
        assert (res.records.status == 200).all()
    (arrivals, finish), again = outs
    assert (arrivals, finish) == again
    assert arrivals == pytest.approx([0.01001, 0.0105] if quantum else [0.010, 0.010005, 0.01001, 0.0105])


def test_clockwork_beats_the_baseline_when_memory_is_tight() -> None:
    cw = run("clockwork", models=300, devices=4, rate=1000, budget=2 * GIB)
    dyn = run("dynamic", models=300, devices=4, rate=1000, budget=2 * GIB)
    assert cw.result.slo_attainment > dyn.result.slo_attainment + 0.1  # type: ignore[attr-defined]
    assert cw.scheduler.counters["loads"] < dyn.scheduler.counters["loads"]


def test_a_slow_device_shows_up_as_refusals_and_misses_but_loses_nothing() -> None:
    sim = run("clockwork", models=100, devices=2, rate=600, seconds=3.0,
              slowdowns=[Slowdown("sim:0", factor=4.0, start=1.0, end=2.0)])
    c = sim.scheduler.counters
    r = sim.result.records  # type: ignore[attr-defined]
    assert not np.isnan(r.finish).any()
    assert c["infer_too_late"] + c["failed_DeadlineExceeded"] > 0
    late = sim.scheduler.telemetry.duration_error
    assert late.max > 2.0  # measured durations 4x the prediction while it lasted


def test_sim_profiles_interpolate() -> None:
    p = CLOCKWORK_V100["resnet50"]
    assert p.infer(16) == pytest.approx(17.33e-3)
    assert p.infer(3) == pytest.approx((4.05e-3 + 5.88e-3) / 2)
    assert SimProfile(1, 1e-3, {1: 1e-3}).infer(4) == pytest.approx(4e-3)


def test_profiles_measured_on_a_gpu_drive_the_simulator(tmp_path: Path) -> None:
    # The file bench/gpu/profiles.py writes (its own sim_profile, on made-up measurements).
    from bench.gpu import profiles as bench_profiles

    rows = [{"batch": b, "graphs_enabled": g, "mode": "graph", "median_us": 100.0 * b * (2 - g), "p99_us": 150.0 * b}
            for b in (1, 2, 4, 8, 16, 32) for g in (False, True)]
    prof = bench_profiles.sim_profile(SimpleNamespace(weight_bytes=50_000_000), rows,  # type: ignore[arg-type]
                                      [2e-3, 3e-3, 4e-3])
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"format": bench_profiles.FORMAT, "profiles": {"net": prof}}))
    p = load_profiles(path)["net"]
    assert p.weight_bytes == 50_000_000
    assert p.load_s == pytest.approx(3e-3)
    assert p.infer(4) == pytest.approx(400e-6)  # the graphs-enabled medians
    assert p.infer(3) == pytest.approx(300e-6)
    assert load_profiles(path, "infer_p99_s")["net"].infer(1) == pytest.approx(150e-6)
    ms = clockwork_models(6, profiles=load_profiles(path))
    sim = Simulation(ms, 2, ClockworkPolicy())
    times, targets = poisson(500, 1.0, 6)
    result = sim.run(times, targets, [m[0].key for m in ms])
    assert not np.isnan(result.records.finish).any()
    assert result.slo_attainment > 0.99
    path.write_text(json.dumps({"format": "other", "profiles": {}}))
    with pytest.raises(ValueError, match="not a profiles file"):
        load_profiles(path)


def test_bench_gpu_profiles_runs_on_the_stand_in_and_the_simulator_reads_it(tmp_path: Path) -> None:
    from bench.gpu import profiles as bench_profiles

    assert bench_profiles.main(["--device", "emucuda:0", "--out", str(tmp_path), "--quick", "--runs", "3",
                                "--models", "mlp_784"]) == 0
    p = load_profiles(tmp_path / "profiles.json")["mlp_784"]
    assert set(p.infer_s) == {1, 2}
    assert p.weight_bytes > 7_000_000 and p.load_s > 0
    assert "| 1 |" in (tmp_path / "profiles.md").read_text()


Sent = tuple[float, str, str, str, float, float, float, int, tuple[int, ...]]


def _decisions(seed: int) -> list[Sent]:
    """Every action the controller sent, in order, with its window, batch and requests (ids
    relative to the run's first), over a noisy run with a slowed device and too little memory."""
    ms = clockwork_models(120)
    sim = Simulation(ms, 3, ClockworkPolicy(), weight_budget=GIB, noise=0.05, seed=seed,
                     slowdowns=[Slowdown("sim:0", factor=4.0, start=0.2, end=0.5)])
    times, targets = poisson(1500, 1.0, 120, seed)
    sent: list[Sent] = []

    def recorder(submit: Callable[[Action], None]) -> Callable[[Action], None]:
        def record(a: Action) -> None:
            sent.append((sim.clock.now(), a.kind.name, a.model.key, a.device, a.earliest, a.latest,
                         a.expected_duration, a.batch_size, tuple(r.id for r in a.requests)))
            submit(a)
        return record

    for ex in sim.executors.values():
        ex.submit = recorder(ex.submit)  # type: ignore[method-assign, assignment]
    sim.run(times, targets, [m[0].key for m in ms], drain_s=1.0)
    first = min(i for a in sent for i in a[8])
    return [(*a[:8], tuple(i - first for i in a[8])) for a in sent]


def test_the_same_seed_sends_the_same_actions_in_the_same_order() -> None:
    a, b = _decisions(7), _decisions(7)
    assert {x[1] for x in a} == {"LOAD", "UNLOAD", "INFER"}  # memory is tight: every kind of decision
    assert a == b
    assert a != _decisions(8)  # (the record does tell runs apart)
