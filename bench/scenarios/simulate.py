"""`simulate`: the controller at scale on simulated devices, in virtual time.

N models (default 1000, cycling through Clockwork's V100 profiles of ResNet18/50/152 and
SE-ResNeXt101) on D simulated devices (default 8), Zipf popularity, Poisson arrivals at
fractions of the devices' batch-1 capacity, through each policy. The same scheduler and policy
code the daemon runs makes every decision; only the devices are simulated. Reports SLO
attainment, and the controller's own cost: CPU microseconds per request and the request rate
one core of controller sustains (requests / controller CPU seconds).
"""

from __future__ import annotations

import typing
from typing import Any

import numpy as np

from bench import loadgen, results
from bench.scenarios.common import command
from daemon.config import PolicyName
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.policy import Policy
from daemon.sim import Simulation, clockwork_models

GIB = 2**30


def _policy(name: str) -> Policy:
    return ClockworkPolicy() if name == "clockwork" else DynamicBatchingPolicy()


def run(quick: bool = False, json_out: str | None = None, models: int = 1000, devices: int = 8,
        seconds: float | None = None, budget_gib: float = 21.5, noise: float = 0.02) -> dict[str, Any]:
    seconds = seconds or (5.0 if quick else 30.0)
    fractions = [0.3, 0.6] if quick else [0.2, 0.4, 0.6, 0.8]
    ms = clockwork_models(models)
    keys = [m[0].key for m in ms]
    popularity = loadgen.zipf_weights(models, 1.0)
    b1 = float(np.sum(popularity * np.array([p.infer(1) for _, p in ms])))
    capacity = devices / b1  # requests/s the devices could serve at batch 1, no cold starts
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"models": models, "devices": devices, "batch1_capacity_rps": capacity}
    for name in typing.get_args(PolicyName):
        for i, f in enumerate(fractions):
            sched = loadgen.poisson(capacity * f, seconds, models, popularity, seed=i)
            sim = Simulation(ms, devices, _policy(name), weight_budget=int(budget_gib * GIB), noise=noise, seed=i)
            res = sim.run(sched.times, sched.targets, keys)
            rec = res.records
            n = len(rec.arrival)
            ok = rec.status == 200
            lat = (rec.finish - rec.arrival)[ok] * 1e3
            c = sim.scheduler.counters
            tel = sim.scheduler.telemetry
            rows.append({
                "label": name, "load_fraction": f, "offered_rps": n / seconds, "achieved_rps": ok.sum() / seconds,
                "goodput_rps": rec.met.sum() / seconds, "slo_ms": 100.0, "slo_attainment": res.slo_attainment,
                "p50_ms": float(np.percentile(lat, 50)), "p90_ms": float(np.percentile(lat, 90)),
                "p99_ms": float(np.percentile(lat, 99)), "p999_ms": float(np.percentile(lat, 99.9)),
                "max_ms": float(lat.max()), "errors": {"deadline": int((rec.status == 504).sum())},
                "reconstructed": 0, "requests": n, "cold_start_rate": c["cold_starts"] / max(c["admitted"], 1),
                "loads": c["loads"], "unloads": c["unloads"],
                "controller_us_per_request": res.controller_s / n * 1e6,
                "requests_per_core_s": n / res.controller_s, "wall_s": res.wall_s,
                "virtual_s": seconds, "duration_error_p99": tel.duration_error.percentile(99),
            })
    cw = [r for r in rows if r["label"] == "clockwork"]
    summary["controller_us_per_request"] = float(np.median([r["controller_us_per_request"] for r in cw]))
    summary["requests_per_core_s"] = float(np.median([r["requests_per_core_s"] for r in cw]))
    for name in typing.get_args(PolicyName):
        summary[f"{name}_slo_attainment"] = {f"{r['load_fraction']:g}": r["slo_attainment"]
                                             for r in rows if r["label"] == name}
    config = {"command": command("simulate", quick), "models": models, "devices": devices,
              "seconds_virtual": seconds, "weight_budget_gib": budget_gib, "noise_lognormal_sigma": noise,
              "profiles": "Clockwork V100: resnet18, resnet50, resnet152, se_resnext101",
              "arrivals": "poisson, zipf(1.0) popularity", "load_fractions_of_batch1_capacity": fractions}
    notes = ["Virtual time: durations come from the profiles (with lognormal noise); the controller's CPU time "
             "is real, measured around every scheduler call.",
             "requests_per_core_s: requests handled per second of controller CPU, i.e. what one core sustains."]
    return results.write("simulate", config, rows, summary, json_out, notes,
                         columns=["label", "load_fraction", "offered_rps", "goodput_rps", "slo_attainment", "p50_ms",
                                  "p99_ms", "cold_start_rate", "loads", "unloads", "controller_us_per_request",
                                  "requests_per_core_s", "wall_s"])
