"""The CUDA backend, written once against the device seam (devapi.py): a real GPU through
`torchcuda.TorchCuda`, or the CPU stand-in `emucuda.EmuCuda` in tests.

Memory. At start-up the backend allocates its weight arena once: the device's budget less
the workspace reserve. Each resident model is one extent of it (arena.py) holding its weights
and its static IO buffers (inputs and outputs at the largest batch size). A plan of stages whose
leading stage other plans share (Pretzel: variants of one backbone) holds that stage's weights
in an extent of their own, one per device for every resident plan that has the stage, freed with
the last of them, and their static inputs in another (`input_block`: INFERs run one at a time);
its extent holds the rest (`prefix_bytes`). CUDA graphs of every
model share one graph pool, charged to the workspace reserve: only one inference runs on a
device at a time, and a graph's outputs are copied into the model's static output buffers,
so the pool holds only temporaries and its size is the largest model's, not the sum. torch's
caching allocator is never on the data path.

Streams. `load` copies weights, `h2d` copies inputs, `exec` runs models, `d2h` copies
outputs, `capture` warms up and captures graphs. A LOAD copies a pinned weight block in one
copy, queued whole (a pageable one through a pinned staging ring, in chunks with at most two in
flight); where one copy engine serves the load and h2d streams in order, an INFER's input copy
issued meanwhile waits for the rest of it. An UNLOAD records fences on every stream that
touched the extent; the load stream waits for them before any later copy, so an extent is
reused only after the device finished with it (without a host wait).

INFER. The host writes the batch into pinned staging memory, one copy moves it into the
static inputs, the exec stream replays the batch size's graph (or runs the model eagerly and
copies its outputs into the static outputs), one copy per output moves the filled rows into
a pinned slot of the model's output ring, and the host waits for that with a deadline. The
outputs handed to the response are views of the ring slot; the slot is reused only once
every view of it is gone (the response was written). Events are allocated once; an INFER
allocates nothing.

Faults. A CUDA error leaves the context unusable: the backend marks itself failed, and every
later action fails at once. A wait past its deadline (a hung kernel) does the same.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from daemon.errors import ConfigError
from daemon.model import TensorSpec
from daemon.request import InferenceRequest
from daemon.runtime.arena import Arena, Extent, Move, aligned
from daemon.runtime.backend import Fill, IOBuffers, NoMemory, Resident
from daemon.runtime.devapi import Buffer, CaptureError, DeviceApi, DeviceFault, Event, Graph, Region, Where
from daemon.runtime.devices import Device
from daemon.runtime.graph_cache import GraphCache, GraphSet, Retargetable, StageKey
from daemon.runtime.hostmem import HostPins, PinnedPool, pages
from daemon.runtime.prefixcache import PrefixCache, PrefixPlan, plan_prefix
from daemon.runtime.program import Chain, Program, prefix_key, tail_key

log = logging.getLogger("escapement.cuda")

LOAD_CHUNK = 4 << 20  # bytes per weight copy through the staging ring (pageable blocks), and per move
LOAD_INFLIGHT = 2  # staged weight chunks queued on the copy engine at once
# Unloaded models' graph sets kept for reuse (graph_cache.py): each holds a graph exec per batch
# size (host memory, and device memory only inside the shared graph pool), so dozens cost little.
PARKED_GRAPH_SETS = 64
# An INFER sleeps this share of its batch size's last device time before polling for its end,
# when that comes to more than MIN_SLEEP_S (shorter ones are caught by the poll's first spin).
SLEEP_THROUGH = 0.7
MIN_SLEEP_S = 200e-6
VIEW_SETS = 128  # weight views kept by (structure, extent offset): tensor objects over the arena only
PINNED_POOL_BUFFERS = 1024  # pooled IO buffers at most (besides the pinned budget, which evicts them)
OUTPUT_RING = 4  # pinned output slots per model (responses not yet written hold theirs)


def _numpy_typestr(dtype: torch.dtype) -> str:
    return np.dtype(torch.empty(0, dtype=dtype).numpy().dtype).str


class _Lease:
    """The owner of output arrays that are views of a ring slot: the slot is free again once the
    last view of it is gone (the response that carries them was written)."""

    __slots__ = ("__array_interface__", "__weakref__", "keep")

    def __init__(self, tensor: torch.Tensor, offset: int, shape: tuple[int, ...], typestr: str) -> None:
        self.keep = tensor  # the slot's memory outlives an UNLOAD while a response still holds it
        self.__array_interface__ = {"data": (tensor.data_ptr() + offset, False), "shape": shape,
                                    "typestr": typestr, "version": 3}


class OutputRing:
    """Pinned output slots of one model, each holding every output at the largest batch size,
    plus one spare slot that is never lent (used, and copied out of, when every slot is lent)."""

    def __init__(self, slots: list[Buffer], spare: Buffer, offsets: list[int], shapes: list[tuple[int, ...]],
                 dtypes: list[torch.dtype]) -> None:
        self.slots = slots
        self.spare = spare
        self.offsets = offsets
        self.shapes = shapes  # per output: the sample shape
        self.typestrs = [_numpy_typestr(d) for d in dtypes]
        self.row_bytes = [int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
        self._lent = [0] * len(slots)  # live views per slot (0: free)
        self._lock = threading.Lock()
        self.overflows = 0

    def acquire(self) -> int:
        """A free slot's index, or -1 for the spare."""
        with self._lock:
            for i, n in enumerate(self._lent):
                if n == 0:
                    self._lent[i] = -1  # taken, not yet lent
                    return i
        self.overflows += 1
        return -1

    def buffer(self, slot: int) -> Buffer:
        return self.spare if slot < 0 else self.slots[slot]

    def regions(self, slot: int, rows: int) -> list[Region]:
        buf = self.buffer(slot)
        return [buf.region(off, rows * rb) for off, rb in zip(self.offsets, self.row_bytes, strict=True)]

    def hand_out(self, slot: int, rows: int) -> tuple[np.ndarray, ...]:
        buf = self.buffer(slot)
        outs: list[np.ndarray] = []
        for off, shape, ts in zip(self.offsets, self.shapes, self.typestrs, strict=True):
            a = np.asarray(_Lease(buf.tensor, off, (rows, *shape), ts))
            outs.append(a.copy() if slot < 0 else a)
        if slot >= 0:
            with self._lock:
                self._lent[slot] = len(outs)
            for a in outs:
                weakref.finalize(a.base, self._returned, slot)
        return tuple(outs)

    def _returned(self, slot: int) -> None:
        with self._lock:
            self._lent[slot] -= 1

    def cancel(self, slot: int) -> None:
        """A slot taken for an INFER that failed before handing it out."""
        if slot >= 0:
            with self._lock:
                self._lent[slot] = 0

    @property
    def lent(self) -> int:
        with self._lock:
            return sum(1 for n in self._lent if n != 0)

    def lent_buffers(self) -> list[Buffer]:
        with self._lock:
            return [b for b, n in zip(self.slots, self._lent, strict=True) if n != 0]


