"""Decision quality of a tree at four scale points: SLO attainment, goodput and cold starts.

    python -m bench.scale_quality TREE

For changes that move decisions (where `scale_probe decisions` hashes differ): the same seed,
load and warm-up on both trees, one JSON line per point. Run both trees interpreted
(ESCAPEMENT_NATIVE=0) or both compiled; decisions do not depend on which (issue 12).
Results: bench/results/scale-callgrind-issue12.md.
"""

from __future__ import annotations

import json
import sys

# (models, req/s, seconds counted, seconds of warm-up, GiB a device)
POINTS = ((10000, 20000.0, 1.0, 2.0, 64.0), (10000, 40000.0, 1.0, 1.0, 64.0), (1000, 60000.0, 1.0, 1.0, 64.0),
          (10000, 20000.0, 1.0, 1.0, 16.0))
KEYS = ("models", "offered_rps", "goodput_rps", "slo_attainment", "cold_start_rate", "controller_us_per_request")


def main(tree: str) -> None:
    sys.path.insert(0, tree)
    from bench.scenarios import scale
    for models, rate, seconds, warm, budget in POINTS:
        r = scale.point(models, 20.0, rate, seconds, 8, budget, 1, warm_s=warm)
        print(json.dumps({k: r[k] for k in KEYS} | {"budget_gib": budget, "warm_s": warm}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
