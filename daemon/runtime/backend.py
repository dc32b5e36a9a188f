"""What an executor needs from a device: memory for weights, copies, and running a batch.

`CpuBackend` runs on the calling executor thread with a fixed number of intra-op threads;
`CudaBackend` (runtime/cuda.py) uses separate streams for weights, IO and execution.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from daemon.repository import ModelSpec
from daemon.request import InferenceRequest
from daemon.runtime.devices import Device
from daemon.runtime.program import Runner


@dataclass(slots=True, eq=False)
class IOBuffers:
    """Preallocated inputs of one model at one batch size: no allocation on the data path."""

    batch_size: int
    host: list[np.ndarray]  # numpy views the executor fills (pinned on CUDA)
    device: list[torch.Tensor]  # what the runner receives (the same memory on CPU)
    filled: int = 0  # rows written by the last batch, so only stale rows get zeroed
    input_ptrs: frozenset[int] = field(default_factory=frozenset)

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


class Backend(Protocol):
    device: Device

    def thread_setup(self) -> None: ...

    def alloc(self, nbytes: int) -> torch.Tensor: ...

    def free(self, block: torch.Tensor) -> None: ...

    def copy_weights(self, host: torch.Tensor, dst: torch.Tensor) -> float: ...

    def make_io(self, spec: ModelSpec, batch: int) -> IOBuffers: ...

    def infer(self, runner: Runner, io: IOBuffers) -> tuple[tuple[np.ndarray, ...], float]: ...


class CpuBackend:
    """A CPU worker standing in for a GPU: weights copied into blocks the budget accounts."""

    def __init__(self, device: Device, threads: int = 1) -> None:
        self.device = device
        self.threads = threads

    def thread_setup(self) -> None:
        # Intra-op threads are per calling thread under OpenMP; set them on each executor thread.
        torch.set_num_threads(self.threads)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def free(self, block: torch.Tensor) -> None:
        del block

    def copy_weights(self, host: torch.Tensor, dst: torch.Tensor) -> float:
        t0 = time.perf_counter()
        dst.copy_(host)
        return time.perf_counter() - t0

    def make_io(self, spec: ModelSpec, batch: int) -> IOBuffers:
        tensors = [torch.zeros((batch, *t.sample_shape), dtype=t.datatype.torch) for t in spec.inputs]
        return IOBuffers(batch, [t.numpy() for t in tensors], tensors,
                         input_ptrs=frozenset(t.untyped_storage().data_ptr() for t in tensors))

    def infer(self, runner: Runner, io: IOBuffers) -> tuple[tuple[np.ndarray, ...], float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            outs = runner(io.device)
        duration = time.perf_counter() - t0
        # An output that aliases an input buffer would be overwritten by the next batch.
        return tuple(
            (o.clone() if o.untyped_storage().data_ptr() in io.input_ptrs else o).numpy() for o in outs
        ), duration
