"""Making an exported program run on a device other than the CPU it was exported on.

`torch.export` bakes the export-time device into the graph: a `.float()` or `.to(dtype)`
leaves `aten._assert_tensor_metadata(..., device=cpu)`, and `arange/zeros/ones/full` carry
`device=cpu`. Run on CUDA tensors such a graph fails (or builds tensors on the wrong device).
`to_device` rewrites every baked device in a copy of the graph, the graph-only part of
torch's `move_to_device_pass` (which also moves the weights, and so needs the device). For a
device other than the CPU it also turns `aten.view` into `aten.reshape`: a view traced on the
CPU assumes the CPU kernels' output strides, and CUDA's differ (its attention returns heads
interleaved, so the view after `scaled_dot_product_attention` in a transformer cannot be taken).
A reshape is that same view where the strides allow one and a copy where they do not; an
exported inference graph is functional, so nothing depends on the aliasing a view would keep.

`check_runs_on` runs a graph on fake tensors of a device (FakeTensorMode: no memory, no
device needed), so a CPU machine can tell whether it would run on `cuda`.

`capture_lint` finds what CUDA graph capture cannot hold: operations whose output size or
control flow depends on data (a host sync).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

# aten ops that read device data on the host (shared with the CUDA stand-in's capture check)
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique",
                      "_unique2", "unique_consecutive", "unique_dim", "equal", "is_nonzero", "allclose",
                      "repeat_interleave", "bincount", "histc", "multinomial", "_assert_async"})


def _graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def baked_devices(gm: torch.fx.GraphModule) -> set[str]:
    """Devices named in the graph's node arguments."""
    out: set[str] = set()
    for m in _graph_modules(gm):
        for node in m.graph.nodes:
            dev = node.kwargs.get("device")
            if isinstance(dev, torch.device | str):
                out.add(str(dev))
            if node.op == "call_function" and node.target is torch.ops.aten.to.device and len(node.args) > 1:
                out.add(str(node.args[1]))
    return out


def _has_views(gm: torch.fx.GraphModule) -> bool:
    return any(node.op == "call_function" and node.target is torch.ops.aten.view.default
               for m in _graph_modules(gm) for node in m.graph.nodes)


def to_device(gm: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """A copy of `gm` with every baked device replaced by `device`, and its views made reshapes
    off the CPU (`gm` itself is untouched)."""
    reshape = device.type != "cpu" and _has_views(gm)
    if not baked_devices(gm) - {str(device)} and not reshape:
        return gm
    with warnings.catch_warnings():  # torch's own pytree specs warn about themselves when copied
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        moved = copy.deepcopy(gm)
    for m in _graph_modules(moved):
        for node in m.graph.nodes:
            if reshape and node.op == "call_function" and node.target is torch.ops.aten.view.default:
                node.target = torch.ops.aten.reshape.default
            if "device" in node.kwargs and node.kwargs["device"] is not None:
                kwargs = dict(node.kwargs)
                kwargs["device"] = device
                node.kwargs = kwargs
            if node.op == "call_function" and node.target is torch.ops.aten.to.device:
                args = list(node.args)
                args[1] = device
                node.args = tuple(args)
        m.recompile()
    return moved


def check_runs_on(gm: torch.fx.GraphModule, device: torch.device,
                  args: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Run `gm` on fake tensors of `device` with arguments of these (dtype, shape); raises the
    graph's error if it cannot run there."""
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=False), torch.inference_mode():
        # torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1) reads every tensor's data pointer, fakes too
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        fakes = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in args]
        outs = gm(*fakes)
        for o in outs if isinstance(outs, tuple | list) else (outs,):
            if isinstance(o, torch.Tensor) and o.device.type != device.type:
                raise RuntimeError(f"an output is computed on {o.device}, not {device}")


def capture_lint(gm: torch.fx.GraphModule) -> str | None:
    """Why a CUDA graph cannot capture this program, or None if nothing in it forbids one."""
    for m in _graph_modules(gm):
        for node in m.graph.nodes:
            if node.op != "call_function":
                continue
            packet = getattr(node.target, "_overloadpacket", None)
            name = getattr(packet, "__name__", "")
            if name in SYNC_OPS:
                return f"aten.{name} depends on data (a host sync)"
            if name == "index" and len(node.args) > 1:
                for idx in node.args[1] or ():
                    val = getattr(idx, "meta", {}).get("val") if idx is not None else None
                    if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
                        return "boolean-mask indexing depends on data (a host sync)"
            if name in ("_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size"):
                return f"the graph constrains a data-dependent size ({name})"
            if node.op == "call_function" and node.target in (torch.ops.higher_order.cond,
                                                             torch.ops.higher_order.while_loop):
                return f"data-dependent control flow ({node.target.__name__})"
    return None
