"""`overhead`: batch-1 latency of each frontend at low load, minus the raw torch call.

The raw call is measured in the same run on the same program, twice: back to back (hot
caches) and paced at the same Poisson rate as the load (what a server at low load sees); the
overhead is taken against the paced one. Each frontend is measured in `reps` repetitions and
the median of their percentiles is reported.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench import loadgen, raw, results
from bench.scenarios.common import FRONTENDS, command, demo_repo, measure, spec_of
from bench.servers import Escapement


def run(quick: bool = False, json_out: str | None = None, model: str = "mlp_784", rate: float = 100.0,
        reps: int | None = None, seconds: float | None = None) -> dict[str, Any]:
    reps = reps or 3
    seconds = seconds or (5.0 if quick else 15.0)
    repo = demo_repo()
    spec = spec_of(repo, model)
    program = raw.program(repo, model)
    n_raw = int(rate * seconds)
    hot = raw.latencies(program, n_raw * 2)
    paced = raw.latencies(program, n_raw, pace_rps=rate)
    del program
    wakes = {"same_core": raw.wake_round_trips(cross_core=False), "cross_core": raw.wake_round_trips()}
    rows = [
        {"label": "raw (back to back)", **_lat_row(hot)},
        {"label": f"raw (paced {rate:g}/s)", **_lat_row(paced)},
    ]
    per_frontend: dict[str, list[dict[str, Any]]] = {f: [] for f in FRONTENDS}
    with Escapement(repo) as server:
        for rep in range(reps):
            for fe in FRONTENDS:
                sched = loadgen.poisson(rate, seconds, seed=rep)
                m = measure(sched, fe, server.pid, [model], socket_path=server.socket, port=server.port,
                            specs=[spec], warmup=min(1.0, seconds / 5))
                r = results.row(m.run, fe, spec.slo_s, rep=rep, server_cores=m.server_cores,
                                generator_cores=m.generator_cores)
                rows.append(r)
                per_frontend[fe].append(r)
    raw_p50 = float(results.percentile(paced, 50) * 1e3)
    summary: dict[str, Any] = {
        "model": model,
        "raw_p50_ms": raw_p50,
        "raw_p99_ms": float(results.percentile(paced, 99) * 1e3),
        "raw_hot_p50_ms": float(results.percentile(hot, 50) * 1e3),
    }
    for fe, rs in per_frontend.items():
        key = fe.replace("-", "_")
        p50 = statistics.median(r["p50_ms"] for r in rs)
        summary[f"{key}_p50_ms"] = p50
        summary[f"{key}_p99_ms"] = statistics.median(r["p99_ms"] for r in rs)
        summary[f"{key}_overhead_p50_ms"] = p50 - raw_p50
    summary["generator_bound_runs"] = sum(r.get("generator_bound", False) for r in rows)
    # What a hand-off between two threads costs here after an idle gap: a request to the daemon
    # and back makes several (client -> loop -> executor -> loop -> client); the raw call none.
    summary["wake_round_trip_p50_ms"] = {k: float(results.percentile(v, 50) * 1e3) for k, v in wakes.items()}
    config = {"command": command("overhead", quick), "model": model, "rate_rps": rate, "seconds_per_run": seconds,
              "reps": reps, "arrivals": "poisson", "server": "escapement, one cpu device, 1 intra-op thread",
              "raw_calls": {"hot": len(hot), "paced": len(paced)}}
    notes = ["Latency is measured from the moment the generator wrote the request to the moment the whole answer "
             "was read, on loopback.",
             "overhead = frontend p50 - raw p50 (paced), each the median over the repetitions.",
             "The generator (this process) and the daemon share the machine's cores; each row gives the cores "
             "each used.",
             "wake_round_trip_p50_ms: two threads waking each other after 5 ms idle, on one core and on two "
             "(bench/raw.py); a request makes four such wake-ups (client, event loop, executor, event loop, "
             "client), the raw call none."]
    return results.write("overhead", config, rows, summary, json_out, notes,
                         columns=["label", "rep", "offered_rps", "achieved_rps", "p50_ms", "p90_ms", "p99_ms",
                                  "p999_ms", "max_ms", "errors", "server_cores", "generator_cores",
                                  "generator_lag_p99_ms", "generator_bound"])


def _lat_row(x: Any) -> dict[str, Any]:
    ms = x * 1e3
    q = {"p50_ms": 50, "p90_ms": 90, "p99_ms": 99, "p999_ms": 99.9}
    out = {k: float(results.percentile(ms, v)) for k, v in q.items()}
    return {"requests": len(x), **out, "max_ms": float(ms.max())}
