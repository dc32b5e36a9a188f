"""Light-load latency with the controller's keep-warm (issue 17): the socket p50 at Poisson 100
req/s, one daemon each way, measured in turn in the same run, against the raw call paced alike.

    python -m bench.keep_warm_ab [--model mlp_784] [--workers 0] [--reps 3] [--seconds 5] [--out FILE.json]

Four daemons, all with the latency path on: keep-warm off; keep-warm spinning between its runs, the
model's alone (`spin_model`: keep_warm_path false) and with the socket's path replayed (`spin`);
and keep-warm sleeping between them, path replayed (`sleep`); controller.keep_warm_ms 100,
keep_warm_touch_ms 1. Each
repetition plays the same schedule against each, the order reversed every other repetition.
Reported per daemon: p50, p99, the p50 over the paced raw call, and the daemon's CPU (cores) while
measured (keep-warm spends CPU to keep the model hot: that is its price).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path
from typing import Any

from bench import loadgen, raw, results
from bench.scenarios.common import demo_repo, measure, spec_of
from bench.servers import Escapement

WARM = {"latency_path": True, "keep_warm_ms": 100.0, "keep_warm_touch_ms": 1.0}
CONFIGS: dict[str, dict[str, Any]] = {
    "off": {"latency_path": True},
    "spin_model": {**WARM, "keep_warm_spin": True, "keep_warm_path": False},
    "spin": {**WARM, "keep_warm_spin": True},
    "sleep": {**WARM, "keep_warm_spin": False},
}


def run(model: str, workers: int | None, reps: int, seconds: float, rate: float = 100.0) -> dict[str, Any]:
    repo = demo_repo()
    spec = spec_of(repo, model)
    program = raw.program(repo, model)
    paced = raw.latencies(program, int(rate * seconds), pace_rps=rate)
    del program
    raw_p50 = float(results.percentile(paced, 50) * 1e3)
    server = {"server": {"frontend_workers": workers}} if workers is not None else {}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in CONFIGS}
    with contextlib.ExitStack() as stack:
        daemons = {k: stack.enter_context(Escapement(repo, controller=c, **server)) for k, c in CONFIGS.items()}
        for rep in range(reps):
            for k in list(CONFIGS) if rep % 2 == 0 else list(CONFIGS)[::-1]:
                d = daemons[k]
                m = measure(loadgen.poisson(rate, seconds, seed=rep), "socket", d.pid, [model], socket_path=d.socket,
                            specs=[spec], warmup=min(1.0, seconds / 5))
                r = results.row(m.run, k, spec.slo_s, rep=rep, server_cores=m.server_cores)
                rows[k].append(r)
                print(f"rep {rep} {k:10s} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.2f} ms  "
                      f"daemon cores {m.server_cores:.3f}", flush=True)
    summary: dict[str, Any] = {"model": model, "frontend_workers": workers, "rate_rps": rate, "reps": reps,
                               "raw_paced_p50_ms": raw_p50}
    for k, rs in rows.items():
        p50 = statistics.median(r["p50_ms"] for r in rs)
        summary[k] = {"p50_ms": p50, "over_raw_p50_ms": p50 - raw_p50,
                      "p99_ms": statistics.median(r["p99_ms"] for r in rs),
                      "daemon_cores": statistics.median(r["server_cores"] for r in rs),
                      "p50_ms_each": [r["p50_ms"] for r in rs]}
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.keep_warm_ab")
    ap.add_argument("--model", default="mlp_784")
    ap.add_argument("--workers", type=int, default=None, help="server.frontend_workers (default: the daemon's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    summary = run(a.model, a.workers, a.reps, a.seconds)
    text = json.dumps(summary, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
