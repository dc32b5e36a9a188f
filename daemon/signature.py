"""A model's config inferred from an exported program (a bare `model.pt2` with no config.toml).

A storage URI that holds only `model.pt2` (what `torch.export.save` writes) reaches the repository
as `<repository>/<name>/model.pt2`; KServe's agent cannot hand over a config with it. The program
itself records what the config would say: each user input's and output's dtype and shape, and the
range of a dynamic batch dimension (`torch.export.Dim("batch", max=N)`). Names follow Triton's
positional convention (INPUT__0, OUTPUT__0, ...), as the demo models do. What a program cannot
say (an SLO, parity, a queue policy, other names) needs a config.toml beside the file.

The result is the raw table a config.toml would hold; model_config.py validates it the same way.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

from daemon.errors import SignatureError

UNBOUNDED_BATCH = 32  # max_batch_size for a batch dimension exported without an upper bound
MAX_BATCH = 4096  # model_config.MAX_BATCH_SIZE


_cache: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}  # path -> (mtime_ns, size), config
_cache_lock = threading.Lock()  # scans run in worker threads


def inferred_config(path: Path) -> dict[str, Any]:
    """The config of an exported program file (read once per version of the file)."""
    st = path.stat()
    stamp = (st.st_mtime_ns, st.st_size)
    with _cache_lock:
        hit = _cache.get(path)
    if hit is not None and hit[0] == stamp:
        return dict(hit[1])
    config = _infer(path)
    with _cache_lock:
        _cache[path] = (stamp, config)
    return dict(config)


def read_exported_file(path: Path) -> Any:
    """torch.export.load, quiet about torch 2.11's warning that it reads the archive's weights from a
    read-only buffer (where warnings are errors, as under pytest on the H200, the read failed)."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.export.load(str(path))


def _infer(path: Path) -> dict[str, Any]:
    import torch  # the scan imports this module; only a bare model.pt2 needs torch here
    from torch.export.graph_signature import InputKind

    from daemon.datatypes import BY_TORCH

    try:
        ep = read_exported_file(path)
    except Exception as e:  # torch raises many types for a bad file
        raise SignatureError(f"cannot read {path.name} as an exported program: {type(e).__name__}: {e}") from e
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    inputs = [nodes[s.arg.name].meta.get("val") for s in ep.graph_signature.input_specs
              if s.kind == InputKind.USER_INPUT and hasattr(s.arg, "name")]
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    outputs = [getattr(a, "meta", {}).get("val") for a in output_node.args[0]]
    if not inputs or not outputs:
        raise SignatureError(f"{path.name} has no tensor inputs or no tensor outputs")
    batch: Any = None  # the symbol of the batch dimension, shared by every input and output

    def spec(val: Any, name: str) -> dict[str, Any]:
        nonlocal batch
        if not isinstance(val, torch.Tensor):
            raise SignatureError(f"{name} of {path.name} is not a tensor")
        dtype = BY_TORCH.get(val.dtype)
        if dtype is None:
            raise SignatureError(f"{name} of {path.name} is {val.dtype}, which has no KServe datatype")
        if val.dim() < 1:
            raise SignatureError(f"{name} of {path.name} is a scalar; inputs and outputs need a batch dimension")
        first, *rest = val.shape
        if any(not isinstance(d, int) for d in rest):
            raise SignatureError(f"{name} of {path.name} has a dynamic dimension other than the first (the "
                                 "batch); only the batch dimension may vary: write a config.toml")
        key = first.node.expr if isinstance(first, torch.SymInt) else int(first)
        if batch is None:
            batch = key
        elif key != batch:
            raise SignatureError(f"{name} of {path.name} has a first dimension ({key}) other than the batch's "
                                 f"({batch}): every input and output must start with the batch dimension")
        return {"name": name, "datatype": dtype.name, "shape": [-1, *(int(d) for d in rest)]}

    config: dict[str, Any] = {
        "inputs": [spec(v, f"INPUT__{i}") for i, v in enumerate(inputs)],
        "outputs": [spec(v, f"OUTPUT__{i}") for i, v in enumerate(outputs)],
    }
    config["max_batch_size"], how = _max_batch(ep, batch, path)
    config["description"] = f"config inferred from {path.name} ({how})"
    return config


def _max_batch(ep: Any, batch: Any, path: Path) -> tuple[int, str]:
    if isinstance(batch, int):
        if batch != 1:
            raise SignatureError(f"{path.name} was exported for a fixed batch of {batch}; export it with a dynamic "
                                 "batch dimension (torch.export.Dim) or write a config.toml")
        return 1, "a fixed batch of 1"
    bounds = ep.range_constraints.get(batch)
    upper: int | None = None
    if bounds is not None:
        try:
            upper = int(bounds.upper)
        except Exception:  # torch's int_oo (exported without an upper bound) is no int; sympy says so oddly
            upper = None
    if upper is None:
        return UNBOUNDED_BATCH, f"batch dimension without an upper bound: max_batch_size {UNBOUNDED_BATCH}"
    return max(1, min(upper, MAX_BATCH)), f"batch dimension up to {upper}"
