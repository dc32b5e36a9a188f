"""`overhead`: batch-1 latency of each frontend at low load, minus the raw torch call.

The raw call is measured in the same run on the same program, twice: back to back (hot
caches) and paced at the same Poisson rate as the load (what a server at low load sees); the
overhead is taken against the paced one. Each frontend is measured in `reps` repetitions and
the median of their percentiles is reported.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from typing import Any

from bench import loadgen, raw, results
from bench.scenarios.common import FRONTENDS, command, demo_repo, measure, spec_of
from bench.servers import Escapement

MODES = {"on": (True,), "off": (False,), "both": (True, False)}


def run(quick: bool = False, json_out: str | None = None, model: str = "mlp_784", rate: float = 100.0,
        reps: int | None = None, seconds: float | None = None, latency_path: str = "both") -> dict[str, Any]:
    """`latency_path`: the controller's latency path (controller.latency_path) "on", "off", or "both":
    two daemons, one each way, measured in turn within each repetition (same run, interleaved)."""
    if latency_path not in MODES:
        raise SystemExit(f"--latency-path must be one of {sorted(MODES)}")
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
    modes = MODES[latency_path]
    per_frontend: dict[tuple[str, bool], list[dict[str, Any]]] = {(f, on): [] for f in FRONTENDS for on in modes}
    with contextlib.ExitStack() as stack:
        servers = {on: stack.enter_context(Escapement(repo, controller={"latency_path": on})) for on in modes}
        for rep in range(reps):
            for fe in FRONTENDS:
                for on in modes if rep % 2 == 0 else modes[::-1]:  # neither way always first
                    server = servers[on]
                    sched = loadgen.poisson(rate, seconds, seed=rep)
                    m = measure(sched, fe, server.pid, [model], socket_path=server.socket, port=server.port,
                                specs=[spec], warmup=min(1.0, seconds / 5))
                    r = results.row(m.run, fe, spec.slo_s, rep=rep, server_cores=m.server_cores,
                                    generator_cores=m.generator_cores)
                    r["latency_path"] = on
                    rows.append(r)
                    per_frontend[(fe, on)].append(r)
    steps = {("on" if on else "off"): _latency_steps(server) for on, server in servers.items()}
    raw_p50 = float(results.percentile(paced, 50) * 1e3)
    summary: dict[str, Any] = {
        "model": model,
        "raw_p50_ms": raw_p50,
        "raw_p99_ms": float(results.percentile(paced, 99) * 1e3),
        "raw_hot_p50_ms": float(results.percentile(hot, 50) * 1e3),
    }
    for (frontend, on), rs in per_frontend.items():
        # the figures of the daemon as configured by default (the path on) keep their names
        key = frontend.replace("-", "_")
        tail = "" if on or len(modes) == 1 else "_path_off"
        p50 = statistics.median(r["p50_ms"] for r in rs)
        summary[f"{key}_p50_ms{tail}"] = p50
        summary[f"{key}_p99_ms{tail}"] = statistics.median(r["p99_ms"] for r in rs)
        summary[f"{key}_overhead_p50_ms{tail}"] = p50 - raw_p50
    if len(modes) == 2:  # what the path saves, per repetition (each pair measured back to back)
        for name in FRONTENDS:
            pairs = zip(per_frontend[(name, False)], per_frontend[(name, True)], strict=True)
            summary[f"{name.replace('-', '_')}_path_saves_p50_ms"] = statistics.median(
                off["p50_ms"] - on["p50_ms"] for off, on in pairs)
    # the controller's steps that issued actions, by what the latency path did (logged at shutdown)
    summary["latency_path_steps"] = steps
    summary["generator_bound_runs"] = sum(r.get("generator_bound", False) for r in rows)
    # What a hand-off between two threads costs here after an idle gap: a request to the daemon
    # and back makes several (client -> loop -> executor -> loop -> client); the raw call none.
    summary["wake_round_trip_p50_ms"] = {k: float(results.percentile(v, 50) * 1e3) for k, v in wakes.items()}
    config = {"command": command("overhead", quick, {"latency_path": latency_path} if latency_path != "both" else None),
              "model": model, "rate_rps": rate, "seconds_per_run": seconds, "latency_path": latency_path,
              "reps": reps, "arrivals": "poisson", "server": "escapement, one cpu device, 1 intra-op thread",
              "raw_calls": {"hot": len(hot), "paced": len(paced)}}
    notes = ["Latency is measured from the moment the generator wrote the request to the moment the whole answer "
             "was read, on loopback.",
             "overhead = frontend p50 - raw p50 (paced), each the median over the repetitions.",
             "The generator (this process) and the daemon share the machine's cores; each row gives the cores "
             "each used.",
             "wake_round_trip_p50_ms: two threads waking each other after 5 ms idle, on one core and on two "
             "(bench/raw.py); a request makes four such wake-ups (client, event loop, executor, event loop, "
             "client), the raw call none; on the controller's latency path (controller.latency_path) two: the "
             "INFER runs on the event loop's thread.",
             "latency_path both: two daemons, the path on and off, measured in turn (alternating which goes first) "
             "in each repetition; keys ending _path_off are the daemon without it; <frontend>_path_saves_p50_ms is "
             "the median over repetitions of (p50 off - p50 on)."]
    return results.write("overhead", config, rows, summary, json_out, notes,
                         columns=["label", "rep", "offered_rps", "achieved_rps", "p50_ms", "p90_ms", "p99_ms",
                                  "p999_ms", "max_ms", "errors", "latency_path", "server_cores", "generator_cores",
                                  "generator_lag_p99_ms", "generator_bound"])


def _latency_steps(server: Escapement) -> dict[str, int] | None:
    for line in reversed(server.log):
        _, found, tail = line.partition("latency path, steps by outcome: ")
        if found:
            counts: dict[str, int] = json.loads(tail)
            return counts
    return None


def _lat_row(x: Any) -> dict[str, Any]:
    ms = x * 1e3
    q = {"p50_ms": 50, "p90_ms": 90, "p99_ms": 99, "p999_ms": 99.9}
    out = {k: float(results.percentile(ms, v)) for k, v in q.items()}
    return {"requests": len(x), **out, "max_ms": float(ms.max())}
