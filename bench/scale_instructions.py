"""Instructions the controller spends at one `bench run scale` point, counted by callgrind.

An instruction count does not depend on what else the machine runs, so two trees compare
exactly on a shared, noisy machine where their timings differ by ±40% run to run (issue 12).
Only the controller's calls are counted: the Driver's submit, step and next_wakeup go through
`operator.call`, and callgrind collects inside that function alone (the simulator's own
bookkeeping, the set-up and the imports are left out).

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=_operator_call \\
        --callgrind-out-file=OUT python -m bench.scale_instructions TREE \\
        [MODELS RATE SECONDS [BUDGET_GIB [WARM [QUANTUM_US]]]]
    callgrind_annotate OUT | grep "PROGRAM TOTALS"   # over the REQUESTS line printed here
                                                     # (or DECISIONS: the actions decided)

TREE is a checkout (its code is imported first; built with `make native` to count the compiled
controller). Defaults: 1,000 models, 75,000 req/s, 0.05 s of virtual time, the 20x profile,
8 devices of 64 GiB, seed 1; WARM seconds of the same load run first, uncounted (a steady
state); QUANTUM_US: steps at most that often, as the saturation row (`scale.LOOP_QUANTUM`).
Under callgrind a run takes ~3 minutes, mostly torch's import.
Results: bench/results/scale-callgrind-issue12.md.
"""

from __future__ import annotations

import operator
import sys
from typing import Any


def main(argv: list[str]) -> None:
    tree, *rest = argv
    sys.path.insert(0, tree)
    from bench.scenarios import scale
    from daemon.controller import driver as dm

    warm = float(rest[4]) if len(rest) > 4 else 0.0
    counting: list[bool] = []
    # Actions decided within the counted window, by kind: the decisions the instructions bought
    # (a 10,000-model point makes LOADs and UNLOADs beside its INFERs; per decision, its cost can be
    # set against a point that makes INFERs only). Counted outside `operator.call`: not charged.
    decided: dict[str, int] = {}
    for name in ("submit", "step", "next_wakeup"):
        f = getattr(dm.Driver, name)

        # (calls of the warm-up, before `warm`, run uncounted: `now` is submit's second argument,
        # step's and next_wakeup's first)
        def routed(self: Any, *a: Any, _f: Any = f, _at: int = int(name == "submit"), _step: bool = name == "step",
                   **k: Any) -> Any:
            if a[_at] < warm:
                return _f(self, *a, **k)
            if not counting:  # telemetry's count of the warm-up's work, left out
                counting.append(True)
                self.scheduler.telemetry.flush()
            out = operator.call(_f, self, *a, **k)
            if _step:
                for action in out.actions:
                    decided[action.kind.name] = decided.get(action.kind.name, 0) + 1
            return out
        setattr(dm.Driver, name, routed)
    # Telemetry counts finished requests and results in batches of FLUSH_AT: a run flushes once
    # or not at all depending on its count of results (LOADs too), so the last batch is flushed
    # here, counted, or two points would differ by whether they happened to flush (a 10,000-model
    # run, with its LOADs, did; the same requests at 1,000 models did not).
    drivers: list[Any] = []
    init = dm.Driver.__init__

    def kept(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        drivers.append(self)
    dm.Driver.__init__ = kept  # type: ignore[method-assign]
    models = int(rest[0]) if rest else 1000
    rate = float(rest[1]) if len(rest) > 1 else 75000.0
    seconds = float(rest[2]) if len(rest) > 2 else 0.05
    budget = float(rest[3]) if len(rest) > 3 else 64.0
    quantum = float(rest[5]) * 1e-6 if len(rest) > 5 else 0.0
    r = scale.point(models, 20.0, rate, seconds, 8, budget, 1, warm_s=warm, quantum=quantum)
    for d in drivers:
        operator.call(d.scheduler.telemetry.flush)
    print("REQUESTS", r["requests"], "attainment", r["slo_attainment"])
    print("DECISIONS", sum(decided.values()), " ".join(f"{k}={v}" for k, v in sorted(decided.items())))


if __name__ == "__main__":
    main(sys.argv[1:])
