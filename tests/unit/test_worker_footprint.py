"""A frontend worker process decodes and encodes tensors with numpy alone: importing it loads
neither torch nor the scheduler (torch cost every worker ~180 MiB and ~3 s of start-up)."""

from __future__ import annotations

import subprocess
import sys


def test_a_frontend_worker_imports_no_torch_and_no_scheduler() -> None:
    banned = ("torch.", "daemon.controller.scheduler", "daemon.runtime")
    code = ("import sys, daemon.api.worker; "
            f"bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith({banned!r})); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_datatypes_give_torch_dtypes_on_demand() -> None:
    import torch

    from daemon.datatypes import BY_NAME, BY_TORCH

    assert BY_NAME["BF16"].tensor_dtype is torch.bfloat16 and BY_NAME["FP32"].torch is torch.float32
    assert BY_NAME["BYTES"].torch is None
    assert BY_TORCH[torch.int64] is BY_NAME["INT64"] and torch.bfloat16 in BY_TORCH
