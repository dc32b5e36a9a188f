"""Pretzel on one GPU: N heads on one ResNet-18 backbone, served shared against black-box.

`python -m bench.gpu.sharing --device cuda:0 --out DIR [--quick] [--budget S]`

N variants declared as plans of stages (docs/models.md): one backbone file (a ResNet-18 without
its classifier, random weights, 3x224x224 -> 512 features) that every variant lists, and a head
of its own (a 512 -> 10 linear layer, its own weights). On the stand-in: a small conv backbone
and 3x32x32. Two real daemons (`bench.servers.Escapement`), one after the other, with the same
weight budget and the same open-loop Poisson loads with Zipf popularity:

- **shared** (`runtime.share_weights = true`, the default): queued requests of several variants
  run the backbone once (cross-model batches, replayed as CUDA graphs: runtime/cuda.py);
- **black-box** (`runtime.share_weights = false`): every variant is batched alone, as a server
  that sees models as black boxes does.

The budget holds every variant. With sharing on, a CUDA device holds the backbone once (the
plans' shared leading stage has an extent of its own, runtime/cuda.py), and every variant's head
and IO buffers in its own extent; black-box, each variant holds a copy of the backbone. Each mode
records the device bytes its resident variants are charged at the end, and `memory_ratio` compares
them per resident variant (black-box / shared). Before the daemons, the CUDA backend alone times a
variant's LOAD over a held backbone against a full one (`load_times`).

Both modes run with the prefix cache off (`runtime.prefix_cache_entries = 0`): the load generator
sends each variant one fixed input, so with the cache on, the shared mode would serve nearly every
backbone from it and measure Pretzel's sub-plan materialization on an artificial workload rather
than cross-model batching (and every request would be hashed whole).

Per mode: SLO attainment, p50/p99 and cold-start rate per load, capacity at SLO (the highest
offered load with >= 99% within the SLO and p99 within it), cross-model batches. Ratios: capacity
shared / black-box, p99 black-box / shared at the highest load both ran. Writes DIR/sharing.json
and DIR/sharing.md (naming the GPU). On `emucuda:N` times are modelled on this CPU: the run only
shows that the script works.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bench import loadgen
from bench.gpu.manymodels import device_name, run_policy
from bench.gpu.profiles import BasicBlock, ResNet
from bench.scenarios.common import passes
from bench.scenarios.many_models import threads_markdown
from bench.spy import markdown as spy_markdown
from daemon.demo import save_model
from daemon.repository import scan

MODES = {"shared": True, "black-box": False}  # runtime.share_weights
FEATURES = 512


@dataclass(frozen=True)
class Plan:
    n: int  # variants
    image: int
    max_batch: int
    levels: tuple[float, ...]  # offered loads, as fractions of min(the backbone's eager batch-1 limit, rate_cap)
    rate_cap: float
    seconds: float  # per load level, at most
    max_requests: int
    warmup_s: float
    workspace: int  # runtime.device_workspace
    budget_s: float


def plan_for(kind: str, quick: bool) -> Plan:
    if kind == "cuda":
        return Plan(16 if quick else 32, 224, 8, (0.5, 2.0) if quick else (0.5, 1.0, 2.0, 4.0), 5000.0,
                    4.0 if quick else 6.0, 10_000, 1.5, 2 << 30, 150.0 if quick else 280.0)
    return Plan(8, 32, 4, (0.3, 1.0), 150.0, 4.0, 1_000, 1.0, 64 << 20, 150.0 if quick else 240.0)


class Backbone(nn.Module):
    """A ResNet-18 up to its pooled features (CUDA), or a small conv net (the stand-in)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "cuda":
            net = ResNet(BasicBlock, (2, 2, 2, 2))
            self.body: nn.Module = nn.Sequential(net.stem, net.stages, net.pool, nn.Flatten())
        else:
            self.body = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(),
                                      nn.Conv2d(64, FEATURES, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build(kind: str, plan: Plan, root: Path) -> list[str]:
    """The repository: the backbone once under .stages/, and N variants each with its own head."""
    torch.manual_seed(0)
    shape = (3, plan.image, plan.image)
    save_model(Backbone(kind).eval(), "pt2", torch.zeros(2, *shape), plan.max_batch, root / ".stages" / "backbone.pt2")
    names = []
    dims = ", ".join(str(d) for d in (-1, *shape))
    for i in range(plan.n):
        torch.manual_seed(1 + i)
        name = f"v{i:03d}"
        save_model(nn.Linear(FEATURES, 10).eval(), "pt2", torch.zeros(2, FEATURES), plan.max_batch,
                   root / name / "1" / "head.pt2")
        (root / name / "config.toml").write_text(
            f'max_batch_size = {plan.max_batch}\nslo_ms = 100\nstages = ["../../.stages/backbone.pt2", "head.pt2"]\n'
            f'[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [{dims}]\n'
            '[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [-1, 10]\n')
        names.append(name)
    return names


def backbone_b1_s(device: str, plan: Plan, kind: str) -> float:
    """The backbone's batch-1 time on the device (median of 20 after 5, graphs off): what the load
    ladder is scaled by."""
    dev = torch.device("cuda", int(device.partition(":")[2])) if kind == "cuda" else torch.device("cpu")
    model = Backbone(kind).eval().to(dev)
    x = torch.zeros(1, 3, plan.image, plan.image, device=dev)
    times = []
    with torch.inference_mode():
        for i in range(25):
            t0 = time.perf_counter()
            model(x)
            if kind == "cuda":
                torch.cuda.synchronize(dev)
            if i >= 5:
                times.append(time.perf_counter() - t0)
    del model
    if kind == "cuda":
        torch.cuda.empty_cache()
    return float(np.median(times))


def load_times(device: str, work: Path, names: list[str], budget: int, workspace: int, reps: int = 12
               ) -> dict[str, Any]:
    """LOAD of a variant whose backbone stage the device holds against a full one, on the CUDA
    backend itself (no daemon): per round a variant is loaded onto an empty device (the backbone
    copied too), then a second variant (its head and IO buffers alone), then both unloaded. The
    first two rounds warm up (graph captures); medians of the rest, wall time and the copy's own
    device time, and the bytes each LOAD charged."""
    from daemon.runtime.cuda import CudaBackend
    from daemon.runtime.devices import Device
    from daemon.runtime.executor import make_backend
    from daemon.runtime.hostmem import HostPins
    from daemon.runtime.objstore import ObjectStore
    from daemon.runtime.program import load_program

    kind, _, index = device.partition(":")
    specs = {m.name: m for m in scan(work).models}
    store = ObjectStore()
    first, second = (load_program(specs[n], store) for n in names[:2])
    host = HostPins(4 << 30)
    be = make_backend(Device(device, kind, int(index or 0), budget, workspace), 1, host=host)  # type: ignore[arg-type]
    full: list[tuple[float, float]] = []
    held: list[tuple[float, float]] = []
    charged = (0, 0)
    alone = 0
    try:
        for r in range(reps + 2):
            t0 = time.perf_counter()
            a, copy_a = be.load("first", first, time.monotonic() + 30)
            t1 = time.perf_counter()
            b, copy_b = be.load("second", second, time.monotonic() + 30)
            t2 = time.perf_counter()
            charged = (a.charged, b.charged)
            if isinstance(be, CudaBackend):  # what a black-box LOAD of it would charge (its whole extent)
                be.shares = False
                alone = be.footprint(first)
                be.shares = True
            be.unload(b)
            be.unload(a)
            if r >= 2:
                full.append((t1 - t0, copy_a))
                held.append((t2 - t1, copy_b))
    finally:
        be.close()
        host.close()

    def med(xs: list[tuple[float, float]], i: int) -> float:
        return float(np.median([x[i] for x in xs])) * 1e3

    out: dict[str, Any] = {"full_load_ms": med(full, 0), "full_copy_ms": med(full, 1), "held_load_ms": med(held, 0),
           "held_copy_ms": med(held, 1), "full_charged_bytes": charged[0], "held_charged_bytes": charged[1],
           "all_blackbox_bytes": alone, "reps": reps}
    out["held_over_full_load"] = out["held_load_ms"] / out["full_load_ms"] if out["full_load_ms"] else None
    return out


def footprint_bytes(root: Path) -> int:
    """The bytes of one variant's weights (backbone and head), unshared."""
    return sum(p.stat().st_size for p in (root / ".stages" / "backbone.pt2", root / "v000" / "1" / "head.pt2"))


def markdown(result: dict[str, Any]) -> str:
    f = result["facts"]
    lines = [f"# Shared backbone against black-box on {result['device']}", "",
             f"`{result['command']}` (torch {result['torch']}, {result['seconds']:.0f} s)", "",
             f"{f['variants']} variants of {f['backbone']} with their own heads, Zipf s=1.0, SLO 100 ms; weight budget "
             f"{f['weight_budget'] / 2**20:.0f} MiB beside a {f['workspace'] / 2**20:.0f} MiB workspace ("
             + (f"{f['weight_share']:g} of the variants' unshared bytes" if f.get("weight_share")
                else "every variant fits")
             + f", ~{f['unshared_variant_bytes'] / 1e6:.1f} MB each); backbone batch-1 "
             f"{f['backbone_b1_ms']:.3f} ms eager. The prefix cache is off in both modes (each variant gets one "
             "fixed input: with it on, the shared mode would serve its backbones from the cache).", "",
             "| mode | capacity at SLO (req/s) | cross-model batches | actions | variants resident at the end "
             "| device MB charged for them |", "|---|---|---|---|---|---|"]
    for m in result["modes"]:
        lines.append(f"| {m['mode']} | {m['capacity_at_slo_rps']:.1f} | "
                     f"{m['counters'].get('cross_model_batches', 0)} | {m['actions_measured']} | "
                     f"{m['models_resident_at_end']} | {m['device_bytes_at_end'] / 1e6:.1f} |")
    lines += ["", "| mode | offered req/s | SLO attainment | p50 ms | p99 ms | cold-start rate | loads/s | errors |",
              "|---|---|---|---|---|---|---|---|"]
    for m in result["modes"]:
        for r in m["rows"]:
            lines.append(f"| {m['mode']} | {r['offered_rps']:.1f} | {r['slo_attainment']:.4f} | {r['p50_ms']:.2f} | "
                         f"{r['p99_ms']:.2f} | {r['cold_start_rate']:.3f} | {r['loads_per_s']:.1f} | "
                         f"{r['errors'] or ''} |")
        if m["skipped_rps"]:
            lines.append(f"| {m['mode']} | skipped (time): {', '.join(f'{x:.1f}' for x in m['skipped_rps'])} "
                         "| | | | | | |")
    lines += threads_markdown([(m["mode"], m["rows"]) for m in result["modes"]])
    for m in result["modes"]:
        for r in m["rows"][-2:]:
            lines += spy_markdown(r.get("spy", {}), f"{m['mode']} at {r['offered_rps']:.1f} req/s")
    for m in result["modes"]:
        for dev, pc in sorted(m.get("prefix_cache", {}).items()):
            lines.append(f"\n{m['mode']}: {dev}'s prefix cache over the daemon's life: {pc['hits']} hits, "
                         f"{pc['misses']} misses, {pc.get('unseen', 0)} large inputs seen once (sketched, not hashed).")
    lt = result.get("load_times")
    if lt:
        lines += ["", f"LOAD on the backend alone (median of {lt['reps']} rounds): a variant onto an empty device "
                  f"{lt['full_load_ms']:.2f} ms (copy {lt['full_copy_ms']:.2f} ms, "
                  f"{lt['full_charged_bytes'] / 1e6:.2f} MB charged); a second variant over the held backbone "
                  f"{lt['held_load_ms']:.2f} ms (copy "
                  f"{lt['held_copy_ms']:.2f} ms, {lt['held_charged_bytes'] / 1e6:.2f} MB): "
                  f"{lt['held_over_full_load']:.2f}x the full LOAD's time."]
    s = result["summary"]
    def num(x: float | None) -> str:
        return "null" if x is None else f"{x:.2f}"
    lines += ["", f"capacity_ratio (shared / black-box): {num(s['capacity_ratio'])}; p99_ratio (black-box / shared, "
              f"at {num(s['p99_at_rps'])} req/s: the highest load both ran where shared met the SLO): "
              f"{num(s['p99_ratio'])}; memory_ratio (device bytes per resident "
              f"variant, black-box / shared): {num(s['memory_ratio'])}.", "",
              *([f"Every variant held at once on the device (the backend's own charges): black-box "
                 f"{s['all_variants_bytes']['black-box'] / 1e6:.1f} MB, shared "
                 f"{s['all_variants_bytes']['shared'] / 1e6:.1f} MB: all_variants_memory_ratio "
                 f"{s['all_variants_memory_ratio']:.1f}.", ""]
                if s.get("all_variants_bytes") else []),
              "Capacity at SLO is a lower bound (the ladder is coarse); a ratio is null where a mode passed no rung."]
    return "\n".join(lines)


def p99_point(shared: list[dict[str, Any]], black: list[dict[str, Any]]) -> tuple[float | None, tuple[float, float]]:
    """Where the p99s are compared: the highest load both modes ran at which the shared mode met the
    SLO (its capacity, when black-box ran it too), else the highest load both ran (past both modes'
    capacities the two p99s are each a backlog's length, not a comparison). (that load, (shared
    p99, black-box p99)); NaN where none."""
    def near(x: float, y: float) -> bool:
        return abs(x - y) / x < 0.05
    both = [r["offered_rps"] for r in shared if any(near(r["offered_rps"], b["offered_rps"]) for b in black)]
    met = [x for x in both if passes(next(r for r in shared if r["offered_rps"] == x))]
    at = max(met or both) if both else None
    if at is None:
        return None, (float("nan"), float("nan"))
    p99 = [next(r["p99_ms"] for r in rows if near(r["offered_rps"], at)) for rows in (shared, black)]
    return at, (p99[0], p99[1])


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 and np.isfinite(a) and np.isfinite(b) else None


def _loads_only(device: str, kind: str, work: Path, names: list[str], budget: int, plan: Plan, out: Path,
                built_s: float) -> int:
    """`--loads-only`: a variant's LOAD over a held backbone against a full one, and what each
    charged, into DIR/sharing-loads.json and .md."""
    loads = load_times(device, work, names, budget, plan.workspace)
    result = {"device": device_name(device), "device_kind": kind, "torch": torch.__version__,
              "command": f"python -m bench.gpu.sharing --device {device} --out DIR --loads-only",
              "backbone": "ResNet-18 features" if kind == "cuda" else "small conv net", "built_s": built_s,
              "load_times": loads}
    (out / "sharing-loads.json").write_text(json.dumps(result, indent=2) + "\n")
    text = "\n".join([f"# A variant's LOAD over a held backbone on {result['device']}", "",
                      f"`{result['command']}` (torch {result['torch']}; {result['backbone']} and a linear head)", "",
                      f"Full LOAD {loads['full_load_ms']:.2f} ms (copy {loads['full_copy_ms']:.3f} ms, "
                      f"{loads['full_charged_bytes'] / 1e6:.2f} MB charged); over the held backbone "
                      f"{loads['held_load_ms']:.2f} ms (copy {loads['held_copy_ms']:.3f} ms, "
                      f"{loads['held_charged_bytes'] / 1e6:.2f} MB): {loads['held_over_full_load']:.2f}x "
                      f"(medians of {loads['reps']} rounds)."])
    (out / "sharing-loads.md").write_text(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.sharing")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, help="seconds for the whole run (default: the plan's)")
    ap.add_argument("--variants", type=int, help="how many variants (default: 32 on CUDA, 8 on the stand-in)")
    ap.add_argument("--weight-share", type=float, default=0.0,
                    help="the weight budget as a share of every variant's unshared bytes (issue 17's setup: "
                         "0.1); default: room for every variant")
    ap.add_argument("--warmup", type=float, help="seconds of load before the first measured one (default: the plan's)")
    ap.add_argument("--spy", action="store_true",
                    help="sample each daemon with py-spy at every load (bench/spy.py; where it is installed)")
    ap.add_argument("--loads-only", action="store_true",
                    help="only the backend's LOAD times (a few seconds; bench/gpu/check.sh runs this)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kind = args.device.partition(":")[0]
    plan = plan_for(kind, args.quick)
    if args.budget:
        plan = replace(plan, budget_s=args.budget)
    if args.variants:
        plan = replace(plan, n=args.variants)
    if args.warmup:
        plan = replace(plan, warmup_s=args.warmup)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + plan.budget_s
    work = Path(tempfile.mkdtemp(prefix="sharegpu-"))
    try:
        names = build(kind, plan, work)
        assert len(scan(work).models) == plan.n
        unshared = footprint_bytes(work)
        # every variant fits (with IO buffers and alignment: a fifth more), or the share asked for
        budget = plan.workspace + int(plan.n * unshared * (args.weight_share or 1.2))
        if args.loads_only:
            return _loads_only(args.device, kind, work, names, budget, plan, out, time.monotonic() - t0)
        b1 = backbone_b1_s(args.device, plan, kind)
        rates = [f * min(1.0 / b1, plan.rate_cap) for f in plan.levels]
        popularity = loadgen.zipf_weights(plan.n, 1.0)
        loads = load_times(args.device, work, names, budget, plan.workspace)
        print(f"{plan.n} variants built in {time.monotonic() - t0:.1f} s; backbone b1 {b1 * 1e3:.3f} ms", flush=True)
        modes = []
        for i, (mode, share) in enumerate(MODES.items()):
            # each mode gets its share of what is left, so the second runs too
            left = deadline - time.monotonic()
            r = run_policy("clockwork", work, names, popularity, rates, args.device, budget, plan,  # type: ignore[arg-type]
                           time.monotonic() + left / (len(MODES) - i), out,
                           {"runtime": {"share_weights": share, "prefix_cache_entries": 0}},
                           log_name=f"sharing-{mode}.log", spy=args.spy)
            r["mode"] = mode
            modes.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shared, black = modes
    at, p99s = p99_point(shared["rows"], black["rows"])
    summary = {"capacity_ratio": _ratio(shared["capacity_at_slo_rps"], black["capacity_at_slo_rps"]),
               "p99_ratio": _ratio(p99s[1], p99s[0]),
               "p99_at_rps": at, "capacity_at_slo_rps": {m["mode"]: m["capacity_at_slo_rps"] for m in modes},
               "memory_ratio": _ratio(black["device_bytes_at_end"] / max(black["models_resident_at_end"], 1),
                                      shared["device_bytes_at_end"] / max(shared["models_resident_at_end"], 1))}
    cmd = (f"python -m bench.gpu.sharing --device {args.device} --out DIR" + (" --quick" if args.quick else "")
           + (f" --budget {args.budget:g}" if args.budget else "") + (" --spy" if args.spy else "")
           + (f" --variants {args.variants}" if args.variants else "")
           + (f" --weight-share {args.weight_share:g}" if args.weight_share else "")
           + (f" --warmup {args.warmup:g}" if args.warmup else ""))
    if loads.get("all_blackbox_bytes") and loads.get("full_charged_bytes"):
        # every variant held at once: black-box, each whole; shared, the first whole and the rest their own
        all_shared = loads["full_charged_bytes"] + (plan.n - 1) * loads["held_charged_bytes"]
        summary["all_variants_bytes"] = {"black-box": plan.n * loads["all_blackbox_bytes"], "shared": all_shared}
        summary["all_variants_memory_ratio"] = plan.n * loads["all_blackbox_bytes"] / all_shared
    result = {"device": device_name(args.device), "device_kind": kind, "torch": torch.__version__, "command": cmd,
              "seconds": time.monotonic() - t0, "plan": asdict(plan),
              "facts": {"variants": plan.n, "backbone": "ResNet-18 features" if kind == "cuda" else "small conv net",
                        "weight_budget": budget, "workspace": plan.workspace, "unshared_variant_bytes": unshared,
                        "weight_share": args.weight_share or None,
                        "backbone_b1_ms": b1 * 1e3, "offered_rps": rates},
              "modes": modes, "summary": summary, "load_times": loads}
    (out / "sharing.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    text = markdown(result)
    (out / "sharing.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
