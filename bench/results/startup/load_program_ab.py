"""Reading ResNet-18 with and without the CPU's native runner, alternating, 4 reps each.

`PYTHONPATH=. .venv/bin/python bench/results/startup/load_program_ab.py` (the model is the one
`bench.gpu.profiles.export` writes: architectures(224, 64)[0] into /tmp/rn18repo)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from daemon.repository import scan
from daemon.runtime.objstore import ObjectStore
from daemon.runtime.program import load_program
from daemon.runtime.shared_prefix import PrefixIndex

spec = next(m for m in scan(Path("/tmp/rn18repo")).models if m.name == "resnet18")
res: dict[bool, list[float]] = {True: [], False: []}
for rep in range(4):
    for native in (True, False) if rep % 2 == 0 else (False, True):
        t = time.monotonic()
        load_program(spec, ObjectStore(), PrefixIndex(), native_runner=native)
        res[native].append(time.monotonic() - t)
for k, v in res.items():
    print("native" if k else "lean", [round(x, 3) for x in v], "median", round(statistics.median(v), 3))
print("ratio lean/native", round(statistics.median(res[False]) / statistics.median(res[True]), 3))
