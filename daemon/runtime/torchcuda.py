"""The device seam over `torch.cuda`: the only module of the daemon that touches it.

Notes on what torch does by default and why this module does otherwise:
- Streams come from torch's pool, which hands the same streams out again after 32 requests;
  ours are made once per device per process and checked distinct.
- Pinned memory from `pin_memory=True` goes through torch's caching host allocator, which
  rounds each block up to a power of two and keeps it; ours registers exactly the bytes asked
  for (`cudaHostRegister`) and unregisters them when told.
- `torch.cuda.graph(...)` synchronizes the whole device and empties the cache on entry (a
  device-wide stall under live work); captures here call `capture_begin/capture_end` on our
  capture stream directly, in thread-local capture mode, so other threads keep working.
- Host waits poll the event with a deadline instead of `synchronize()`, which cannot time out.
- Errors from CUDA (a device-side assert, an illegal address) leave the context unusable:
  they are turned into DeviceFault, and every later call raises it.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from daemon.runtime.devapi import Buffer, CaptureError, DeviceFault, DeviceHang, Kernel, Region, Where
from daemon.runtime.hostmem import page_aligned

PAGE = 4096
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context
_SPIN_S = 50e-6  # poll without sleeping this long, then sleep in growing steps up to _POLL_MAX_S
_POLL_MAX_S = 200e-6
_SANITIZING = os.environ.get("TORCH_CUDA_SANITIZER", "") not in ("", "0")
# Host ranges this process has page-locked: pointer -> [bytes, owners] (see TorchCuda.pin).
_REGISTERED: dict[int, list[int]] = {}
_REGISTERED_LOCK = threading.Lock()


def device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_name(index: int) -> str:
    """The device's model as the driver names it ("NVIDIA H100 80GB HBM3")."""
    return str(torch.cuda.get_device_name(index))


def memory(index: int) -> tuple[int, int]:
    free, total = torch.cuda.mem_get_info(index)
    return int(free), int(total)


def _is_cuda_error(e: BaseException) -> bool:
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or (isinstance(e, RuntimeError) and "CUDA error" in str(e))


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (the same instance: same per-thread state)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libcudart.so" in ln}
    except OSError:
        return None
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def _end_capture(raw: torch.cuda.Stream) -> bool:
    """End a capture torch left open on `raw` after a failure; True if it is still open."""
    with torch.cuda.stream(raw):
        if not torch.cuda.is_current_stream_capturing():
            return False
    lib = _cudart()
    if lib is None:
        return True
    graph = ctypes.c_void_p()
    lib.cudaStreamEndCapture(ctypes.c_void_p(raw.cuda_stream), ctypes.byref(graph))
    if graph.value:
        lib.cudaGraphDestroy(graph)
    lib.cudaGetLastError()  # the invalidated capture's error must not surface at the next launch
    with torch.cuda.stream(raw):
        return bool(torch.cuda.is_current_stream_capturing())


class CudaStream:
    def __init__(self, name: str, raw: torch.cuda.Stream) -> None:
        self.name = name
        self.raw = raw


# torch >= 2.9 records an `external` event inside a capture as a node of the graph (each replay
# records it); before that it had no such flag and an in-capture record was a fork/join edge.
_GRAPH_EVENTS = "external" in inspect.signature(torch.cuda.Event.__new__).parameters


class CudaEvent:
    def __init__(self, dev: TorchCuda, timing: bool, external: bool = False) -> None:
        self._dev = dev
        self.external = external and _GRAPH_EVENTS
        self.raw = (torch.cuda.Event(enable_timing=timing, external=True) if self.external
                    else torch.cuda.Event(enable_timing=timing))
        self.recorded = False

    def query(self) -> bool:
        return self._dev._guard(self.raw.query)

    def wait(self, deadline: float | None) -> None:
        self._dev._poll(self.raw.query, deadline, "an event")
        if _SANITIZING:  # torch's CUDA sanitizer sees synchronize, not our polls: the event is done
            self.raw.synchronize()

    def elapsed_s(self, end: CudaEvent) -> float:
        return self._dev._guard(lambda: self.raw.elapsed_time(end.raw)) / 1000.0


