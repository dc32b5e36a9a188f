"""Where the controller's time goes at one `bench run scale` point, for any tree (issue 12).

    python -m bench.scale_probe phases TREE [MODELS RATE SECONDS SPEEDUP RUNS]
        wall µs per request of each Scheduler phase (submit, schedule, on_result, next_wakeup),
        median of RUNS runs in this process
    python -m bench.scale_probe profile TREE [MODELS RATE SECONDS SPEEDUP]
        cProfile of the controller's calls only (the Driver's submit, step, next_wakeup); with
        CALLERS=PATTERN in the environment, also who called the functions matching PATTERN
    python -m bench.scale_probe point TREE [MODELS RATE SECONDS SPEEDUP]
        one point's controller µs per request and SLO attainment (seed 1, as the 35k row)
    python -m bench.scale_probe models TREE [RUNS [WARM]]
        whether the cost per request grows with the number of models: 1,000 and 10,000 models at
        the 20x, 20,000 req/s point, with the scale scenario's budget (64 GiB a device: ~11% of
        requests at 10,000 models need a LOAD) and with one that holds every model (no LOAD), RUNS
        interleaved rounds (seeds 1..): median µs per request and per INFER action, and the ratios;
        WARM seconds of the same load first, not counted: the steady state (every model seen)
    python -m bench.scale_probe thrash TREE [RUNS [BUDGET_GIB]]
        memory thrash: 1,000 models at the 20x, 20,000 req/s point with BUDGET_GIB a device
        (default 3: ~36% of requests need a LOAD, most LOADs wait for room under copy pressure),
        0.25 s counted after 1.5 s of the same load (where the cost had grown 15x); beside it, in
        the same rounds, the scale scenario's 64 GiB (no LOAD). Controller µs per request,
        medians of RUNS interleaved rounds (seeds 1..), and the ratio of the two
    python -m bench.scale_probe decisions TREE
    python -m bench.scale_probe decisions-wide TREE
        one hash per point (six: those three, 10,000 models after a 2 s warm-up, at 16 GiB a device
        (thrash), the saturation row), with its actions counted from the start and its attainment
    python -m bench.scale_probe without TREE PART [RUNS]
        the 20x, 20,000 req/s point's controller µs per request (median of RUNS seeds) with one part
        made a no-op: `telemetry` (Telemetry.request and .action), `observe` (Estimator.observe_infer:
        estimates never change, so their memos never miss either), `best_case`, or `none`: what
        each part costs where it runs, caches and all (a profiler's own cost hides that)
    python -m bench.scale_probe hot TREE [RATE SECONDS RUNS]
        one hot model on one device with batch_wait 4 ms (the real daemon's default), Poisson at
        RATE (default 4,000 req/s): the regime of `bench run loop-cost`, simulated; controller µs per
        request (median of RUNS, seeds 0..), batches and a hash of the decisions
        a hash of every action sent and every request answered at three points: two trees whose
        hashes agree made the same decisions in the same order

TREE is a checkout (e.g. a `git worktree add /tmp/old COMMIT`); its code is imported first.
Defaults: 1000 models, 20,000 req/s, 0.5 s, the 20x profile, 3 runs; 8 devices, 64 GiB each.
"""

from __future__ import annotations

import cProfile
import hashlib
import os
import pstats
import statistics
import sys
import time
from typing import Any, Final


def _point(models: int, rate: float, seconds: float, speedup: float) -> dict[str, Any]:
    from bench.scenarios import scale
    return scale.point(models, speedup, rate, seconds, 8, 64.0, 2)


