"""`many-models`: N models with Zipf popularity and a weight budget that holds a tenth of them.

The N models are copies of the demo models (their files linked, not copied), so loads and
evictions happen all the time. The workload's capacity (the highest offered load at which 99%
of requests meet their SLO) is measured first; offered loads are fractions of it
(`load_fraction`). Each point reports SLO attainment, the cold-start rate and loads and
evictions per second, read from the daemon's own counters (`/v2/controller/stats`). The mix's
raw batch-1 limit (no batching, no cold starts) is reported beside it for scale.
"""

from __future__ import annotations

import contextlib
import http.client
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import loadgen, raw, results
from bench.scenarios.common import command, demo_repo, measure, spec_of
from bench.servers import Escapement
from bench.spy import Spy
from daemon.model import ModelSpec
from daemon.repository import scan

BASE = ("digits_mlp", "digits_cnn", "mlp_784", "cnn_heavy")


def build_repo(n: int, base_repo: Path, out: Path, bases: tuple[str, ...] = BASE) -> list[str]:
    """N model directories m000.. cycling through `bases` (the demo models), model files symlinked."""
    names = []
    for i in range(n):
        base = bases[i % len(bases)]
        d = out / f"m{i:03d}"
        (d / "1").mkdir(parents=True)
        shutil.copy(base_repo / base / "config.toml", d / "config.toml")
        (d / "1" / "model.pt2").symlink_to(base_repo / base / "1" / "model.pt2")
        profile = base_repo / base / "1" / "profile.json"
        if profile.exists():  # the same program on the same machine: no warm-up needed
            shutil.copy(profile, d / "1" / "profile.json")
        names.append(d.name)
    return names


