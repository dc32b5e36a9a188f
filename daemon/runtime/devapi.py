"""The device seam: everything the CUDA backend asks of a GPU, as one small interface.

Two implementations exist: `torchcuda.TorchCuda` over `torch.cuda` (the only module that
imports it), and `emucuda.EmuCuda`, a CPU stand-in that keeps CUDA's semantics (work queued
per stream and run later, events, copy engines, a fixed capacity, graph capture rules,
injectable faults) and checks every access for races. The backend (`runtime/cuda.py`) is
written once against this interface, so CI runs its logic without a GPU.

Memory comes as `Buffer`s (flat bytes: device memory, or pinned host memory) and is accessed
through `Region`s of them. Every stream operation names the regions it reads and writes, so
the stand-in can check them; the host declares its own reads and writes of pinned memory
(`host_read`, `host_write`) for the same reason. On a real GPU these declarations cost
nothing.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class DeviceFault(RuntimeError):
    """The device is unusable from now on (a sticky CUDA error such as a device-side assert)."""


class DeviceHang(DeviceFault):
    """Device work did not finish by its deadline: the device is treated as hung."""


class CaptureError(RuntimeError):
    """Something a CUDA graph capture does not permit (a host sync, an allocation, a host read)."""


class Where(enum.IntEnum):
    DEVICE = 1
    PINNED = 2  # page-locked host memory: copies from and to it are asynchronous
    PAGEABLE = 3  # plain host memory: only the host touches it


_buffer_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class Buffer:
    """Flat bytes the device API handed out (or registered): `tensor` is uint8, one dimension."""

    tensor: torch.Tensor
    where: Where
    label: str = ""
    id: int = field(default_factory=lambda: next(_buffer_ids))
    freed: bool = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def region(self, offset: int = 0, nbytes: int | None = None) -> Region:
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"region [{offset}, {offset + n}) outside {self.label or 'buffer'} of {self.nbytes} bytes")
        return Region(self, offset, n)

    def view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A typed tensor over bytes [offset, offset + its size) (offset aligned for dtype)."""
        n = dtype.itemsize
        for s in shape:
            n *= s
        raw = self.tensor[offset : offset + n]
        if n == 0:
            return torch.empty(tuple(shape), dtype=dtype, device=self.tensor.device)
        return raw.view(dtype).view(tuple(shape))


@dataclass(frozen=True, slots=True)
class Region:
    buffer: Buffer
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def bytes(self) -> torch.Tensor:
        return self.buffer.tensor[self.offset : self.end]

    def sub(self, offset: int, nbytes: int) -> Region:
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"sub-region [{offset}, {offset + nbytes}) outside a region of {self.nbytes} bytes")
        return Region(self.buffer, self.offset + offset, nbytes)


class Stream(Protocol):
    name: str


class Event(Protocol):
    def query(self) -> bool:
        """True once the work before the record point has finished (True if never recorded)."""
        ...

    def wait(self, deadline: float | None) -> None:
        """Block the host until the event completes; DeviceHang past `deadline` (monotonic s),
        DeviceFault if the device failed."""
        ...

    def elapsed_s(self, end: Event) -> float:
        """Device seconds between this event and `end`, both recorded and complete."""
        ...


class Graph(Protocol):
    nbytes: int  # memory the graph's private allocations added to the device's graph pool

    def replay(self, stream: Stream) -> None: ...

    def close(self) -> None:
        """Drop the graph; its share of the graph pool is released once no graph needs it."""
        ...


Kernel = Callable[[], None]


class DeviceApi(Protocol):
    """One CUDA device, as the backend sees it. Thread-safe; one instance per device per process."""

    name: str
    kind: str  # "cuda" or "emucuda"
    torch_device: torch.device  # where kernels' tensors live (cuda:N; cpu for the stand-in)
    allocations: int  # buffers, events, pins and graphs made so far (tests: zero during INFER)

    def stream(self, name: str, priority: int = 0) -> Stream: ...

    # Whether an `external` event recorded inside a capture becomes a node of the graph, so that
    # every replay records it: a graph's own device time, without the host's launch of it.
    graph_events: bool

    def event(self, timing: bool = True, external: bool = False) -> Event: ...

    def record(self, event: Event, stream: Stream) -> None:
        """Enqueue the event on `stream`; inside a capture only an `external` event may be recorded
        (CaptureError otherwise), and then each replay of the graph records it."""
        ...

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Work enqueued on `stream` after this waits for `event` (the host does not wait)."""
        ...

    def alloc(self, nbytes: int, label: str = "") -> Buffer:
        """Device memory; raises torch.OutOfMemoryError past the device's capacity."""
        ...

    def free(self, buffer: Buffer) -> None:
        """Release device memory; the caller makes sure no queued work still uses it."""
        ...

    def alloc_pinned(self, nbytes: int, label: str = "") -> Buffer:
        """Fresh page-locked host memory of exactly `nbytes` (rounded to a page, never to a power of two)."""
        ...

    def pin(self, tensor: torch.Tensor, label: str = "") -> Buffer:
        """Page-lock existing host memory (a flat uint8 tensor) in place."""
        ...

    def unpin(self, buffer: Buffer) -> None: ...

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked through this API (alloc_pinned and pin), now."""
        ...

    def copy(self, dst: Region, src: Region, stream: Stream) -> None:
        """An asynchronous copy on `stream` (host to device, device to host, or device to device)."""
        ...

    def launch(self, stream: Stream, kernel: Kernel, reads: Sequence[Region], writes: Sequence[Region]) -> None:
        """Run `kernel` (torch ops on tensors over the regions) on `stream`."""
        ...

    def host_read(self, region: Region) -> None:
        """The host is about to read pinned memory (the stand-in checks it is not still being written)."""
        ...

    def host_write(self, region: Region) -> None:
        """The host is about to write pinned memory (the stand-in checks nothing still reads it)."""
        ...

    def discard(self, region: Region, stream: Stream) -> None:
        """The region's content is dead once `stream`'s work so far is done (the stand-in poisons it)."""
        ...

    def capture(self, stream: Stream, body: Callable[[], None]) -> Graph:
        """A CUDA graph of the work `body` enqueues on `stream`; raises CaptureError if not capturable."""
        ...

    @property
    def graph_pool_bytes(self) -> int:
        """Device memory held by the device's graph pool (shared by every graph captured here)."""
        ...

    def memory(self) -> tuple[int, int]:
        """(free, total) device bytes."""
        ...

    def synchronize(self, deadline: float | None = None) -> None:
        """Wait for all work on the device; DeviceHang past `deadline`."""
        ...

    def check(self) -> None:
        """Raise DeviceFault if the device has failed."""
        ...

    def close(self) -> None: ...
