"""A model version loaded into host memory, ready to be bound to any device's weights.

A program's weights are host tensors of the process's object store (`objstore.py`): each
distinct tensor is held once, whichever models and versions use it. Binding a program to a
device's copy of its tensors gives a runner that computes with the device's weights. A CUDA
device copies one packed block per model (`weights.py`), made from the tensors when one first
asks for it (`host_block`).

Two kinds of runner exist for a `model.pt2` (torch.export) program:

- the graph runner calls the lifted graph with the weights as arguments. It serves every
  device and skips the guard and pytree layer of `ExportedProgram.module()` (~100 µs a call).
  But it calls each aten op from Python, re-acquiring the GIL between ops; while the event
  loop is busy, each re-acquire waits up to a switch interval, and a 20-op model ran 2x
  slower under load (bench/README.md, "GIL convoy").
- the native runner is a TorchScript trace of the same program, run by the TorchScript
  interpreter in one call without the GIL. It is made at load, checked against the graph on
  real batches, and used by CPU devices. If tracing fails or disagrees, CPU devices fall back
  to the graph runner. (TorchScript is deprecated upstream; this is why the graph stays the
  reference and the fallback.)

`model.ts` (TorchScript) files are served by a native runner over their own weights.

A model declared as a plan of stages (`stages` in config.toml, Pretzel's model plans) is one
program made of its stages' programs run in turn: its weights are theirs, in stage order, and
its runner a `Chain` of stage runners. Each stage has an identity, `sid`: a hash of its graph's
code, its signature and its weights' content ids, so two models whose leading stages are the
same program over the same weights share a `prefix`, which the controller may run once for
both (cross-model batching) and the runtime may cache by input (`prefixcache.py`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch.export.graph_signature import InputKind, OutputKind

from daemon.errors import ProgramError
from daemon.model import ModelSpec
from daemon.runtime.graph_cache import structure_of
from daemon.runtime.objstore import STORE, ObjectStore, block_bytes
from daemon.runtime.retarget import capture_lint, check_runs_on, to_device
from daemon.runtime.weights import WeightLayout, pack

if TYPE_CHECKING:
    from daemon.runtime.shared_prefix import PrefixIndex

log = logging.getLogger("escapement.repository")

Runner = Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]


class Binder(Protocol):
    def __call__(self, views: list[torch.Tensor], owner: str | None = None,
                 device: torch.device | None = None) -> Runner: ...


def prefix_key(sid: str) -> str:
    """The controller's estimate key of a shared leading stage (one for every model that has it)."""
    return f"prefix:{sid}"


def tail_key(model_key: str) -> str:
    """The controller's estimate key of a model's stages after its shared leading one."""
    return f"tail:{model_key}"


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of a plan: its identity, and which of the plan's weight entries are its own."""

    sid: str  # graph code, signature and weights' content ids, hashed: equal means interchangeable
    first: int  # its first weight entry in the plan's layout
    count: int  # how many entries it has
    program: Program


