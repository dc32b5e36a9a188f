"""A frontend worker freezes the heap its start-up left (daemon/api/worker.py `freeze_heap`), so
that no full collection walks its imports' objects while it serves (with torch imported, a ~110 ms
stall on 2 cores, which its loop monitor took for overload: 503s in bench run peers; workers no
longer import torch, and what is left is still frozen)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
import daemon.api.worker as w
before = len(gc.get_objects())
frozen = w.freeze_heap()
print(json.dumps({"before": before, "frozen": frozen, "left": len(gc.get_objects())}))
"""


def test_the_worker_freezes_what_its_imports_left() -> None:
    # a fresh interpreter: the heap a worker process starts with (this test process's is not)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] > 20_000  # the frontends, gRPC, numpy: what a full pass would walk
    assert got["frozen"] >= 0.9 * got["before"]
    assert got["left"] < 1_000  # a collection now walks only what serving allocates
