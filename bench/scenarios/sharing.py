"""`sharing`: N fine-tuned variants of one backbone served with parameters stored once, against
the same N served as separate black-box models (issue 17).

Each side runs in a fresh process (host RSS is the process's own): it loads every variant's
program (`load_program`) and places every one on a CPU device. Shared: one object store for
the host, blocks by content on the device and in the controller's memory map. Black-box: a
store per model (each keeps its own copy), and the memory map charges every model in full (as
the controller did before sharing, and still does on CUDA devices).

Figures: host RSS growth and host weight bytes; device-budget bytes (the controller's map, and
the CPU backend's own count, which must agree); LOAD time of a variant whose backbone is
resident against a full LOAD (wall time of the backend's load, and the copy alone); and
`outputs_identical`: every variant's outputs on the shared device equal, bit for bit, those of
the variant loaded alone in a process of its own.

Load (bench/scenarios/sharing_load.py): capacity at SLO, p99 and cold-start rate of the variants
under Zipf load with a weight budget for a tenth of their unshared weights, served as black
boxes against as plans of stages with sharing and cross-model batching (`capacity_ratio`,
`p99_ratio`: without / with), `reps` times, sides interleaved; and `outputs_identical` also
covers answers computed in cross-model batches through the daemon.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import results
from bench.scenarios.common import command


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(mode: str, repo: str, n: int, load_reps: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from daemon.controller.memory import DeviceMemory
    from daemon.repository import scan
    from daemon.runtime.backend import CpuBackend
    from daemon.runtime.devices import Device
    from daemon.runtime.objstore import ObjectStore
    from daemon.runtime.program import load_program

    torch.set_num_threads(1)
    specs = sorted(scan(repo).models, key=lambda s: s.name)[:n]
    x = torch.from_numpy(np.random.default_rng(0).uniform(0, 16, (32, 64)).astype(np.float32))
    gc.collect()
    rss0 = _rss()
    shared = mode == "shared"
    stores = [ObjectStore()] if shared else []
    progs = []
    rss1 = rss0
    for s in specs:
        if not shared:
            stores.append(ObjectStore())
        progs.append(load_program(s, stores[-1]))
        if len(progs) == 1:  # (the first pays what any program costs once: torch's lazy set-up, imports)
            gc.collect()
            rss1 = _rss()
    gc.collect()
    host_rss = _rss() - rss0
    per_variant = (_rss() - rss1) / max(len(specs) - 1, 1)
    host_weights = sum(st.nbytes for st in stores)
    memory = DeviceMemory(1 << 40, shares=shared)
    for s, p in zip(specs, progs, strict=True):
        memory.reserve(s.key, p.block_bytes, p.blocks)
    out: dict[str, Any] = {"mode": mode, "variants": len(specs), "host_rss_bytes": host_rss,
                           "host_rss_per_variant_bytes": per_variant,
                           "host_weight_bytes": host_weights, "device_budget_bytes": memory.used}
    if not shared:  # each black-box model's answers, computed alone
        out["outputs"] = [_digest(p.host_runner([x])) for p in progs]
        return out
    backend = CpuBackend(Device("cpu:0", "cpu", 0, 1 << 40))
    full_wall, full_copy, part_wall, part_copy = [], [], [], []
    for _ in range(load_reps):  # a full LOAD (nothing of it on the device), then one beside it
        t0 = time.perf_counter()
        first, copy_s = backend.load(specs[0].key, progs[0], float("inf"))
        full_wall.append(time.perf_counter() - t0)
        full_copy.append(copy_s)
        t0 = time.perf_counter()
        second, copy_s = backend.load(specs[1].key, progs[1], float("inf"))
        part_wall.append(time.perf_counter() - t0)
        part_copy.append(copy_s)
        backend.unload(second)
        backend.unload(first)
    assert backend.used == 0
    residents = [backend.load(s.key, p, float("inf"))[0] for s, p in zip(specs, progs, strict=True)]
    with torch.inference_mode():
        out["outputs"] = [_digest(r.runner([x])) for r in residents]
    out |= {"backend_used_bytes": backend.used,
            "load_full_ms": statistics.median(full_wall) * 1e3, "load_full_copy_ms": statistics.median(full_copy) * 1e3,
            "load_resident_backbone_ms": statistics.median(part_wall) * 1e3,
            "load_resident_backbone_copy_ms": statistics.median(part_copy) * 1e3,
            "full_load_bytes": progs[0].block_bytes,
            "resident_backbone_load_bytes": sum(n for c, n in progs[1].blocks if c not in set(progs[0].cids))}
    return out


def _digest(outs: tuple[Any, ...]) -> str:
    h = hashlib.sha256()
    for o in outs:
        h.update(o.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _side(mode: str, repo: Path, n: int, load_reps: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "bench.scenarios.sharing", "--child", mode, str(repo), str(n),
                           str(load_reps)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} side failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _load_phase(repo: Path, n: int, budget: int, reps: int, probe_s: float, ablation: bool = False,
                policy: str = "clockwork", detected: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Capacity, p99 and cold starts without and with sharing, `reps` times (sharing_load.py)."""
    import numpy as np

    from bench import loadgen
    from bench.scenarios import sharing_load
    from daemon import variants as family

    rng = np.random.default_rng(0)
    popularity = np.empty(n)
    popularity[rng.permutation(n)] = loadgen.zipf_weights(n, 1.0)  # popularity rank -> variant, by name order
    want = sharing_load.reference(repo)
    # the shared side's repository: the declared stages, or the whole programs split at load
    shared_repo = repo if detected else family.staged_out(repo)
    caps, p99s, colds, ident = [], [], [], None
    solo_caps: list[float] = []
    solo_p99: list[float | None] = []
    rows: list[dict[str, Any]] = []
    for rep in range(reps):
        seed = 1000 * (rep + 1)
        alone = sharing_load.side("without sharing", repo, popularity, budget, False, probe_s, seed, policy=policy)
        shared = sharing_load.side("with sharing", shared_repo, popularity, budget, True, probe_s, seed,
                                   at_rate=alone["capacity_rps"], want=want if rep == 0 else None, policy=policy)
        ident = ident or shared.get("identity")
        if ablation:  # the staged variants with their weights shared, but no cross-model batching
            solo = sharing_load.side("sharing, no cross-model batching", shared_repo, popularity, budget,
                                     True, probe_s, seed, at_rate=alone["capacity_rps"], cross_model=False,
                                     policy=policy)
            solo_caps.append(solo["capacity_rps"])
            solo_p99.append(solo["at_rate"]["p99_ms"] if solo["at_rate"] else None)
            rows.extend({**r, "rep": rep} for r in solo["rows"])
        a_row, s_row = alone["at_rate"], shared["at_rate"]
        caps.append((alone["capacity_rps"], shared["capacity_rps"]))
        p99s.append((a_row["p99_ms"], s_row["p99_ms"]) if a_row and s_row else (None, None))
        colds.append((a_row["cold_start_rate"], s_row["cold_start_rate"]) if a_row and s_row else (None, None))
        for side in (alone, shared):
            for r in side["rows"]:
                rows.append({**r, "rep": rep})
    ratios = [s / a for a, s in caps if a]
    p99r = [a / s for a, s in p99s if a and s]
    figures = {
        "capacity_ratio": statistics.median(ratios) if ratios else None,
        "p99_ratio": statistics.median(p99r) if p99r else None,
        "capacity_rps_without_sharing": [a for a, _ in caps],
        "capacity_rps_with_sharing": [s for _, s in caps],
        "capacity_ratio_reps": ratios,
        "p99_ms_without_sharing": [a for a, _ in p99s],
        "p99_ms_with_sharing": [s for _, s in p99s],
        "p99_ratio_reps": p99r,
        "cold_start_rate_without_sharing": [a for a, _ in colds],
        "cold_start_rate_with_sharing": [s for _, s in colds],
        "load_budget_bytes": budget,
        **({"capacity_rps_sharing_without_cross_model_batching": solo_caps,
            "p99_ms_sharing_without_cross_model_batching": solo_p99} if ablation else {}),
        "outputs_identical_cross_model": ident["identical"] if ident else None,
        "identity_check": ident,
    }
    return figures, rows