@dataclass(slots=True, eq=False)
class CudaResident:
    """What a model holds on a CUDA device (Resident.state)."""

    extent: Extent
    weights: Region  # its own weights (a plan's after its shared leading stage's)
    inputs: list[Region]  # static inputs at the largest batch size
    outputs: list[Region]  # static outputs at the largest batch size
    in_row_bytes: list[int]
    out_row_bytes: list[int]
    staging: dict[int, Buffer] = field(default_factory=dict)  # batch size -> pinned inputs
    staging_offsets: dict[int, list[int]] = field(default_factory=dict)  # batch size -> each input's offset
    ring: OutputRing | None = None
    steps: dict[int, Callable[[], None]] = field(default_factory=dict)  # batch size -> the eager kernel
    graphs: dict[int, Graph] = field(default_factory=dict)
    # batch size -> events its graph records as its first and last nodes: the graph's own device
    # time, where events around the replay would also count the host's launch of it
    graph_timing: dict[int, tuple[Event, Event]] = field(default_factory=dict)
    kernels: dict[int, Retargetable] = field(default_factory=dict)  # batch size -> what its graph was captured from
    # A plan whose first stage is shared: that stage's outputs at the largest batch size, and per
    # (0: first stage, 1: the rest; batch size) an eager kernel, its graph and what it was captured from
    mids: list[Region] = field(default_factory=list)
    mid_row_bytes: list[int] = field(default_factory=list)
    stage_steps: dict[StageKey, Callable[[], None]] = field(default_factory=dict)
    stage_graphs: dict[StageKey, Graph] = field(default_factory=dict)
    stage_kernels: dict[StageKey, Retargetable] = field(default_factory=dict)
    # (bytes asked for, buffer): pooled or unpinned at UNLOAD
    pinned: list[tuple[int, Buffer]] = field(default_factory=list)
    pinned_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by an INFER, or by a compaction moving it
    last_s: dict[int, float] = field(default_factory=dict)  # batch size -> a low estimate of its device time
    # A plan whose leading stage's weights are held apart, shared (SharedStage): its stage_key and
    # those weights' region ("" and None for other models); and its static inputs' block, held
    # apart too (input_block): its id, its region and its lock
    shared_sid: str = ""
    shared: Region | None = None
    inputs_sid: str = ""
    shared_inputs: Region | None = None
    inputs_lock: threading.Lock | None = None

    @property
    def weight_regions(self) -> list[Region]:
        """Every region its weights are in (what its kernels read)."""
        return [self.weights] if self.shared is None else [self.shared, self.weights]


@dataclass(slots=True, eq=False)
class SharedStage:
    """A leading stage's weights on a device, or its plans' static inputs, held once for every
    resident plan that has it."""

    extent: Extent
    holders: int
    # (an input block's: held while something reads or writes its bytes, an INFER or a LOAD's
    # first runs, so a LOAD of one variant never reads what another's INFER is copying in)
    lock: threading.Lock = field(default_factory=threading.Lock)


def low_estimate(prev: float, seconds: float) -> float:
    """What an INFER may sleep through next time: it follows a faster device at once and a slower
    one by 10% an INFER, so one slow INFER never makes the next sleep long."""
    return seconds if prev <= 0 else min(seconds, prev * 1.1)

def _zero(tensors: list[torch.Tensor]) -> Callable[[], None]:
    def zero() -> None:
        for t in tensors:
            t.zero_()
    return zero


