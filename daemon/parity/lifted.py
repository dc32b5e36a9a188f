"""The deployed program as a trainable module, and its trained weights back into a program.

A parity model has the deployed model's architecture: `Lifted` takes the program's exported
graph with weights of its own (fresh, ParM's way, or the deployed ones), runs a copy with
BatchNorm on batch statistics (and dropout, if asked) while training, and the exported graph as
it is served in eval mode. `export` writes a trained module's weights into a copy of the deployed
program, with a dynamic batch dimension. The recipe that trains it is daemon/parity/trainer.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Literal

import torch
from torch.export.graph_signature import InputKind

from daemon.model import ModelSpec
from daemon.signature import read_exported_file

NormMode = Literal["recalibrate", "batch", "frozen"]

_BATCH_NORM = torch.ops.aten.batch_norm.default
_BATCH_NORM_EVAL = torch.ops.aten._native_batch_norm_legit_no_training.default
_DROPOUTS = (torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default,
             torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default)


def training_graph(gm: torch.fx.GraphModule, dropout: bool, momentum: float | None = None) -> torch.fx.GraphModule:
    """A copy of an eval-mode exported graph with BatchNorm on batch statistics (updating the running
    statistics with `momentum` when given) and, if `dropout`, dropout on."""
    out = copy.deepcopy(gm)
    for node in out.graph.nodes:
        if node.op != "call_function":
            continue
        args = list(node.args)
        if node.target is _BATCH_NORM:  # (x, w, b, mean, var, training, momentum, eps, cudnn)
            args[5] = True
            if momentum is not None:
                args[6] = momentum
        elif node.target is _BATCH_NORM_EVAL:  # (x, w, b, mean, var, momentum, eps) -> the training op
            node.target = torch.ops.aten._native_batch_norm_legit.default
            args = [*args[:5], True, momentum if momentum is not None else args[5], args[6]]
        elif node.target in _DROPOUTS and dropout:  # (x, p, train)
            args[2] = True
        node.args = tuple(args)
    out.recompile()
    return out


def _has_batch_norm(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in (_BATCH_NORM, _BATCH_NORM_EVAL) for n in gm.graph.nodes)


class Lifted(torch.nn.Module):
    """The deployed program's lifted graph with trainable weights of its own.

    `train()` runs a copy of the graph with BatchNorm on batch statistics and dropout on (unless
    norm is "frozen"); `eval()` runs the exported graph as it is served."""

    def __init__(self, ep: torch.export.ExportedProgram, norm: NormMode = "recalibrate", dropout: bool = False,
                 fresh: bool = True) -> None:
        super().__init__()
        self.gm = ep.graph_module
        self.norm = norm
        self.gm_train = self.gm if norm == "frozen" else training_graph(self.gm, dropout=dropout)
        self.gm_recal = training_graph(self.gm, dropout=False, momentum=1.0) if _has_batch_norm(self.gm) else None
        self.names: list[str] = []
        self.weights = torch.nn.ParameterList()
        self.plan: list[int] = []
        n_inputs = 0
        for s in ep.graph_signature.input_specs:
            if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                assert s.target is not None
                t = ep.state_dict.get(s.target)
                if t is None:
                    t = ep.constants[s.target]
                p = torch.nn.Parameter(t.detach().clone().float() if t.is_floating_point() else t.detach().clone(),
                                       requires_grad=s.kind == InputKind.PARAMETER and t.is_floating_point())
                self.plan.append(len(self.names))
                self.names.append(s.target)
                self.weights.append(p)
            else:
                self.plan.append(-(n_inputs + 1))
                n_inputs += 1
        if fresh:
            self.reset()

    def reset(self) -> None:
        """Fresh weights, as ParM initialises parity models."""
        with torch.no_grad():
            for name, p in zip(self.names, self.weights, strict=True):
                leaf = name.rsplit(".", 1)[-1]
                if not p.is_floating_point():
                    continue
                if leaf == "running_mean" or (leaf == "bias"):
                    p.zero_()
                elif leaf == "running_var" or p.dim() == 1:
                    p.fill_(1.0)
                else:  # Linear and Conv weights (N(0, 0.01) left 3-layer MLPs barely learning)
                    torch.nn.init.xavier_uniform_(p, gain=torch.nn.init.calculate_gain("relu"))

    def _run(self, gm: torch.fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
        args = [self.weights[i] if i >= 0 else x for i in self.plan]
        out = gm(*args)
        return out[0] if isinstance(out, tuple | list) else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.gm_train if self.training else self.gm, x)

    def recalibrate(self, x: torch.Tensor) -> None:
        """Set every BatchNorm's running statistics to those of the parity inputs `x` (one batch:
        each layer sees the previous ones normalised by the same batch's statistics)."""
        if self.gm_recal is None or self.norm != "recalibrate":
            return
        with torch.no_grad():
            self._run(self.gm_recal, x)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in zip(self.names, self.weights, strict=True)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in zip(self.names, self.weights, strict=True):
                p.copy_(state[n])


def export(parity: torch.nn.Module, spec: ModelSpec, path: Path) -> None:
    """Write the parity model as a torch.export program with a dynamic batch dimension."""
    assert isinstance(parity, Lifted)
    ep = read_exported_file(spec.path)
    module = ep.module()
    state = parity.state()
    with torch.no_grad():
        for name, value in state.items():
            owner, _, leaf = name.rpartition(".")
            target = module.get_submodule(owner) if owner else module
            getattr(target, leaf).copy_(value.to(getattr(target, leaf).dtype))
    example = torch.zeros((min(2, spec.max_batch_size) if spec.max_batch_size > 1 else 2, *spec.inputs[0].sample_shape),
                          dtype=spec.inputs[0].datatype.torch)
    batch = torch.export.Dim("batch", min=1, max=max(spec.max_batch_size, 2))
    new = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    torch.export.save(new, str(tmp))
    tmp.replace(path)