class CudaGraph:
    def __init__(self, dev: TorchCuda, raw: torch.cuda.CUDAGraph, nbytes: int) -> None:
        self._dev = dev
        self.raw: torch.cuda.CUDAGraph | None = raw
        self.nbytes = nbytes

    def replay(self, stream: CudaStream) -> None:
        if self.raw is None:
            raise RuntimeError("replay of a closed graph")
        raw = self.raw

        def run() -> None:
            with torch.cuda.stream(stream.raw):
                raw.replay()
        self._dev._guard(run)

    def close(self) -> None:
        if self.raw is None:
            return
        self._dev._guard(self.raw.reset)  # the graph's share of the pool goes back to it
        self.raw = None
        self._dev._graphs -= 1
        self._dev._graph_bytes -= self.nbytes
        if self._dev._graphs == 0:  # the pool is retired with its last graph (see TorchCuda)
            self._dev._pool = torch.cuda.graph_pool_handle()


class TorchCuda:
    """One CUDA device of this process; see the module docstring."""

    kind = "cuda"
    graph_events = _GRAPH_EVENTS

    def __init__(self, index: int) -> None:
        self.index = index
        self.name = f"cuda:{index}"
        self.torch_device = torch.device("cuda", index)
        self.allocations = 0
        self.fault = ""
        self._streams: dict[str, CudaStream] = {}
        self._pinned: dict[int, tuple[int, int]] = {}  # buffer id -> (pointer, page-rounded bytes)
        torch.cuda.init()
        torch.cuda.set_device(self.torch_device)
        # One graph pool for the device (cuda.py says why). torch retires a pool when its last
        # graph goes and asserts (use_count > 0, seen on torch 2.11 in both its device and its
        # host allocator) if a later capture names it again: a fresh handle is taken then.
        self._pool = torch.cuda.graph_pool_handle()
        self._limited = False
        self._graph_bytes = 0  # what live graphs took from the allocator when captured
        self._graphs = 0
        self._buffer_bytes = 0
        self._capturing: set[int] = set()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- errors

    def _guard(self, fn: Callable[[], Any]) -> Any:
        if self.fault:
            raise DeviceFault(f"{self.name}: {self.fault}")
        try:
            return fn()
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            if _is_cuda_error(e) and threading.get_ident() not in self._capturing:
                # (inside a capture, an error invalidates the capture, not the context: capture()
                # turns it into a CaptureError.) The line naming the CUDA error (TorchScript puts
                # its trace first) is kept.
                lines = str(e).splitlines() or [type(e).__name__]
                self.fault = next((ln.strip() for ln in lines if "CUDA error" in ln), lines[0])
                raise DeviceFault(f"{self.name}: {self.fault}") from e
            raise

    def _poll(self, done: Callable[[], bool], deadline: float | None, what: str) -> None:
        if threading.get_ident() in self._capturing:
            raise CaptureError(f"{self.name}: cannot synchronize while capturing a graph")
        start = time.monotonic()
        pause = 10e-6
        while not self._guard(done):
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise DeviceHang(f"{self.name}: {what} did not finish by its deadline")
            if now - start > _SPIN_S:
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)

    def check(self) -> None:
        self._guard(lambda: None)

    def thread_setup(self) -> None:
        torch.cuda.set_device(self.torch_device)

    # ---------------------------------------------------------------- streams and events

    def stream(self, name: str, priority: int = 0) -> CudaStream:
        with self._lock:
            if name in self._streams:  # made once per device per process, whoever asks again
                return self._streams[name]
            raw = self._guard(lambda: torch.cuda.Stream(self.torch_device, priority=priority))
            if any(s.raw.cuda_stream == raw.cuda_stream for s in self._streams.values()):
                raise RuntimeError(f"{self.name}: torch handed out stream {name} twice (its pool is exhausted)")
            s = self._streams[name] = CudaStream(name, raw)
            self.allocations += 1
            return s

    def event(self, timing: bool = True, external: bool = False) -> CudaEvent:
        self.allocations += 1
        return CudaEvent(self, timing, external)

    def record(self, event: CudaEvent, stream: CudaStream) -> None:
        if threading.get_ident() in self._capturing and not event.external:
            raise CaptureError(f"{self.name}: only an external event is recorded inside a capture")
        self._guard(lambda: event.raw.record(stream.raw))
        event.recorded = True

    def wait_event(self, stream: CudaStream, event: CudaEvent) -> None:
        self._guard(lambda: stream.raw.wait_event(event.raw))

    # ---------------------------------------------------------------- memory

    def alloc(self, nbytes: int, label: str = "") -> Buffer:
        self.allocations += 1
        t = self._guard(lambda: torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device))
        # torch made it on the current stream; our streams use it without waiting on that one
        # (start-up and tests only: the data path allocates nothing).
        self._guard(lambda: torch.cuda.current_stream(self.torch_device).synchronize())
        self._buffer_bytes += nbytes
        return Buffer(t, Where.DEVICE, label)

    def free(self, buffer: Buffer) -> None:
        self._buffer_bytes -= buffer.nbytes
        buffer.freed = True
        buffer.tensor = torch.empty(0, dtype=torch.uint8, device=self.torch_device)

    def alloc_pinned(self, nbytes: int, label: str = "") -> Buffer:
        return self.pin(page_aligned(nbytes), label)

    def pin(self, tensor: torch.Tensor, label: str = "") -> Buffer:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.device.type != "cpu":
            raise ValueError("pin() takes a flat uint8 host tensor")
        n = max(tensor.numel(), 1)
        ptr = tensor.data_ptr()
        with _REGISTERED_LOCK:
            # Page-locking is per process, not per device: a block another owner (a second
            # HostPins, another device) registered is shared, counted; a partial overlap is refused
            # here, since CUDA's refusal would also leave an error behind for the next launch.
            entry = _REGISTERED.get(ptr)
            if entry is not None and entry[0] == n:
                entry[1] += 1
            elif any(p < ptr + n and ptr < p + m for p, (m, _) in _REGISTERED.items()):
                raise ValueError(f"{self.name}: {label or 'buffer'} overlaps host memory already page-locked")
            else:
                rt = torch.cuda.cudart()
                self._guard(lambda: torch.cuda.check_error(rt.cudaHostRegister(ptr, n, REGISTER_PORTABLE)))
                _REGISTERED[ptr] = [n, 1]
        self.allocations += 1
        buf = Buffer(tensor, Where.PINNED, label)
        self._pinned[buf.id] = (ptr, -(-n // PAGE) * PAGE)
        return buf

    def unpin(self, buffer: Buffer) -> None:
        entry = self._pinned.pop(buffer.id, None)
        if entry is None:
            raise ValueError(f"{self.name}: {buffer.label or 'buffer'} is not pinned here")
        ptr = entry[0]
        buffer.freed = True
        with _REGISTERED_LOCK:
            reg = _REGISTERED.get(ptr)
            if reg is not None and reg[1] > 1:
                reg[1] -= 1
                return
            _REGISTERED.pop(ptr, None)
            rt = torch.cuda.cudart()
            self._guard(lambda: torch.cuda.check_error(rt.cudaHostUnregister(ptr)))

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self._pinned.values())

    @property
    def graph_pool_bytes(self) -> int:
        # What capturing the live graphs took from the caching allocator (the growth of its
        # reservation across each capture); the backend charges it against its workspace reserve.
        return max(0, self._graph_bytes)

    def memory(self) -> tuple[int, int]:
        return self._guard(lambda: memory(self.index))

    def limit(self, nbytes: int | None) -> None:
        """Make the caching allocator refuse (OutOfMemoryError) past `nbytes` more than it holds
        now on this device; None lifts the limit. torch's limit is per process and device, so a
        backend that closes lifts its own."""
        _, total = self.memory()
        if nbytes is None:
            if self._limited:
                torch.cuda.set_per_process_memory_fraction(1.0, self.torch_device)
                self._limited = False
            return
        held = int(torch.cuda.memory_reserved(self.torch_device))
        torch.cuda.set_per_process_memory_fraction(min(1.0, (held + nbytes) / total), self.torch_device)
        self._limited = True

    # ---------------------------------------------------------------- work

    def copy(self, dst: Region, src: Region, stream: CudaStream) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")

        def run() -> None:
            with torch.cuda.stream(stream.raw):
                dst.bytes().copy_(src.bytes(), non_blocking=True)
        self._guard(run)

    def launch(self, stream: CudaStream, kernel: Kernel, reads: Sequence[Region],
               writes: Sequence[Region]) -> None:
        def run() -> None:
            with torch.cuda.stream(stream.raw):
                kernel()
        self._guard(run)

    def host_read(self, region: Region) -> None:
        pass

    def host_write(self, region: Region) -> None:
        pass

    def discard(self, region: Region, stream: CudaStream) -> None:
        pass

    def capture(self, stream: CudaStream, body: Callable[[], None]) -> CudaGraph:
        if self.fault:
            raise DeviceFault(f"{self.name}: {self.fault}")
        before = torch.cuda.memory_reserved(self.torch_device)
        g = torch.cuda.CUDAGraph()
        me = threading.get_ident()
        pool = self._pool

        def run() -> None:
            with torch.cuda.stream(stream.raw):
                g.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    body()
                except BaseException:
                    # End the capture without letting its complaints (an empty graph, an invalidated
                    # capture) replace the error that says what the body did wrong.
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        try:
                            g.capture_end()
                        except Exception:
                            pass
                    raise
                g.capture_end()
        self._capturing.add(me)
        try:
            run()
        except Exception as e:
            # A program that cannot be captured (a host sync inside, say) invalidates the capture,
            # not the context: it is not a device fault. torch 2.11 skips ending the allocator's
            # capture when capture_end fails, so that is ended here, and the pool is not reused.
            try:
                torch._C._cuda_endAllocateToPool(self.index, pool)
            except Exception:
                pass
            if _end_capture(stream.raw):  # still capturing: nothing else may run on this thread
                self.fault = f"a failed capture could not be ended ({type(e).__name__}: {e})"
                raise DeviceFault(f"{self.name}: {self.fault}") from e
            if self._graphs == 0:
                self._pool = torch.cuda.graph_pool_handle()
            if isinstance(e, CaptureError):
                raise
            raise CaptureError(f"{self.name}: capture failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
        finally:
            self._capturing.discard(me)
        self.allocations += 1
        self._graphs += 1
        graph = CudaGraph(self, g, int(torch.cuda.memory_reserved(self.torch_device)) - int(before))
        self._graph_bytes += graph.nbytes
        return graph

    def synchronize(self, deadline: float | None = None) -> None:
        for s in list(self._streams.values()):
            self._poll(s.raw.query, deadline, s.name)
            if _SANITIZING:
                s.raw.synchronize()
        if _SANITIZING:  # the whole device, stream 0 too: the sanitizer sees no waits done by polling
            torch.cuda.synchronize(self.torch_device)

    def stream_synchronize(self, stream: CudaStream, deadline: float | None = None) -> None:
        self._poll(stream.raw.query, deadline, stream.name)
        if _SANITIZING:
            stream.raw.synchronize()

    def close(self) -> None:
        pass

    _instances: dict[int, TorchCuda] = {}  # noqa: RUF012  # one per device per process
    _instances_lock = threading.Lock()

    @classmethod
    def get(cls, index: int) -> TorchCuda:
        with cls._instances_lock:
            dev = cls._instances.get(index)
            if dev is None:
                dev = cls._instances[index] = cls(index)
            return dev
