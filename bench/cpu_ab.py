"""Paired A/B of two trees: the daemon's whole CPU per request at fixed HTTP JSON loads.

    python -m bench.cpu_ab OLD_TREE NEW_TREE [REPS] [RATES]   e.g. ... /tmp/old . 5 1000,2500

Each tree's daemon (escapement as `bench run peers` configures it: one CPU device, one intra-op
thread, batch_wait 0; frontend workers as the default chooses) is offered Poisson HTTP JSON at
each rate for 5 s after a 1 s warm-up, interleaved per repetition (the order alternates). Per
point: CPU of the daemon's whole process tree per answered request (what bounds capacity on a
small machine), p99 and SLO attainment; then per rate the medians of each side and of the paired
new/old ratios. Written for the latency path's gate (bench/results/latency-gate-ab.md).
"""

from __future__ import annotations

import statistics
import sys

from bench import loadgen, results
from bench.scenarios.common import demo_repo, measure, spec_of
from bench.servers import Escapement

CONFIG = {"runtime": {"devices": ["cpu:0"], "cpu_threads": 1}, "controller": {"batch_wait_ms": 0.0}}


def main(argv: list[str]) -> None:
    old, new, *rest = argv
    reps = int(rest[0]) if rest else 3
    rates = [float(r) for r in rest[1].split(",")] if len(rest) > 1 else [1000.0, 2500.0]
    repo = demo_repo()
    spec = spec_of(repo, "mlp_784")
    trees = [("old", old), ("new", new)]
    cpu: dict[tuple[str, float], list[float]] = {}
    for rep in range(reps):
        for side, tree in trees if rep % 2 == 0 else trees[::-1]:
            with Escapement(repo, tree=tree, **CONFIG) as server:  # type: ignore[arg-type]
                for rate in rates:
                    m = measure(loadgen.poisson(rate, 5.0, seed=rep), "http-json", server.pid, ["mlp_784"],
                                port=server.port, specs=[spec], warmup=1.0)
                    r = results.row(m.run, side, spec.slo_s)
                    us = m.server_cores / max(r["achieved_rps"], 1.0) * 1e6
                    cpu.setdefault((side, rate), []).append(us)
                    print(f"{side} rep {rep} {rate:g} req/s: {us:.0f} µs CPU/request, p99 {r['p99_ms']:.1f} ms, "
                          f"attainment {r['slo_attainment']:.4f}", flush=True)
    for rate in rates:
        o, n = cpu[("old", rate)], cpu[("new", rate)]
        ratio = statistics.median(b / a for a, b in zip(o, n, strict=True))
        print(f"{rate:g} req/s: old {statistics.median(o):.0f} µs, new {statistics.median(n):.0f} µs, "
              f"new/old {ratio:.2f} (median of {reps} paired reps)")


if __name__ == "__main__":
    main(sys.argv[1:])
