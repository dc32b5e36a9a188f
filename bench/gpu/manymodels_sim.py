"""The many-models GPU scenario in the simulator, on a measured profile, with the LOAD time varied.

`python -m bench.gpu.manymodels_sim --profiles PATH --out DIR [--model resnet18] [--load-ms 1.05,5]`

The real controller and policies (clockwork, dynamic) drive one simulated device whose INFER
times are a GPU's measured profile (`bench.gpu.profiles`' profiles.json) and whose weight budget
holds 4 of 40 copies, under the same Zipf Poisson loads as `bench.gpu.manymodels`, 10 s each. The
LOAD time is the variable: the profile's own (the copy alone) against what the daemon measured.
This says how much of the real run's SLO attainment a LOAD's duration decides, without a GPU.
Writes DIR/manymodels_sim.json and DIR/manymodels_sim.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import loadgen
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.policy import Policy
from daemon.sim import Simulation, clockwork_models, load_profiles

RATES = (60.0, 120.0, 240.0, 480.0, 960.0)
MODELS = 40
FIT = 4


def policy(name: str) -> Policy:
    return ClockworkPolicy() if name == "clockwork" else DynamicBatchingPolicy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.manymodels_sim")
    ap.add_argument("--profiles", required=True, help="profiles.json from python -m bench.gpu.profiles")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--load-ms", default="", help="comma-separated LOAD times (default: the profile's and 5)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.profiles).read_text(encoding="utf-8"))
    prof = load_profiles(args.profiles)[args.model]
    loads = [float(x) / 1e3 for x in args.load_ms.split(",")] if args.load_ms else [prof.load_s, 0.005]
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for load_s in loads:
        p = replace(prof, load_s=load_s)
        for pol in ("clockwork", "dynamic"):
            for rate in RATES:
                models = clockwork_models(MODELS, 0.1, 8, {args.model: p})
                sim = Simulation(models, 1, policy(pol), weight_budget=int((FIT + 0.5) * p.weight_bytes), seed=1)
                sched = loadgen.poisson(rate, args.seconds, MODELS, loadgen.zipf_weights(MODELS, 1.0), seed=2)
                r = sim.run(sched.times, sched.targets, [m.key for m, _ in models])
                c = sim.scheduler.counters
                rows.append({"load_ms": load_s * 1e3, "policy": pol, "offered_rps": rate,
                             "slo_attainment": r.slo_attainment, "loads": c.get("loads", 0),
                             "requests": len(sched.times)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = (f"python -m bench.gpu.manymodels_sim --profiles {args.profiles} --model {args.model} --out DIR"
           + (f" --load-ms {args.load_ms}" if args.load_ms else ""))
    result = {"command": cmd, "device": doc.get("device"), "model": args.model, "models": MODELS, "fit": FIT,
              "infer_s": prof.infer_s, "seconds": time.monotonic() - t0, "rows": rows}
    (out / "manymodels_sim.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Many models in simulation, {args.model} as measured on {doc.get('device')}", "", f"`{cmd}`", "",
             f"{MODELS} copies, a budget that holds {FIT}, Zipf 1.0, SLO 100 ms, one device, {args.seconds:.0f} s "
             "per load; SLO attainment (loads/s):", "",
             "| LOAD ms | policy | " + " | ".join(f"{x:.0f} req/s" for x in RATES) + " |",
             "|---|---|" + "---|" * len(RATES)]
    for load_s in loads:
        for pol in ("clockwork", "dynamic"):
            cells = [r for r in rows if r["load_ms"] == load_s * 1e3 and r["policy"] == pol]
            lines.append(f"| {load_s * 1e3:.2f} | {pol} | " + " | ".join(
                f"{r['slo_attainment']:.3f} ({r['loads'] / args.seconds:.0f})" for r in cells) + " |")
    (out / "manymodels_sim.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
