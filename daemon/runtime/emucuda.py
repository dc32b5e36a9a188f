"""A CPU stand-in of the CUDA device API that keeps CUDA's semantics and checks them.

What it models, so that the CUDA backend's mistakes show up on a CPU:

- Asynchrony: work waits in per-stream queues. In `eager` mode it runs as soon as its stream
  and events allow; in `lazy` mode only when the host waits for it; in `random` mode at seeded
  random moments and in random orders that streams and events allow. Code that reads a result
  it did not wait for sees stale or poisoned bytes in some mode.
- Races: every access (copies, kernels, host reads and writes of pinned memory, frees) goes
  through a vector-clock race checker (`racecheck.py`) when it is enqueued.
- Poison: fresh and freed device memory, and regions discarded after use, are filled with 0xFF
  bytes (NaN in floating point), so an early or stale read gives a wrong answer.
- Time: a virtual device clock anchored to the host's monotonic clock, one host-to-device and
  one device-to-host copy engine (copies on an engine run in the order they start), one
  compute engine; events carry the modelled times. In `timed` mode the host also waits until
  the modelled completion, so a copy queued behind a long one really waits for it.
- Memory: a fixed capacity (`torch.OutOfMemoryError` past it), pinned host bytes counted
  (page-rounded; registration never rounds to a power of two), one graph pool per device.
- Capture rules: while a thread captures, it may not synchronize, allocate or read on the host,
  and the captured kernels may not call operations that need a host sync (`.item()`, boolean
  indexing, `nonzero`): capture fails with CaptureError. Capture records work, it computes
  nothing (the regions the captured kernels write are poisoned).
- Faults: OOM at the Nth allocation, a sticky error raised by the next kernel, a kernel that
  hangs until released.

One instance per device per process, like a CUDA context.
"""

from __future__ import annotations

import collections
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from daemon.runtime.devapi import Buffer, CaptureError, DeviceFault, DeviceHang, Kernel, Region, Where
from daemon.runtime.hostmem import page_aligned
from daemon.runtime.racecheck import HOST, Clock, RaceChecker
from daemon.runtime.retarget import SYNC_OPS

Mode = Literal["eager", "lazy", "random"]
MODES: tuple[Mode, ...] = ("eager", "lazy", "random")
PAGE = 4096
POISON = 0xFF

@dataclass(frozen=True, slots=True)
class EmuSettings:
    capacity: int = 1 << 30  # device bytes
    mode: Mode = "eager"
    seed: int = 0
    h2d_gbps: float = 25.0
    d2h_gbps: float = 25.0
    d2d_gbps: float = 1000.0
    kernel_s: float | None = None  # modelled duration of every kernel; None: its real CPU time
    timed: bool = False  # the host waits until work's modelled completion
    strict: bool = True  # a race raises RaceError at once (else it is only collected)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"emucuda mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.capacity <= 0 or min(self.h2d_gbps, self.d2h_gbps, self.d2d_gbps) <= 0:
            raise ValueError("emucuda: capacity and bandwidths must be positive")


# ------------------------------------------------------------------ work items


@dataclass(slots=True, eq=False)
class _Op:
    stream: EmuStream
    kind: str  # copy | kernel | record | wait | poison
    what: str
    effect: Callable[[], None] | None = None
    engine: str = ""  # h2d | d2h | d2d | sm | "" (no time)
    nbytes: int = 0
    event: EmuEvent | None = None  # record: the event
    after: _Op | None = None  # wait: the record op awaited (an event may be recorded again later)
    submitted: float = 0.0
    done: bool = False
    hang: bool = False
    fail: str = ""  # a sticky fault this op raises when it runs
    t_end: float = 0.0
    error: BaseException | None = None  # raised by its kernel while it was being launched


@dataclass(frozen=True, slots=True)
class Traced:
    """One op as it ran, in modelled device time (tests read when work waited and for what)."""

    what: str
    stream: str
    engine: str
    submitted: float
    start: float
    end: float


