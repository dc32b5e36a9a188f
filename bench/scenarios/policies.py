"""`policies`: the same workloads through every controller policy in the project, in one run.

Two workloads per policy: the `many-models` mix (loads, evictions, cold starts) and one model
at rising load (batching). Rows are labelled with the policy and carry `load_fraction`. The
many-models capacity is measured once, with the default policy, and every policy is offered
the same absolute loads (fractions of it).
"""

from __future__ import annotations

import typing
from typing import Any

from bench import results
from bench.scenarios import curve, many_models
from bench.scenarios.common import command
from daemon.config import PolicyName


def run(quick: bool = False, json_out: str | None = None, n: int | None = None,
        seconds: float | None = None) -> dict[str, Any]:
    policies = list(typing.get_args(PolicyName))
    n = n or (40 if quick else 120)
    seconds = seconds or (5.0 if quick else 15.0)
    fractions = [0.3, 0.6, 0.9] if quick else [0.3, 0.5, 0.7, 0.9]
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"policies": policies}
    capacity: float | None = None  # measured once, with the first policy (the default); the same loads for all
    for p in policies:
        mm_rows, facts = many_models.workload(n, p, fractions, seconds, capacity=capacity,
                                              probe_s=3.0 if quick else 5.0)
        capacity = facts["capacity_at_slo_rps"]
        summary["many_models_capacity_rps"] = capacity
        for r in mm_rows:
            r["workload"] = f"many-models ({n})"
        rows += mm_rows
        single = curve.run(quick=True, json_out=str(results.RESULTS / f"policies-curve-{p}.json"), policy=p,
                           seconds=seconds)
        for r in single["rows"]:
            r["workload"] = "one model (cnn_heavy)"
        rows += single["rows"]
        summary[f"{p}_many_models_slo_attainment"] = {f"{r['load_fraction']:g}": r["slo_attainment"] for r in mm_rows}
        summary[f"{p}_many_models_cold_start_rate"] = {f"{r['load_fraction']:g}": r["cold_start_rate"]
                                                       for r in mm_rows}
        summary[f"{p}_capacity_at_slo_rps"] = single["summary"]["capacity_at_slo_rps"]
        summary[f"{p}_fraction_of_limit"] = single["summary"]["fraction_of_limit"]
    config = {"command": command("policies", quick), "policies": policies, "models": n, "seconds_per_point": seconds,
              "load_fractions": fractions}
    return results.write("policies", config, rows, summary, json_out,
                         ["Each policy gets a fresh daemon per workload; load fractions are of raw limits measured "
                          "in the same run (see many-models and curve)."],
                         columns=["label", "workload", "load_fraction", "offered_rps", "goodput_rps", "slo_attainment",
                                  "p50_ms", "p99_ms", "p999_ms", "cold_start_rate", "errors", "generator_bound"])
