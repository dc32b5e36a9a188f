"""CPU time of the daemon's threads, by name: where the process's cores go.

The event loop, each device's INFER and LOAD lanes and the worker pools are Python threads with
names; `other` is what the process spent beyond them: threads Python does not know (CUDA's, torch's
intra-op pool) and threads that have ended. On a GPU the controller process is one interpreter,
so this says which part of it holds the one core the GIL allows (bench/gpu/manymodels.py reads it
per offered load). Read from /proc (Linux); elsewhere everything is `other`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) each named thread has used, and `other`: the rest of the process's."""
    out: dict[str, float] = {}
    known = 0.0
    for t in threading.enumerate():
        tid = t.native_id
        if tid is None:
            continue
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # (the thread ended meanwhile, or no /proc here)
            continue
        s = (int(fields[11]) + int(fields[12])) / _TICKS
        out[t.name] = out.get(t.name, 0.0) + s
        known += s
    times = os.times()
    out["other"] = max(0.0, times.user + times.system - known)
    return out
