"""`curve`: one model's throughput-latency curve as offered load rises past saturation.

The raw batched limit (the best samples/s of the bare torch call over the model's batch
sizes, one intra-op thread like one daemon CPU device) is measured first, in the same run;
offered loads are fractions of it. Capacity at SLO is the highest offered load whose p99 stays
within the SLO with at least 99% of requests answered within it; between the last good and
the first bad point the search bisects to refine it.
"""

from __future__ import annotations

from typing import Any

from bench import loadgen, raw, results
from bench.scenarios.common import Frontend, command, demo_repo, measure, spec_of
from bench.scenarios.many_models import predictability, stats
from bench.servers import Escapement


def run(quick: bool = False, json_out: str | None = None, model: str = "cnn_heavy", frontend: Frontend = "socket",
        policy: str = "clockwork", seconds: float | None = None, refine: int | None = None,
        latency_path: bool = True, keep_warm_ms: float = 0.0, frontend_workers: int | None = None) -> dict[str, Any]:
    seconds = seconds or (6.0 if quick else 20.0)
    refine = 1 if quick and refine is None else (refine if refine is not None else 3)
    repo = demo_repo()
    spec = spec_of(repo, model)
    program = raw.program(repo, model)
    limit, best_b, per_size = raw.batched_limit(program, seconds_per_size=0.5 if quick else 2.0)
    del program
    fractions = [0.2, 0.5, 0.7, 0.85, 1.0, 1.15] if quick else [0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0,
                                                                  1.1, 1.25]
    rows: list[dict[str, Any]] = []
    # keep_warm_ms: the controller's keep-warm (docs/controller.md), spinning, the socket path replayed
    ctl: dict[str, Any] = {"policy": policy, "latency_path": latency_path}
    if keep_warm_ms:
        ctl["keep_warm_ms"] = keep_warm_ms
    server_cfg = {"server": {"frontend_workers": frontend_workers}} if frontend_workers is not None else {}
    with Escapement(repo, controller=ctl, **server_cfg) as server:

        def point(rate: float, seed: int) -> dict[str, Any]:
            sched = loadgen.poisson(rate, seconds, seed=seed)
            m = measure(sched, frontend, server.pid, [model], socket_path=server.socket, port=server.port,
                        specs=[spec], warmup=min(2.0, seconds / 4), drain_s=max(2.0, 3 * spec.slo_s))
            r = results.row(m.run, policy, spec.slo_s, load_fraction=rate / limit, server_cores=m.server_cores,
                            generator_cores=m.generator_cores)
            rows.append(r)
            return r

        point(limit * 0.3, seed=99)  # warm-up: estimates, caches; not reported
        rows.clear()
        for i, f in enumerate(fractions):
            point(limit * f, seed=i)
        for i in range(refine):
            cap = results.capacity_at_slo(rows)
            above = [r["offered_rps"] for r in rows if r["offered_rps"] > cap]
            if not above:
                break
            point((cap + min(above)) / 2 if cap else min(above) / 2, seed=100 + i)
        telemetry = stats(server.port)["telemetry"]
    rows.sort(key=lambda r: r["offered_rps"])
    cap = results.capacity_at_slo(rows)
    summary = {"model": model, "policy": policy, "frontend": frontend, "slo_ms": spec.slo_s * 1e3,
               "capacity_at_slo_rps": cap, "raw_limit_samples_per_s": limit, "raw_limit_batch_size": best_b,
               "fraction_of_limit": cap / limit if limit else 0.0, **predictability(telemetry)}
    extra: dict[str, Any] = {"model": model} if model != "cnn_heavy" else {}
    if not latency_path:
        extra["latency_path"] = "false"
    if keep_warm_ms:
        extra["keep_warm_ms"] = keep_warm_ms
    if frontend_workers is not None:
        extra["frontend_workers"] = frontend_workers
    config = {"command": command("curve", quick, extra or None),
              "model": model, "frontend": frontend, "policy": policy, "seconds_per_point": seconds,
              "latency_path": latency_path, "keep_warm_ms": keep_warm_ms, "frontend_workers": frontend_workers,
              "arrivals": "poisson", "load_fractions": fractions, "raw_samples_per_s_by_batch": per_size,
              "server": "escapement, one cpu device, 1 intra-op thread"}
    png = results.plot_curve(f"curve-{model}", rows, spec.slo_s * 1e3, f"{model}: latency vs offered load",
                             vlines={f"raw limit {limit:.0f}/s": limit, f"capacity at SLO {cap:.0f}/s": cap})
    notes = [f"Raw limit: best of batch sizes {list(per_size)} on one thread, at batch {best_b}.",
             "Capacity at SLO counts only points where p99 <= SLO, >= 99% of requests met it, and the generator "
             "kept its schedule."]
    if png:
        notes.append(f"Plot: {png.name}")
    return results.write(f"curve-{model}" if model != "cnn_heavy" else "curve", config, rows, summary, json_out,
                         notes, columns=["label", "load_fraction", "offered_rps", "achieved_rps", "goodput_rps",
                                         "slo_attainment", "p50_ms", "p99_ms", "p999_ms", "max_ms", "errors",
                                         "server_cores", "generator_cores", "generator_bound"])
