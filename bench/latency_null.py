"""Socket round trip of a null model (Linear 784 -> 10: the model's run is ~20 µs) at 100 req/s,
one request at a time: what the daemon itself adds at light load (issue 17's latency goal), with
and without frontend workers and the latency path.

    python -m bench.latency_null [WORKERS,...]     (default 0,1; two 4 s runs of each, p50 and p99)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench import loadgen, results
from bench.scenarios.common import measure, spec_of
from bench.scenarios.ingest import MODEL, _build_repo
from bench.servers import Escapement


def main(argv: list[str]) -> None:
    repo = _build_repo(Path(tempfile.mkdtemp(prefix="latency-null-")) / "repo")
    spec = spec_of(repo, MODEL)
    for workers in [int(w) for w in (argv[0] if argv else "0,1").split(",")]:
        for path in (True, False):
            with Escapement(repo, server={"frontend_workers": workers}, controller={"latency_path": path}) as s:
                rows = []
                for _ in range(2):
                    m = measure(loadgen.constant(100, 4.0, 1), "socket", s.pid, [MODEL], socket_path=s.socket,
                                specs=[spec], warmup=0.5)
                    rows.append(results.row(m.run, "x", 0.1))
                print(f"workers {workers} latency_path {path}: p50 ms {[round(x['p50_ms'], 3) for x in rows]}, "
                      f"p99 ms {[round(x['p99_ms'], 3) for x in rows]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
