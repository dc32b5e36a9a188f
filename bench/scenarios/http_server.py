"""`http-server`: the event-loop CPU the HTTP layer costs per request, escapement's own HTTP/1.1
server (daemon/api/httpserver.py, on httptools) against aiohttp's web server.

Both run the same handler (bench/http_servers.py: decode the 784-float KServe v2 JSON body,
build the array, answer a fixed result) in their own process on uvloop, and are offered the same
Poisson load, alternately, `repeats` times in one run. Reported: server CPU microseconds per
request (median over the repeats) and latency at that load. This is why the daemon does not
serve HTTP through aiohttp.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

from bench import loadgen, results
from bench.scenarios.common import command, demo_repo, http_json, measure, spec_of
from bench.scenarios.peers import free_port
from bench.servers import ROOT

KINDS = ("aiohttp", "escapement")


def run(quick: bool = False, json_out: str | None = None, rate: float = 3000.0, seconds: float | None = None,
        repeats: int | None = None) -> dict[str, Any]:
    seconds = seconds or (5.0 if quick else 10.0)
    repeats = repeats or (3 if quick else 5)
    spec = spec_of(demo_repo(), "mlp_784")
    req = http_json(spec)
    rows: list[dict[str, Any]] = []
    for i in range(repeats):
        for kind in KINDS:
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "bench.http_servers", kind, str(port)], cwd=ROOT,
                                    stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"{kind} server did not start")
                measure(loadgen.poisson(300, 1.0, seed=1000 + i), "http", proc.pid, [spec.name], port=port,
                        http_requests=[req])  # warm-up
                m = measure(loadgen.poisson(rate, seconds, seed=i), "http", proc.pid, [spec.name], port=port,
                            http_requests=[req], warmup=0.5)
            finally:
                proc.kill()
                proc.wait()
            r = results.row(m.run, kind, spec.slo_s, server_cores=m.server_cores, generator_cores=m.generator_cores,
                            repeat=i)
            r["server_us_per_request"] = m.server_cores / r["achieved_rps"] * 1e6 if r["achieved_rps"] else None
            rows.append(r)
    per = {k: statistics.median(r["server_us_per_request"] for r in rows if r["label"] == k) for k in KINDS}
    p50 = {k: statistics.median(r["p50_ms"] for r in rows if r["label"] == k) for k in KINDS}
    summary = {"rate_rps": rate, "server_us_per_request": per, "p50_ms": p50,
               "escapement_over_aiohttp_cpu": per["escapement"] / per["aiohttp"]}
    config = {"command": command("http-server", quick), "rate_rps": rate, "seconds_per_run": seconds,
              "repeats": repeats, "request": "POST /v2/models/mlp_784/infer, KServe v2 JSON, [1, 784] FP32",
              "handler": "bench/http_servers.py: orjson decode, float32 array, fixed answer"}
    notes = ["server_us_per_request: the server process's CPU (user + system) per answered request; medians over "
             "the repeats, the two servers alternating."]
    return results.write("http-server", config, rows, summary, json_out, notes,
                         columns=["label", "repeat", "offered_rps", "achieved_rps", "p50_ms", "p99_ms",
                                  "server_cores", "server_us_per_request", "generator_cores"])