@dataclass(slots=True, eq=False)
class EmuStream:
    name: str
    priority: int = 0
    queue: collections.deque[_Op] = field(default_factory=collections.deque)
    t: float = 0.0  # modelled end of its last finished op
    last: _Op | None = None  # the last op enqueued

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class EmuEvent:
    def __init__(self, dev: EmuCuda, timing: bool, external: bool = False) -> None:
        self._dev = dev
        self.timing = timing
        self.external = external  # recorded inside a capture as a node of the graph
        self.op: _Op | None = None
        self.clock: Clock = {}

    def query(self) -> bool:
        return self._dev._query(self)

    def wait(self, deadline: float | None) -> None:
        self._dev._wait_event(self, deadline)

    def elapsed_s(self, end: EmuEvent) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed time needs two timing events")
        if self.op is None or end.op is None or not (self.op.done and end.op.done):
            raise RuntimeError("elapsed time of an event not recorded or not complete")
        return max(0.0, end.op.t_end - self.op.t_end)


@dataclass(slots=True, eq=False)
class _Captured:
    kind: str
    what: str
    effect: Callable[[], None]
    engine: str
    nbytes: int
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    event: EmuEvent | None = None  # a record node: the external event each replay records


class EmuGraph:
    def __init__(self, dev: EmuCuda, stream: EmuStream) -> None:
        self._dev = dev
        self.stream = stream
        self.items: list[_Captured] = []
        self.nbytes = 0  # the largest activation footprint of its kernels
        self.closed = False
        self.written: list[Region] = []  # what its kernels write: garbage once captured (poisoned in stream order)

    def replay(self, stream: EmuStream) -> None:
        self._dev._replay(self, stream)

    def close(self) -> None:
        self._dev._close_graph(self)


# ------------------------------------------------------------------ kernel guards


class _Activations(TorchDispatchMode):
    """Counts the bytes of new storages kernels allocate (their activation memory, peak live)."""

    def __init__(self, capture: bool) -> None:
        super().__init__()
        self.capture = capture
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._overloadpacket.__name__
        if self.capture and (name in SYNC_OPS or (name == "index" and _bool_index(args))):
            raise CaptureError(f"aten.{name} needs a host synchronization, which CUDA graph capture forbids")
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in _tensors(args, kwargs)}
        for o in out if isinstance(out, tuple | list) else (out,):
            if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                st = o.untyped_storage()
                key = st.data_ptr()
                if key and key not in given and key not in self._seen:  # new memory, not an alias
                    self._seen.add(key)
                    n = st.nbytes()
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._dead, key, n)
        return out

    def _dead(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n


def _nothing() -> None:
    """A record node's effect: recording is the op itself."""


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _bool_index(args: Any) -> bool:
    return len(args) > 1 and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())


# ------------------------------------------------------------------ the device