def _unbound(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    raise RuntimeError("the model is not bound to the device")


def _sample_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def mid_specs(program: Program) -> tuple[TensorSpec, ...]:
    """What a plan's shared first stage hands to the rest (it has a static place in the extent, so
    each part can be a graph); nothing for other programs."""
    return program.stages[0].program.spec.outputs if program.prefix else ()


def prefix_bytes(program: Program) -> int:
    """Bytes of a plan's leading stage's weights, the start of its packed block (packed as the
    stage alone packs them: every plan with this stage holds the same bytes there); 0 for a
    program that is not a plan of several stages, or whose leading stage has no weights."""
    if not program.prefix:
        return 0
    n, entries = program.stages[0].count, program.layout.entries
    if not any(e.nbytes for e in entries[:n]):
        return 0
    return entries[n].offset if n < len(entries) else program.layout.nbytes


def stage_key(program: Program) -> str:
    """What a shared stage's extent is held under: the stage's identity and where each of its weights
    lies in those bytes. The identity names the weights by content but not their order (a prefix
    found in whole models, runtime/shared_prefix.py, is the same computation whatever order its
    layers were registered in), and a plan reads the bytes at its own layout's offsets: two plans
    share the bytes only where both say the same content at the same place."""
    n = program.stages[0].count
    h = hashlib.blake2b(program.prefix.encode(), digest_size=12)
    for cid, e in zip(program.cids[:n], program.layout.entries[:n], strict=True):
        h.update(f"|{cid}@{e.offset}+{e.nbytes}".encode())
    return f"stage:{h.hexdigest()}"


def shared_block(program: Program) -> tuple[str, int] | None:
    """The block a CUDA device holds once for every plan with this leading stage laid out alike, as
    the controller's memory map counts it (controller/memory.py): (its id, its bytes in the arena)."""
    n = prefix_bytes(program)
    return (stage_key(program), aligned(n)) if n else None


def input_block(program: Program) -> tuple[str, int, list[int]] | None:
    """The static inputs a CUDA device holds once for every plan with this shared leading stage and
    these inputs at this largest batch size: (its id, its bytes in the arena, each input's offset
    in it); None where the plan has no shared stage (it keeps its inputs in its own extent).

    Variants of one backbone take the same inputs, and at ResNet sizes those buffers were most of
    what a variant held of its own (4.8 of 4.9 MB on the H200, 3x224x224 at batch 8). Sharing
    them is safe because INFERs on a device run one at a time (its one INFER lane) and each copies
    its rows in before its kernels read them; a LOAD's first runs read them under the block's
    lock (`SharedStage.lock`)."""
    if not prefix_bytes(program):
        return None
    spec = program.spec
    offsets, off = [], 0
    rows = [spec.max_batch_size * _sample_bytes(t.sample_shape, t.datatype.tensor_dtype) for t in spec.inputs]
    for n in rows:
        offsets.append(off)
        off += aligned(n)
    return f"inputs:{stage_key(program)}:{','.join(map(str, rows))}", aligned(max(off, 256)), offsets


def shared_blocks(program: Program) -> tuple[tuple[str, int], ...]:
    """Every block a CUDA device holds once for all plans alike (its leading stage's weights, its
    static inputs), as the controller's memory map counts them: (id, bytes) each."""
    stage, ins = shared_block(program), input_block(program)
    return (*((stage,) if stage is not None else ()), *(((ins[0], ins[1]),) if ins is not None else ()))


def extent_layout(program: Program, skip: int = 0) -> tuple[int, list[int], list[int], int, list[int]]:
    """(weights bytes, input offsets, output offsets, total, first-stage output offsets) of a
    model's extent; its weights less the first `skip` bytes (held apart: prefix_bytes). A plan
    whose stage is held apart holds its inputs apart too (input_block): no input offsets then."""
    spec = program.spec
    b = spec.max_batch_size
    off = aligned(program.weight_bytes - skip)
    ins: list[int] = []
    outs: list[int] = []
    mids: list[int] = []
    for group, tensors in ((ins, () if skip else spec.inputs), (outs, spec.outputs), (mids, mid_specs(program))):
        for t in tensors:
            group.append(off)
            off += aligned(b * _sample_bytes(t.sample_shape, t.datatype.tensor_dtype))
    return program.weight_bytes - skip, ins, outs, max(off, 256), mids


class CudaBackend:
    def __init__(self, device: Device, api: DeviceApi, host: HostPins, graphs: bool = True,
                 hang_timeout_s: float = 2.0, graph_cache: int = PARKED_GRAPH_SETS,
                 prefix_cache: PrefixCache | None = None, shares: bool = True) -> None:
        self.device = device
        # Plans' shared leading stages held once (runtime.share_weights); off: every model holds
        # all of its weights in its own extent, as black-box serving does
        self.shares = shares
        self._stages: dict[str, SharedStage] = {}  # stage_key -> the stage's weights here
        self.api = api
        self.host = host
        self.graphs_enabled = graphs
        # unloaded models' graphs, for the next LOAD of the same structure into the same extent
        self.graph_cache = GraphCache(graph_cache)
        self.pinned_pool = PinnedPool(PINNED_POOL_BUFFERS)  # unloaded models' IO buffers, still pinned
        # Shared stages' outputs by input, in device memory: the workspace's (torch's allocator), so
        # a quarter of the workspace at most, whatever runtime.prefix_cache_bytes says.
        pc = prefix_cache if prefix_cache is not None else PrefixCache(0, 0)
        self.prefix_cache = PrefixCache(pc.max_entries, min(pc.max_bytes, device.workspace // 4))
        self.hang_timeout_s = hang_timeout_s
        self.check_target = torch.device("cuda", device.index)  # what the stand-in stands in for
        self.load_chunk = LOAD_CHUNK
        self._failed = ""
        self._lock = threading.Lock()  # the arena and the charge
        self.arena = Arena(device.model_budget)
        self.arena_buf = api.alloc(self.arena.size, f"{device.name} arena")
        self.load_s = api.stream("load")
        self.h2d = api.stream("h2d", priority=-1)
        self.exec = api.stream("exec")
        self.d2h = api.stream("d2h", priority=-1)
        self.capture_s = api.stream("capture")
        self._streams_used = (self.exec, self.h2d, self.d2h, self.capture_s)
        # Every event the data path needs, made once.
        self.ev_in, self.ev_begin, self.ev_end, self.ev_out = (api.event() for _ in range(4))
        self._chunk_events = [api.event(timing=False) for _ in range(LOAD_INFLIGHT)]
        self._copy_begin, self._copy_end = api.event(), api.event()
        self._loaded, self._captured = api.event(timing=False), api.event(timing=False)
        self._warmed = api.event(timing=False)  # a LOAD's first runs over a shared input block are done
        self._fences = {s.name: api.event(timing=False) for s in self._streams_used}
        self._events_staged: list[Event] = []  # timing between a cross-model batch's kernels (infer_staged)
        self._longest_s = 0.0  # the longest INFER's device time here (infer_staged's deadline)
        if not host.charge(LOAD_CHUNK * LOAD_INFLIGHT):
            raise ConfigError(f"runtime.host_pinned_budget = {host.budget} bytes leaves no room for {device.name}'s "
                              f"staging ring ({LOAD_CHUNK * LOAD_INFLIGHT} bytes)")
        self._staging = [api.alloc_pinned(LOAD_CHUNK, f"{device.name} staging") for _ in range(LOAD_INFLIGHT)]
        self._said: dict[str, str] = {}  # model -> why it runs eagerly, as logged
        self._residents: dict[int, Resident] = {}  # extent id -> the model in it
        self._views: OrderedDict[tuple[str, int, int], list[torch.Tensor]] = OrderedDict()
        self.compactions = 0  # arena compactions done (models moved to make a LOAD fit)
        self.staged_replays = 0  # cross-model batches run as graphs (the rest ran eagerly)
        limit = getattr(api, "limit", None)
        if limit is not None:  # torch's allocator refuses past the budget rather than overrun it: the
            limit(device.workspace)  # arena is allocated, so what it may still take is the workspace

    # ---------------------------------------------------------------- accounting

    @property
    def charged(self) -> int:
        return self.device.workspace + self.arena.used

    @property
    def failed(self) -> str:
        return self._failed

    def footprint(self, program: Program) -> int:
        """Bytes a LOAD of `program` charges here when the device holds none of its shared stage
        (nor its input block)."""
        skip = self._skip(program)
        if not skip:
            return self._own_bytes(program, 0)
        ins = input_block(program)
        assert ins is not None
        return self._own_bytes(program, skip) + aligned(skip, self.arena.align) + aligned(ins[1], self.arena.align)

    def _own_bytes(self, program: Program, skip: int) -> int:
        """Its own extent's bytes: its weights less the first `skip` (a shared stage's), IO buffers."""
        return aligned(extent_layout(program, skip)[3], self.arena.align)

    def _skip(self, program: Program) -> int:
        """Bytes of its weights held apart, in a shared stage's extent (0: none)."""
        return prefix_bytes(program) if self.shares else 0

    def thread_setup(self, role: str) -> None:
        setup = getattr(self.api, "thread_setup", None)
        if setup is not None:  # the calling thread's current device (torch.cuda keeps it per thread)
            setup()

    def _usable(self) -> None:
        if self._failed:
            raise DeviceFault(f"{self.device.name} failed: {self._failed}")

    def _fault(self, e: DeviceFault) -> None:
        if not self._failed:
            self._failed = str(e)
            log.critical("%s failed: %s", self.device.name, e)

    # ---------------------------------------------------------------- LOAD

    def load(self, key: str, program: Program, deadline: float) -> tuple[Resident, float]:
        self._usable()
        program.check_device(self.check_target, program.spec.max_batch_size)
        skip = self._skip(program)
        need = self._own_bytes(program, skip)
        sk = stage_key(program) if skip else ""
        block = input_block(program) if skip else None
        ik = block[0] if block is not None else ""
        held: list[str] = []  # shared blocks this LOAD holds, let go of if it fails before it binds
        try:
            stage, fresh = self._hold_stage(key, sk, skip, deadline) if skip else (None, False)
            held += [sk] if skip else []
            ins, fresh_in = self._hold_stage(key, ik, block[1], deadline) if block is not None else (None, False)
            held += [ik] if block is not None else []
            ext = self._place(key, need, deadline)
        except BaseException:
            for sid in held:
                self._drop_stage(sid)
            raise
        st = self._layout(program, ext, self.arena_buf.region(stage.extent.offset, skip) if stage else None,
                          self.arena_buf.region(ins.extent.offset, block[1]) if ins and block else None)
        st.shared_sid, st.inputs_sid = sk, ik
        st.inputs_lock = ins.lock if ins is not None else None
        # (what this LOAD took of the budget: a block another resident plan holds costs nothing)
        res = Resident(key, program, need + sum(h.extent.nbytes for h, new in ((stage, fresh), (ins, fresh_in))
                                                if h is not None and new), _unbound, {}, st)
        try:
            duration = self._copy_weights(program, st, deadline, fresh)
            self._pin_io(program, res, st)
            self._bind(res, st)
            res.notes = self._make_graphs(program, res, st, deadline, zero_shared=fresh_in)
            self.api.record(self._captured, self.capture_s)
            self._captured.wait(deadline)
        except DeviceFault as e:
            self._fault(e)
            self._unwind(res, st)
            raise
        except BaseException:
            self._unwind(res, st)
            raise
        with self._lock:
            self._residents[ext.id] = res
        return res, duration

    def _hold_stage(self, key: str, sk: str, nbytes: int, deadline: float) -> tuple[SharedStage, bool]:
        """The extent of the shared stage `sk` (stage_key; or an input block's id) here, held once
        more; (it, whether this LOAD made it: then its weights must be copied in)."""
        with self._lock:
            held = self._stages.get(sk)
            if held is not None:
                held.holders += 1
                return held, False
        # (LOADs on a device run one at a time, on its load lane: no other makes this stage meanwhile)
        held = SharedStage(self._place(f"{key}'s shared stage", nbytes, deadline), 1)
        with self._lock:
            self._stages[sk] = held
        return held, True

    def _drop_stage(self, sid: str, discard: bool = False) -> int:
        """A resident plan lets go of its shared stage; the last one frees its extent (after the
        fences `_release` recorded, when `discard`). Returns the bytes freed."""
        with self._lock:
            held = self._stages[sid]
            held.holders -= 1
            if held.holders:
                return 0
            del self._stages[sid]
        if discard:
            try:
                self.api.discard(self.arena_buf.region(held.extent.offset, held.extent.nbytes), self.load_s)
            except DeviceFault as e:
                self._fault(e)
        with self._lock:
            self.arena.free(held.extent)
        return held.extent.nbytes

    def shared_stages(self) -> dict[str, tuple[int, int]]:
        """Shared stages held here: stage_key -> (bytes, resident plans holding it)."""
        with self._lock:
            return {sid: (h.extent.nbytes, h.holders) for sid, h in self._stages.items()}

    def _place(self, key: str, need: int, deadline: float) -> Extent:
        """An extent of `need` bytes: first fit, else after compacting idle extents; NoMemory if the
        budget or the arena has no room."""
        with self._lock:
            if self.charged + need > self.device.weight_budget:
                raise NoMemory(f"{key} needs {need} bytes on {self.device.name}; "
                               f"{self.device.weight_budget - self.charged} of its budget are free")
            ext = self.arena.alloc(need, key)
        if ext is None:
            ext = self._compact(key, need, deadline)
        if ext is None:
            raise NoMemory(f"{key} needs {need} contiguous bytes on {self.device.name}; the largest free extent "
                           f"of its arena is {self.arena.largest_free} ({self.arena.free_bytes} free), and "
                           "moving its idle models would not make one")
        return ext

    def _layout(self, program: Program, ext: Extent, shared: Region | None = None,
                inputs: Region | None = None) -> CudaResident:
        """Where a model's weights and static buffers are: in its extent, and (`shared`) its leading
        stage's weights in their shared extent, with (`inputs`) its static inputs in their block."""
        wbytes, ins, outs, _, mids = extent_layout(program, shared.nbytes if shared is not None else 0)
        spec = program.spec
        b = spec.max_batch_size
        base = self.arena_buf.region(ext.offset, ext.nbytes)
        in_rb = [_sample_bytes(t.sample_shape, t.datatype.tensor_dtype) for t in spec.inputs]
        out_rb = [_sample_bytes(t.sample_shape, t.datatype.tensor_dtype) for t in spec.outputs]
        mid_rb = [_sample_bytes(t.sample_shape, t.datatype.tensor_dtype) for t in mid_specs(program)]
        if inputs is not None:
            block = input_block(program)
            assert block is not None and block[1] == inputs.nbytes
            in_regions = [inputs.sub(o, b * n) for o, n in zip(block[2], in_rb, strict=True)]
        else:
            in_regions = [base.sub(o, b * n) for o, n in zip(ins, in_rb, strict=True)]
        return CudaResident(ext, base.sub(0, wbytes), in_regions,
                            [base.sub(o, b * n) for o, n in zip(outs, out_rb, strict=True)], in_rb, out_rb,
                            mids=[base.sub(o, b * n) for o, n in zip(mids, mid_rb, strict=True)],
                            mid_row_bytes=mid_rb, shared=shared, shared_inputs=inputs)

    def _copy_weights(self, program: Program, st: CudaResident, deadline: float, stage: bool = False) -> float:
        """The weights into the extent (and, with `stage`, the shared stage's into theirs), after
        every fence of earlier UNLOADs. From a pinned block, one copy per extent queued whole: the
        host takes no part until it ends (chunks paced by host waits idle the engine whenever the
        LOAD thread waits for the GIL; on the H200 the daemon's LOADs took 5 ms at p50 against a
        1 ms copy). From a pageable block, chunks through the staging ring, at most LOAD_INFLIGHT
        queued (a slot is refilled once its copy is done)."""
        api = self.api
        src = self.host.block(program.host_block, api, f"{program.spec.key} weights")
        skip = st.shared.nbytes if st.shared is not None else 0
        # (destination, where in the packed block it starts): a held stage is not copied again
        pieces = ([(st.shared, 0)] if stage and st.shared is not None else []) + [(st.weights, skip)]
        pieces = [(dst, off) for dst, off in pieces if dst.nbytes]
        api.record(self._copy_begin, self.load_s)
        if src.where == Where.PINNED:
            for dst, off in pieces:
                api.copy(dst, src.region(off, dst.nbytes), self.load_s)
        else:
            self._copy_staged(program, pieces, deadline)
        api.record(self._copy_end, self.load_s)
        api.record(self._loaded, self.load_s)
        self._copy_end.wait(deadline)
        return self._copy_begin.elapsed_s(self._copy_end)

    def _copy_staged(self, program: Program, pieces: list[tuple[Region, int]], deadline: float) -> None:
        api = self.api
        chunks = [(dst, at, src + at, min(self.load_chunk, dst.nbytes - at))
                  for dst, src in pieces for at in range(0, dst.nbytes, self.load_chunk)]
        for i, (dst, at, off, size) in enumerate(chunks):
            slot = i % LOAD_INFLIGHT
            ev = self._chunk_events[slot]
            if i >= LOAD_INFLIGHT:
                ev.wait(deadline)  # the chunk two back has left its staging slot
            stage = self._staging[slot].region(0, size)
            api.host_write(stage)
            stage.bytes().copy_(program.host_block[off : off + size])
            api.copy(dst.sub(at, size), stage, self.load_s)
            api.record(ev, self.load_s)

    def _pin_io(self, program: Program, res: Resident, st: CudaResident) -> None:
        """Pinned host memory for the model's IO: input staging per batch size, the output ring."""
        spec = program.spec
        for b in spec.batch_sizes:
            # each input's place in this batch size's buffer: after the others' b rows
            in_offsets, off = [], 0
            for rb in st.in_row_bytes:
                in_offsets.append(off)
                off += aligned(b * rb)
            st.staging_offsets[b] = in_offsets
            stage = self._pin(st, off, f"{spec.key} inputs b{b}")
            st.staging[b] = stage
            host = [stage.view(o, t.datatype.tensor_dtype, (b, *t.sample_shape)).numpy()
                    for o, t in zip(in_offsets, spec.inputs, strict=True)]
            # Every row counts as stale, so the first batch zeroes its padding rows (never what the
            # memory held): zeroing whole buffers here cost a ResNet-18 LOAD ~9 MB of memset.
            res.io[b] = IOBuffers(b, host, [], filled=b)
        out_offsets, off = [], 0
        for rb in st.out_row_bytes:
            out_offsets.append(off)
            off += aligned(spec.max_batch_size * rb)
        slots = [self._pin(st, max(off, 1), f"{spec.key} outputs {i}") for i in range(OUTPUT_RING)]
        spare = self._pin(st, max(off, 1), f"{spec.key} outputs spare")
        st.ring = OutputRing(slots, spare, out_offsets, [t.sample_shape for t in spec.outputs],
                             [t.datatype.tensor_dtype for t in spec.outputs])

    def _bind(self, res: Resident, st: CudaResident) -> None:
        """Point the model at its extent: weights, static inputs and outputs, one kernel per batch size."""
        program, spec = res.program, res.program.spec
        views = self._weight_views(program, st)
        # one instance per resident (a program may be held twice here: served, and warming up)
        res.runner = program.bind(views, native=False, owner=f"{self.device.name}/{res.key}",
                                  device=self.api.torch_device)
        in_views = [r.buffer.view(r.offset, t.datatype.tensor_dtype, (spec.max_batch_size, *t.sample_shape))
                    for r, t in zip(st.inputs, spec.inputs, strict=True)]
        out_views = [r.buffer.view(r.offset, t.datatype.tensor_dtype, (spec.max_batch_size, *t.sample_shape))
                     for r, t in zip(st.outputs, spec.outputs, strict=True)]
        for b in spec.batch_sizes:
            res.io[b].device = [v[:b] for v in in_views]
            st.steps[b] = self._kernel(res, [v[:b] for v in in_views], [v[:b] for v in out_views], b)
        st.stage_steps.clear()
        if st.mids:
            mid_views = [r.buffer.view(r.offset, t.datatype.tensor_dtype, (spec.max_batch_size, *t.sample_shape))
                         for r, t in zip(st.mids, mid_specs(program), strict=True)]
            for b in spec.batch_sizes:
                st.stage_steps[(0, b)] = self._part(res, 0, [v[:b] for v in in_views], [v[:b] for v in mid_views], b)
                st.stage_steps[(1, b)] = self._part(res, 1, [v[:b] for v in mid_views], [v[:b] for v in out_views], b)

    def _weight_views(self, program: Program, st: CudaResident) -> list[torch.Tensor]:
        """The program's weights as tensors over its extent (and its shared stage's). The same
        structure (weight layout included) at the same offsets gives the same tensors, so they are
        kept for the next LOAD there (making ~120 views took a ResNet-18 LOAD ~1 ms of host time)."""
        ext, shared = st.extent, st.shared
        key = (program.structure, ext.offset, shared.offset if shared is not None else -1)
        if key[0]:
            with self._lock:
                views = self._views.get(key)
                if views is not None:
                    self._views.move_to_end(key)
                    return views
        arena = self.arena_buf.tensor
        if shared is None:
            views = program.layout.views(arena[ext.offset : ext.offset + program.weight_bytes])
        else:
            views = program.layout.split_views(arena[shared.offset : shared.offset + shared.nbytes],
                                               arena[ext.offset : ext.offset + st.weights.nbytes],
                                               program.stages[0].count, shared.nbytes)
        if key[0]:
            with self._lock:
                self._views[key] = views
                while len(self._views) > VIEW_SETS:
                    self._views.popitem(last=False)
        return views

    # ---------------------------------------------------------------- compaction

    def _compact(self, key: str, need: int, deadline: float) -> Extent | None:
        """Slide idle models' extents towards the start of the arena until `need` contiguous bytes
        are free; the new extent, or None. A model is idle when its lock is free (no INFER runs);
        an INFER that comes for it meanwhile waits until it is moved and its graphs captured again.
        A shared stage moves too when every plan holding it is resident and idle (a stage that never
        moved would pin the arena's fragments for as long as any plan holds it)."""
        locked: list[Resident] = []
        try:
            with self._lock:
                candidates = list(self._residents.values())
            for r in candidates:
                if r.state.lock.acquire(blocking=False):
                    locked.append(r)
            by_extent = {r.state.extent.id: r for r in locked}
            idle = {id(r) for r in locked}
            holding: dict[str, list[Resident]] = {}
            for r in candidates:
                for sid in (r.state.shared_sid, r.state.inputs_sid):
                    if sid:
                        holding.setdefault(sid, []).append(r)
            with self._lock:
                # (a LOAD in progress holds its stage without being resident: that stage stays put)
                stages = {held.extent.id: holding.get(sk, []) for sk, held in self._stages.items()
                          if len(holding.get(sk, ())) == held.holders and all(id(r) in idle for r in holding[sk])}
                moves = self.arena.plan_compaction(set(by_extent) | set(stages), need)
            if moves is None:
                return None
            self._move(moves, by_extent, stages, deadline)
            self.compactions += 1
            log.info("%s: compacted its arena (%d extent(s) moved) for %s", self.device.name, len(moves), key)
            with self._lock:
                return self.arena.alloc(need, key)
        finally:
            for r in locked:
                r.state.lock.release()

    def _move(self, moves: list[Move], by_extent: dict[int, Resident], stages: dict[int, list[Resident]],
              deadline: float) -> None:
        """Carry out planned moves (models' extents and shared stages'), then point every model that
        moved, or whose stage did, at its new place."""
        api = self.api
        moved: dict[int, Resident] = {}
        for m in moves:
            for r in [by_extent[m.extent.id]] if m.extent.id in by_extent else stages[m.extent.id]:
                moved[id(r)] = r
        for r in moved.values():
            # its graphs stay valid where it was: parked there for the next of its structure (and it
            # may find a set parked at its new place)
            st = r.state
            for gs in self.graph_cache.park(self._graph_key(r.program, st), st.extent.offset, st.extent.nbytes,
                                            self._unhold_graphs(st)):
                gs.close()
        for m in moves:  # in address order, each down: what one reads was never written by one before
            n = m.extent.nbytes
            step = min(self.load_chunk, m.old - m.new)  # chunks never overlap what they read from
            for off in range(0, n, step):
                size = min(step, n - off)
                api.copy(self.arena_buf.region(m.new + off, size), self.arena_buf.region(m.old + off, size),
                         self.load_s)
            vacated = max(m.new + n, m.old)
            api.discard(self.arena_buf.region(vacated, m.old + n - vacated), self.load_s)
            with self._lock:
                self.arena.apply([m])
        api.record(self._loaded, self.load_s)
        for r in moved.values():
            st = r.state
            shared = inputs = None
            with self._lock:
                if st.shared is not None:
                    shared = self.arena_buf.region(self._stages[st.shared_sid].extent.offset, st.shared.nbytes)
                if st.shared_inputs is not None:
                    inputs = self.arena_buf.region(self._stages[st.inputs_sid].extent.offset, st.shared_inputs.nbytes)
            now = self._layout(r.program, st.extent, shared, inputs)
            # (a plan's first-stage outputs too: its parts' graphs write them, and they moved with it)
            st.weights, st.inputs, st.outputs, st.mids, st.shared = now.weights, now.inputs, now.outputs, now.mids, \
                now.shared
            st.shared_inputs = now.shared_inputs
            self._bind(r, st)
            r.notes = self._make_graphs(r.program, r, st, deadline)
        api.record(self._captured, self.capture_s)
        self._captured.wait(deadline)

    def _pin(self, st: CudaResident, nbytes: int, label: str) -> Buffer:
        buf = self.pinned_pool.take(nbytes)  # pinned and charged already
        if buf is None:
            while not self.host.charge(nbytes):  # pooled buffers give way, oldest first
                if not len(self.pinned_pool):
                    raise NoMemory(f"the host's pinned memory budget (runtime.host_pinned_budget = "
                                   f"{self.host.budget}) has no room for {label}")
                self._unpin(self.pinned_pool.evict(pages(nbytes)))
            try:
                buf = self.api.alloc_pinned(nbytes, label)
            except BaseException:
                self.host.release(nbytes)
                raise
        st.pinned.append((nbytes, buf))
        st.pinned_bytes += pages(nbytes)
        return buf

    def _unpin(self, bufs: Sequence[tuple[int, Buffer]]) -> None:
        for nbytes, buf in bufs:
            try:
                self.api.unpin(buf)
            except Exception as e:
                log.warning("%s: unpinning %s failed: %s", self.device.name, buf.label, e)
            self.host.release(nbytes)

    @staticmethod
    def _kernel(res: Resident, ins: list[torch.Tensor], outs: list[torch.Tensor], b: int) -> Callable[[], None]:
        def step() -> None:
            with torch.inference_mode():
                result = res.runner(ins)
                for dst, src in zip(outs, result, strict=True):
                    dst.copy_(src)
        step.__name__ = f"{res.key} b={b}"
        return step

    @staticmethod
    def _part(res: Resident, part: int, ins: list[torch.Tensor], outs: list[torch.Tensor], b: int
              ) -> Callable[[], None]:
        """A plan's first stage (0) or its other stages (1), from static buffers into static buffers."""
        def step() -> None:
            chain = res.runner
            assert isinstance(chain, Chain)
            with torch.inference_mode():
                result = chain.stages[0](ins) if part == 0 else chain.tail(ins)
                for dst, src in zip(outs, result, strict=True):
                    dst.copy_(src)
        step.__name__ = f"{res.key} {'first stage' if part == 0 else 'rest'} b={b}"
        return step

    def _stage_touches(self, st: CudaResident, key: StageKey) -> tuple[list[Region], list[Region]]:
        part, b = key
        ins = [r.sub(0, b * n) for r, n in zip(st.inputs, st.in_row_bytes, strict=True)]
        mids = [r.sub(0, b * n) for r, n in zip(st.mids, st.mid_row_bytes, strict=True)]
        outs = [r.sub(0, b * n) for r, n in zip(st.outputs, st.out_row_bytes, strict=True)]
        return ([*st.weight_regions, *ins], mids) if part == 0 else ([*st.weight_regions, *mids], outs)

    def _timed_step(self, step: Callable[[], None], reads: list[Region], writes: list[Region],
                    timing: tuple[Event, Event] | None) -> None:
        """What a capture records: the step, between two timing nodes when the device has them."""
        if timing is not None:
            self.api.record(timing[0], self.capture_s)
        self.api.launch(self.capture_s, step, reads, writes)
        if timing is not None:
            self.api.record(timing[1], self.capture_s)

    def _touches(self, st: CudaResident, b: int) -> tuple[list[Region], list[Region]]:
        reads = [*st.weight_regions, *(r.sub(0, b * n) for r, n in zip(st.inputs, st.in_row_bytes, strict=True))]
        writes = [r.sub(0, b * n) for r, n in zip(st.outputs, st.out_row_bytes, strict=True)]
        return reads, writes

    def _make_graphs(self, program: Program, res: Resident, st: CudaResident, deadline: float,
                     zero_shared: bool = False) -> str:
        """Warm every batch size up on the capture stream and capture its graph, largest first;
        why the model runs eagerly, if it does. `zero_shared`: its input block is new here."""
        api = self.api
        api.wait_event(self.capture_s, self._loaded)
        # The first runs read the static inputs (and a plan's rest reads its first stage's outputs),
        # and so do a cross-model batch's padding rows, which no copy fills: zeros, never what the
        # arena held (an index read from stale bytes can trip a device-side assert). A shared input
        # block is zeroed once, when made: later it holds real inputs, and another plan's INFER may
        # be copying some in.
        zero_mids = [r.buffer.view(r.offset, torch.uint8, (r.nbytes,)) for r in st.mids]
        zero_ins = st.shared_inputs is None or zero_shared
        api.launch(self.capture_s, _zero([*(res.io[program.spec.max_batch_size].device if zero_ins else ()),
                                          *zero_mids]), [], [*(st.inputs if zero_ins else ()), *st.mids])
        if self.graphs_enabled and not program.capture_problem:
            parked = self.graph_cache.take(self._graph_key(program, st), st.extent.offset, st.extent.nbytes)
            if parked is not None:  # captured for this structure at this offset: the copy was the LOAD
                parked.retarget(st.steps, st.stage_steps)
                st.graphs, st.graph_timing, st.kernels = parked.graphs, parked.timing, parked.kernels
                st.stage_graphs, st.stage_kernels = parked.stages, parked.stage_kernels
                res.set_up = False
                return ""
        why = ""
        if not self.graphs_enabled:
            why = "CUDA graphs are off (runtime.cuda_graphs)"
        elif program.capture_problem:
            why = f"not capturable: {program.capture_problem}"
        sizes = sorted(program.spec.batch_sizes, reverse=True)
        parts = sorted(st.stage_steps, key=lambda k: (-k[1], k[0]))
        lock = st.inputs_lock if st.inputs_lock is not None else contextlib.nullcontext()
        with lock:  # (a shared input block: no other plan's INFER copies in while these read it)
            for b in sizes:  # first runs (lazy initialisation) all before any capture: a failed
                reads, writes = self._touches(st, b)  # capture is the last thing done on this stream
                api.launch(self.capture_s, st.steps[b], reads, writes)
            for key in parts:
                api.launch(self.capture_s, st.stage_steps[key], *self._stage_touches(st, key))
            if st.inputs_lock is not None:
                api.record(self._warmed, self.capture_s)
                self._warmed.wait(deadline)
        for b in sizes:
            if why:
                break
            reads, writes = self._touches(st, b)
            timing = (api.event(external=True), api.event(external=True)) if api.graph_events else None
            kernel = Retargetable(st.steps[b])
            try:
                graph = api.capture(self.capture_s, functools.partial(
                    self._timed_step, kernel, reads, writes, timing))
            except (CaptureError, torch.OutOfMemoryError) as e:
                why = f"capture failed at batch {b}: {e}"
                break
            pool = api.graph_pool_bytes
            if pool > self.device.workspace:
                graph.close()
                why = (f"its graphs need {pool} bytes of graph memory, more than the workspace reserve "
                       f"(runtime.device_workspace = {self.device.workspace})")
                continue
            st.graphs[b] = graph
            st.kernels[b] = kernel
            if timing is not None:
                st.graph_timing[b] = timing
        if why:
            for g in st.graphs.values():
                g.close()
            st.graphs.clear()
            st.graph_timing.clear()
            st.kernels.clear()
            if self._said.get(program.spec.key) != why:  # once per model, not at every LOAD
                log.info("%s on %s runs eagerly: %s", program.spec.key, self.device.name, why)
                self._said[program.spec.key] = why
            return f"runs without CUDA graphs: {why}"
        self._capture_parts(program, st, parts)
        res.set_up = True  # warmed up and captured: one-time work the next LOAD here may skip
        return ""

    def _capture_parts(self, program: Program, st: CudaResident, parts: list[StageKey]) -> None:
        """A plan's first stage and its rest as graphs of their own, per batch size: what a cross-model
        batch replays. Any failure leaves such batches eager (the plan alone keeps its whole graphs)."""
        api = self.api
        why = ""
        for key in parts:
            kernel = Retargetable(st.stage_steps[key])
            try:
                graph = api.capture(self.capture_s, functools.partial(
                    self._timed_step, kernel, *self._stage_touches(st, key), None))
            except (CaptureError, torch.OutOfMemoryError) as e:
                why = f"capture of {'its first stage' if key[0] == 0 else 'its rest'} failed at batch {key[1]}: {e}"
                break
            st.stage_graphs[key] = graph
            st.stage_kernels[key] = kernel
            if api.graph_pool_bytes > self.device.workspace:
                why = (f"its stages' graphs need {api.graph_pool_bytes} bytes of graph memory, more than the "
                       f"workspace reserve (runtime.device_workspace = {self.device.workspace})")
                break
        if why:
            for g in st.stage_graphs.values():
                g.close()
            st.stage_graphs.clear()
            st.stage_kernels.clear()
            said = f"stages: {why}"
            if self._said.get(program.spec.key) != said:
                log.info("%s on %s runs cross-model batches eagerly: %s", program.spec.key, self.device.name, why)
                self._said[program.spec.key] = said

    @staticmethod
    def _unhold_graphs(st: CudaResident) -> GraphSet:
        """Every graph the resident holds, as one set (to park or close); the resident keeps none."""
        held = GraphSet(dict(st.graphs), dict(st.graph_timing), dict(st.kernels), dict(st.stage_graphs),
                        dict(st.stage_kernels))
        st.graphs.clear()
        st.graph_timing.clear()
        st.kernels.clear()
        st.stage_graphs.clear()
        st.stage_kernels.clear()
        return held

    @staticmethod
    def _graph_key(program: Program, st: CudaResident) -> str:
        """What parked graphs are kept under besides their extent's place: the structure, and where
        the shared stage's weights they read are ("" where the structure cannot be told)."""
        if not program.structure or st.shared is None:
            return program.structure
        ins = f"+{st.shared_inputs.offset}" if st.shared_inputs is not None else ""
        return f"{program.structure}@{st.shared.offset}{ins}"

    def _unwind(self, res: Resident, st: CudaResident) -> None:
        """A failed LOAD lets go of what it took; the LOAD's own error is the one raised (the
        caller re-raises it), unless undoing it gave the device up: then that fault is."""
        try:
            self._release(res, st, keep=False)
        except DeviceFault:
            raise
        except Exception as e:
            log.warning("%s: undoing the failed LOAD of %s also failed: %r", self.device.name, res.key, e)

    def _first(self, error: BaseException | None, e: BaseException, key: str) -> BaseException:
        """The error a release raises: the first; a later one is logged, not lost."""
        if error is None:
            return e
        log.warning("%s: releasing %s: %r after %r", self.device.name, key, e, error)
        return error

    # ---------------------------------------------------------------- UNLOAD

    def unload(self, res: Resident) -> None:
        st: CudaResident = res.state
        self._release(res, st)

    def _release(self, res: Resident, st: CudaResident, keep: bool = True) -> None:
        """Everything a resident holds, in order: graphs (before their memory), the program's view
        of the weights, then the extent once the device is done with it, then pinned memory.
        `keep`: graphs parked and IO buffers pooled for the next LOAD (not after a failed one).

        The extent, the shared stage's hold and the pinned memory are let go whatever an earlier
        step raises (it is raised after them): a hold left behind would pin the stage's extent, and
        the budget would count it, for the daemon's life."""
        api = self.api
        keep = keep and not self._failed
        error: BaseException | None = None
        try:
            held = self._unhold_graphs(st)
            for gs in (self.graph_cache.park(self._graph_key(res.program, st), st.extent.offset,
                                             st.extent.nbytes, held) if keep else [held]):
                gs.close()
        except Exception as e:  # (graphs are torch objects; their memory goes with the extent below)
            error = e
            keep = False
        try:
            res.program.release(f"{self.device.name}/{res.key}")
        except Exception as e:
            error = self._first(error, e, res.key)
        res.runner = _unbound
        try:
            if not self._failed:
                for s in self._streams_used:
                    api.record(self._fences[s.name], s)
                    api.wait_event(self.load_s, self._fences[s.name])
                api.discard(self.arena_buf.region(st.extent.offset, st.extent.nbytes), self.load_s)
                if st.pinned:  # the host unpins: it must have seen the last copies from and to them
                    self._fences["h2d"].wait(self._deadline())
                    self._fences["d2h"].wait(self._deadline())
        except DeviceFault as e:
            self._fault(e)
        except Exception as e:
            # Unknown whether the device is done with this memory: reusing it could corrupt another
            # model's weights, so the device is given up, as after a fault, and the UNLOAD says so
            # (a DeviceFault: the controller then stops sending work here).
            fault = DeviceFault(f"releasing {res.key} failed: {e!r}")
            fault.__cause__ = e
            self._fault(fault)
            if error is not None:
                log.warning("%s: releasing %s also failed earlier: %r", self.device.name, res.key, error)
            error = fault
        with self._lock:
            self._residents.pop(st.extent.id, None)
            self.arena.free(st.extent)
        freed = st.extent.nbytes
        for sid in (st.shared_sid, st.inputs_sid):  # (discarded after the same fences; freed with the last holder)
            if sid:
                freed += self._drop_stage(sid, discard=not self._failed)
        st.shared_sid = st.inputs_sid = ""
        res.charged = freed  # what the UNLOAD freed (a stage other plans hold stays)
        # An output slot still lent (a response not yet written reads it) is never handed to another
        # model: it is unpinned, and its memory lives on with the response's view.
        lent = {id(b) for b in st.ring.lent_buffers()} if st.ring is not None else set()
        gone: list[tuple[int, Buffer]] = []
        for nbytes, buf in st.pinned:
            if keep and id(buf) not in lent:
                gone += self.pinned_pool.give(nbytes, buf)
            else:
                gone.append((nbytes, buf))
        self._unpin(gone)
        st.pinned.clear()
        st.pinned_bytes = 0
        if error is not None:
            raise error

    # ---------------------------------------------------------------- INFER

    def infer(self, res: Resident, io: IOBuffers, fill: Fill, deadline: float) -> tuple[tuple[np.ndarray, ...], float]:
        self._usable()
        api = self.api
        st: CudaResident = res.state
        assert st.ring is not None
        b = io.batch_size
        stage = st.staging[b]
        slot = -2
        st.lock.acquire()  # a compaction may be moving this model
        if st.inputs_lock is not None:  # (a shared input block: a LOAD's first runs may be reading it)
            st.inputs_lock.acquire()
        try:
            api.host_write(stage.region())
            rows = fill(io)
            for k, (dst, n) in enumerate(zip(st.inputs, st.in_row_bytes, strict=True)):
                if n:
                    api.copy(dst.sub(0, b * n), stage.region(st.staging_offsets[b][k], b * n), self.h2d)
            api.record(self.ev_in, self.h2d)
            api.wait_event(self.exec, self.ev_in)
            graph = st.graphs.get(b)
            timing = st.graph_timing.get(b) if graph is not None else None
            if timing is None:
                api.record(self.ev_begin, self.exec)
            if graph is not None:
                graph.replay(self.exec)
            else:
                reads, writes = self._touches(st, b)
                api.launch(self.exec, st.steps[b], reads, writes)
            api.record(self.ev_end, self.exec)
            api.wait_event(self.d2h, self.ev_end)
            slot = st.ring.acquire()
            dst_regions = st.ring.regions(slot, rows)
            for dst, src, n in zip(dst_regions, st.outputs, st.out_row_bytes, strict=True):
                if n:
                    api.copy(dst, src.sub(0, rows * n), self.d2h)
            api.record(self.ev_out, self.d2h)
            # Most of a graph's time is known: sleep through it (the GIL free for others) and poll
            # only near its end. The poll alone sleeps in growing steps, up to 200 µs, and wakes an
            # INFER of a few hundred µs ~0.1 ms late; a replay's time varies by <1% (H200, p99).
            ahead = st.last_s.get(b, 0.0) * SLEEP_THROUGH
            if ahead > MIN_SLEEP_S:
                time.sleep(ahead)
            self.ev_out.wait(deadline)
            for r in dst_regions:
                api.host_read(r)
            begin, end = timing if timing is not None else (self.ev_begin, self.ev_end)
            duration = begin.elapsed_s(end)
            st.last_s[b] = low_estimate(st.last_s.get(b, 0.0), duration)
            self._longest_s = max(self._longest_s, duration)
            outputs = st.ring.hand_out(slot, rows)
        except DeviceFault as e:
            self._fault(e)
            if slot > -2:
                st.ring.cancel(slot)
            raise
        except BaseException:
            if slot > -2:
                st.ring.cancel(slot)
            raise
        finally:
            if st.inputs_lock is not None:
                st.inputs_lock.release()
            st.lock.release()
        return outputs, duration

    def infer_staged(self, members: Sequence[tuple[Resident, Sequence[InferenceRequest]]], io: IOBuffers
                     ) -> tuple[list[tuple[np.ndarray, ...]], float, tuple[tuple[str, int, float], ...]]:
        """A cross-model batch (controller/sharing.py): models whose plans begin with one stage. The
        first member's extent takes every member's rows as its inputs, its first stage runs once
        on them, then each member's other stages run over its own weights on its own rows, into
        its own static outputs and output ring. Eager kernels (a batch's members and rows vary:
        no graph is captured for it); device time per stage from events between the kernels.
        A lone plan runs as one program (`infer`, with its graphs), as before. (each member's
        outputs, device seconds, (estimate key, rows, seconds) per stage run; none for a lone plan.)"""
        lead = members[0][0]
        # (the executor gives the whole-program path a deadline from the action's estimate; this
        # path has none, so it allows the hang timeout past ten times the longest INFER seen here)
        deadline = self._deadline() + 10 * self._longest_s
        # a lone plan that must run its prefix runs whole (below) and keeps nothing, so its lookups
        # pay off only where this stage's outputs are kept (black-box serving: never)
        pc, sid = self.prefix_cache, lead.program.prefix
        plan = plan_prefix(pc, sid, [r for _, reqs in members for r in reqs], look=len(members) > 1 or pc.holds(sid))
        if len(members) == 1 and plan.run:
            # a lone plan whose prefix must run anyway runs as one program, with its graphs
            reqs = members[0][1]
            outs, duration = self.infer(lead, io, lambda b: b.fill(reqs), deadline)
            return [outs], duration, ()
        self._usable()
        api = self.api
        sts: list[CudaResident] = [res.state for res, _ in members]
        lst = sts[0]
        assert all(isinstance(res.runner, Chain) for res, _ in members)
        b = io.batch_size
        stage = lst.staging[b]
        counts = [sum(r.samples for r in reqs) for _, reqs in members]
        events = self._stage_events(len(members) + 1)
        slots: list[int] = []
        taken: list[threading.Lock] = []
        try:
            for st in sts:  # a compaction may be moving one of them (it never waits for these)
                if st.lock in taken:
                    continue
                st.lock.acquire()
                taken.append(st.lock)
            if lst.inputs_lock is not None:  # the rows go into the lead's inputs (input_block)
                lst.inputs_lock.acquire()
                taken.append(lst.inputs_lock)
            # only the requests whose prefix output the cache lacks are copied in and run through it
            api.host_write(stage.region())
            rows = io.fill(plan.run) if plan.run else 0
            for k, (dst, n) in enumerate(zip(lst.inputs, lst.in_row_bytes, strict=True)):
                if n and rows:
                    api.copy(dst.sub(0, rows * n), stage.region(lst.staging_offsets[b][k], rows * n), self.h2d)
            api.record(self.ev_in, self.h2d)
            api.wait_event(self.exec, self.ev_in)
            mid: list[tuple[torch.Tensor, ...]] = []  # the first stage's outputs, from one kernel to the next
            if self._parts_ready(lead, members, sts, counts, rows):
                self.staged_replays += 1
                self._replay_parts(lead, members, sts, counts, rows, plan, mid, events)
            else:
                self._run_parts(lead, members, sts, counts, rows, plan, mid, events)
            api.record(self.ev_end, self.exec)
            api.wait_event(self.d2h, self.ev_end)
            regions: list[list[Region]] = []
            for st, n in zip(sts, counts, strict=True):
                assert st.ring is not None
                slots.append(st.ring.acquire())
                dst_regions = st.ring.regions(slots[-1], n)
                regions.append(dst_regions)
                for dst, src, rb in zip(dst_regions, st.outputs, st.out_row_bytes, strict=True):
                    if rb:
                        api.copy(dst, src.sub(0, n * rb), self.d2h)
            api.record(self.ev_out, self.d2h)
            self.ev_out.wait(deadline)
            for rs in regions:
                for r in rs:
                    api.host_read(r)
            marks = [*events[: len(members) + 1], self.ev_end]
            runs = [(prefix_key(lead.program.prefix), rows, marks[0].elapsed_s(marks[1]))]
            runs += [(tail_key(res.program.spec.key), n, marks[i + 1].elapsed_s(marks[i + 2]))
                     for i, ((res, _), n) in enumerate(zip(members, counts, strict=True))]
            parts = []
            for st, slot, n in zip(sts, slots, counts, strict=True):
                assert st.ring is not None
                parts.append(st.ring.hand_out(slot, n))
            slots.clear()
        except DeviceFault as e:
            self._fault(e)
            raise
        finally:
            for st, slot in zip(sts, slots, strict=False):  # taken for a batch that failed before handing out
                if st.ring is not None:
                    st.ring.cancel(slot)
            for lock in taken:
                lock.release()
        duration = marks[0].elapsed_s(self.ev_end)
        self._longest_s = max(self._longest_s, duration)
        return parts, duration, tuple(runs)

    @staticmethod
    def _parts_ready(lead: Resident, members: Sequence[tuple[Resident, Sequence[InferenceRequest]]],
                     sts: list[CudaResident], counts: list[int], rows: int) -> bool:
        """Whether a cross-model batch can replay graphs: the lead's first stage at the computed rows'
        batch size (none computed: nothing to replay), each member's rest at its own."""
        if rows and (0, lead.program.spec.batch_size_for(rows)) not in sts[0].stage_graphs:
            return False
        for (res, _), st, n in zip(members, sts, counts, strict=True):
            spec = res.program.spec
            if n > spec.max_batch_size or (1, spec.batch_size_for(n)) not in st.stage_graphs:
                return False
        return True

    def _replay_parts(self, lead: Resident, members: Sequence[tuple[Resident, Sequence[InferenceRequest]]],
                      sts: list[CudaResident], counts: list[int], rows: int, plan: PrefixPlan,
                      mid: list[tuple[torch.Tensor, ...]], events: list[Event]) -> None:
        """A cross-model batch as graphs: the lead's first stage over the computed rows (its static
        inputs to its static first-stage outputs), a copy of those rows out (the cache keeps some,
        and the lead's own rest overwrites them), then per member its rows gathered into its static
        first-stage outputs and its rest replayed into its static outputs."""
        api, lst = self.api, sts[0]
        api.record(events[0], self.exec)
        if rows:
            lst.stage_graphs[(0, lead.program.spec.batch_size_for(rows))].replay(self.exec)
            lead_mids = [r.buffer.view(r.offset, t.datatype.tensor_dtype, (rows, *t.sample_shape))
                         for r, t in zip(lst.mids, mid_specs(lead.program), strict=True)]
            cache = self.prefix_cache

            def snapshot() -> None:
                with torch.inference_mode():
                    computed = tuple(v.clone() for v in lead_mids)
                    mid.append(computed)
                    plan.keep(cache, computed)
            api.launch(self.exec, snapshot, [r.sub(0, rows * n) for r, n in zip(lst.mids, lst.mid_row_bytes,
                                                                                  strict=True)], [])
        else:  # every request's first-stage output was held
            mid.append(())
        first = 0
        for i, ((res, reqs), st, n) in enumerate(zip(members, sts, counts, strict=True)):
            api.record(events[i + 1], self.exec)
            dests = [r.buffer.view(r.offset, t.datatype.tensor_dtype, (n, *t.sample_shape))
                     for r, t in zip(st.mids, mid_specs(res.program), strict=True)]
            api.launch(self.exec, self._gather(res, mid, plan, first, len(reqs), dests), [],
                       [r.sub(0, n * rb) for r, rb in zip(st.mids, st.mid_row_bytes, strict=True)])
            st.stage_graphs[(1, res.program.spec.batch_size_for(n))].replay(self.exec)
            first += len(reqs)

    def _run_parts(self, lead: Resident, members: Sequence[tuple[Resident, Sequence[InferenceRequest]]],
                   sts: list[CudaResident], counts: list[int], rows: int, plan: PrefixPlan,
                   mid: list[tuple[torch.Tensor, ...]], events: list[Event]) -> None:
        """A cross-model batch as eager kernels (no graphs for its parts): the first stage once over
        the computed rows in the lead's static inputs, then each member's rest on its own rows."""
        api, lst, cache = self.api, sts[0], self.prefix_cache
        ins = [r.buffer.view(r.offset, t.datatype.tensor_dtype, (rows, *t.sample_shape))
               for r, t in zip(lst.inputs, lead.program.spec.inputs, strict=True)]
        chain = lead.runner
        assert isinstance(chain, Chain)

        def prefix() -> None:
            with torch.inference_mode():
                computed = chain.stages[0](ins)
                mid.append(computed)
                plan.keep(cache, computed)  # copies, on this stream, after the stage wrote them
        api.record(events[0], self.exec)
        if rows:
            api.launch(self.exec, prefix, [*lst.weight_regions, *(r.sub(0, rows * n) for r, n in
                                                                 zip(lst.inputs, lst.in_row_bytes, strict=True))], [])
        else:  # every request's prefix output was held
            mid.append(())
        first = 0
        for i, ((res, reqs), st, n) in enumerate(zip(members, sts, counts, strict=True)):
            api.record(events[i + 1], self.exec)
            dests = [r.buffer.view(r.offset, t.datatype.tensor_dtype, (n, *t.sample_shape))
                     for r, t in zip(st.outputs, res.program.spec.outputs, strict=True)]
            api.launch(self.exec, self._tail(res, mid, plan, first, len(reqs), dests), st.weight_regions,
                       [r.sub(0, n * rb) for r, rb in zip(st.outputs, st.out_row_bytes, strict=True)])
            first += len(reqs)

    @staticmethod
    def _gather(res: Resident, mid: list[tuple[torch.Tensor, ...]], plan: PrefixPlan, first: int, count: int,
                dests: list[torch.Tensor]) -> Callable[[], None]:
        """A member's requests' first-stage outputs (computed in this batch, or held) into its static ones."""
        def gather() -> None:
            with torch.inference_mode():
                for dst, src in zip(dests, plan.parts(mid[0], first, count), strict=True):
                    dst.copy_(src)
        gather.__name__ = f"{res.key} gather, requests {first}..{first + count - 1}"
        return gather

    @staticmethod
    def _tail(res: Resident, mid: list[tuple[torch.Tensor, ...]], plan: PrefixPlan, first: int, count: int,
              outs: list[torch.Tensor]) -> Callable[[], None]:
        """A member's stages after the first, on its requests' first-stage outputs (computed in this
        batch, or held by the prefix cache), into `outs`."""
        chain = res.runner
        assert isinstance(chain, Chain)

        def tail() -> None:
            with torch.inference_mode():
                result = chain.tail(plan.parts(mid[0], first, count))
                for dst, src in zip(outs, result, strict=True):
                    dst.copy_(src)
        tail.__name__ = f"{res.key} tail, requests {first}..{first + count - 1}"
        return tail

    def _stage_events(self, n: int) -> list[Event]:
        """`n` timing events for a cross-model batch's kernels, made on first need and kept (at most
        one per member a batch may hold, sharing.MAX_MEMBERS + 2)."""
        while len(self._events_staged) < n:
            self._events_staged.append(self.api.event())
        return self._events_staged

    def _deadline(self) -> float:
        return time.monotonic() + self.hang_timeout_s

    def close(self) -> None:
        with self._lock:
            residents = list(self._residents.values())
        for res in residents:  # registered host memory must never outlive the backend
            try:
                self._release(res, res.state)
            except Exception as e:
                log.warning("%s: releasing %s at close failed: %s", self.device.name, res.key, e)
        for gs in self.graph_cache.clear():  # before the memory they replay over
            gs.close()
        self._unpin(self.pinned_pool.clear())
        c = self.graph_cache
        if c.hits or c.misses:
            log.info("%s: %d LOAD(s) replayed parked graphs, %d captured their own (%d graph set(s) evicted)",
                     self.device.name, c.hits, c.misses, c.evicted)
        try:
            if not self._failed:
                self.api.synchronize(self._deadline())
        except DeviceFault:
            pass
        for buf in self._staging:
            try:
                self.api.unpin(buf)
            except Exception as e:
                log.warning("%s: unpinning its staging ring failed: %s", self.device.name, e)
            self.host.release(buf.nbytes)
        self._staging = []
        with self._lock:
            self._views.clear()  # (tensors over the arena: none may outlive it)
        if not self.arena_buf.freed:
            self.api.free(self.arena_buf)
        limit = getattr(self.api, "limit", None)
        if limit is not None:
            limit(None)
        self.api.close()
