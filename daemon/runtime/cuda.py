"""The CUDA backend: one exec stream, one copy stream for weights, one stream for IO copies.

Weights come from pinned host blocks in one large asynchronous copy on the copy stream, so a
LOAD never waits behind (or delays) inference. Inputs are staged in pinned buffers and copied
on the IO stream, so they do not queue behind weight copies either. Device durations come
from CUDA events. Only one inference runs at a time on a device: the exec stream serialises
them, which is what makes their durations predictable.
"""

from __future__ import annotations

import numpy as np
import torch

from daemon.repository import ModelSpec
from daemon.runtime.backend import IOBuffers
from daemon.runtime.devices import Device
from daemon.runtime.program import Runner


class CudaBackend:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.torch_device = torch.device("cuda", device.index)
        self.exec_stream = torch.cuda.Stream(self.torch_device)
        self.copy_stream = torch.cuda.Stream(self.torch_device)
        self.io_stream = torch.cuda.Stream(self.torch_device, priority=-1)

    def thread_setup(self, role: str) -> None:
        torch.cuda.set_device(self.torch_device)

    def alloc(self, nbytes: int) -> torch.Tensor:
        with torch.cuda.stream(self.copy_stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)

    def free(self, block: torch.Tensor) -> None:
        # The controller unloads only models with nothing in flight; syncing the exec stream
        # makes sure no queued kernel still reads the block when the allocator reuses it.
        self.exec_stream.synchronize()
        del block

    def trim(self, limit: int) -> None:
        # The caching allocator keeps freed blocks; return what the budget no longer leaves room for.
        if torch.cuda.memory_reserved(self.torch_device) - torch.cuda.memory_allocated(self.torch_device) > limit:
            torch.cuda.empty_cache()

    def copy_weights(self, host: torch.Tensor, dst: torch.Tensor) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            start.record()
            dst.copy_(host, non_blocking=True)
            end.record()
        end.synchronize()
        # The exec stream must see the finished copy before any kernel reads the weights.
        dst.record_stream(self.exec_stream)
        return start.elapsed_time(end) / 1000.0

    def make_io(self, spec: ModelSpec, batch: int) -> IOBuffers:
        host = [torch.zeros((batch, *t.sample_shape), dtype=t.datatype.torch).pin_memory() for t in spec.inputs]
        dev = [torch.zeros((batch, *t.sample_shape), dtype=t.datatype.torch, device=self.torch_device)
               for t in spec.inputs]
        io = IOBuffers(batch, [h.numpy() for h in host], dev)
        io.pinned = host  # type: ignore[attr-defined]  # keep the pinned tensors alive
        return io

    def infer(self, runner: Runner, io: IOBuffers, rows: int) -> tuple[tuple[np.ndarray, ...], float]:
        copied = torch.cuda.Event()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        pinned: list[torch.Tensor] = io.pinned  # type: ignore[attr-defined]
        with torch.cuda.stream(self.io_stream):
            for d, h in zip(io.device, pinned, strict=True):
                d.copy_(h, non_blocking=True)
            copied.record()
        self.exec_stream.wait_event(copied)
        with torch.cuda.stream(self.exec_stream), torch.inference_mode():
            begin.record()
            outs = runner(io.device)
            end.record()
        self.io_stream.wait_event(end)
        with torch.cuda.stream(self.io_stream):
            host_outs = []
            for o in outs:
                o.record_stream(self.io_stream)
                h = torch.empty(o.shape, dtype=o.dtype, pin_memory=True)
                h.copy_(o, non_blocking=True)
                host_outs.append(h)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        return tuple(h.numpy()[:rows] for h in host_outs), begin.elapsed_time(end) / 1000.0
