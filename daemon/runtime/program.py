"""A model version loaded into host memory, ready to be bound to any device's weights.

`model.pt2` (torch.export): the lifted graph takes weights as arguments, so one graph serves
every device: a device's runner calls it with that device's weight views. This also skips the
guard and pytree layer of `ExportedProgram.module()`, which costs ~100 µs per call on a CPU.

`model.ts` (TorchScript): a weightless shell of the module is kept; binding copies the shell and
points its parameters and buffers at the device's views.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind, OutputKind

from daemon.repository import ModelSpec
from daemon.runtime.weights import WeightLayout, pack

log = logging.getLogger("escapement.repository")

Runner = Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]


class ProgramError(ValueError):
    """The model file cannot be served as its config describes; the message says why."""


@dataclass(slots=True, eq=False)
class Program:
    spec: ModelSpec
    layout: WeightLayout
    host_block: torch.Tensor  # flat uint8, pinned on CUDA machines
    bind: Callable[[list[torch.Tensor]], Runner]
    host_runner: Runner = field(init=False)
    seed_timings: dict[int, float] = field(default_factory=dict)  # batch size -> seconds, host CPU

    def __post_init__(self) -> None:
        self.host_runner = self.bind(self.layout.views(self.host_block))

    @property
    def weight_bytes(self) -> int:
        return self.layout.nbytes


def _as_tuple(out: object, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, tuple | list):
        return tuple(out)
    if isinstance(out, dict):
        try:
            return tuple(out[o.name] for o in spec.outputs)
        except KeyError as e:
            raise ProgramError(f"{spec.key}: the model returned a dict without output {e}") from None
    raise ProgramError(f"{spec.key}: the model returned {type(out).__name__}, not tensors")


def _load_exported(spec: ModelSpec, pin: bool) -> Program:
    ep = torch.export.load(str(spec.path))
    sig = ep.graph_signature
    weights: list[tuple[str, torch.Tensor]] = []
    plan: list[int] = []  # per graph argument: >= 0 weight index, < 0 user input -(k+1)
    n_inputs = 0
    for s in sig.input_specs:
        if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            assert s.target is not None
            t = ep.state_dict.get(s.target)
            if t is None:
                t = ep.constants.get(s.target)
            if not isinstance(t, torch.Tensor):
                raise ProgramError(f"{spec.key}: exported weight {s.target} is not a tensor")
            plan.append(len(weights))
            weights.append((s.target, t))
        elif s.kind == InputKind.USER_INPUT:
            if type(s.arg).__name__ != "TensorArgument":
                raise ProgramError(f"{spec.key}: exported input {s.arg} is not a tensor; only tensor "
                                   "inputs can be served")
            plan.append(-(n_inputs + 1))
            n_inputs += 1
        else:
            raise ProgramError(f"{spec.key}: exported programs with {s.kind.name} inputs are not supported")
    for o in sig.output_specs:
        if o.kind != OutputKind.USER_OUTPUT:
            raise ProgramError(f"{spec.key}: the program mutates its state ({o.kind.name}); export the "
                               "model in eval() mode")
    if n_inputs != len(spec.inputs):
        raise ProgramError(f"{spec.key}: the program takes {n_inputs} inputs but config.toml lists "
                           f"{len(spec.inputs)}")
    gm = ep.graph_module
    layout, block = pack(weights, pin=pin)
    del ep, weights
    simple = plan == list(range(len(layout.entries))) + [-(k + 1) for k in range(n_inputs)]

    def bind(views: list[torch.Tensor]) -> Runner:
        if simple:
            def run(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
                return _as_tuple(gm(*views, *xs), spec)
        else:
            def run(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
                args = [views[i] if i >= 0 else xs[-i - 1] for i in plan]
                return _as_tuple(gm(*args), spec)
        return run

    return Program(spec, layout, block, bind)


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False)
            if isinstance(getattr(module, name), torch.nn.Parameter) else value)


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    # ScriptModules do not support get_submodule.
    mod = root
    for part in path.split(".") if path else ():
        mod = getattr(mod, part)
    return mod


def _load_torchscript(spec: ModelSpec, pin: bool) -> Program:
    with warnings.catch_warnings():
        # torch 2.13 deprecates TorchScript; existing .ts models are still served.
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(spec.path), map_location="cpu").eval()
    log.info("%s: TorchScript is deprecated upstream; prefer model.pt2 (torch.export)", spec.key)
    # Unique tensors by identity, so tied weights share one slot.
    slots: dict[int, int] = {}
    weights: list[tuple[str, torch.Tensor]] = []
    owners: list[tuple[str, str, int]] = []  # (submodule path, attribute, slot)
    for path, sub in module.named_modules():
        own = list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False))
        for attr, t in own:
            if id(t) not in slots:
                slots[id(t)] = len(weights)
                weights.append((f"{path}.{attr}" if path else attr, t))
            owners.append((path, attr, slots[id(t)]))
    layout, block = pack(weights, pin=pin)
    shell = copy.deepcopy(module)
    for path, attr, _ in owners:  # drop the shell's own copies of the weights
        sub = _submodule(shell, path)
        _set_tensor(sub, attr, torch.empty(0, dtype=getattr(sub, attr).dtype))
    del module, weights

    def bind(views: list[torch.Tensor]) -> Runner:
        inst = copy.deepcopy(shell)
        for path, attr, slot in owners:
            _set_tensor(_submodule(inst, path), attr, views[slot])

        def run(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return _as_tuple(inst(*xs), spec)
        return run

    return Program(spec, layout, block, bind)


def zeros_batch(spec: ModelSpec, batch: int) -> list[torch.Tensor]:
    return [torch.zeros((batch, *t.sample_shape), dtype=t.datatype.torch) for t in spec.inputs]


def check_outputs(spec: ModelSpec, outs: tuple[torch.Tensor, ...], batch: int) -> None:
    if len(outs) != len(spec.outputs):
        raise ProgramError(f"{spec.key}: the model returned {len(outs)} outputs but config.toml lists "
                           f"{len(spec.outputs)}")
    for o, t in zip(spec.outputs, outs, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ProgramError(f"{spec.key}: output {o.name} is {type(t).__name__}, not a tensor")
        if t.dtype != o.datatype.torch:
            raise ProgramError(f"{spec.key}: output {o.name} is {t.dtype} but config.toml says "
                               f"{o.datatype.name}")
        want = (batch, *o.sample_shape)
        if tuple(t.shape) != want:
            raise ProgramError(f"{spec.key}: output {o.name} has shape {tuple(t.shape)} for a batch of "
                               f"{batch}; config.toml implies {want}")


def load_program(spec: ModelSpec, pin: bool = False) -> Program:
    """Read the model file into host memory and check it against its config by running it.

    Runs batch 1 and the largest batch size once each (after a warm-up call) on the host CPU,
    which both validates the shapes and gives first timings to seed estimates with.
    """
    try:
        program = _load_exported(spec, pin) if spec.format == "pt2" else _load_torchscript(spec, pin)
    except ProgramError:
        raise
    except Exception as e:  # torch raises many types for a bad file
        raise ProgramError(f"{spec.key}: cannot load {spec.path.name}: {type(e).__name__}: {e}") from e
    sizes = sorted({1, min(2, spec.max_batch_size), spec.max_batch_size})
    with torch.inference_mode():
        for b in sizes:
            xs = zeros_batch(spec, b)
            try:
                outs = program.host_runner(xs)
                check_outputs(spec, outs, b)
                t0 = time.perf_counter()
                program.host_runner(xs)
                program.seed_timings[b] = time.perf_counter() - t0
            except ProgramError:
                raise
            except Exception as e:
                raise ProgramError(f"{spec.key}: running a batch of {b} zeros failed "
                                   f"({type(e).__name__}: {e}); do the inputs in config.toml match the model, "
                                   "and was the batch dimension exported as dynamic?") from e
    return program
