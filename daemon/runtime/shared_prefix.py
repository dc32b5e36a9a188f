"""A shared prefix found inside single-program models: plain models split into stages at load.

Fine-tuned variants exported whole (one torch.export program each, as a user exports them)
begin with the same layers over the same weights. Before a repository's models are loaded, the
model manager reads their programs ahead (`PrefixIndex.read_ahead`, with
`runtime.detect_shared_prefix`) and this module walks each exported graph from its inputs,
op by op, hashing what it has seen so far without names: each op's target, its arguments as
earlier ops (by position), user inputs (by position), weights (by content id) and constants.
A *cut* is a point after an op where that op's output is the only value later ops still need
(weights aside) and is a tensor with the batch dimension first: a prefix that ends at a single
tensor. Models whose cut hashes match begin with the same computation over the same weights.

When a model is loaded (`program.load_program`) and one of its cuts is also another model's, it
is split at its longest such cut into two stages, each a graph of the exported program's own
ops (fx node copies, no re-export: the same aten calls, so the outputs are bit-identical to the
whole program's), and served exactly as a model declared as a plan of stages: the first
stage's identity is the cut's hash, shared by every model that has it, so the controller runs
it once for their queued requests (cross-model batching) and the prefix cache keeps its outputs.

Reads ahead are bounded in count; cut hashes of models since unloaded stay known (a model split
at a cut no served model shares still serves its exact outputs, as a plan of two stages).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import fx

from daemon.datatypes import BY_TORCH, WIRE_ONLY
from daemon.errors import ProgramError
from daemon.model import ModelSpec, TensorSpec
from daemon.runtime.objstore import STORE, ObjectStore
from daemon.runtime.program import Program, exported_weights, graph_stage, plan_of, read_exported

log = logging.getLogger("escapement.repository")

MAX_READS = 512  # programs held read ahead of their load (more are read again at load)
MAX_PENDING = 65536  # models read ahead and not yet loaded, programs or not (the oldest are forgotten)
PREFIX_NAME = "PREFIX__0"  # the tensor between the two stages of a split model


@dataclass(frozen=True, slots=True)
class Cut:
    node: str  # the graph node whose output ends the prefix
    key: str  # the prefix's hash (name-free, weights by content id): equal means the same computation
    weights: int  # weight arguments the prefix uses


@dataclass(slots=True)
class Read:
    ep: torch.export.ExportedProgram | None  # None once dropped (MAX_READS): read again at load
    cuts: tuple[Cut, ...]


def cuts(ep: torch.export.ExportedProgram, spec: ModelSpec, cids: list[str], plan: list[int]) -> tuple[Cut, ...]:
    """The points of `ep`'s graph where a prefix ends at a single tensor, in graph order."""
    nodes = list(ep.graph.nodes)
    holders = [n for n in nodes if n.op == "placeholder"]
    token: dict[fx.Node, str] = {}
    for n, p in zip(holders, plan, strict=True):
        token[n] = f"w:{cids[p]}" if p >= 0 else f"x:{-p - 1}"
    weights = {n for n, p in zip(holders, plan, strict=True) if p >= 0}
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i
    h = hashlib.blake2b(digest_size=16)
    for t in spec.inputs:
        h.update(f"{t.datatype.name}{t.sample_shape}|".encode())
    live: set[fx.Node] = {n for n in holders if n not in weights and n in last}
    used: set[fx.Node] = set()
    out: list[Cut] = []
    ops = 0
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            continue
        if n.op != "call_function":
            break  # the output (or an op form this walk does not know: no cut past it)
        token[n] = f"n:{ops}"
        ops += 1

        def norm(a: object) -> str:
            if isinstance(a, fx.Node):
                return token[a]
            if isinstance(a, list | tuple):
                return "(" + ",".join(norm(x) for x in a) + ")"
            if isinstance(a, dict):
                return "{" + ",".join(f"{k}={norm(v)}" for k, v in sorted(a.items())) + "}"
            return repr(a)

        h.update(f"{n.target}{norm(n.args)}{norm(n.kwargs)};".encode())
        used.update(a for a in n.all_input_nodes if a in weights)
        live = {v for v in live if last.get(v, -1) > i}
        if n in last and last[n] > i:
            live.add(n)
        if live == {n} and used and _batched(n) is not None and last[n] < len(nodes) - 1:
            out.append(Cut(n.name, h.hexdigest(), len(used)))
    return tuple(out)


