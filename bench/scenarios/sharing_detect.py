"""Load-time cost of finding shared prefixes in single-program models (runtime.detect_shared_prefix).

`python -m bench.scenarios.sharing_detect REPO N MODE`: loads the first N models of REPO (the
monolithic demo variants) in one fresh process as the model manager does, MODE `off` (each
`load_program` alone) or `on` (every program read ahead, cut hashes noted, then each loaded and
split at its shared prefix); prints JSON: wall seconds of the read-ahead and of the loads, how many
were split, and a digest of every model's outputs (equal between the modes: bit-identical)."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any


def measure(repo: str, n: int, mode: str) -> dict[str, Any]:
    import numpy as np
    import torch

    from daemon.repository import scan
    from daemon.runtime.objstore import ObjectStore
    from daemon.runtime.program import load_program
    from daemon.runtime.shared_prefix import PrefixIndex

    torch.set_num_threads(1)
    specs = sorted(scan(repo).models, key=lambda s: s.name)[:n]
    store, index = ObjectStore(), PrefixIndex()
    t0 = time.perf_counter()
    if mode == "on":
        index.read_ahead(specs, store)
    t1 = time.perf_counter()
    progs = [load_program(s, store, index) for s in specs]
    t2 = time.perf_counter()
    x = torch.from_numpy(np.random.default_rng(0).uniform(0, 16, (8, 64)).astype(np.float32))
    h = hashlib.sha256()
    with torch.inference_mode():
        for p in progs:
            h.update(p.host_runner([x])[0].numpy().tobytes())
    return {"mode": mode, "models": len(specs), "read_ahead_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0,
            "split": sum(1 for p in progs if p.prefix), "prefixes": len({p.prefix for p in progs if p.prefix}),
            "outputs_digest": h.hexdigest()}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
