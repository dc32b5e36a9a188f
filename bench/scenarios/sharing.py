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

`capacity_ratio` and `p99_ratio` need cross-model batching (issue 17 items 2-3), not built.
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
    for s in specs:
        if not shared:
            stores.append(ObjectStore())
        progs.append(load_program(s, stores[-1]))
    gc.collect()
    host_rss = _rss() - rss0
    host_weights = sum(st.nbytes for st in stores)
    memory = DeviceMemory(1 << 40, shares=shared)
    for s, p in zip(specs, progs, strict=True):
        memory.reserve(s.key, p.block_bytes, p.blocks)
    out: dict[str, Any] = {"mode": mode, "variants": len(specs), "host_rss_bytes": host_rss,
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


def run(quick: bool = False, json_out: str | None = None, variants: int | None = None,
        load_reps: int | None = None) -> dict[str, Any]:
    from daemon import variants as family

    n = variants or (20 if quick else 200)
    reps = load_reps or (5 if quick else 20)
    repo = Path(tempfile.gettempdir()) / f"escapement-variants-{n}"
    t0 = time.perf_counter()
    family.build(repo, n)
    build_s = time.perf_counter() - t0
    shared = _side("shared", repo, n, reps)
    alone = _side("unshared", repo, n, reps)
    identical = shared.pop("outputs") == alone.pop("outputs")
    rows = [shared, alone]
    summary = {
        "variants": n,
        "memory_ratio": alone["device_budget_bytes"] / shared["device_budget_bytes"],
        "device_budget_shared_bytes": shared["device_budget_bytes"],
        "device_budget_unshared_bytes": alone["device_budget_bytes"],
        "backend_agrees_with_controller": shared["backend_used_bytes"] == shared["device_budget_bytes"],
        "host_weight_ratio": alone["host_weight_bytes"] / shared["host_weight_bytes"],
        "host_rss_ratio": alone["host_rss_bytes"] / max(shared["host_rss_bytes"], 1),
        "host_rss_shared_mib": shared["host_rss_bytes"] / 2**20,
        "host_rss_unshared_mib": alone["host_rss_bytes"] / 2**20,
        "load_full_ms": shared["load_full_ms"],
        "load_resident_backbone_ms": shared["load_resident_backbone_ms"],
        "load_full_copy_ms": shared["load_full_copy_ms"],
        "load_resident_backbone_copy_ms": shared["load_resident_backbone_copy_ms"],
        "outputs_identical": identical,
        "capacity_ratio": None,
        "p99_ratio": None,
    }
    notes = [
        "memory_ratio: device-budget bytes of every variant placed on one device as separate models over "
        "with blocks shared (the controller's memory map; the CPU backend's own count must agree).",
        "host_rss: growth of each side's process RSS while it loads every variant (programs, traced runners "
        "and IO-free host state included), so it counts per-model overhead the weights do not.",
        "LOAD times: median of reps on a CPU device; wall is the backend's whole load (copy, binding the "
        "runner, IO buffers), copy is the weight copy alone.",
        "capacity_ratio and p99_ratio: not built (they need cross-model batching, issue 17 items 2-3).",
        f"variant family built (or found) in {build_s:.1f} s",
    ]
    config = {"variants": n, "load_reps": reps, "repo": str(repo)}
    return results.write("sharing", config, rows, summary, json_out, notes)


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=4, metavar=("MODE", "REPO", "N", "REPS"), required=True)
    a = p.parse_args()
    mode, repo, n, reps = a.child
    print(json.dumps(_child(mode, repo, int(n), int(reps))))


if __name__ == "__main__":
    _main()