def _batched(n: fx.Node) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """(dtype, sample shape) of a node's output that is one tensor with the batch dimension (symbolic)
    first and fixed sample dimensions, of a type the runtime's stages can hand on; else None."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 1 or isinstance(val.shape[0], int):
        return None
    sample = tuple(val.shape[1:])
    if not all(isinstance(d, int) for d in sample):
        return None
    dt = BY_TORCH.get(val.dtype)
    if dt is None or dt.name in WIRE_ONLY:
        return None
    return val.dtype, sample


class PrefixIndex:
    """Which models have which cuts, and programs read ahead of their load; thread-safe (the model
    manager reads and loads in worker threads)."""

    def __init__(self, max_reads: int = MAX_READS) -> None:
        self.max_reads = max_reads
        self._lock = threading.Lock()
        self._reads: OrderedDict[str, Read] = OrderedDict()
        self._owners: dict[str, set[str]] = {}  # cut key -> models that have it

    def read_ahead(self, specs: Iterable[ModelSpec], store: ObjectStore = STORE) -> int:
        """Read the single-program models among `specs` and note their cuts (before any of them loads,
        so that the first one loaded already knows the others share its prefix); how many were read."""
        n = 0
        for spec in specs:
            if spec.stages or spec.format != "pt2":
                continue
            try:
                ep = read_exported(spec)
                found = self._cuts(ep, spec, store)
            except Exception as e:  # (its load reports what is wrong with it)
                log.debug("%s: not read ahead: %s", spec.key, e)
                continue
            with self._lock:
                for c in found:
                    self._owners.setdefault(c.key, set()).add(spec.key)
                self._reads[spec.key] = Read(ep, found)
                self._reads.move_to_end(spec.key)
                kept = [r for r in self._reads.values() if r.ep is not None]
                for r in kept[: max(0, len(kept) - self.max_reads)]:
                    r.ep = None  # the oldest: read again at load
                while len(self._reads) > MAX_PENDING:  # read ahead and never loaded (a stop, say)
                    self._reads.popitem(last=False)
            n += 1
        return n

    @staticmethod
    def _cuts(ep: torch.export.ExportedProgram, spec: ModelSpec, store: ObjectStore) -> tuple[Cut, ...]:
        weights, plan = exported_weights(ep, spec)
        cids = []
        for name, t in weights:  # into the store now: a read-ahead program holds no second copy of a block
            cid, held = store.put(t)
            cids.append(cid)
            if name in ep.state_dict:
                # a parameter stays one (ep.module(), which the native runner's trace calls, asserts
                # it; a plain tensor there cost the model its GIL-free runner)
                ep.state_dict[name] = (torch.nn.Parameter(held, requires_grad=False)
                                       if isinstance(t, torch.nn.Parameter) else held)
            elif name in ep.constants:
                ep.constants[name] = held
        return cuts(ep, spec, cids, plan)

    def take(self, spec: ModelSpec) -> Read | None:
        """The read-ahead of `spec` (None when it was not read ahead), its program read again if it was dropped."""
        with self._lock:
            read = self._reads.pop(spec.key, None)
        if read is not None and read.ep is None:
            read.ep = read_exported(spec)
        return read

    def shared(self, spec: ModelSpec, read: Read) -> Cut | None:
        """Its longest cut that another model has too."""
        with self._lock:
            for c in reversed(read.cuts):
                if self._owners.get(c.key, set()) - {spec.key}:
                    return c
        return None

    def split(self, spec: ModelSpec, read: Read, store: ObjectStore = STORE,
              native_runner: bool = True) -> Program | None:
        """`spec` as a plan of two stages at its longest shared cut; None if it shares none."""
        cut = self.shared(spec, read)
        if cut is None or read.ep is None:
            return None
        try:
            return split_at(read.ep, spec, cut, store, native_runner)
        except ProgramError:
            raise
        except Exception as e:  # splitting is an optimisation: the whole program serves as it is
            log.warning("%s: not split at its shared prefix (%s: %s); served whole", spec.key, type(e).__name__, e)
            return None

    def owners(self, cut_key: str) -> set[str]:
        """The models (version keys) known to have the cut, loaded since or not."""
        with self._lock:
            return set(self._owners.get(cut_key, ()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._reads)


def split_at(ep: torch.export.ExportedProgram, spec: ModelSpec, cut: Cut, store: ObjectStore,
             native_runner: bool = True) -> Program:
    """`ep` as two stages: its ops up to `cut.node`, then the rest on that node's output."""
    weights, plan = exported_weights(ep, spec)
    nodes = list(ep.graph.nodes)
    at = next(i for i, n in enumerate(nodes) if n.name == cut.node)
    holders = [n for n in nodes if n.op == "placeholder"]
    weight_of = {n: weights[p] for n, p in zip(holders, plan, strict=True) if p >= 0}
    inputs = sorted((n for n, p in zip(holders, plan, strict=True) if p < 0),
                    key=lambda n: -plan[holders.index(n)])  # user inputs in their order
    head = [n for n in nodes[: at + 1] if n.op == "call_function"]
    rest = [n for n in nodes[at + 1 :] if n.op == "call_function"]
    output = nodes[-1]
    assert output.op == "output"
    batched = _batched(nodes[at])
    assert batched is not None
    dtype, sample = batched
    mid = TensorSpec(PREFIX_NAME, BY_TORCH[dtype], (-1, *sample))

    Weights = list[tuple[str, torch.Tensor]]

    def stage(ops: list[fx.Node], ins: list[fx.Node], result: object) -> tuple[fx.GraphModule, Weights]:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        used = [n for n in holders if n in weight_of and any(n in op.all_input_nodes for op in ops)]
        for n in [*used, *ins]:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
        for n in ops:
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output(fx.node.map_arg(result, lambda a: env[a]))  # type: ignore[type-var, arg-type]
        g.lint()
        return fx.GraphModule(torch.nn.Module(), g), [weight_of[n] for n in used]

    gm0, w0 = stage(head, inputs, (nodes[at],))
    gm1, w1 = stage(rest, [nodes[at]], output.args[0])
    spec0 = ModelSpec(f"{spec.name}.stage0", spec.version, spec.path, "pt2", spec.inputs, (mid,),
                      spec.max_batch_size, spec.slo_s)
    spec1 = ModelSpec(f"{spec.name}.stage1", spec.version, spec.path, "pt2", (mid,), spec.outputs,
                      spec.max_batch_size, spec.slo_s)
    first = graph_stage(spec0, gm0, w0, store, native_runner)
    program = plan_of(spec, [first, graph_stage(spec1, gm1, w1, store, native_runner)], sids=[cut.key])
    log.info("%s: split at its shared prefix (%d ops, %d weights, %d bytes of them)", spec.key, len(head),
             cut.weights, first.block_bytes)
    return program


INDEX = PrefixIndex()