class Chain:
    """A plan's runner: each stage's runner on the previous one's outputs (`stages` lets the
    runtime run the first stage for several models at once and the rest for each)."""

    __slots__ = ("stages",)

    def __init__(self, stages: list[Runner]) -> None:
        self.stages = stages

    def __call__(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = tuple(xs)
        for run in self.stages:
            out = run(out)
        return out

    def tail(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Every stage after the first (the prefix's outputs in)."""
        out = tuple(xs)
        for run in self.stages[1:]:
            out = run(out)
        return out


@dataclass(slots=True, eq=False, weakref_slot=True)  # (stage programs are held weakly: _STAGE_PROGRAMS)
class Program:
    spec: ModelSpec
    layout: WeightLayout
    host_tensors: tuple[torch.Tensor, ...]  # per layout entry: the object store's tensor
    cids: tuple[str, ...]  # per layout entry: its content id (entries may repeat one)
    bind_graph: Binder | None  # any device (None for TorchScript files)
    bind_native: Binder | None  # CPU devices: one call without the GIL
    seed_timings: dict[int, float] = field(default_factory=dict)  # batch size -> seconds, host CPU
    _host: Runner | None = field(default=None, init=False, repr=False)  # host_runner, once bound
    graph: torch.fx.GraphModule | None = None  # the exported graph (None for TorchScript files)
    capture_problem: str | None = None  # why a CUDA graph cannot capture it (retarget.capture_lint)
    checked_on: set[str] = field(default_factory=set)  # device types check_device passed on
    # The distinct weight blocks (content id, device bytes), each once, in entry order.
    blocks: tuple[tuple[str, int], ...] = field(init=False)
    packed: torch.Tensor | None = None  # the packed host block, once a CUDA device asked for it
    _pack_lock: threading.Lock = field(default_factory=threading.Lock)
    stages: tuple[Stage, ...] = ()  # a plan of stages (empty: one program)
    # A plan: batch size -> seconds of its first stage and of the rest, host CPU (seeds the
    # controller's per-stage estimates, which plan cross-model batches).
    stage_timings: dict[int, tuple[float, float]] = field(default_factory=dict)
    _structure: str | None = field(default=None, init=False, repr=False)

    @property
    def structure(self) -> str:
        """What its CUDA graphs depend on besides addresses (graph code, weight layout, shapes),
        digested: another program with the same structure, loaded where this one was, can replay
        its graphs (runtime/graph_cache.py). "" where that cannot be told (TorchScript files)."""
        if self._structure is None:
            graphs = [s.program.graph for s in self.stages] if self.stages else [self.graph]
            if any(g is None for g in graphs):
                self._structure = ""
            else:
                spec = self.spec
                shapes = ([(t.name, str(t.datatype), tuple(t.sample_shape)) for t in spec.inputs],
                          [(t.name, str(t.datatype), tuple(t.sample_shape)) for t in spec.outputs],
                          tuple(spec.batch_sizes))
                self._structure = structure_of([g.code for g in graphs if g is not None],
                                               self.layout.entries, shapes)
        return self._structure

    def __post_init__(self) -> None:
        seen: dict[str, int] = {}
        for cid, t in zip(self.cids, self.host_tensors, strict=True):
            if cid not in seen and t.numel():
                seen[cid] = block_bytes(t)
        self.blocks = tuple(seen.items())

    @property
    def host_runner(self) -> Runner:
        """It over the host's copy of its weights, bound at first use: a model only ever served
        from a GPU holds no CPU instance of it (a traced runner per variant was most of what 200
        variants of one backbone held in host memory beyond their weights)."""
        runner = self._host
        if runner is None:
            runner = self._host = self.bind(list(self.host_tensors), native=True)
        return runner

    @host_runner.setter
    def host_runner(self, runner: Runner) -> None:
        self._host = runner

    @property
    def prefix(self) -> str:
        """The identity of its leading stage when it has more than one ("" otherwise): models with
        one prefix may run it once for all their requests."""
        return self.stages[0].sid if len(self.stages) > 1 else ""

    @property
    def weight_bytes(self) -> int:
        """Bytes of the packed block (one copy of every entry, each aligned)."""
        return self.layout.nbytes

    @property
    def block_bytes(self) -> int:
        """Bytes of its distinct blocks: what a device that shares blocks holds for it."""
        return sum(n for _, n in self.blocks)

    @property
    def host_block(self) -> torch.Tensor:
        """The weights packed into one flat uint8 block (CUDA backends page-lock it in place,
        runtime/hostmem.py); made on first use, so hosts without CUDA devices hold no second copy."""
        with self._pack_lock:
            if self.packed is None:
                self.packed = pack([(e.name, t) for e, t in zip(self.layout.entries, self.host_tensors,
                                                                strict=True)])[1]
            return self.packed

    releasers: list[Callable[[str], None]] = field(default_factory=list)

    def bind(self, views: list[torch.Tensor], native: bool, owner: str | None = None,
             device: torch.device | None = None) -> Runner:
        """A runner over `views`; `native` picks the GIL-free runner when there is one. An `owner`
        (a device) keeps one instance and re-points it at each new set of views, so what the
        instance learned on its first calls (TorchScript's profiling) is not paid again. With a
        `device`, the graph's baked devices are rewritten to it (retarget.py)."""
        binder = (self.bind_native or self.bind_graph) if native else (self.bind_graph or self.bind_native)
        assert binder is not None
        return binder(views, owner, device)

    def check_device(self, device: torch.device, batch: int) -> None:
        """Raise ProgramError unless the exported graph, moved to `device`, runs there (checked on
        fake tensors: no device needed). TorchScript files cannot be checked ahead."""
        if self.graph is None or device.type in self.checked_on:
            return  # checked once per program and device type (tens of ms on fake tensors)
        weights = [(e.dtype, e.shape) for e in self.layout.entries]
        inputs = [(t.datatype.tensor_dtype, (batch, *t.sample_shape)) for t in self.spec.inputs]
        args = [weights[i] if i >= 0 else inputs[-i - 1] for i in self._plan()]
        try:
            check_runs_on(to_device(self.graph, device), device, args)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise ProgramError(f"{self.spec.key}: the exported graph cannot run on {device.type}: "
                               f"{type(e).__name__}: {first}") from e
        self.checked_on.add(device.type)

    def _plan(self) -> list[int]:
        return getattr(self.bind_graph, "plan", [])

    def release(self, owner: str) -> None:
        """Drop the owner's instance's references to its views (its weights were unloaded)."""
        for r in self.releasers:
            r(owner)


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


# ------------------------------------------------------------------ TorchScript modules as weightless shells


def _submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    # ScriptModules do not support get_submodule.
    mod = root
    for part in path.split(".") if path else ():
        mod = getattr(mod, part)
    return mod


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False)
            if isinstance(getattr(module, name), torch.nn.Parameter) else value)


def _owned_tensors(module: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(submodule path, attribute, tensor) for every parameter and buffer, tied ones repeated."""
    out = []
    for path, sub in module.named_modules():
        for attr, t in list(sub.named_parameters(recurse=False)) + list(sub.named_buffers(recurse=False)):
            out.append((path, attr, t))
    return out


# Weightless copies of traced modules by structure: variants' heads traced alike (same code, same
# weights' places, dtypes and shapes) share one, as each bind copies it anyway. ~100 KiB of host
# memory a head; alive while a binder holds it.
_SHELLS: weakref.WeakValueDictionary[tuple[object, ...], torch.jit.ScriptModule] = weakref.WeakValueDictionary()


def _code(sub: torch.nn.Module) -> str | None:
    try:
        return str(sub.code)
    except AttributeError:
        return None


def _shell(module: torch.jit.ScriptModule, owned: list[tuple[str, str, torch.Tensor]]) -> torch.jit.ScriptModule:
    """`module` without its weights (each an empty tensor of its dtype): one made before for the
    same structure, or a new copy."""
    key: tuple[object, ...] | None
    try:
        # (a submodule with no method of its own, such as a weights holder the parent's code reads,
        # has no code: its place and its weights' are in the key all the same)
        key = (tuple((path, _code(sub)) for path, sub in module.named_modules()),
               tuple((path, attr, t.dtype, tuple(t.shape)) for path, attr, t in owned))
    except Exception:  # (what cannot be told apart keeps a shell of its own)
        key = None
    if key is not None:
        with _STRUCTURE_LOCK:
            shell = _SHELLS.get(key)
        if shell is not None:
            return shell
    shell = copy.deepcopy(module)
    for path, attr, t in owned:  # drop the shell's own copies of the weights
        _set_tensor(_submodule(shell, path), attr, torch.empty(0, dtype=t.dtype))
    if key is None:
        return shell
    with _STRUCTURE_LOCK:
        return _SHELLS.setdefault(key, shell)


def _script_binder(module: torch.jit.ScriptModule, spec: ModelSpec, slot: Callable[[str, str, torch.Tensor], int]
                   ) -> tuple[Binder, Callable[[str], None]]:
    """A binder that points a weightless copy of `module` at the views, and its releaser."""
    owned = _owned_tensors(module)
    return _binder_over(_shell(module, owned), [(path, attr, slot(path, attr, t)) for path, attr, t in owned],
                        [t.dtype for _, _, t in owned], spec)


def _binder_over(shell: torch.jit.ScriptModule, owners: list[tuple[str, str, int]], dtypes: list[torch.dtype],
                 spec: ModelSpec, keep: object = None) -> tuple[Binder, Callable[[str], None]]:
    """The binder of a weightless traced module: each (path, attribute) of `owners` is pointed at the
    views' slot it names; `keep`: what must live as long as the binder (a cache entry)."""
    empties = {(path, attr): torch.empty(0, dtype=dt) for (path, attr, _), dt in zip(owners, dtypes, strict=True)}
    instances: dict[str, torch.jit.ScriptModule] = {}  # owner -> its instance (one per device)

    def bind(views: list[torch.Tensor], owner: str | None = None, device: torch.device | None = None) -> Runner:
        # A script's baked devices cannot be rewritten; a LOAD on CUDA runs it once to find out.
        inst = instances.get(owner) if owner is not None else None
        if inst is None:
            inst = copy.deepcopy(shell)
            if owner is not None:
                instances[owner] = inst
        for path, attr, s in owners:
            _set_tensor(_submodule(inst, path), attr, views[s])

        # The script's own forward, not the module's call: nn.Module.__call__ adds two Python frames
        # and its hook checks (~4k instructions a run; nothing here registers hooks).
        forward = inst.forward

        def run(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            out = forward(*xs)
            return (out,) if isinstance(out, torch.Tensor) else _as_tuple(out, spec)
        return run

    def release(owner: str) -> None:
        inst = instances.get(owner)
        if inst is not None:
            for path, attr, _ in owners:
                _set_tensor(_submodule(inst, path), attr, empties[(path, attr)])

    bind.keep = keep  # type: ignore[attr-defined]  # (alive as long as the binder)
    return bind, release


# ------------------------------------------------------------------ model.pt2


def _stored(weights: list[tuple[str, torch.Tensor]], store: ObjectStore
            ) -> tuple[WeightLayout, tuple[torch.Tensor, ...], tuple[str, ...]]:
    """The weights' layout, and each weight as the store's tensor with its content id."""
    held = [store.put(t) for _, t in weights]
    return WeightLayout.of(weights), tuple(t for _, t in held), tuple(c for c, _ in held)


def read_exported(spec: ModelSpec) -> torch.export.ExportedProgram:
    from daemon.signature import read_exported_file

    return read_exported_file(spec.path)


def exported_weights(ep: torch.export.ExportedProgram, spec: ModelSpec
                     ) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """The program's weights (name, tensor) in signature order, and its argument plan: per graph
    argument, >= 0 a weight's index, < 0 user input -(k+1). Raises ProgramError for what cannot be served."""
    sig = ep.graph_signature
    weights: list[tuple[str, torch.Tensor]] = []
    plan: list[int] = []
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
    return weights, plan


def _graph_binder(gm: torch.fx.GraphModule, plan: list[int], n_weights: int, spec: ModelSpec) -> Binder:
    """A binder calling the lifted graph `gm` with the weights as arguments, in `plan`'s order."""
    simple = plan == list(range(n_weights)) + [-(k + 1) for k in range(len(plan) - n_weights)]

    def bind_graph(views: list[torch.Tensor], owner: str | None = None,
                   device: torch.device | None = None) -> Runner:
        g = _on_device(gm, device) if device is not None else gm
        if simple:
            def run(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
                return _as_tuple(g(*views, *xs), spec)
        else:
            def run(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
                args = [views[i] if i >= 0 else xs[-i - 1] for i in plan]
                return _as_tuple(g(*args), spec)
        return run

    bind_graph.plan = plan  # type: ignore[attr-defined]
    return bind_graph


def _load_exported(spec: ModelSpec, store: ObjectStore, ep: torch.export.ExportedProgram | None = None,
                   native_runner: bool = True) -> Program:
    ep = ep if ep is not None else read_exported(spec)
    weights, plan = exported_weights(ep, spec)
    key = _exported_structure(ep, weights, plan, spec)
    gm = ep.graph_module
    if key is not None:
        with _STRUCTURE_LOCK:  # programs exported alike (variants' heads) share one graph module
            gm = _GRAPHS.setdefault(key, gm)
    layout, tensors, cids = _stored(weights, store)
    bind_graph = _graph_binder(gm, plan, len(weights), spec)
    native = _trace_binder(ep, spec, layout, key) if native_runner else None
    lint = capture_lint(gm)
    if native is None:
        return Program(spec, layout, tensors, cids, bind_graph, None, graph=gm, capture_problem=lint)
    return Program(spec, layout, tensors, cids, bind_graph, native[0], releasers=[native[1]], graph=gm,
                   capture_problem=lint)


def graph_stage(spec: ModelSpec, gm: torch.fx.GraphModule, weights: list[tuple[str, torch.Tensor]],
                store: ObjectStore, native_runner: bool = True) -> Program:
    """A stage cut out of an exported program (shared_prefix.py): `gm` takes `weights`, then the
    stage's inputs. Its native runner is a trace of the same graph over the same weight slots."""
    layout, tensors, cids = _stored(weights, store)
    plan = list(range(len(weights))) + [-(k + 1) for k in range(len(spec.inputs))]
    bind_graph = _graph_binder(gm, plan, len(weights), spec)
    native = _trace_graph(gm, spec, tensors) if native_runner else None
    lint = capture_lint(gm)
    if native is None:
        return Program(spec, layout, tensors, cids, bind_graph, None, graph=gm, capture_problem=lint)
    return Program(spec, layout, tensors, cids, bind_graph, native[0], releasers=[native[1]], graph=gm,
                   capture_problem=lint)


class _GraphShell(torch.nn.Module):
    """A module holding a lifted graph's weights as buffers `w0..wn`, calling the graph with them:
    what TorchScript traces for a stage cut out of an exported program."""

    def __init__(self, gm: torch.fx.GraphModule, weights: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.gm = gm
        self.n = len(weights)
        for i, t in enumerate(weights):
            self.register_buffer(f"w{i}", t)

    def forward(self, *xs: torch.Tensor) -> object:
        return self.gm(*(getattr(self, f"w{i}") for i in range(self.n)), *xs)


def _trace_graph(gm: torch.fx.GraphModule, spec: ModelSpec, weights: Sequence[torch.Tensor]
                 ) -> tuple[Binder, Callable[[str], None]] | None:
    example = [torch.zeros((min(2, spec.max_batch_size), *t.sample_shape), dtype=t.datatype.tensor_dtype)
               for t in spec.inputs]
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(_GraphShell(gm, weights), tuple(example), check_trace=False, strict=False)
        return _script_binder(traced, spec, lambda path, attr, _t: int(attr[1:]))
    except Exception as e:  # an optimisation, as for whole programs
        log.info("%s: no native runner (%s: %s); CPU devices use the graph runner", spec.key, type(e).__name__, e)
        return None


def _trace_binder(ep: torch.export.ExportedProgram, spec: ModelSpec, layout: WeightLayout,
                  key: tuple[object, ...] | None = None) -> tuple[Binder, Callable[[str], None]] | None:
    """A TorchScript trace of the program over the same weight slots, or None if it cannot be made.
    `key` (_exported_structure): a program exported alike was traced before: its trace serves
    (a variant's head is not traced again: ~50 ms and its garbage each)."""
    slots = {e.name: i for i, e in enumerate(layout.entries)}

    def slot(path: str, attr: str) -> int:
        return slots[f"{path}.{attr}" if path else attr]

    with _STRUCTURE_LOCK:
        done = _TRACED.get(key) if key is not None else None
    if done is None:
        example = [torch.zeros((min(2, spec.max_batch_size), *t.sample_shape), dtype=t.datatype.tensor_dtype)
                   for t in spec.inputs]
        try:
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")  # tracer and deprecation warnings
                traced = torch.jit.trace(ep.module(), tuple(example), check_trace=False, strict=False)
            owned = _owned_tensors(traced)
            done = _Traced(_shell(traced, owned), tuple((path, attr, t.dtype) for path, attr, t in owned))
        except Exception as e:  # tracing is an optimisation: any failure falls back to the graph
            log.info("%s: no native runner (%s: %s); CPU devices use the graph runner", spec.key, type(e).__name__, e)
            return None
        if key is not None:
            with _STRUCTURE_LOCK:
                done = _TRACED.setdefault(key, done)
    try:
        owners = [(path, attr, slot(path, attr)) for path, attr, _ in done.owned]
    except KeyError as e:  # (names the trace gave that the layout lacks: no native runner)
        log.info("%s: no native runner (the trace's weight %s is not the program's)", spec.key, e)
        return None
    return _binder_over(done.shell, owners, [dt for _, _, dt in done.owned], spec, keep=done)


@dataclass(eq=False, slots=True, weakref_slot=True)
class _Traced:
    """A trace's weightless module and its weights' places (path, attribute, dtype)."""

    shell: torch.jit.ScriptModule
    owned: tuple[tuple[str, str, torch.dtype], ...]


# Exported programs by structure (_exported_structure): their graph module and their trace, shared
# by the programs alike while any of them lives. Variants fine-tuned from one model are exported
# alike: 200 heads need one graph and one trace, not 200 (~50 KiB of host memory and ~50 ms each).
_GRAPHS: weakref.WeakValueDictionary[tuple[object, ...], torch.fx.GraphModule] = weakref.WeakValueDictionary()
_TRACED: weakref.WeakValueDictionary[tuple[object, ...], _Traced] = weakref.WeakValueDictionary()
_STRUCTURE_LOCK = threading.Lock()  # (and _SHELLS')
# A graph module's copies for other devices (retarget.to_device), by device; None: itself serves
# there (never the module itself as a value: the entry would keep its key alive).
_MOVED: weakref.WeakKeyDictionary[torch.fx.GraphModule, dict[str, torch.fx.GraphModule | None]] = \
    weakref.WeakKeyDictionary()


def _on_device(gm: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """`gm` as it runs on `device`: made once per graph module and device, so the programs that
    share one graph module (exported alike) share its copies too."""
    where = str(device)
    if where == "cpu":
        return gm
    with _STRUCTURE_LOCK:
        copies = _MOVED.setdefault(gm, {})
        if where in copies:
            got = copies[where]
            return gm if got is None else got
    moved = to_device(gm, device)
    with _STRUCTURE_LOCK:
        got = copies.setdefault(where, None if moved is gm else moved)
    return gm if got is None else got


def _attr(root: object, dotted: str) -> object:
    for part in dotted.split("."):
        root = getattr(root, part, None)
    return root


def _exported_structure(ep: torch.export.ExportedProgram, weights: list[tuple[str, torch.Tensor]],
                        plan: list[int], spec: ModelSpec) -> tuple[object, ...] | None:
    """What a program's graph and trace depend on, besides its weights' values: the graph's code,
    each weight's name, dtype and shape in signature order, the argument plan, and its inputs'
    and outputs' types. None (never shared) where the graph module holds tensors of its own, whose
    values the code does not show (export lifts them into the signature; this is the guard)."""
    gm = ep.graph_module
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()) or any(
            isinstance(_attr(gm, str(n.target)), torch.Tensor) for n in gm.graph.nodes if n.op == "get_attr"):
        return None
    return (gm.code, tuple((n, t.dtype, tuple(t.shape)) for n, t in weights), tuple(plan),
            tuple((t.datatype.name, tuple(t.sample_shape)) for t in (*spec.inputs, *spec.outputs)))


# ------------------------------------------------------------------ a plan of stages


def stage_id(gm: torch.fx.GraphModule, cids: tuple[str, ...], spec: ModelSpec) -> str:
    """A stage's identity: its graph's code, its inputs' and outputs' types and its weights by content."""
    h = hashlib.blake2b(gm.code.encode(), digest_size=16)
    for t in (*spec.inputs, *spec.outputs):
        h.update(f"|{t.datatype.name}{t.sample_shape}".encode())
    h.update("|".join(cids).encode())
    return h.hexdigest()


def _stage_specs(spec: ModelSpec) -> list[ModelSpec]:
    """Each stage's own spec: the model's inputs in, the model's outputs out, what the programs
    record in between (each stage must take what the one before returns)."""
    from daemon.errors import ModelConfigError, SignatureError
    from daemon.model_config import check_model_config
    from daemon.signature import inferred_config

    out: list[ModelSpec] = []
    for i, path in enumerate(spec.stages):
        try:
            cfg = check_model_config(inferred_config(path), spec.name, spec.slo_s * 1e3)
        except (SignatureError, ModelConfigError) as e:
            raise ProgramError(f"{spec.key}: stage {i} ({path.name}): {e}") from None
        inputs = spec.inputs if i == 0 else cfg["inputs"]
        outputs = spec.outputs if i == len(spec.stages) - 1 else cfg["outputs"]
        if i > 0:
            before = [(t.datatype, t.sample_shape) for t in out[-1].outputs]
            if before != [(t.datatype, t.sample_shape) for t in inputs]:
                raise ProgramError(f"{spec.key}: stage {i} ({path.name}) takes "
                                   f"{[(t.datatype.name, t.sample_shape) for t in inputs]}, but stage {i - 1} returns "
                                   f"{[(d.name, s) for d, s in before]}")
        out.append(ModelSpec(f"{spec.name}.stage{i}", spec.version, path, "pt2", inputs, outputs,
                             spec.max_batch_size, spec.slo_s))
    return out


# Stage programs read from files, per object store: variants that list one backbone file share one
# program for it (its graph, its trace, its tensors), read once; alive while a plan holds it.
_STAGE_PROGRAMS: weakref.WeakKeyDictionary[ObjectStore, weakref.WeakValueDictionary[tuple[object, ...], Program]] = \
    weakref.WeakKeyDictionary()
_STAGE_LOCK = threading.Lock()


def _stage_program(s: ModelSpec, store: ObjectStore, native_runner: bool) -> Program:
    """A stage's program: read from its file, or the one read before from the same file (same
    size and modification time) with the same inputs, outputs and largest batch. Reading the
    backbone again for each of 200 variants took most of their start-up (torch.export.load, the
    weights hashed, a TorchScript trace, every time)."""
    st = s.path.stat()
    key = (str(s.path.resolve()), st.st_size, st.st_mtime_ns, native_runner, s.max_batch_size,
           tuple((t.datatype.name, tuple(t.sample_shape)) for t in s.inputs),
           tuple((t.datatype.name, tuple(t.sample_shape)) for t in s.outputs))
    with _STAGE_LOCK:
        held = _STAGE_PROGRAMS.setdefault(store, weakref.WeakValueDictionary())
        program = held.get(key)
    if program is None:
        program = _load_exported(s, store, native_runner=native_runner)
        with _STAGE_LOCK:
            program = held.setdefault(key, program)
    return program


def _load_staged(spec: ModelSpec, store: ObjectStore, native_runner: bool = True) -> Program:
    return plan_of(spec, [_stage_program(s, store, native_runner) for s in _stage_specs(spec)])


def plan_of(spec: ModelSpec, programs: list[Program], sids: Sequence[str | None] = ()) -> Program:
    """One program made of `programs` run in turn (a plan of stages); `sids` may give a stage's
    identity (else it is its graph's, stage_id)."""
    stages: list[Stage] = []
    entries: list[tuple[str, torch.Tensor]] = []
    first = 0
    for i, p in enumerate(programs):
        assert p.graph is not None
        sid = sids[i] if i < len(sids) else None
        stages.append(Stage(sid or stage_id(p.graph, p.cids, p.spec), first, len(p.layout.entries), p))
        entries.extend((f"s{i}.{e.name}", t) for e, t in zip(p.layout.entries, p.host_tensors, strict=True))
        first += len(p.layout.entries)
    layout = WeightLayout.of(entries)
    tensors = tuple(t for p in programs for t in p.host_tensors)
    cids = tuple(c for p in programs for c in p.cids)

    def binder(native: bool) -> Binder:
        def bind(views: list[torch.Tensor], owner: str | None = None, device: torch.device | None = None) -> Runner:
            return Chain([st.program.bind(views[st.first : st.first + st.count], native, owner, device)
                          for st in stages])
        return bind

    releasers = [r for p in programs for r in p.releasers]
    native = binder(True) if all(p.bind_native is not None for p in programs) else None
    problem = next((p.capture_problem for p in programs if p.capture_problem), None)
    return Program(spec, layout, tensors, cids, binder(False), native, releasers=releasers,
                   capture_problem=problem, stages=tuple(stages))


# ------------------------------------------------------------------ model.ts


def _load_torchscript(spec: ModelSpec, store: ObjectStore) -> Program:
    with warnings.catch_warnings():
        # torch 2.13 deprecates TorchScript; existing .ts models are still served.
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(spec.path), map_location="cpu").eval()
    log.info("%s: TorchScript is deprecated upstream; prefer model.pt2 (torch.export)", spec.key)
    ids: dict[int, int] = {}  # unique tensors by identity, so tied weights share one slot
    weights: list[tuple[str, torch.Tensor]] = []
    for path, attr, t in _owned_tensors(module):
        if id(t) not in ids:
            ids[id(t)] = len(weights)
            weights.append((f"{path}.{attr}" if path else attr, t))
    layout, tensors, cids = _stored(weights, store)
    bind, release = _script_binder(module, spec, lambda _p, _a, t: ids[id(t)])
    return Program(spec, layout, tensors, cids, None, bind, releasers=[release])


# ------------------------------------------------------------------ loading and checking


def zeros_batch(spec: ModelSpec, batch: int) -> list[torch.Tensor]:
    return [torch.zeros((batch, *t.sample_shape), dtype=t.datatype.tensor_dtype) for t in spec.inputs]


def _probe_batch(spec: ModelSpec, batch: int) -> list[torch.Tensor]:
    """Inputs that exercise every weight (random values; zeros would hide a wrong native runner)."""
    g = torch.Generator().manual_seed(batch)
    out = []
    for t in spec.inputs:
        shape = (batch, *t.sample_shape)
        if t.datatype.tensor_dtype.is_floating_point:
            out.append(torch.rand(shape, generator=g).to(t.datatype.tensor_dtype))
        else:
            out.append(torch.zeros(shape, dtype=t.datatype.tensor_dtype))
    return out


def check_outputs(spec: ModelSpec, outs: tuple[torch.Tensor, ...], batch: int) -> None:
    if len(outs) != len(spec.outputs):
        raise ProgramError(f"{spec.key}: the model returned {len(outs)} outputs but config.toml lists "
                           f"{len(spec.outputs)}")
    for o, t in zip(spec.outputs, outs, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ProgramError(f"{spec.key}: output {o.name} is {type(t).__name__}, not a tensor")
        if t.dtype != o.datatype.tensor_dtype:
            raise ProgramError(f"{spec.key}: output {o.name} is {t.dtype} but config.toml says "
                               f"{o.datatype.name}")
        want = (batch, *o.sample_shape)
        if tuple(t.shape) != want:
            raise ProgramError(f"{spec.key}: output {o.name} has shape {tuple(t.shape)} for a batch of "
                               f"{batch}; config.toml implies {want}")


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype
        and (torch.equal(x, y) if not x.is_floating_point() else torch.allclose(x, y, rtol=1e-4, atol=1e-5))
        for x, y in zip(a, b, strict=True))


def _native_agrees(spec: ModelSpec, native: Runner, xs: list[torch.Tensor], reference: tuple[torch.Tensor, ...],
                   batch: int) -> bool:
    try:
        outs = native(xs)
        check_outputs(spec, outs, batch)
    except Exception:
        return False
    return _same(outs, reference)


# Outputs and seconds of shared first stages on the probe batches (_probe_batch: the same inputs
# for every plan): 200 variants of one backbone each ran it a dozen times to check themselves.
_FIRST_RUNS: OrderedDict[tuple[str, str, int], tuple[tuple[torch.Tensor, ...], float]] = OrderedDict()
_FIRST_RUNS_MAX = 64
_FIRST_LOCK = threading.Lock()


class _MemoFirst:
    """A plan's first stage on the probe batches, run once per stage identity (its graph, its
    weights by content, its inputs and outputs: stage_id), runner kind and batch size, then
    answered from the memo: the same inputs through the same computation give the same outputs.
    Only load_program's checks call it, and only with _probe_batch's inputs."""

    __slots__ = ("kind", "run", "sid")

    def __init__(self, sid: str, kind: str, run: Runner) -> None:
        self.sid, self.kind, self.run = sid, kind, run

    def __call__(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        key = (self.sid, self.kind, int(xs[0].shape[0]) if xs else 0)
        with _FIRST_LOCK:
            hit = _FIRST_RUNS.get(key)
        if hit is not None:  # (copies: a stage after it may write its inputs in place)
            return tuple(t.clone() for t in hit[0])
        self.run(xs)  # (the first run initialises lazily; the second is the one timed)
        t0 = time.perf_counter()
        outs = tuple(self.run(xs))
        with _FIRST_LOCK:
            _FIRST_RUNS[key] = (outs, time.perf_counter() - t0)
            while len(_FIRST_RUNS) > _FIRST_RUNS_MAX:
                _FIRST_RUNS.popitem(last=False)
        return outs

    def seconds(self, b: int) -> float:
        with _FIRST_LOCK:
            hit = _FIRST_RUNS.get((self.sid, self.kind, b))
        return hit[1] if hit is not None else 0.0


def _memo_first(chain: Runner | None, sid: str, kind: str) -> Runner | None:
    return Chain([_MemoFirst(sid, kind, chain.stages[0]), *chain.stages[1:]]) if isinstance(chain, Chain) else chain


def load_program(spec: ModelSpec, store: ObjectStore = STORE, prefixes: PrefixIndex | None = None,
                 native_runner: bool = True) -> Program:
    """Read the model file into host memory (its weights into `store`: each distinct tensor once)
    and check it against its config by running it. A single-program model read ahead into
    `prefixes` (default: the process's, shared_prefix.INDEX) is split at the longest leading stage
    it shares with another model there. `native_runner` off (no CPU device serves it): no
    TorchScript trace is made or checked, which is most of a big model's read on a GPU host.

    Runs batch 1, 2 and the largest batch size on the host CPU: this validates the shapes,
    checks the native runner against the graph, and gives first timings to seed estimates.
    """
    from daemon.runtime.shared_prefix import INDEX

    index = prefixes if prefixes is not None else INDEX
    try:
        if spec.stages:
            program = _load_staged(spec, store, native_runner)
        elif spec.format == "pt2":
            read = index.take(spec)  # read ahead when detection is on (runtime.detect_shared_prefix)
            split = index.split(spec, read, store, native_runner) if read is not None else None
            program = split or _load_exported(spec, store, read.ep if read is not None else None, native_runner)
        else:
            program = _load_torchscript(spec, store)
    except ProgramError:
        raise
    except Exception as e:  # torch raises many types for a bad file
        raise ProgramError(f"{spec.key}: cannot load {spec.path.name}: {type(e).__name__}: {e}") from e
    views = list(program.host_tensors)
    graph = program.bind_graph(views) if program.bind_graph else None
    native = program.bind_native(views) if program.bind_native else None
    if program.stages:  # a plan: its first stage's probe runs are done once for every plan with it
        graph = _memo_first(graph, program.stages[0].sid, "graph")
        native = _memo_first(native, program.stages[0].sid, "native")
    sizes = sorted({1, min(2, spec.max_batch_size), spec.max_batch_size})
    with torch.inference_mode():
        for b in sizes:
            xs = _probe_batch(spec, b)
            try:
                reference = graph(xs) if graph else None
                if reference is not None:
                    check_outputs(spec, reference, b)
                if native is not None:
                    if reference is None:
                        check_outputs(spec, native(xs), b)
                    elif not _native_agrees(spec, native, xs, reference, b):
                        # a trace can bake shapes or control flow the graph keeps dynamic
                        log.warning("%s: the native runner disagrees with the graph at batch %d; CPU devices "
                                    "use the graph runner", spec.key, b)
                        program.bind_native = native = None
                        program.host_runner = program.bind(views, native=False)
                runner = native or graph
                assert runner is not None
                if isinstance(runner, Chain) and isinstance(runner.stages[0], _MemoFirst):
                    mid = runner.stages[0](xs)
                    t1 = time.perf_counter()
                    runner.tail(mid)
                    head = runner.stages[0].seconds(b)
                    program.stage_timings[b] = (head, time.perf_counter() - t1)
                    program.seed_timings[b] = sum(program.stage_timings[b])
                else:
                    t0 = time.perf_counter()
                    runner(xs)
                    program.seed_timings[b] = time.perf_counter() - t0
            except ProgramError:
                raise
            except Exception as e:
                raise ProgramError(f"{spec.key}: running a batch of {b} failed "
                                   f"({type(e).__name__}: {e}); do the inputs in config.toml match the model, "
                                   "and was the batch dimension exported as dynamic?") from e
    return program
