"""A transformer exported on the CPU runs on CUDA: the views it traced after attention assumed the
CPU kernels' strides (found on the first H100 run: "Cannot view a tensor with shape [64, 32, 4,
64] ... as (2048, 256)"). Checked on fake CUDA tensors, so no GPU is needed."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from daemon.runtime.retarget import check_runs_on, to_device


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(1))


@pytest.fixture(scope="module")
def exported() -> tuple[torch.export.ExportedProgram, list[tuple[torch.dtype, tuple[int, ...]]]]:
    torch.manual_seed(0)
    with warnings.catch_warnings():  # torch's export warns about its own pytree specs
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
        ep = torch.export.export(Encoder().eval(), (torch.randn(2, 16, 64),),
                                 dynamic_shapes=({0: torch.export.Dim("b", min=1, max=32)},)).run_decompositions({})
    args = []
    for spec in ep.graph_signature.input_specs:  # weights (lifted) and the input, in graph order
        if spec.target is not None:
            t = ep.state_dict[spec.target]
            args.append((t.dtype, tuple(t.shape)))
        else:
            args.append((torch.float32, (8, 16, 64)))
    return ep, args


def test_the_views_as_traced_do_not_run_on_cuda(exported: tuple[torch.export.ExportedProgram, list]) -> None:
    ep, args = exported
    gm = ep.graph_module
    with pytest.raises((RuntimeError, ValueError), match="view"):
        check_runs_on(gm, torch.device("cuda"), args)


def test_retargeted_to_cuda_it_runs(exported: tuple[torch.export.ExportedProgram, list]) -> None:
    ep, args = exported
    moved = to_device(ep.graph_module, torch.device("cuda"))
    assert not any(n.target is torch.ops.aten.view.default for n in moved.graph.nodes)
    check_runs_on(moved, torch.device("cuda"), args)


def test_the_reshapes_compute_what_the_views_did(exported: tuple[torch.export.ExportedProgram, list]) -> None:
    ep, _ = exported
    original = ep.graph_module
    moved = to_device(original, torch.device("cuda"))
    assert moved is not original and any(n.target is torch.ops.aten.view.default for n in original.graph.nodes)
    params = [ep.state_dict[s.target] for s in ep.graph_signature.input_specs if s.target is not None]
    x = torch.randn(5, 16, 64)
    with torch.inference_mode():
        want = original(*params, x)
        got = moved(*params, x)  # on the CPU: a reshape of a contiguous tensor is the same view
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


def test_the_cpu_keeps_the_graph_as_exported(exported: tuple[torch.export.ExportedProgram, list]) -> None:
    ep, _ = exported
    assert to_device(ep.graph_module, torch.device("cpu")) is ep.graph_module
