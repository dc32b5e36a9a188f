"""What an executor needs from a device: placing a model, running a batch, removing a model.

`CpuBackend` runs on the calling executor thread with a fixed number of intra-op threads;
`CudaBackend` (runtime/cuda.py) drives a CUDA device, or its CPU stand-in, through the device
seam (runtime/devapi.py). A backend owns the device's memory and its accounting; the executor
only orders actions and reports results.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from daemon.model import ModelSpec
from daemon.parity.codes import encode_requests
from daemon.request import InferenceRequest
from daemon.runtime.devices import Device
from daemon.runtime.prefixcache import PrefixCache, plan_prefix
from daemon.runtime.program import Chain, Program, Runner, prefix_key, tail_key


@dataclass(slots=True, eq=False)
class IOBuffers:
    """Preallocated inputs of one model at one batch size: no allocation on the data path."""

    batch_size: int
    host: list[np.ndarray]  # numpy views the executor fills (pinned on CUDA)
    device: list[torch.Tensor]  # what the runner receives (the same memory on CPU)
    filled: int = 0  # rows written by the last batch, so only stale rows get zeroed
    input_ptrs: frozenset[int] = field(default_factory=frozenset)

    def fill_coded(self, members: Sequence[Sequence[InferenceRequest]], encoder: str) -> int:
        """A parity batch: each member's rows, encoded (parity/codes.py, the same code training used)."""
        rows = encode_requests(self.host, members, encoder)
        for buf in self.host:
            if rows < self.filled:
                buf[rows : self.filled] = 0
        self.filled = rows
        return rows

    def fill(self, requests: Sequence[InferenceRequest]) -> int:
        rows = 0
        for i, buf in enumerate(self.host):
            rows = 0
            for r in requests:
                buf[rows : rows + r.samples] = r.inputs[i]
                rows += r.samples
            if rows < self.filled:
                buf[rows : self.filled] = 0
        self.filled = rows
        return rows


class NoMemory(RuntimeError):
    """A LOAD that does not fit the device's budget now (evicting others would make room)."""


@dataclass(slots=True, eq=False)
class Resident:
    """A model's weights on a device, with its bound runner and IO buffers per batch size."""

    key: str
    program: Program
    charged: int  # device bytes this model holds (weights, IO buffers)
    runner: Runner
    io: dict[int, IOBuffers]
    state: Any = None  # the backend's own (device extents, graphs, output rings)
    notes: str = ""  # what the backend could not do for it (e.g. why it runs without CUDA graphs)
    # Its LOAD did one-time work a later LOAD of its kind may skip (warm-ups, graph captures): its
    # time is not what the next LOAD takes
    set_up: bool = False


Fill = Callable[[IOBuffers], int]  # writes a batch into the IO buffers' host side; returns its rows


class Backend(Protocol):
    device: Device

    def thread_setup(self, role: str) -> None:
        """Called on each executor thread as it starts; `role` is "infer" or "load"."""
        ...

    def footprint(self, program: Program) -> int:
        """Device bytes a LOAD of `program` charges (what the controller reserves for it)."""
        ...

    @property
    def charged(self) -> int:
        """Device bytes charged now: resident models plus any fixed reserve."""
        ...

    @property
    def failed(self) -> str:
        """Why the device is unusable ("" while it is healthy)."""
        ...

    def load(self, key: str, program: Program, deadline: float) -> tuple[Resident, float]:
        """Place a model; (its resident, device seconds of the copy). Raises NoMemory when it does
        not fit, DeviceFault when the device failed; leaves nothing behind when it raises."""
        ...

    def unload(self, res: Resident) -> None: ...

    def infer(self, res: Resident, io: IOBuffers, fill: Fill, deadline: float) -> tuple[tuple[np.ndarray, ...], float]:
        """Fill `io`, run it; outputs have exactly the filled rows; (outputs, device seconds)."""
        ...

    def close(self) -> None: ...


