"""`loop-cost`: the controller process's event-loop CPU per request in the real daemon (issue 12).

The daemon serves the demo's `mlp_784` on its CPU device; an open-loop Poisson generator offers
`rate` requests/s of batch 1 over the unix socket (msgpack) and over HTTP JSON for `seconds`.
`loop_us_per_request` is the CPU time of the daemon's main thread (the event loop that owns the
controller) per answered request, from /proc/PID/task/PID/schedstat, over the measured window:
with `frontend_workers = 0` that thread also parses and encodes every request; with 1 worker it
runs the link records and the controller only. Where the latency path runs a lone INFER on that
thread, the model's run is loop CPU too: `loop_us_deciding` takes it out (the daemon counts it,
`escapement_controller_events_total{event="latency_path_cpu_ns"}`), leaving what the controller's
own work costs, comparable with a tree that has no latency path.

`--base TREE` runs the same points on an older checkout too (e.g. `git worktree add /tmp/base
e5e4aa8`, the start of this round), interleaved with this tree in every repetition: the ratio
new/old of each pair is what to quote on a shared machine. An older tree without frontend
workers runs its only mode (its row says workers = "-").
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench import loadgen, results
from bench.scenarios.common import Frontend, command, demo_repo, measure, spec_of
from bench.scenarios.ingest import _thread_cpu_ns, inline_run_ns
from bench.servers import Escapement

MODEL = "mlp_784"
FRONTENDS: tuple[Frontend, ...] = ("socket", "http-json")


def _point(server: Escapement, frontend: Frontend, rate: float, seconds: float, rep: int, spec: Any) -> dict[str, Any]:
    sched = loadgen.poisson(rate, seconds, seed=rep)
    warmup = min(1.0, seconds / 5)
    i0 = inline_run_ns(server.port)
    c0 = _thread_cpu_ns(server.pid, server.pid)
    m = measure(sched, frontend, server.pid, [MODEL], socket_path=server.socket, port=server.port, specs=[spec],
                warmup=warmup, drain_s=2.0)
    loop_s = (_thread_cpu_ns(server.pid, server.pid) - c0) / 1e9
    inline_s = (inline_run_ns(server.port) - i0) / 1e9
    r = results.row(m.run, frontend, spec.slo_s, rep=rep, server_cores=m.server_cores,
                    generator_cores=m.generator_cores)
    answered = int((m.run.records.status == 200).sum())  # every request of the run, warm-up included
    r["loop_us_per_request"] = loop_s / max(answered, 1) * 1e6
    r["inline_run_us_per_request"] = inline_s / max(answered, 1) * 1e6
    r["loop_us_deciding"] = (loop_s - inline_s) / max(answered, 1) * 1e6
    return r


def run(quick: bool = False, json_out: str | None = None, rate: float = 4000.0, seconds: float | None = None,
        reps: int | None = None, base: str = "", workers: str = "0,1") -> dict[str, Any]:
    seconds = seconds or (4.0 if quick else 8.0)
    reps = reps or 3
    repo = demo_repo()
    spec = spec_of(repo, MODEL)
    counts = [int(w) for w in str(workers).split(",") if w != ""]
    trees: list[tuple[str, Path | None, int | None]] = [("new", None, n) for n in counts]
    if base:
        trees.insert(0, ("old", Path(base), None))
    rows: list[dict[str, Any]] = []
    for rep in range(reps):
        order = trees if rep % 2 == 0 else trees[::-1]  # neither side always first
        for side, tree, n in order:
            server_cfg = {} if n is None else {"frontend_workers": n}
            with Escapement(repo, tree=tree, server=server_cfg) as server:
                for fe in FRONTENDS:
                    r = _point(server, fe, rate, seconds, rep, spec)
                    r.update(side=side, workers="-" if n is None else n, label=f"{side} {fe} workers="
                             f"{'-' if n is None else n}")
                    rows.append(r)
    summary: dict[str, Any] = {"model": MODEL, "rate_rps": rate}
    for key in ("loop_us_per_request", "loop_us_deciding"):
        loop: dict[str, float] = {}
        for side, _, n in trees:
            for fe in FRONTENDS:
                mine = [r for r in rows if r["side"] == side and r["workers"] == ("-" if n is None else n)
                        and r["label"].split()[1] == fe]
                loop[f"{side} {fe} workers={'-' if n is None else n}"] = statistics.median(r[key] for r in mine)
        summary[key] = loop
    if base:  # paired ratios: each new point against the old one of the same repetition and frontend
        for key, name in (("loop_us_per_request", "new_over_old"), ("loop_us_deciding", "deciding_new_over_old")):
            ratios: dict[str, float] = {}
            for _, _, n in trees[1:]:
                for fe in FRONTENDS:
                    pairs = [(o[key], x[key]) for rep in range(reps)
                             for o in rows if o["rep"] == rep and o["side"] == "old" and o["label"].split()[1] == fe
                             for x in rows if x["rep"] == rep and x["side"] == "new" and x["workers"] == n
                             and x["label"].split()[1] == fe]
                    ratios[f"{fe} workers={n}"] = statistics.median(x / o for o, x in pairs)
            summary[name] = ratios
    notes = [f"{rate:g} req/s Poisson, batch 1, {seconds:g} s per point ({reps} reps, medians); the generator "
             "shares the machine's 2 cores with the daemon.",
             "loop_us_per_request: the daemon main thread's CPU (schedstat) over the whole point, per answered "
             "request. inline_run_us_per_request: the part of it that ran models on the latency path (a lone "
             "INFER run on the loop's thread, counted by the daemon); loop_us_deciding: the rest, what the loop "
             "spends on requests and decisions (a tree without the latency path runs no model there)."]
    config = {"command": command("loop-cost", quick, {"base": base} if base else None), "rate": rate,
              "seconds": seconds, "reps": reps, "base": base, "workers": counts}
    return results.write("loop-cost", config, rows, summary, json_out, notes=notes,
                         columns=["label", "rep", "offered_rps", "achieved_rps", "p50_ms", "p99_ms",
                                  "slo_attainment", "loop_us_per_request", "inline_run_us_per_request",
                                  "loop_us_deciding", "server_cores", "generator_cores"])