def phases(models: int, rate: float, seconds: float, speedup: float, runs: int) -> None:
    from daemon.controller import scheduler as sm
    acc: dict[str, float] = {}
    for name in ("submit", "schedule", "on_result", "next_wakeup"):
        f = getattr(sm.Scheduler, name)

        def timed(self: Any, *a: Any, _f: Any = f, _n: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(self, *a, **k)
            finally:
                acc[_n] = acc.get(_n, 0.0) + time.perf_counter() - t0
        setattr(sm.Scheduler, name, timed)
    out = []
    for _ in range(runs):
        acc.clear()
        r = _point(models, rate, seconds, speedup)
        out.append({k: v / r["requests"] * 1e6 for k, v in acc.items()} | {"whole": r["controller_us_per_request"]})
    for k in out[0]:
        print(f"{k:12s} {statistics.median(x[k] for x in out):6.1f} µs/request")


def profile(models: int, rate: float, seconds: float, speedup: float) -> None:
    from daemon.controller import driver as dm
    prof = cProfile.Profile()
    for name in ("submit", "step", "next_wakeup"):
        f = getattr(dm.Driver, name)

        def profiled(self: Any, *a: Any, _f: Any = f, **k: Any) -> Any:
            prof.enable()
            try:
                return _f(self, *a, **k)
            finally:
                prof.disable()
        setattr(dm.Driver, name, profiled)
    r = _point(models, rate, seconds, speedup)
    print("requests", r["requests"], "attainment", r["slo_attainment"], "(µs/request under the profiler:",
          round(r["controller_us_per_request"], 1), ")")
    pstats.Stats(prof).sort_stats("tottime").print_stats(40)
    if os.environ.get("CALLERS"):  # e.g. CALLERS="method 'get'": who makes those calls
        pstats.Stats(prof).print_callers(os.environ["CALLERS"])


def decisions() -> None:
    from daemon.controller import driver as dm
    h = hashlib.sha256()
    n = [0]
    step = dm.Driver.step

    def recorded(self: Any, now: float, results: Any = (), on_error: Any = None) -> Any:
        d = step(self, now, results, on_error)
        for a in d.actions:
            h.update(repr((a.kind.name, a.model.key, a.device, round(a.earliest, 9), round(a.latest, 9),
                           a.batch_size, a.samples)).encode())
            n[0] += 1
        for req in d.finished:
            h.update(repr((req.status.name, round(req.finished_at, 9))).encode())
        return d
    dm.Driver.step = recorded  # type: ignore[method-assign]
    for models, rate, secs in ((1000, 20000, 0.3), (10000, 20000, 0.2), (1000, 60000, 0.2)):
        r = _point(models, rate, secs, 20.0)
        print(models, rate, n[0], r["slo_attainment"], h.hexdigest()[:16])


# (models, req/s, seconds counted, GiB a device, seconds of warm-up first): the three points of
# `decisions`, then the steady 10,000-model state with its LOADs, memory thrash, the saturation row
WIDE_POINTS: Final = ((1000, 20000.0, 0.3, 64.0, 0.0), (10000, 20000.0, 0.2, 64.0, 0.0),
                      (1000, 60000.0, 0.2, 64.0, 0.0), (10000, 20000.0, 0.5, 64.0, 2.0),
                      (10000, 20000.0, 0.3, 16.0, 1.0), (1000, 75000.0, 0.5, 64.0, 0.5))


def decisions_wide() -> None:
    """A hash of every action sent and every request answered, one per point of WIDE_POINTS (seed
    1): where two trees differ, the point says which path (LOADs, thrash, overload) moved."""
    from bench.scenarios import scale
    from daemon.controller import driver as dm
    h = [hashlib.sha256()]
    n = [0]
    step = dm.Driver.step

    def recorded(self: Any, now: float, results: Any = (), on_error: Any = None) -> Any:
        d = step(self, now, results, on_error)
        for a in d.actions:
            h[0].update(repr((a.kind.name, a.model.key, a.device, round(a.earliest, 9), round(a.latest, 9),
                              a.batch_size, a.samples)).encode())
            n[0] += 1
        for req in d.finished:
            h[0].update(repr((req.status.name, round(req.finished_at, 9))).encode())
        return d
    dm.Driver.step = recorded  # type: ignore[method-assign]
    for models, rate, secs, gib, warm in WIDE_POINTS:
        h[0], n[0] = hashlib.sha256(), 0
        r = scale.point(models, 20.0, rate, secs, 8, gib, 1, warm_s=warm)
        print(models, rate, secs, gib, warm, n[0], round(r["slo_attainment"], 6), h[0].hexdigest()[:16], flush=True)


def hot(rate: float, seconds: float, runs: int) -> None:
    from bench import loadgen
    from daemon.config import ControllerSettings
    from daemon.controller import driver as dm
    from daemon.controller.policies.clockwork import ClockworkPolicy
    from daemon.runtime.simdevice import SimProfile
    from daemon.sim import Simulation, sim_spec

    h = hashlib.sha256()
    step = dm.Driver.step

    def recorded(self: Any, now: float, results: Any = (), on_error: Any = None) -> Any:
        d = step(self, now, results, on_error)
        for a in sorted(repr((a.kind.name, a.earliest, a.latest, a.batch_size, a.samples)) for a in d.actions):
            h.update(a.encode())
        return d
    dm.Driver.step = recorded  # type: ignore[method-assign]
    costs, batches = [], []
    for seed in range(runs):
        # an mlp-sized model: ~60 µs at batch 1, 350 µs at 32
        ms = [(sim_spec("hot", 32, 0.1), SimProfile(2**20, 1e-3, {1: 60e-6, 8: 130e-6, 32: 350e-6}))]
        sim = Simulation(ms, 1, ClockworkPolicy(batch_wait=0.004), ControllerSettings(), weight_budget=2**30,
                         seed=seed)
        sim.place(ms[0][0].key, ["sim:0"])
        sched = loadgen.poisson(rate, seconds, 1, [1.0], seed=seed)
        res = sim.run(sched.times, sched.targets, [ms[0][0].key], drain_s=0.5)
        costs.append(res.controller_s / len(sched.times) * 1e6)
        batches.append(sim.scheduler.counters["infer_actions"])
    print(f"{statistics.median(costs):.1f} us/request (runs: {', '.join(f'{c:.1f}' for c in costs)}), batches "
          f"{batches}, decisions {h.hexdigest()[:16]}")


def without(part: str, runs: int) -> None:
    from bench.scenarios import scale
    from daemon.controller import estimates, scheduler
    from daemon.observability import telemetry

    if part == "telemetry":
        telemetry.Telemetry.request = lambda self, req: None  # type: ignore[method-assign]
        telemetry.Telemetry.action = lambda self, result: None  # type: ignore[method-assign]
    elif part == "observe":
        estimates.Estimator.observe_infer = lambda self, *a, **k: None  # type: ignore[method-assign]
    elif part == "best_case":
        scheduler.Scheduler.best_case = lambda self, req: 0.0  # type: ignore[method-assign]
    elif part != "none":
        raise SystemExit(f"unknown part {part!r}: telemetry, observe, best_case or none")
    costs = [scale.point(1000, 20.0, 20000, 0.5, 8, 64.0, seed)["controller_us_per_request"]
             for seed in range(1, runs + 1)]
    print(f"without {part}: {statistics.median(costs):.1f} us/request ({', '.join(f'{c:.1f}' for c in costs)})")


def by_models(runs: int, warm_s: float = 0.0) -> None:
    from bench.scenarios import scale
    from daemon import sim as simmod

    counters: dict[str, int] = {}
    run = simmod.Simulation.run

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        r = run(self, *a, **k)
        counters.clear()
        counters.update(self.scheduler.counters)
        return r
    simmod.Simulation.run = counted  # type: ignore[method-assign]
    cells = [(m, gib) for gib in (64.0, 1024.0) for m in (1000, 10000)]
    per_req: dict[tuple[int, float], list[float]] = {c: [] for c in cells}
    per_act: dict[tuple[int, float], list[float]] = {c: [] for c in cells}
    cold: dict[tuple[int, float], float] = {}
    for seed in range(1, runs + 1):
        for m, gib in cells:  # interleaved: a noisy stretch of the machine hits every cell alike
            r = scale.point(m, 20.0, 20000, 0.5, 8, gib, seed, warm_s=warm_s)
            per_req[(m, gib)].append(r["controller_us_per_request"])
            actions = counters.get("infer_actions", 0) + counters.get("loads", 0) + counters.get("unloads", 0)
            per_act[(m, gib)].append(r["controller_us_per_request"] * r["requests"] / max(actions, 1))
            cold[(m, gib)] = r["cold_start_rate"]
    print("| budget per device | models | cold-start rate | µs/request | µs/action | 10,000 / 1,000 (per request) |")
    print("|---|---|---|---|---|---|")
    for m, gib in cells:
        med = statistics.median(per_req[(m, gib)])
        base = statistics.median(per_req[(1000, gib)])
        # (the scheduler's action counts cover the warm-up too: per action only without one)
        act = f"{statistics.median(per_act[(m, gib)]):.1f}" if not warm_s else "-"
        print(f"| {gib:g} GiB | {m:,} | {cold[(m, gib)]:.3f} | {med:.1f} | {act} | {med / base:.2f} |")
    for gib in (64.0, 1024.0):
        ratios = [a / b for a, b in zip(per_req[(10000, gib)], per_req[(1000, gib)], strict=True)]
        print(f"{gib:g} GiB: paired ratios 10,000 / 1,000 models per round: {', '.join(f'{x:.2f}' for x in ratios)}"
              f" (median {statistics.median(ratios):.2f})")


def thrash(runs: int, budget_gib: float) -> None:
    from bench.scenarios import scale
    us: dict[float, list[float]] = {budget_gib: [], 64.0: []}
    cold: list[float] = []
    for seed in range(1, runs + 1):
        for gib in us:
            r = scale.point(1000, 20.0, 20000.0, 0.25, 8, gib, seed, warm_s=1.5)
            us[gib].append(r["controller_us_per_request"])
            if gib == budget_gib:
                cold.append(r["cold_start_rate"])
            print(f"seed {seed}, {gib:g} GiB: {r['controller_us_per_request']:.1f} us/request, "
                  f"{r['cold_start_rate']:.1%} cold starts, attainment {r['slo_attainment']:.4f}", flush=True)
    a, b = statistics.median(us[budget_gib]), statistics.median(us[64.0])
    ratios = [x / y for x, y in zip(us[budget_gib], us[64.0], strict=True)]
    print(f"thrash ({budget_gib:g} GiB, {statistics.median(cold):.1%} cold starts): {a:.1f} us/request; "
          f"64 GiB: {b:.1f}; paired ratios {', '.join(f'{x:.2f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f})")


def main(argv: list[str]) -> None:
    mode, tree, *rest = argv
    sys.path.insert(0, tree)
    args = [float(x) for x in rest] if mode != "without" else []
    if mode == "without":
        without(rest[0], int(rest[1]) if len(rest) > 1 else 5)
        return
    if mode == "models":
        by_models(int(args[0]) if args else 5, float(args[1]) if len(args) > 1 else 0.0)
        return
    if mode == "thrash":
        thrash(int(args[0]) if args else 3, args[1] if len(args) > 1 else 3.0)
        return
    if mode == "decisions-wide":
        decisions_wide()
        return
    if mode == "hot":
        hot(args[0] if args else 4000.0, args[1] if len(args) > 1 else 5.0, int(args[2]) if len(args) > 2 else 3)
        return
    models, rate, seconds, speedup = (int(args[0]) if args else 1000, args[1] if len(args) > 1 else 20000.0,
                                      args[2] if len(args) > 2 else 0.5, args[3] if len(args) > 3 else 20.0)
    if mode == "phases":
        phases(models, rate, seconds, speedup, int(args[4]) if len(args) > 4 else 3)
    elif mode == "profile":
        profile(models, rate, seconds, speedup)
    elif mode == "point":
        from bench.scenarios import scale
        r = scale.point(models, speedup, rate, seconds, 8, 64.0, 1)
        print(f"{r['controller_us_per_request']:.1f} us/request, attainment {r['slo_attainment']:.4f}, "
              f"{r['requests']} requests")
    else:
        decisions()


if __name__ == "__main__":
    main(sys.argv[1:])