class EmuCuda:
    """The stand-in device `emucuda:N`; see the module docstring."""

    kind = "emucuda"
    graph_events = True

    def __init__(self, index: int = 0, settings: EmuSettings | None = None) -> None:
        self.settings = settings or EmuSettings()
        self.index = index
        self.name = f"emucuda:{index}"
        self.torch_device = torch.device("cpu")
        self.allocations = 0
        self.races = RaceChecker(strict=self.settings.strict)
        self.fault = ""  # set once a sticky error happened: every later call raises DeviceFault
        self.peak_activation_bytes = 0
        self.kernels_run = 0
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._rng = random.Random(self.settings.seed)
        self._streams: list[EmuStream] = []
        self._engines: dict[str, float] = {"h2d": 0.0, "d2h": 0.0, "d2d": 0.0, "sm": 0.0}
        self._buffers: dict[int, Buffer] = {}
        self._device_bytes = 0
        self._pinned: dict[int, int] = {}  # buffer id -> page-rounded bytes
        self._pages: dict[int, tuple[int, int]] = {}  # registered buffer id -> its first and last page
        self._graphs: set[EmuGraph] = set()
        self._capturing: dict[int, tuple[EmuStream, EmuGraph]] = {}  # thread id -> its capture
        self._fail_alloc_at = 0  # the allocation number that raises OOM (0: none)
        self._faults: collections.deque[str] = collections.deque()  # pending: "sticky:<msg>" | "hang"
        self._released = threading.Event()
        self.closed = False
        self.hung = False
        self.trace: list[Traced] | None = None  # set to a list to record every op's modelled times
        self._launching: _Op | None = None

    # ---------------------------------------------------------------- faults (tests)

    def fail_allocation(self, after: int = 0) -> None:
        """The allocation `after` allocations from now raises torch.OutOfMemoryError."""
        with self._lock:
            self._fail_alloc_at = self.allocations + after + 1

    def fail_next_kernel(self, message: str = "device-side assert triggered") -> None:
        """The next kernel enqueued raises a sticky error when it runs (as a device-side assert)."""
        with self._lock:
            self._faults.append(f"sticky:{message}")

    def hang_next_kernel(self) -> None:
        """The next kernel enqueued never finishes until `release()`."""
        with self._lock:
            self._released.clear()
            self._faults.append("hang")

    def release(self) -> None:
        with self._lock:
            self._released.set()
            for s in self._streams:
                for op in s.queue:
                    op.hang = False
            self._cond.notify_all()

    # ---------------------------------------------------------------- streams and events

    def stream(self, name: str, priority: int = 0) -> EmuStream:
        with self._lock:
            self._no_capture("create a stream")
            for s in self._streams:  # made once per device per process, whoever asks again
                if s.name == name:
                    return s
            s = EmuStream(name, priority)
            self._streams.append(s)
            self.allocations += 1
            return s

    def event(self, timing: bool = True, external: bool = False) -> EmuEvent:
        with self._lock:
            self.allocations += 1
            return EmuEvent(self, timing, external)

    def record(self, event: EmuEvent, stream: EmuStream, submitted: float | None = None) -> None:
        with self._lock:
            self._usable()
            cap = self._capture_of(stream)
            if cap is not None:
                if not event.external:  # CUDA would make it a fork/join edge, which we never mean
                    raise CaptureError("only an external event is recorded inside a capture")
                cap[1].items.append(_Captured("record", "event record", _nothing, "", 0, (), (), event))
                return
            op = _Op(stream, "record", "event record", event=event)
            event.clock = self._enqueue(op, submitted=submitted)
            event.op = op

    def wait_event(self, stream: EmuStream, event: EmuEvent) -> None:
        with self._lock:
            self._usable()
            if event.op is None:
                return  # an event never recorded is complete
            self.races.stream_waits(stream.name, event.clock)
            self._enqueue(_Op(stream, "wait", "event wait", after=event.op))

    # ---------------------------------------------------------------- memory

    def alloc(self, nbytes: int, label: str = "") -> Buffer:
        with self._lock:
            self._usable()
            self._no_capture("allocate device memory")
            self._count_allocation(nbytes)
            if self._device_bytes + self.graph_pool_bytes + nbytes > self.settings.capacity:
                raise torch.OutOfMemoryError(
                    f"{self.name}: out of memory allocating {nbytes} bytes ({self._device_bytes} allocated, "
                    f"{self.graph_pool_bytes} in the graph pool, capacity {self.settings.capacity})")
            t = torch.full((nbytes,), POISON, dtype=torch.uint8)
            buf = Buffer(t, Where.DEVICE, label)
            self._buffers[buf.id] = buf
            self._device_bytes += nbytes
            return buf

    def free(self, buffer: Buffer) -> None:
        with self._lock:
            self._no_capture("free device memory")
            if buffer.freed or buffer.id not in self._buffers:
                raise ValueError(f"{self.name}: {buffer.label or 'buffer'} freed twice or not ours")
            # The host frees it now: queued work still using it would read poison, and races (a
            # failed device runs nothing more, so nothing can race then).
            if not (self.fault or self.hung):
                self.races.access(HOST, self.races.host_tick(), buffer.id, 0, buffer.nbytes, True,
                                  f"free({buffer.label})")
            buffer.tensor.fill_(POISON)
            buffer.freed = True
            del self._buffers[buffer.id]
            self._device_bytes -= buffer.nbytes
            self.races.forget(buffer.id)

    def alloc_pinned(self, nbytes: int, label: str = "") -> Buffer:
        with self._lock:
            self._no_capture("allocate pinned memory")
            self._count_allocation(nbytes)
            t = page_aligned(nbytes)
            t.fill_(POISON)
            buf = Buffer(t, Where.PINNED, label)
            self._pinned[buf.id] = -(-max(nbytes, 1) // PAGE) * PAGE
            return buf

    def pin(self, tensor: torch.Tensor, label: str = "") -> Buffer:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.device.type != "cpu":
            raise ValueError("pin() takes a flat uint8 host tensor")
        with self._lock:
            self._no_capture("register host memory")
            first = tensor.data_ptr() // PAGE
            last = (tensor.data_ptr() + max(tensor.numel(), 1) - 1) // PAGE
            for other, (a, b) in self._pages.items():
                if first <= b and a <= last:  # CUDA locks whole pages, and a page only once
                    raise RuntimeError(f"{self.name}: cudaErrorHostMemoryAlreadyRegistered: {label or 'memory'} "
                                       f"shares a page with buffer {other}, registered already")
            self._count_allocation(tensor.numel())
            buf = Buffer(tensor, Where.PINNED, label)
            self._pinned[buf.id] = (last - first + 1) * PAGE
            self._pages[buf.id] = (first, last)
            return buf

    def unpin(self, buffer: Buffer) -> None:
        with self._lock:
            if self._pinned.pop(buffer.id, None) is None:
                raise ValueError(f"{self.name}: {buffer.label or 'buffer'} is not pinned here")
            self._pages.pop(buffer.id, None)
            # Unregistering while a copy still reads it is a race, as on CUDA.
            if not (self.fault or self.hung):
                self.races.access(HOST, self.races.host_tick(), buffer.id, 0, buffer.nbytes, True,
                                  f"unpin({buffer.label})")
            buffer.freed = True
            self.races.forget(buffer.id)

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned.values())

    @property
    def device_bytes(self) -> int:
        """Device memory allocated now: buffers plus the graph pool."""
        return self._device_bytes + self.graph_pool_bytes

    @property
    def graph_pool_bytes(self) -> int:
        return max((g.nbytes for g in self._graphs), default=0)

    def memory(self) -> tuple[int, int]:
        with self._lock:
            return self.settings.capacity - self.device_bytes, self.settings.capacity

    def _count_allocation(self, nbytes: int) -> None:
        self.allocations += 1
        if self._fail_alloc_at and self.allocations >= self._fail_alloc_at:
            self._fail_alloc_at = 0
            raise torch.OutOfMemoryError(f"{self.name}: injected out of memory allocating {nbytes} bytes")

    # ---------------------------------------------------------------- work

    def copy(self, dst: Region, src: Region, stream: EmuStream) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        for r in (dst, src):
            if r.buffer.freed:
                raise ValueError(f"{self.name}: copy with freed {r.buffer.label or 'buffer'}")
            if r.buffer.where == Where.PAGEABLE:
                raise ValueError("asynchronous copies need pinned host memory")
        engine = ("h2d" if src.buffer.where != Where.DEVICE else "d2h" if dst.buffer.where != Where.DEVICE else "d2d")
        what = f"copy {src.buffer.label}->{dst.buffer.label}"

        def effect() -> None:
            dst.bytes().copy_(src.bytes())
        self._work(stream, "copy", what, effect, engine, src.nbytes, (src,), (dst,))

    def launch(self, stream: EmuStream, kernel: Kernel, reads: Sequence[Region],
               writes: Sequence[Region]) -> None:
        for r in (*reads, *writes):
            if r.buffer.where != Where.DEVICE or r.buffer.freed:
                raise ValueError(f"{self.name}: kernels touch live device memory only ({r.buffer.label})")
        cap = self._capture_of(stream)
        if cap is not None:
            self._dry_run(cap[1], kernel, writes)
        self._work(stream, "kernel", getattr(kernel, "__name__", "kernel"), kernel, "sm", 0, tuple(reads),
                   tuple(writes))

    def discard(self, region: Region, stream: EmuStream) -> None:
        def effect() -> None:
            region.bytes().fill_(POISON)
        self._work(stream, "poison", f"discard {region.buffer.label}", effect, "", 0, (), (region,))

    def host_read(self, region: Region) -> None:
        self._host_access(region, False)

    def host_write(self, region: Region) -> None:
        self._host_access(region, True)

    def _host_access(self, region: Region, write: bool) -> None:
        with self._lock:
            self._no_capture("touch pinned memory on the host")
            if region.buffer.where == Where.DEVICE:
                raise ValueError(f"{self.name}: the host cannot access device memory ({region.buffer.label})")
            if region.buffer.freed:
                raise ValueError(f"{self.name}: host access to freed {region.buffer.label}")
            self.races.access(HOST, self.races.host_tick(), region.buffer.id, region.offset, region.end, write,
                              f"host {'write' if write else 'read'} of {region.buffer.label}")

    def _work(self, stream: EmuStream, kind: str, what: str, effect: Callable[[], None], engine: str, nbytes: int,
              reads: tuple[Region, ...], writes: tuple[Region, ...], submitted: float | None = None) -> None:
        with self._lock:
            self._usable()
            cap = self._capture_of(stream)
            if cap is not None:
                cap[1].items.append(_Captured(kind, what, effect, engine, nbytes, reads, writes))
                return
            op = _Op(stream, kind, what, effect, engine, nbytes)
            if kind == "kernel" and self._faults:
                fault = self._faults.popleft()
                if fault == "hang":
                    op.hang = True
                else:
                    op.fail = fault.partition(":")[2]
            clock = self._enqueue(op, check=False, submitted=submitted)
            for r in reads:
                self.races.access(stream.name, clock, r.buffer.id, r.offset, r.end, False, what)
            for r in writes:
                self.races.access(stream.name, clock, r.buffer.id, r.offset, r.end, True, what)
            self._launching = op
            try:
                self._after_enqueue()
            finally:
                self._launching = None
            if op.error is not None:
                # A kernel that ran as it was launched and raised: the launch raises, as CUDA's
                # host-side errors do (a kernel run later raises a sticky device fault instead).
                raise op.error

    def _enqueue(self, op: _Op, check: bool = True, submitted: float | None = None) -> Clock:
        op.submitted = time.monotonic() if submitted is None else submitted
        clock = self.races.enqueue(op.stream.name)
        op.stream.queue.append(op)
        op.stream.last = op
        if check:
            self._after_enqueue()
        return clock

    def _after_enqueue(self) -> None:
        mode = self.settings.mode
        if mode == "eager":
            self._pump()
        elif mode == "random" and self._rng.random() < 0.5:
            self._pump(limit=self._rng.randint(1, 4))

    # ---------------------------------------------------------------- running work

    def _ready(self, s: EmuStream) -> bool:
        if not s.queue:
            return False
        op = s.queue[0]
        if op.hang:
            return False
        return not (op.after is not None and not op.after.done)

    def _pump(self, limit: int | None = None) -> int:
        """Run ready work: everything (eager), or `limit` steps picked at random (random mode)."""
        ran = 0
        while limit is None or ran < limit:
            ready = [s for s in self._streams if self._ready(s)]
            if not ready:
                break
            s = self._rng.choice(ready) if self.settings.mode == "random" else ready[0]
            self._step(s)
            ran += 1
        return ran

    def _step(self, s: EmuStream) -> None:
        op = s.queue.popleft()
        start = max(op.submitted, s.t)
        if op.after is not None:
            start = max(start, op.after.t_end)
        duration = 0.0
        if op.engine in ("h2d", "d2h", "d2d"):
            start = max(start, self._engines[op.engine])
            gbps = {"h2d": self.settings.h2d_gbps, "d2h": self.settings.d2h_gbps, "d2d": self.settings.d2d_gbps}
            duration = op.nbytes / (gbps[op.engine] * 1e9)
        elif op.engine == "sm":
            start = max(start, self._engines["sm"])
        if op.fail:
            self.fault = op.fail
            self._cond.notify_all()
        elif op.effect is not None:
            if op.kind == "kernel":
                t0 = time.perf_counter()
                meter = _Activations(capture=False)
                try:
                    with meter:
                        op.effect()
                except Exception as e:
                    if op is self._launching:
                        op.error = e
                    else:  # an error inside device work run later is sticky, as on CUDA
                        self.fault = f"{type(e).__name__} in {op.what}: {e}"
                        self._cond.notify_all()
                self.kernels_run += 1
                self.peak_activation_bytes = max(self.peak_activation_bytes, meter.peak)
                duration = self.settings.kernel_s if self.settings.kernel_s is not None else time.perf_counter() - t0
            else:
                op.effect()
        op.t_end = start + duration
        if op.engine:
            self._engines[op.engine] = op.t_end
        s.t = op.t_end
        op.done = True
        if self.trace is not None:
            self.trace.append(Traced(op.what, s.name, op.engine, op.submitted, start, op.t_end))
        self._cond.notify_all()

    def _complete(self, target: _Op, deadline: float | None) -> None:
        """Run work until `target` is done (lazy: only what it depends on)."""
        while not target.done:
            self._usable()
            if self.settings.mode == "lazy":
                progressed = self._advance_towards(target)
            else:
                progressed = self._pump(limit=1 if self.settings.mode == "random" else None) > 0
            if not progressed:
                self._blocked(deadline, f"{target.what} on {target.stream.name}")

    def _advance_towards(self, target: _Op) -> bool:
        """One step on the path to `target`: its stream's head, or what that head waits for."""
        s = target.stream
        seen: set[int] = set()
        while s.queue and id(s) not in seen:
            seen.add(id(s))
            head = s.queue[0]
            if head.hang:
                return False
            if head.after is not None and not head.after.done:
                s = head.after.stream
                continue
            self._step(s)
            return True
        return False

    def _blocked(self, deadline: float | None, what: str) -> None:
        """Nothing can run: a hung kernel. Wait (without the lock) until released or the deadline."""
        if deadline is not None and time.monotonic() >= deadline:
            self.hung = True  # whoever gave up on it abandons the device: nothing is ordered after
            raise DeviceHang(f"{self.name}: {what} did not finish by its deadline (a kernel hangs)")
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._cond.wait(timeout)

    def _query(self, event: EmuEvent) -> bool:
        with self._lock:
            self._usable()
            self._no_capture("query an event")
            op = event.op
            if op is None:
                return True
            if not op.done and self.settings.mode == "random":
                self._pump(limit=self._rng.randint(0, 3))
            if not op.done or (self.settings.timed and time.monotonic() < op.t_end):
                return False
            self.races.host_syncs(event.clock)
            return True

    def _wait_event(self, event: EmuEvent, deadline: float | None) -> None:
        with self._lock:
            self._usable()
            self._no_capture("synchronize with an event")
            op = event.op
            if op is None:
                return
            self._complete(op, deadline)
            self._usable()
            t_end = op.t_end
        self._sleep_until(t_end, deadline, "an event")
        self.races.host_syncs(event.clock)

    def synchronize(self, deadline: float | None = None) -> None:
        with self._lock:
            self._no_capture("synchronize the device")
            last = 0.0
            for s in self._streams:
                if s.last is not None:
                    self._complete(s.last, deadline)
                    last = max(last, s.last.t_end)
            self._usable()
            clocks = [self.races.snapshot(s.name) for s in self._streams]
        self._sleep_until(last, deadline, "the device")
        for c in clocks:
            self.races.host_syncs(c)

    def stream_synchronize(self, stream: EmuStream, deadline: float | None = None) -> None:
        with self._lock:
            self._no_capture("synchronize a stream")
            if stream.last is not None:
                self._complete(stream.last, deadline)
            self._usable()
            clock = self.races.snapshot(stream.name)
            t_end = stream.t
        self._sleep_until(t_end, deadline, stream.name)
        self.races.host_syncs(clock)

    def _sleep_until(self, t_end: float, deadline: float | None, what: str) -> None:
        if not self.settings.timed:
            return
        now = time.monotonic()
        if deadline is not None and t_end > deadline:
            time.sleep(max(0.0, deadline - now))
            raise DeviceHang(f"{self.name}: {what} did not finish by its deadline")
        if t_end > now:
            time.sleep(t_end - now)

    # ---------------------------------------------------------------- graphs

    def capture(self, stream: EmuStream, body: Callable[[], None]) -> EmuGraph:
        me = threading.get_ident()
        with self._lock:
            self._usable()
            if me in self._capturing or any(c[0] is stream for c in self._capturing.values()):
                raise CaptureError(f"{self.name}: a capture is in progress")
            graph = EmuGraph(self, stream)
            self._capturing[me] = (stream, graph)
            self.allocations += 1
        try:
            body()
        except (DeviceFault, CaptureError):
            raise
        except Exception as e:  # an op refused inside a kernel surfaces wrapped (TorchScript does so)
            raise CaptureError(f"{self.name}: capture failed: {type(e).__name__}: "
                               f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}") from e
        finally:
            with self._lock:
                del self._capturing[me]
        with self._lock:
            if self.device_bytes - self.graph_pool_bytes + max(self.graph_pool_bytes, graph.nbytes) \
                    > self.settings.capacity:
                raise torch.OutOfMemoryError(f"{self.name}: out of memory for a graph's {graph.nbytes} bytes")
            self._graphs.add(graph)
        for r in graph.written:  # nothing was computed there: what follows on the stream sees garbage
            self.discard(r, stream)
        return graph

    def _dry_run(self, graph: EmuGraph, kernel: Kernel, writes: Sequence[Region]) -> None:
        """Check a kernel being captured: no host syncs inside; measure its activations. Capture
        computes nothing and writes nothing when it happens: what the dry run wrote is put back at
        once (work still queued may read those bytes: a compaction's copies out of the old place,
        say), and poisoned in stream order when the capture ends (`capture`)."""
        before = [r.bytes().clone() for r in writes]
        meter = _Activations(capture=True)
        try:
            with meter:
                kernel()
        finally:
            for r, b in zip(writes, before, strict=True):
                r.bytes().copy_(b)
        graph.nbytes = max(graph.nbytes, meter.peak)
        graph.written.extend(writes)

    def _replay(self, graph: EmuGraph, stream: EmuStream) -> None:
        if graph.closed:
            raise RuntimeError(f"{self.name}: replay of a closed graph")
        launched = time.monotonic()  # a graph is launched as one unit: its nodes wait for no host
        for item in graph.items:
            if item.event is not None:
                self.record(item.event, stream, submitted=launched)
            else:
                self._work(stream, item.kind, f"graph {item.what}", item.effect, item.engine, item.nbytes,
                           item.reads, item.writes, submitted=launched)

    def _close_graph(self, graph: EmuGraph) -> None:
        with self._lock:
            graph.closed = True
            self._graphs.discard(graph)

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    @property
    def streams(self) -> int:
        """Streams made on this device (each once per process, whoever asks for it again)."""
        return len(self._streams)

    # ---------------------------------------------------------------- state

    def _capture_of(self, stream: EmuStream) -> tuple[EmuStream, EmuGraph] | None:
        cap = self._capturing.get(threading.get_ident())
        if cap is not None and cap[0] is not stream:
            raise CaptureError(f"{self.name}: work on {stream.name} while capturing {cap[0].name}")
        return cap

    def _no_capture(self, what: str) -> None:
        if threading.get_ident() in self._capturing:
            raise CaptureError(f"{self.name}: cannot {what} while capturing a graph")

    def _usable(self) -> None:
        if self.fault:
            raise DeviceFault(f"{self.name}: {self.fault}")

    def check(self) -> None:
        with self._lock:
            self._usable()

    def pending(self) -> int:
        """Work items enqueued and not yet run."""
        with self._lock:
            return sum(len(s.queue) for s in self._streams)

    def close(self) -> None:
        self.closed = True
        self.release()


# ------------------------------------------------------------------ one instance per device per process

_devices: dict[int, EmuCuda] = {}
_devices_lock = threading.Lock()


def device(index: int, settings: EmuSettings | None = None) -> EmuCuda:
    """The process's stand-in device `emucuda:index` (made on first use with `settings`)."""
    with _devices_lock:
        dev = _devices.get(index)
        if dev is None or dev.closed or dev.fault or (settings is not None and dev.settings != settings):
            dev = _devices[index] = EmuCuda(index, settings)
        return dev


def settings_from(cfg: Any) -> EmuSettings:
    """Stand-in settings from the config's [runtime.emucuda] table (None: the defaults)."""
    if cfg is None:
        return EmuSettings()
    if isinstance(cfg, EmuSettings):
        return cfg
    return EmuSettings(capacity=cfg.capacity, mode=cfg.mode, seed=cfg.seed, timed=cfg.timed,
                       h2d_gbps=cfg.h2d_gbps, d2h_gbps=cfg.d2h_gbps)