def stats(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/v2/controller/stats")
        return orjson.loads(conn.getresponse().read())  # type: ignore[no-any-return]
    finally:
        conn.close()


def predictability(telemetry: dict[str, Any]) -> dict[str, Any]:
    """The headline predictability figures from the daemon's telemetry (/v2/controller/stats)."""
    lat, dur, start = telemetry["executor_lateness_ms"], telemetry["duration_error"], telemetry["start_error_ms"]
    return {"executor_lateness_p99_ms": lat.get("p99"), "executor_lateness_p50_ms": lat.get("p50"),
            "duration_error_p99": dur.get("p99"), "duration_error_p1": dur.get("p1"),
            "start_error_p99_ms": start.get("p99"), "actions_measured": lat.get("count", 0),
            **{f"prediction_error_{k.lower()}_p99_ms": v.get("p99")
               for k, v in telemetry.get("prediction_error_ms", {}).items()}}


def point(server: Escapement, sched: loadgen.Schedule, names: list[str], specs: list[ModelSpec], seconds: float,
          slo: float, label: str, spy_out: Path | None = None, **extra: Any) -> dict[str, Any]:
    """One offered load against a running daemon: the client's row, with cold starts, loads and
    evictions from the daemon's counters over the same span; `spy_out`: the daemon sampled by
    py-spy meanwhile, where it is installed (bench/spy.py), its raw stacks written there."""
    first = stats(server.port)
    t0 = time.monotonic()
    with Spy(server.pid, seconds, spy_out) if spy_out is not None else contextlib.nullcontext() as spy:
        m = measure(sched, "socket", server.pid, names, socket_path=server.socket, specs=specs, warmup=0.0,
                    drain_s=3 * slo)
    last = stats(server.port)
    threads = thread_cores(first.get("threads_cpu_s", {}), last.get("threads_cpu_s", {}), time.monotonic() - t0)
    before, after = first["counters"], last["counters"]
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    r = results.row(m.run, label, slo, **extra, server_cores=m.server_cores, generator_cores=m.generator_cores,
                    cold_start_rate=d.get("cold_starts", 0) / max(d.get("admitted", 0), 1),
                    loads_per_s=d.get("loads", 0) / seconds, evictions_per_s=d.get("unloads", 0) / seconds,
                    missed_deadline=d.get("missed_deadline", 0))
    # every model's own SLO counts: attainment from the daemon's met/missed counters too
    r["daemon_slo_attainment"] = d.get("met_deadline", 0) / max(d.get("admitted", 0), 1)
    r["server_threads"] = threads
    if spy is not None and spy.summary:
        r["spy"] = spy.summary
    return r


def thread_cores(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Cores each of the daemon's threads used between two readings of its `threads_cpu_s`, busiest
    first (those under 0.005 left out)."""
    cores = {n: (s - before.get(n, 0.0)) / wall for n, s in after.items()} if wall > 0 else {}
    return {n: round(c, 3) for n, c in sorted(cores.items(), key=lambda kv: -kv[1]) if c >= 0.005}


def threads_markdown(groups: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """Lines of a table: per label and offered load, the controller process's cores and its busiest
    threads (its `threads_cpu_s`; `other` is library threads such as CUDA's and ended ones)."""
    lines = ["", "The controller process's CPU per offered load (cores: the process, then its busiest threads):",
             "", "| run | offered req/s | process | threads |", "|---|---|---|---|"]
    for label, rows in groups:
        for r in rows:
            top = ", ".join(f"{n} {c:.2f}" for n, c in list(r.get("server_threads", {}).items())[:5])
            lines.append(f"| {label} | {r['offered_rps']:.1f} | {r.get('server_cores', 0.0):.2f} | {top} |")
    return lines


def _meets_slo(r: dict[str, Any]) -> bool:
    return r["slo_attainment"] >= 0.99 and r["p99_ms"] <= r["slo_ms"] and not r["generator_bound"]


def workload(n: int, policy: str, fractions: list[float], seconds: float, seed: int = 0,
             zipf_s: float = 1.0, capacity: float | None = None,
             probe_s: float = 3.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows for one policy at fractions of the workload's capacity, and facts about the workload.

    Without `capacity`, it is measured first with this policy: the highest offered load at which
    >= 99% of requests meet their SLO and p99 is within it (doubling, then three bisections).
    """
    base_repo = demo_repo()
    base_specs = {b: spec_of(base_repo, b) for b in BASE}
    b1 = {b: float(np.median(raw.latencies(raw.program(base_repo, b), 200))) for b in BASE}
    work = Path(tempfile.mkdtemp(prefix="mm-"))
    try:
        names = build_repo(n, base_repo, work)
        specs: dict[str, ModelSpec] = {m.name: m for m in scan(work).models}
        rng = np.random.default_rng(seed)
        order = rng.permutation(n)  # popularity rank -> model, so big and small models mix
        popularity = np.empty(n)
        popularity[order] = loadgen.zipf_weights(n, zipf_s)
        base_of = [BASE[i % len(BASE)] for i in range(n)]
        limit = 1.0 / float(sum(popularity[i] * b1[base_of[i]] for i in range(n)))
        weights = {b: raw.program(base_repo, b).weight_bytes for b in BASE}
        total = sum(weights[base_of[i]] for i in range(n))
        budget = total // 10
        facts = {"models": n, "zipf_s": zipf_s, "raw_b1_limit_rps": limit, "weight_bytes_total": total,
                 "weight_budget": budget, "raw_b1_ms": {k: v * 1e3 for k, v in b1.items()}}
        rows: list[dict[str, Any]] = []
        with Escapement(work, runtime={"weight_budget": budget}, controller={"policy": policy}) as server:
            slo = max(base_specs[b].slo_s for b in BASE)

            def probe(rate: float, secs: float, s: int) -> dict[str, Any]:
                secs = max(secs, 300 / rate)  # enough requests that one miss does not decide it
                m = measure(loadgen.poisson(rate, secs, n, popularity, seed=s), "socket", server.pid, names,
                            socket_path=server.socket, specs=[specs[x] for x in names], drain_s=3 * slo)
                return results.row(m.run, policy, slo)

            probe(limit * 0.05, probe_s, 99)  # warm-up: estimates, caches
            if capacity is None:
                good, bad, rate = 0.0, None, limit * 0.05
                for k in range(10):
                    if _meets_slo(probe(rate, probe_s, 200 + k)):
                        good, rate = rate, rate * 2
                    else:
                        bad = rate
                        break
                for k in range(3):
                    if bad is None:
                        break
                    mid = (good + bad) / 2 if good else bad / 2
                    if _meets_slo(probe(mid, probe_s, 300 + k)):
                        good = mid
                    else:
                        bad = mid
                capacity = good
            facts["capacity_at_slo_rps"] = capacity
            for i, f in enumerate(fractions):
                sched = loadgen.poisson(capacity * f, seconds, n, popularity, seed=seed + i)
                rows.append(point(server, sched, names, [specs[x] for x in names], seconds, slo, policy,
                                  load_fraction=f))
            facts.update(predictability(stats(server.port)["telemetry"]))
        return rows, facts
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(quick: bool = False, json_out: str | None = None, n: int | None = None, policy: str = "clockwork",
        seconds: float | None = None) -> dict[str, Any]:
    n = n or (60 if quick else 200)
    seconds = seconds or (6.0 if quick else 20.0)
    fractions = [0.5, 0.7, 1.0] if quick else [0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.2]
    rows, facts = workload(n, policy, fractions, seconds, probe_s=3.0 if quick else 5.0)
    summary = {"policy": policy, **facts, "capacity_at_slo_rps": facts["capacity_at_slo_rps"],
               "slo_attainment_by_load_fraction": {f"{r['load_fraction']:g}": r["slo_attainment"] for r in rows},
               "cold_start_rate_by_load_fraction": {f"{r['load_fraction']:g}": r["cold_start_rate"] for r in rows},
               "loads_per_s_max": max(r["loads_per_s"] for r in rows),
               "evictions_per_s_max": max(r["evictions_per_s"] for r in rows)}
    config = {"command": command("many-models", quick), "models": n, "policy": policy, "seconds_per_point": seconds,
              "load_fractions": fractions, "arrivals": "poisson, zipf popularity", "frontend": "socket",
              "server": "escapement, one cpu device (1 intra-op thread), weight budget = a tenth of all weights"}
    png = results.plot_curve("many-models", rows, 100.0, f"{n} models, Zipf popularity, budget holds 1/10")
    notes = ["Models are copies of digits_mlp, digits_cnn, mlp_784 and cnn_heavy in turn; SLO is each model's "
             "own (100 ms); slo_ms in the rows is the largest.",
             "load_fraction = offered load / capacity_at_slo_rps, the capacity of this workload measured first in "
             "the same run with the same policy."]
    if png:
        notes.append(f"Plot: {png.name}")
    return results.write("many-models", config, rows, summary, json_out, notes,
                         columns=["label", "load_fraction", "offered_rps", "achieved_rps", "goodput_rps",
                                  "slo_attainment", "p50_ms", "p99_ms", "p999_ms", "cold_start_rate", "loads_per_s",
                                  "evictions_per_s", "errors", "server_cores", "generator_bound"])