def run(quick: bool = False, json_out: str | None = None, variants: int | None = None,
        load_reps: int | None = None, reps: int | None = None, probe_s: float | None = None,
        load: bool = True, ablation: bool = False, policy: str = "clockwork", detected: bool = False) -> dict[str, Any]:
    """`load` false: the memory, LOAD and identity figures only (no capacity, p99 or cold starts).
    `policy`: the controller's policy on every side of the load phase (clockwork, dynamic, aimd).
    `detected`: the shared side serves the whole programs, their backbone found at load
    (runtime.detect_shared_prefix), instead of the declared stages."""
    if policy not in ("clockwork", "dynamic", "aimd"):
        raise SystemExit(f"--policy {policy!r}: one of clockwork, dynamic, aimd")
    from daemon import variants as family

    # MKL picks its sgemm kernels by row count on some CPUs (AVX-512 Xeons): a row's answer then
    # differs in its last bits with the batch it ran in, cross-model or not. Its conditional
    # numerical reproducibility (STRICT) makes a row's answer the same in any batch, so that
    # outputs_identical tests sharing, not the BLAS. Every child and daemon inherits it.
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    n = int(variants or (40 if quick else 200))
    load_reps = int(load_reps or (5 if quick else 20))
    rounds = int(reps or (1 if quick else 3))
    probe = float(probe_s or (2.0 if quick else 4.0))
    extra = {k: v for k, v in (("variants", variants), ("reps", reps), ("probe_s", probe_s),
                               ("ablation", "true" if ablation else None),
                               ("policy", policy if policy != "clockwork" else None),
                               ("detected", "true" if detected else None)) if v is not None}
    repo = Path(tempfile.gettempdir()) / f"escapement-variants-{n}"
    t0 = time.perf_counter()
    family.build(repo, n)
    build_s = time.perf_counter() - t0
    # the shared side in the form its daemon serves (the load phase): plans of the declared stages
    shared = _side("shared", repo if detected else family.staged_out(repo), n, load_reps)
    alone = _side("unshared", repo, n, load_reps)
    identical = shared.pop("outputs") == alone.pop("outputs")
    # a tenth of the variants' unshared weights (two variants' worth at least: a family of a few)
    budget = max(alone["device_budget_bytes"] // 10, 2 * alone["device_budget_bytes"] // n)
    figures, load_rows = _load_phase(repo, n, budget, rounds, probe, ablation, policy, detected) if load else ({
        "capacity_ratio": None, "p99_ratio": None, "outputs_identical_cross_model": None}, [])
    rows = [shared, alone, *load_rows]
    summary = {
        "variants": n,
        "policy": policy,
        "shared_form": "whole programs, prefix found at load" if detected else "declared stages",
        "memory_ratio": alone["device_budget_bytes"] / shared["device_budget_bytes"],
        "device_budget_shared_bytes": shared["device_budget_bytes"],
        "device_budget_unshared_bytes": alone["device_budget_bytes"],
        "backend_agrees_with_controller": shared["backend_used_bytes"] == shared["device_budget_bytes"],
        "host_weight_ratio": alone["host_weight_bytes"] / shared["host_weight_bytes"],
        "host_rss_ratio": alone["host_rss_bytes"] / max(shared["host_rss_bytes"], 1),
        # what each variant after the first adds (the first pays the process's one-time costs)
        "host_rss_per_variant_ratio": alone["host_rss_per_variant_bytes"]
        / max(shared["host_rss_per_variant_bytes"], 1),
        "host_rss_per_variant_kib": {"shared": shared["host_rss_per_variant_bytes"] / 1024,
                                     "unshared": alone["host_rss_per_variant_bytes"] / 1024},
        "host_rss_shared_mib": shared["host_rss_bytes"] / 2**20,
        "host_rss_unshared_mib": alone["host_rss_bytes"] / 2**20,
        "load_full_ms": shared["load_full_ms"],
        "load_resident_backbone_ms": shared["load_resident_backbone_ms"],
        "load_full_copy_ms": shared["load_full_copy_ms"],
        "load_resident_backbone_copy_ms": shared["load_resident_backbone_copy_ms"],
        # each variant alone vs on a shared device, and vs in cross-model batches through the daemon
        # (the cross-model check is None when the load phase was not run: then the device check alone)
        "outputs_identical": identical and figures["outputs_identical_cross_model"] is not False,
        **figures,
    }
    notes = [
        "memory_ratio: device-budget bytes of every variant placed on one device as separate models over "
        "with blocks shared (the controller's memory map; the CPU backend's own count must agree).",
        "host_rss: growth of each side's process RSS while it loads every variant (programs, traced runners "
        "and IO-free host state included), so it counts per-model overhead the weights do not.",
        "LOAD times: median of reps on a CPU device; wall is the backend's whole load (copy, binding the "
        "runner, IO buffers), copy is the weight copy alone.",
        "capacity: the highest offered load (Poisson, Zipf 1.0 over the variants, socket, one CPU device) at which "
        ">= 99% of requests meet their 100 ms SLO and p99 is within it (doubling from 200 req/s, then 3 geometric "
        "bisections); capacity_ratio = with / without sharing, median of the reps; each rep starts both daemons "
        "afresh, without sharing first.",
        "p99_ratio: p99 without sharing at its own capacity over p99 with sharing at that same offered load "
        "(median of the reps); cold-start rates are at that load too.",
        f"policy: {policy} on both sides of the load phase (every policy forms cross-model batches).",
        "with sharing, " + ("the monolithic variants, their backbone found at load (runtime.detect_shared_prefix) and "
                            "run as a shared stage." if detected else "the variants declared as plans of stages."),
        "without sharing: the monolithic variants, runtime.share_weights = false (each model charged and held in "
        "full), no cross-model batching; with sharing: the backbone stage shared (as the line above says), cross-model "
        "batching on, prefix cache off (each model's load repeats one input, which it would serve).",
        "outputs_identical: every variant's outputs on a shared CPU device equal those of its program alone (32 "
        "rows), and every variant's answers through the shared daemon, all variants asked at once (cross-model "
        "batches), equal its monolithic program alone on the same 8-row requests.",
        f"MKL_CBWR={os.environ.get('MKL_CBWR', '')} for every process of the run (MKL's reproducible mode: a row's "
        "answer the same in a batch of any size; without it, on an AVX-512 Xeon, 103 of 104 8-row slices of "
        "larger batches of the variants' backbone differed from the 8 rows alone in their last bits).",
        f"variant family built (or found) in {build_s:.1f} s",
    ]
    config = {"variants": n, "policy": policy, "load_reps": load_reps, "repo": str(repo), "load_rounds": rounds,
              "probe_s": probe, "command": command("sharing", quick, extra), "mkl_cbwr": os.environ.get("MKL_CBWR", "")}
    return results.write("sharing", config, rows, summary, json_out, notes)


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=4, metavar=("MODE", "REPO", "N", "REPS"), required=True)
    a = p.parse_args()
    mode, repo, n, reps = a.child
    print(json.dumps(_child(mode, repo, int(n), int(reps))))


if __name__ == "__main__":
    _main()
