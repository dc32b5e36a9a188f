"""Timed steady-state growth of the controller's cost with the models (issue 12).

`scale.point` at 1,000 and 10,000 models (20x profile, 8 devices of 64 GiB, 20,000 req/s), 2 s
counted after `scale.STEADY_WARM_S` of the same load, REPS pairs (seeds 200..), alternating which
goes first; one JSON line a point, then the paired ratios and their median.

    python -m bench.scale_steady TREE [REPS]

Timed on a shared machine the pairs spread widely; `bench/scale_instructions.py` counts the same
points exactly (bench/results/scale-callgrind-issue12.md).
"""

from __future__ import annotations

import json
import statistics
import sys


def main(argv: list[str]) -> None:
    sys.path.insert(0, argv[0])
    from bench.scenarios import scale

    reps = int(argv[1]) if len(argv) > 1 else 3
    ratios = []
    for rep in range(reps):
        us: dict[int, float] = {}
        for n in (1000, 10_000) if rep % 2 == 0 else (10_000, 1000):
            r = scale.point(n, 20.0, 20_000.0, 2.0, 8, 64.0, seed=200 + rep, warm_s=scale.STEADY_WARM_S)
            us[n] = r["controller_us_per_request"]
            print(json.dumps({"rep": rep, "models": n, "us": round(us[n], 2), "cold": round(r["cold_start_rate"], 4),
                              "attainment": r["slo_attainment"]}), flush=True)
        ratios.append(us[10_000] / us[1000])
    print("ratios", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))


if __name__ == "__main__":
    main(sys.argv[1:])
