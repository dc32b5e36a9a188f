"""Cold starts of textbook replacement policies on the scale scenario's trace, offline (issue 12).

At 10,000 models the controller's cost per request grows with its LOADs and UNLOADs (~140k
instructions a pair, bench/results/scale-callgrind-issue12.md): fewer cold starts would cut it as
surely as a cheaper LOAD. This replays the scale scenario's request mix (Zipf(1.0) popularity,
the four Clockwork model sizes in turn, `bench/scenarios/scale.py`) against one cache of the
devices' whole budget, with no timing, and reports the share of requests that find their model
cold after a warm-up, for: LRU (Clockwork's), segmented LRU (a probation segment for models seen
once), GreedyDual-Size-Frequency with unit cost (popularity per byte, aged), and the static
best (the models with most requests per byte, placed once: what no online policy beats).
The daemon's own rate is measured by `bench run scale` (`cold_start_rate`), not here.

    python -m bench.cache_policies [--models 10000] [--devices 8] [--gib 64] [--requests 140000]
        [--warm 100000] [--seed 1]
"""

from __future__ import annotations

import argparse
import collections
import heapq

import numpy as np

from daemon.sim import CLOCKWORK_V100


def trace(models: int, requests: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(requested model per request, model sizes in bytes, popularity)."""
    sizes = [p.weight_bytes for p in CLOCKWORK_V100.values()]
    w = 1.0 / np.arange(1, models + 1)
    w /= w.sum()
    reqs = np.random.default_rng(seed).choice(models, size=requests, p=w)
    return reqs, np.array([sizes[i % len(sizes)] for i in range(models)], dtype=np.float64), w


def lru(reqs: np.ndarray, sz: np.ndarray, cap: float, warm: int) -> float:
    held: collections.OrderedDict[int, None] = collections.OrderedDict()
    used, miss = 0.0, 0
    for t, m in enumerate(reqs.tolist()):
        if m in held:
            held.move_to_end(m)
            continue
        miss += t >= warm
        while used + sz[m] > cap:
            k, _ = held.popitem(last=False)
            used -= sz[k]
        held[m] = None
        used += sz[m]
    return miss / (len(reqs) - warm)


def slru(reqs: np.ndarray, sz: np.ndarray, cap: float, warm: int, protected: float) -> float:
    """Segmented LRU: a model enters probation; a second hit moves it to the protected segment
    (at most `protected` of the budget, its LRU end demoted back to probation)."""
    prob: collections.OrderedDict[int, None] = collections.OrderedDict()
    prot: collections.OrderedDict[int, None] = collections.OrderedDict()
    used = pused = 0.0
    miss = 0
    for t, m in enumerate(reqs.tolist()):
        if m in prot:
            prot.move_to_end(m)
            continue
        if m in prob:
            del prob[m]
            prot[m] = None
            pused += sz[m]
            while pused > cap * protected:
                k, _ = prot.popitem(last=False)
                pused -= sz[k]
                prob[k] = None
            continue
        miss += t >= warm
        while used + sz[m] > cap:
            if prob:
                k, _ = prob.popitem(last=False)
            else:
                k, _ = prot.popitem(last=False)
                pused -= sz[k]
            used -= sz[k]
        prob[m] = None
        used += sz[m]
    return miss / (len(reqs) - warm)


def gdsf(reqs: np.ndarray, sz: np.ndarray, cap: float, warm: int) -> float:
    """GreedyDual-Size-Frequency, unit cost: priority = L + hits / size; evicts the lowest and
    ages every later priority by it (L)."""
    prio: dict[int, float] = {}
    hits: collections.Counter[int] = collections.Counter()
    heap: list[tuple[float, int]] = []
    used, age, miss = 0.0, 0.0, 0
    for t, m in enumerate(reqs.tolist()):
        hits[m] += 1
        if m not in prio:
            miss += t >= warm
            while used + sz[m] > cap:
                h, k = heapq.heappop(heap)
                if prio.get(k) != h:
                    continue  # (an old entry of a model whose priority rose since)
                age = h
                del prio[k]
                used -= sz[k]
            used += sz[m]
        prio[m] = age + hits[m] * 2**20 / sz[m]
        heapq.heappush(heap, (prio[m], m))
    return miss / (len(reqs) - warm)


def static_best(reqs: np.ndarray, sz: np.ndarray, w: np.ndarray, cap: float, warm: int) -> float:
    keep = np.zeros(len(sz), dtype=bool)
    used = 0.0
    for m in np.argsort(-(w / sz)):
        if used + sz[m] <= cap:
            keep[m] = True
            used += sz[m]
    return float(np.mean(~keep[reqs[warm:]]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=int, default=10_000)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--gib", type=float, default=64.0)
    ap.add_argument("--requests", type=int, default=140_000)
    ap.add_argument("--warm", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    reqs, sz, w = trace(a.models, a.requests, a.seed)
    cap = a.devices * a.gib * 2**30
    print(f"{a.models} models, {a.devices} x {a.gib:g} GiB, {a.requests - a.warm} requests counted after "
          f"{a.warm}; share of requests that find their model cold:")
    print(f"  LRU                 {lru(reqs, sz, cap, a.warm):.4f}")
    for p in (0.5, 0.8):
        print(f"  segmented LRU {p:.1f}   {slru(reqs, sz, cap, a.warm, p):.4f}")
    print(f"  GDSF (unit cost)    {gdsf(reqs, sz, cap, a.warm):.4f}")
    print(f"  static best         {static_best(reqs, sz, w, cap, a.warm):.4f}")


if __name__ == "__main__":
    main()
