"""Decision quality of a tree at scale points: SLO attainment, goodput and cold starts.

    python -m bench.scale_quality TREE              four points (below)
    python -m bench.scale_quality TREE --rows       every row of `bench run scale` (its loads,
                                                    seeds and 2 s), the thrash row last
    python -m bench.scale_quality TREE --shared     two models at 1-3x what their shared device
                                                    runs, batches no cheaper per sample
                                                    (tests/unit/harness.py): admitted, refused,
                                                    answered late, on time

For changes that move decisions (where `scale_probe decisions` hashes differ): the same seed,
load and warm-up on both trees, one JSON line per point. Run both trees interpreted
(ESCAPEMENT_NATIVE=0) or both compiled; decisions do not depend on which (issue 12).
Results: bench/results/scale-callgrind-issue12.md, bench/results/scale-admission-issue12.md.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# (models, req/s, seconds counted, seconds of warm-up, GiB a device)
POINTS = ((10000, 20000.0, 1.0, 2.0, 64.0), (10000, 40000.0, 1.0, 1.0, 64.0), (1000, 60000.0, 1.0, 1.0, 64.0),
          (10000, 20000.0, 1.0, 1.0, 16.0))
KEYS = ("models", "offered_rps", "goodput_rps", "slo_attainment", "cold_start_rate", "controller_us_per_request")


ROW_KEYS = ("label", "offered_rps", "goodput_rps", "slo_attainment", "goodput_of_capacity", "cold_start_rate")


def main(tree: str) -> None:
    sys.path.insert(0, tree)
    from bench.scenarios import scale
    for models, rate, seconds, warm, budget in POINTS:
        r = scale.point(models, 20.0, rate, seconds, 8, budget, 1, warm_s=warm)
        print(json.dumps({k: r[k] for k in KEYS} | {"budget_gib": budget, "warm_s": warm}), flush=True)


def rows(tree: str) -> None:
    """The rows `bench run scale` makes (without timing them), in its order."""
    sys.path.insert(0, tree)
    from bench.scenarios import scale
    loads = [5_000, 10_000, 20_000, 35_000, 50_000, 75_000, 100_000]
    points: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    for speedup in (5.0, 20.0):
        points += [((1000, speedup, rate, 2.0, 8, 64.0), {"seed": i}) for i, rate in enumerate(loads)]
    points += [((1000, 20.0, rate, 2.0, 8, 64.0), {"seed": i, "quantum": scale.LOOP_QUANTUM})
               for i, rate in enumerate(loads)]
    points += [((10_000, 20.0, rate, 2.0, 8, 64.0), {"seed": 100 + i}) for i, rate in enumerate(loads[1:3])]
    points.append(((1000, 20.0, 20_000.0, 0.25, 8, scale.THRASH_GIB, 1), {"warm_s": scale.THRASH_WARM_S}))
    for args, kwargs in points:
        r = scale.point(*args, **kwargs)
        print(json.dumps({k: r[k] for k in ROW_KEYS}), flush=True)


def shared(tree: str) -> None:
    """Two models on one device (1,000 samples/s at any batch size) offered 400-1,500/s each for 4 s."""
    sys.path.insert(0, tree)
    from daemon.errors import Overloaded
    from tests.unit.harness import MS, Harness, make_spec

    for rate in (400.0, 600.0, 900.0, 1500.0):
        h = Harness()
        specs = [h.add(make_spec(f"m{i}", max_batch=8, slo=0.1), b1=1 * MS, bmax=8 * MS) for i in range(2)]
        for spec in specs:
            h.use(spec)
        admitted, refused, i = [], 0, 0
        todo, end, upcoming = h.step(), h.now + 4.0, h.now
        while h.now < end:
            while upcoming <= h.now:
                try:
                    admitted.append(h.request(specs[i % 2], timeout=0.1))
                except Overloaded:
                    refused += 1
                i += 1
                upcoming += 1 / (2 * rate)
            if todo:
                action, todo = todo[0], todo[1:]
                todo += h.result(action) + h.step()
            else:
                wake = h.sched.next_wakeup(h.now)
                h.clock.set(max(h.now + 1e-4, min(upcoming, wake if wake is not None else upcoming)))
                todo = h.step()
        late = sum(1 for r in admitted if r.status.finished and not r.ok)
        print(json.dumps({"offered_each_rps": rate, "admitted": len(admitted), "refused": refused,
                          "answered_504": late, "on_time": sum(1 for r in admitted if r.ok)}), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    where = args[0] if args and not args[0].startswith("--") else "."
    if "--rows" in args:
        rows(where)
    elif "--shared" in args:
        shared(where)
    else:
        main(where)
