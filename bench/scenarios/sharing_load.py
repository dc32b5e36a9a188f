"""The load half of `sharing`: many variants under Zipf load, with and without sharing.

Two daemons in turn, each on one CPU device whose weight budget holds a tenth of the variants'
unshared weights, each offered Poisson arrivals spread over the variants by Zipf popularity
over the socket:

- without sharing: the variants as monolithic programs, served as black boxes
  (`runtime.share_weights = false`: every model is charged and held in full; no cross-model
  batching);
- with sharing: the same variants as plans of stages (a shared backbone stage, a head each),
  their backbone held once and run once per cross-model batch. The prefix cache is off here:
  each model's requests repeat one input, which the cache would serve and flatter this side.

Per side: capacity at SLO (the highest offered load at which >= 99% of requests meet their SLO
and p99 is within it: doubling, then bisections), and at the capacity without sharing, both
sides' p99 and cold-start rate (from the daemon's counters). Then, on the shared daemon,
`outputs_identical`: every variant's answers to 8-sample requests sent to all variants at once
(so they run in cross-model batches) against its monolithic program run alone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench import loadgen
from bench.scenarios.many_models import point, stats
from bench.servers import Escapement
from daemon.model import ModelSpec
from daemon.repository import scan

CHECK_ROWS = 8  # samples per request of the identity check (BLAS runs 1-3 rows otherwise than more)
CHECK_INPUTS = 2


def _meets(r: dict[str, Any]) -> bool:
    return r["slo_attainment"] >= 0.99 and r["p99_ms"] <= r["slo_ms"] and not r["generator_bound"]


def check_inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(17)
    return [rng.uniform(0, 16, (CHECK_ROWS, 64)).astype(np.float32) for _ in range(CHECK_INPUTS)]


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def reference(repo: Path) -> dict[str, list[str]]:
    """Each monolithic variant's answers to the check inputs, loaded alone (in a child process)."""
    proc = subprocess.run([sys.executable, "-m", "bench.scenarios.sharing_load", str(repo)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the reference run failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _reference_child(repo: str) -> dict[str, list[str]]:
    import torch

    from daemon.runtime.objstore import ObjectStore
    from daemon.runtime.program import load_program

    torch.set_num_threads(1)
    xs = check_inputs()
    out = {}
    for spec in scan(repo).models:
        prog = load_program(spec, ObjectStore())  # a store of its own: nothing shared
        with torch.inference_mode():
            out[spec.name] = [digest(prog.host_runner([torch.from_numpy(x)])[0].numpy()) for x in xs]
    return out


def identity_check(server: Escapement, names: list[str], want: dict[str, list[str]]) -> dict[str, Any]:
    """Every variant's answers through the daemon, all variants at once, against `want`."""
    from daemon.client import AsyncSocketClient

    xs = check_inputs()
    before = stats(server.port)["counters"]

    async def go() -> dict[str, list[str]]:
        async with AsyncSocketClient(server.socket) as c:
            got: dict[str, list[str]] = {}
            for x in xs:
                answers = await asyncio.gather(*(c.infer(n, {"INPUT__0": x}) for n in names))
                for n, a in zip(names, answers, strict=True):
                    got.setdefault(n, []).append(digest(a.outputs["OUTPUT__0"]))
            return got

    got = asyncio.run(go())
    after = stats(server.port)["counters"]
    batches = after.get("cross_model_batches", 0) - before.get("cross_model_batches", 0)
    members = after.get("cross_model_members", 0) - before.get("cross_model_members", 0)
    mismatched = sorted(n for n in names if got.get(n) != want.get(n))
    return {"identical": not mismatched, "mismatched": mismatched[:10], "checked": len(names) * len(xs),
            "cross_model_batches": batches, "mean_members": members / batches if batches else 0.0}


def side(label: str, repo: Path, popularity: np.ndarray, budget: int, shared: bool, probe_s: float, seed: int,
         at_rate: float | None = None, want: dict[str, list[str]] | None = None,
         cross_model: bool | None = None, policy: str = "clockwork") -> dict[str, Any]:
    """One daemon: its capacity at SLO, and its row at `at_rate` (default: its capacity). `cross_model`
    (default: `shared`) apart from `shared` measures what weight sharing alone buys; `policy` is the
    controller's (every policy forms cross-model batches)."""
    specs: dict[str, ModelSpec] = {m.name: m for m in scan(repo).models}
    names = sorted(specs)
    n = len(names)
    runtime = {"weight_budget": budget, "share_weights": shared, "prefix_cache_entries": 0}
    controller = {"policy": policy, "cross_model_batching": shared if cross_model is None else cross_model}
    with Escapement(repo, runtime=runtime, controller=controller) as server:
        slo = max(s.slo_s for s in specs.values())

        def probe(rate: float, secs: float, s: int, tag: str) -> dict[str, Any]:
            secs = max(secs, 400 / rate)  # enough requests that one miss does not decide it
            sched = loadgen.poisson(rate, secs, n, popularity, seed=s)
            return point(server, sched, names, [specs[x] for x in names], secs, slo, label, probe=tag,
                         target_rps=rate)

        probe(50.0, probe_s, seed + 99, "warm-up")  # estimates and caches
        rows: list[dict[str, Any]] = []
        good, bad, rate = 0.0, None, 200.0
        for k in range(8):
            rows.append(probe(rate, probe_s, seed + k, "capacity"))
            if _meets(rows[-1]):
                good, rate = rate, rate * 2
            else:
                bad = rate
                break
        for k in range(3):
            if bad is None:
                break
            mid = (good * bad) ** 0.5 if good else bad / 2
            rows.append(probe(mid, probe_s, seed + 20 + k, "capacity"))
            if _meets(rows[-1]):
                good = mid
            else:
                bad = mid
        at = at_rate if at_rate is not None else good
        row = next((r for r in rows if at_rate is None and r["target_rps"] == at), None)
        if row is None and at > 0:
            row = probe(at, probe_s, seed + 50, "p99")
            rows.append(row)
        out: dict[str, Any] = {"label": label, "capacity_rps": good, "rows": rows, "at_rate": row}
        if want is not None:
            out["identity"] = identity_check(server, names, want)
        return out


if __name__ == "__main__":
    print(json.dumps(_reference_child(sys.argv[1])))