class BlockPool:
    """Freed weight blocks kept for reuse by size, as a GPU allocator keeps its pages.

    A fresh block of host memory costs a page fault per 4 KiB page on first touch (a 52 MB
    LOAD took ~100 ms instead of ~10 ms); a reused block is already mapped. Kept blocks count
    against the device's budget with the live ones: `trim` releases them to the OS as needed.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self.cached = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        blocks = self._free.get(nbytes)
        if not blocks:
            return None
        self.cached -= nbytes
        return blocks.pop()

    def give(self, block: torch.Tensor) -> None:
        n = block.numel()
        self._free.setdefault(n, []).append(block)
        self.cached += n

    def trim(self, limit: int) -> None:
        """Release kept blocks (largest first) until at most `limit` bytes are kept."""
        for n in sorted(self._free, reverse=True):
            blocks = self._free[n]
            while blocks and self.cached > limit:
                blocks.pop()
                self.cached -= n
            if not blocks:
                del self._free[n]


_THREAD = threading.local()  # an executor thread's own state (CpuBackend.thread_setup)


class CpuBackend:
    """A CPU worker standing in for a GPU: weights copied into blocks the budget accounts.

    Blocks are per distinct tensor (content id, runtime/objstore.py) and held once: a LOAD copies
    and charges only the blocks the device lacks, an UNLOAD frees those no other resident model
    holds (the controller's memory map accounts the same way: controller/memory.py). Without
    `shares` (runtime.share_weights off) every model holds blocks of its own, as black-box
    serving does.
    """

    def __init__(self, device: Device, threads: int = 1, core: int | None = None,
                 prefix_cache: PrefixCache | None = None, shares: bool = True) -> None:
        self.device = device
        self.shares = shares
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(0, 0)
        self.threads = threads
        self.core = core  # the core the INFER thread is pinned to, if any
        self.pool = BlockPool()
        self.used = 0
        self.blocks: dict[str, tuple[torch.Tensor, int]] = {}  # content id -> (block, resident models holding it)
        self._lock = threading.Lock()

    @property
    def charged(self) -> int:
        return self.used

    @property
    def failed(self) -> str:
        return ""

    def thread_setup(self, role: str) -> None:
        # Intra-op threads are per calling thread under OpenMP; set them on each executor thread.
        torch.set_num_threads(self.threads)
        if role == "infer":
            if self.core is not None:
                os.sched_setaffinity(0, {self.core})  # this thread only
            # Everything this thread runs is inference: the mode is entered once for the thread's
            # life (thread-local), where a `with torch.inference_mode()` per run was four Python
            # calls (~5k instructions). Held by the thread's own storage until it ends.
            mode = torch.inference_mode()
            mode.__enter__()
            _THREAD.inference = mode

    def footprint(self, program: Program) -> int:
        return program.block_bytes

    def load(self, key: str, program: Program, deadline: float) -> tuple[Resident, float]:
        # One LOAD or UNLOAD at a time per device (its load lane), so what is missing stays missing.
        with self._lock:
            missing = [(cid, n) for cid, n in program.blocks if self._bk(key, cid) not in self.blocks]
            nbytes = sum(n for _, n in missing)
            # kept blocks and live weights together stay within the budget
            self.pool.trim(self.device.weight_budget - self.used - nbytes)
            if self.used + nbytes > self.device.weight_budget:
                raise NoMemory(f"insufficient weight memory on {self.device.name}: {nbytes} bytes needed, "
                               f"{self.device.weight_budget - self.used} free")
            self.used += nbytes
        copied: dict[str, torch.Tensor] = {}
        handed = False  # the copied blocks belong to self.blocks (then _drop undoes the LOAD)
        try:
            source = dict(zip(program.cids, program.host_tensors, strict=True))
            t0 = time.perf_counter()
            for cid, n in missing:
                block = self.pool.take(n)
                if block is None:
                    block = torch.empty(n, dtype=torch.uint8)
                t = source[cid]
                block[: t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
                copied[cid] = block
            duration = time.perf_counter() - t0
            with self._lock:
                for cid, _ in program.blocks:
                    bk = self._bk(key, cid)
                    block, holders = self.blocks.get(bk) or (copied[cid], 0)
                    self.blocks[bk] = (block, holders + 1)
                handed = True
            try:
                runner = program.bind(self._views(key, program), native=True, owner=f"{self.device.name}/{key}")
                io = {b: self._make_io(program.spec, b) for b in program.spec.batch_sizes}
            except BaseException:
                program.release(f"{self.device.name}/{key}")
                self._drop(key, program)
                raise
        except BaseException:
            if not handed:
                with self._lock:
                    for block in copied.values():
                        self.pool.give(block)
                    self.used -= nbytes
            raise
        return Resident(key, program, nbytes, runner, io), duration

    def _bk(self, key: str, cid: str) -> str:
        """The key a block is held under: its content, or (not sharing) its model's too."""
        return cid if self.shares else f"{key}|{cid}"

    def _views(self, key: str, program: Program) -> list[torch.Tensor]:
        """The program's weights over this device's blocks, one per layout entry."""
        out: list[torch.Tensor] = []
        for cid, e in zip(program.cids, program.layout.entries, strict=True):
            if e.nbytes:
                out.append(self.blocks[self._bk(key, cid)][0][: e.nbytes].view(e.dtype).view(e.shape))
            else:
                out.append(torch.empty(e.shape, dtype=e.dtype))
        return out

    def _drop(self, key: str, program: Program) -> int:
        """Let go of a program's blocks; those no resident model holds any more are freed. Bytes freed."""
        freed = 0
        with self._lock:
            for cid, n in program.blocks:
                bk = self._bk(key, cid)
                block, holders = self.blocks[bk]
                if holders > 1:
                    self.blocks[bk] = (block, holders - 1)
                    continue
                del self.blocks[bk]
                self.pool.give(block)
                freed += n
            self.used -= freed
        return freed

    def unload(self, res: Resident) -> None:
        res.program.release(f"{self.device.name}/{res.key}")
        res.charged = self._drop(res.key, res.program)  # what the UNLOAD freed (shared blocks stay)

    @staticmethod
    def _make_io(spec: ModelSpec, batch: int) -> IOBuffers:
        tensors = [torch.zeros((batch, *t.sample_shape), dtype=t.datatype.tensor_dtype) for t in spec.inputs]
        return IOBuffers(batch, [t.numpy() for t in tensors], tensors,
                         input_ptrs=frozenset(t.untyped_storage().data_ptr() for t in tensors))

    def infer(self, res: Resident, io: IOBuffers, fill: Fill, deadline: float) -> tuple[tuple[np.ndarray, ...], float]:
        rows = fill(io)
        # On a CPU a padded row costs as much as a real one, so only the filled rows run (the
        # graph's batch dimension is dynamic); GPUs run fixed sizes for their CUDA graphs.
        xs = io.device if rows == io.batch_size else [t[:rows] for t in io.device]
        t0 = time.perf_counter()
        if torch.is_inference_mode_enabled():  # (the lane's thread: thread_setup)
            outs = res.runner(xs)
        else:  # (the latency path, on the loop's thread)
            with torch.inference_mode():
                outs = res.runner(xs)
        duration = time.perf_counter() - t0
        # An output that aliases an input buffer would be overwritten by the next batch.
        return tuple(
            (o.clone() if o.untyped_storage().data_ptr() in io.input_ptrs else o).numpy() for o in outs
        ), duration

    def infer_staged(self, members: Sequence[tuple[Resident, Sequence[InferenceRequest]]], io: IOBuffers
                     ) -> tuple[list[tuple[np.ndarray, ...]], float, tuple[tuple[str, int, float], ...]]:
        """Plans of stages sharing their first (one model, or a cross-model batch): the first stage
        once on every request's rows (in `io`, the first member's buffers), minus those whose
        output the prefix cache holds and repeats of one input; then each member's other stages on
        its own rows. (each member's outputs, device seconds, (estimate key, rows, seconds) per
        stage run)."""
        lead = members[0][0]
        assert isinstance(lead.runner, Chain) and lead.program.stages
        sid = lead.program.stages[0].sid
        plan = plan_prefix(self.prefix_cache, sid, [r for _, reqs in members for r in reqs])
        t0 = time.perf_counter()
        rows = io.fill(plan.run) if plan.run else 0
        computed: tuple[torch.Tensor, ...] = ()
        if rows:
            xs = io.device if rows == io.batch_size else [t[:rows] for t in io.device]
            with torch.inference_mode():
                computed = lead.runner.stages[0](xs)
            if any(o.untyped_storage().data_ptr() in io.input_ptrs for o in computed):
                computed = tuple(o.clone() for o in computed)  # the next batch overwrites the buffers
        t1 = time.perf_counter()
        plan.keep(self.prefix_cache, computed)
        out: list[tuple[np.ndarray, ...]] = []
        stage_runs = [(prefix_key(sid), rows, t1 - t0)]
        i = 0
        for res, reqs in members:
            xs2 = plan.parts(computed, i, len(reqs))
            i += len(reqs)
            assert isinstance(res.runner, Chain)
            t2 = time.perf_counter()
            with torch.inference_mode():
                outs = res.runner.tail(xs2)
            stage_runs.append((tail_key(res.program.spec.key), sum(r.samples for r in reqs), time.perf_counter() - t2))
            out.append(tuple(o.numpy() for o in outs))
        return out, time.perf_counter() - t0, tuple(stage_runs)

    def close(self) -> None:
        self.pool.trim(0)
