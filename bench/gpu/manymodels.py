"""Many ResNet-sized models on one GPU: predictability and SLO attainment, clockwork against dynamic.

`python -m bench.gpu.manymodels --device cuda:0 --out DIR [--quick]`

N copies of one model (ResNet-18 at 3x224x224 from bench/gpu/profiles.py, random weights, ~47 MB;
on the stand-in a small conv net at 3x32x32) with Zipf popularity, on a real daemon
(`bench.servers.Escapement`, a child process, as the `many-models` scenario runs it) whose weight
budget (`runtime.weight_budget`, less the workspace reserve) holds a tenth of them. The model is
exported once and profiled once in this process (the daemon's own profiler); every copy links its
file and copies its profile, so the daemon starts without warm-ups. Each policy
(`controller.policy`: clockwork, dynamic) gets a fresh daemon and the same open-loop Poisson loads
(fractions of the raw batch-1 limit, bounded in requests and seconds). Per policy: SLO attainment
per load, capacity at SLO (the highest offered load whose row passes `common.passes`: >= 99%
within the SLO, p99 within it), cold-start rate, and from the daemon's telemetry
(`/v2/controller/stats`) the prediction error p99 (|measured - predicted| INFER and LOAD
duration) and the action start lateness p99 (actual start - planned start).

Writes DIR/manymodels.json and DIR/manymodels.md (naming the GPU). On `emucuda:N` times are
modelled on this CPU: the run only shows that the script works.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bench import loadgen
from bench.gpu import errors
from bench.gpu.profiles import Arch, architectures, export
from bench.scenarios.common import passes
from bench.scenarios.many_models import build_repo, point, predictability, stats, threads_markdown
from bench.servers import Escapement
from bench.spy import markdown as spy_markdown
from daemon.clock import MonotonicClock
from daemon.config import load_settings
from daemon.repository import scan
from daemon.runtime.devices import resolve_devices
from daemon.runtime.executor import make_backend
from daemon.runtime.profiler import profile_program, write_profile

POLICIES = ("clockwork", "dynamic")


@dataclass(frozen=True)
class Plan:
    n: int  # model copies
    max_batch: int
    levels: tuple[float, ...]  # offered loads, as fractions of min(raw batch-1 limit, rate_cap)
    rate_cap: float  # the most requests/s offered (the generator's and, on the stand-in, the CPU's limit)
    seconds: float  # per load level, at most
    max_requests: int  # per load level, at most
    warmup_s: float  # per daemon, the lowest load before the measured ones (first LOADs, caches)
    workspace: int  # runtime.device_workspace: graphs, activations, library workspaces
    profile_reps: int
    budget_s: float  # the whole run; load levels that would pass it are skipped (and said so)


def plan_for(kind: str, quick: bool) -> Plan:
    if kind == "cuda":
        # 12 s of warm-up: every extent's first LOAD captures its graphs (tens of ms each) before the
        # measured loads (on the H200 a 1.5 s warm-up left them in the first row: 0.85 of it within
        # the SLO at 56 req/s against 1.0 at 127 req/s; with 12 s, 1.0 at 50 req/s)
        return Plan(20 if quick else 40, 8, (0.05, 0.2) if quick else (0.05, 0.1, 0.2, 0.4), 1500.0,
                    4.0 if quick else 6.0, 10_000, 4.0 if quick else 12.0, 2 << 30, 10, 90.0 if quick else 145.0)
    # the stand-in runs kernels on this (2-core) machine's CPU, beside the generator
    return Plan(20, 4, (0.2, 0.6) if quick else (0.1, 0.3, 0.6), 100.0, 4.0 if quick else 6.0, 1_000, 1.0,
                64 << 20, 3, 85.0 if quick else 150.0)


def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1), nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1), nn.ReLU(),
                         nn.Conv2d(64, 128, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(128, 10))


def arch_for(kind: str) -> Arch:
    if kind == "cuda":
        return architectures(224, 64)[0]  # resnet18
    return Arch("smallcnn", small_cnn, (3, 32, 32), 10, "small conv net (3 convs), 3x32x32")


def device_name(device: str) -> str:
    kind, _, idx = device.partition(":")
    if kind == "cuda":
        return torch.cuda.get_device_name(int(idx))
    return f"{device} (the CPU stand-in: modelled times)"


def prepare(device: str, plan: Plan, arch: Arch, base: Path) -> dict[str, Any]:
    """Export the model once and profile it with the daemon's profiler on `device` (in this process;
    the backend is closed before any daemon starts). Returns its weight bytes, footprint and profile."""
    t0 = time.monotonic()
    program = export(arch, plan.max_batch, base)
    t1 = time.monotonic()
    rt = load_settings(None).runtime
    # a budget that holds the one model: the daemon's, later, is set from its footprint
    room = (1 << 30) if device.startswith("cuda") else (256 << 20)  # within the stand-in's 1 GiB
    (dev,) = resolve_devices([device], plan.workspace + room, plan.workspace, rt.emucuda)
    be = make_backend(dev, rt.cpu_threads, graphs=rt.cuda_graphs, hang_timeout_s=rt.hang_timeout_s,
                      emucuda=rt.emucuda)
    try:
        footprint = be.footprint(program)
        entry = profile_program(program, dev, be, MonotonicClock(), plan.profile_reps)
    finally:
        be.close()
        if dev.kind == "cuda":
            torch.cuda.empty_cache()  # this process's cached blocks are not the daemon's to count
    if not write_profile(program.spec, dev.kind, entry):
        raise SystemExit(f"the profile of {arch.name} could not be stored")
    return {"weight_bytes": program.weight_bytes, "footprint_bytes": footprint, "profile": entry,
            "export_s": t1 - t0, "profile_s": time.monotonic() - t1}


def run_policy(policy: str, work: Path, names: list[str], popularity: np.ndarray, rates: list[float],
               device: str, budget: int, plan: Plan, deadline: float, log_dir: Path,
               overrides: dict[str, dict[str, Any]] | None = None, log_name: str = "", trace: bool = False,
               spy: bool = False) -> dict[str, Any]:
    """One policy's daemon at every load; `trace`: every action traced, and where its INFER prediction
    errors come from summarized (bench/gpu/errors.py; the trace's writing costs the loop a little)."""
    specs = {m.name: m for m in scan(work).models}
    spec_list = [specs[x] for x in names]
    slo = max(s.slo_s for s in spec_list)
    rows: list[dict[str, Any]] = []
    skipped: list[float] = []
    t0 = time.monotonic()
    # The copies stand for distinct models (fine-tunes of one architecture): their shared weights
    # are an artefact of linking one file, so no shared stage is looked for (Pretzel's bench is
    # bench.scenarios.sharing). Their shared structure is real, and their LOADs replay parked graphs.
    sections: dict[str, dict[str, Any]] = {
        "runtime": {"devices": [device], "weight_budget": budget, "device_workspace": plan.workspace,
                    "detect_shared_prefix": False},
        "controller": {"policy": policy}}
    if trace:
        sections["controller"]["trace_path"] = str(log_dir / f"trace-{log_name or policy}.jsonl")
    for sec, kv in (overrides or {}).items():
        sections.setdefault(sec, {}).update(kv)
    with Escapement(work, log_file=log_dir / (log_name or f"manymodels-{policy}.log"), **sections) as server:
        started_s = time.monotonic() - t0
        point(server, loadgen.poisson(rates[0], plan.warmup_s, len(names), popularity, seed=99), names, spec_list,
              plan.warmup_s, slo, policy)
        for i, rate in enumerate(rates):
            secs = min(plan.seconds, plan.max_requests / rate)
            if time.monotonic() + secs + 3 * slo + 2.0 > deadline:
                skipped.append(rate)  # bounded in time: the rows say what was not offered
                continue
            sched = loadgen.poisson(rate, secs, len(names), popularity, seed=i)
            spy_out = log_dir / f"spy-{log_name or policy}-{i}.txt".replace(".log", "") if spy else None
            rows.append(point(server, sched, names, spec_list, secs, slo, policy, spy_out=spy_out, level=i))
        st = stats(server.port)
    causes: dict[str, Any] = {}
    if trace:
        traced = Path(sections["controller"]["trace_path"])
        causes = errors.summarize(errors.read(traced)) if traced.exists() else {}
        traced.unlink(missing_ok=True)  # (tens of MB: the summary is what is kept)
    tel = st["telemetry"]
    good = [r["offered_rps"] for r in rows if passes(r)]
    devices = st.get("devices", {}).values()
    resident = max((len(d.get("models", ())) for d in devices), default=0)
    # device memory the resident models are charged, less the workspace reserve
    held = sum(d.get("used", 0) - d.get("workspace", 0) for d in devices)
    return {"policy": policy, "daemon_start_s": started_s, "rows": rows, "skipped_rps": skipped,
            "device_bytes_at_end": held, "infer_error_causes": causes,
            "capacity_at_slo_rps": max(good) if good else 0.0,
            "slo_attainment_by_rps": {f"{r['offered_rps']:.1f}": r["slo_attainment"] for r in rows},
            "cold_start_rate_by_rps": {f"{r['offered_rps']:.1f}": r["cold_start_rate"] for r in rows},
            "models_resident_at_end": resident, **predictability(tel),
            "telemetry": {k: tel[k] for k in ("executor_lateness_ms", "start_error_ms", "duration_error",
                                              "prediction_error_ms", "load_time_ms", "load_copy_ms") if k in tel},
            "counters": st.get("counters", {}), "prefix_cache": st.get("prefix_cache", {})}


def _f(x: Any, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def markdown(result: dict[str, Any]) -> str:
    f = result["facts"]
    lines = [f"# Many models on {result['device']}", "",
             f"`{result['command']}` (torch {result['torch']}, {result['seconds']:.0f} s)", "",
             f"{f['models']} copies of {f['model']} ({f['weight_bytes'] / 1e6:.1f} MB weights, "
             f"{f['footprint_bytes'] / 1e6:.1f} MB charged per LOAD), Zipf s={f['zipf_s']}; weight budget "
             f"{f['weight_budget'] / 2**20:.0f} MiB (workspace {f['workspace'] / 2**20:.0f} MiB) holds "
             f"{f['models_that_fit']}; SLO {f['slo_ms']:.0f} ms; profiled batch-1 INFER {f['b1_ms']:.3f} ms, "
             f"LOAD {f['load_ms']:.2f} ms; raw batch-1 limit {f['raw_b1_limit_rps']:.0f} req/s.", "",
             "| policy | capacity at SLO (req/s) | prediction error p99 INFER (ms) | prediction error p99 LOAD "
             "(ms) | start lateness p99 (ms, actual - planned) | executor lateness p99 (ms) | LOAD p50 / p99 (ms) "
             "| its weight copy p50 / p99 (ms) | actions |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in result["policies"]:
        load, copy = (p["telemetry"].get(k, {}) for k in ("load_time_ms", "load_copy_ms"))
        lines.append(f"| {p['policy']} | {p['capacity_at_slo_rps']:.1f} | "
                     f"{_f(p.get('prediction_error_infer_p99_ms'), '.3f')} | "
                     f"{_f(p.get('prediction_error_load_p99_ms'), '.3f')} | {_f(p['start_error_p99_ms'], '.3f')} | "
                     f"{_f(p['executor_lateness_p99_ms'], '.3f')} | {_f(load.get('p50'))} / {_f(load.get('p99'))} | "
                     f"{_f(copy.get('p50'))} / {_f(copy.get('p99'))} | {p['actions_measured']} |")
    messages: dict[str, str] = {}
    lines += ["", "| policy | offered req/s | SLO attainment | p50 ms | p99 ms | cold-start rate | loads/s | "
              "evictions/s | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for p in result["policies"]:
        for r in p["rows"]:
            lines.append(f"| {p['policy']} | {r['offered_rps']:.1f} | {r['slo_attainment']:.4f} | {r['p50_ms']:.2f} | "
                         f"{r['p99_ms']:.2f} | {r['cold_start_rate']:.3f} | {r['loads_per_s']:.1f} | "
                         f"{r['evictions_per_s']:.1f} | {r['errors'] or ''} |")
            messages.update(r.get("error_messages", {}))
        if p["skipped_rps"]:
            lines.append(f"| {p['policy']} | skipped (time): {', '.join(f'{x:.1f}' for x in p['skipped_rps'])} "
                         "| | | | | | | |")
    lines += threads_markdown([(p["policy"], p["rows"]) for p in result["policies"]])
    for p in result["policies"]:
        for r in p["rows"][-2:]:  # the highest loads: where the SLO holds last and breaks
            lines += spy_markdown(r.get("spy", {}), f"{p['policy']} at {r['offered_rps']:.1f} req/s")
    for p in result["policies"]:
        if p.get("infer_error_causes", {}).get("infers"):
            lines += ["", f"Where {p['policy']}'s INFER prediction errors come from (its trace, bench/gpu/errors.py):",
                      "", errors.markdown(p["infer_error_causes"])]
    if messages:
        lines += ["", "First error message per kind:", ""] + [f"- {k}: {v}" for k, v in sorted(messages.items())]
    lines += ["", "Telemetry figures are the daemon's, over its whole life (warm-up load included). Capacity at "
              "SLO: the highest offered load of this ladder whose row has >= 99% of requests within the SLO "
              "and p99 within it (a lower bound: the ladder is coarse)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.manymodels")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--policy", action="append", choices=POLICIES, help="the policies to run (default: all)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a daemon setting for every policy's run, a TOML value (repeatable)")
    ap.add_argument("--budget", type=float, help="seconds for the whole run (default: the plan's)")
    ap.add_argument("--spy", action="store_true",
                    help="sample each daemon with py-spy at every load (bench/spy.py; where it is installed)")
    args = ap.parse_args(argv)
    overrides: dict[str, dict[str, Any]] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        sec, _, name = key.partition(".")
        overrides.setdefault(sec, {})[name] = tomllib.loads(f"v = {value}")["v"]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kind = args.device.partition(":")[0]
    plan = plan_for(kind, args.quick)
    if args.budget:
        plan = replace(plan, budget_s=args.budget)
    arch = arch_for(kind)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + plan.budget_s
    base = Path(tempfile.mkdtemp(prefix="mmgpu-base-"))
    work = Path(tempfile.mkdtemp(prefix="mmgpu-"))
    try:
        prep = prepare(args.device, plan, arch, base)
        print(f"{arch.name}: export {prep['export_s']:.1f} s, profile {prep['profile_s']:.1f} s", flush=True)
        names = build_repo(plan.n, base, work, (arch.name,))
        fit = max(1, plan.n // 10)
        # the footprint is what a LOAD charges; half a model more so rounding cannot drop one
        budget = plan.workspace + fit * prep["footprint_bytes"] + prep["footprint_bytes"] // 2
        popularity = loadgen.zipf_weights(plan.n, 1.0)
        b1 = prep["profile"]["infer_median_ms"]["1"] / 1e3
        limit = 1.0 / b1
        rates = [f * min(limit, plan.rate_cap) for f in plan.levels]
        facts = {"model": arch.description, "models": plan.n, "zipf_s": 1.0, "weight_bytes": prep["weight_bytes"],
                 "footprint_bytes": prep["footprint_bytes"], "weight_budget": budget, "workspace": plan.workspace,
                 "models_that_fit": fit, "slo_ms": scan(work).models[0].slo_s * 1e3, "b1_ms": b1 * 1e3,
                 "load_ms": prep["profile"]["load_ms"], "raw_b1_limit_rps": limit, "offered_rps": rates,
                 "export_s": prep["export_s"], "profile_s": prep["profile_s"]}
        policies = [run_policy(p, work, names, popularity, rates, args.device, budget, plan, deadline, out,
                               overrides, trace=True, spy=args.spy) for p in args.policy or POLICIES]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    cmd = (f"python -m bench.gpu.manymodels --device {args.device} --out DIR" + (" --quick" if args.quick else "")
           + (f" --budget {args.budget:g}" if args.budget else "")
           + "".join(f" --policy {p}" for p in args.policy or ()) + "".join(f" --set {x}" for x in args.set)
           + (" --spy" if args.spy else ""))
    result = {"device": device_name(args.device), "device_kind": kind, "torch": torch.__version__, "command": cmd,
              "seconds": time.monotonic() - t0, "plan": asdict(plan), "facts": facts, "policies": policies,
              "summary": {p["policy"]: {k: p.get(k) for k in (
                  "capacity_at_slo_rps", "slo_attainment_by_rps", "cold_start_rate_by_rps",
                  "prediction_error_infer_p99_ms", "prediction_error_load_p99_ms", "start_error_p99_ms",
                  "executor_lateness_p99_ms")} for p in policies}}
    (out / "manymodels.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "manymodels.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
