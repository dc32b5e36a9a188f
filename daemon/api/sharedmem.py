"""Shared-memory regions: Triton's system shared-memory extension, for clients on this host.

A client creates a POSIX shared-memory object (`shm_open`, a file in /dev/shm), registers a
range of it under a name, then names the region in requests instead of sending tensor bytes:
inputs are read from it, and outputs asked for that way are written into it (the answer carries
the region's parameters, not the bytes). Every frontend uses this one registry, which lives in
the controller process, which answers register, unregister and status. With frontend workers
on, each worker holds a replica (`RegionReplica`): the controller pushes the registry over the
link whenever it changes, the worker opens each region's object itself (checked to be the very
object the controller registered) and reads inputs from it and writes outputs into it as the
controller process would, so that a request naming a region reaches the controller as an
ordinary SUBMIT. A request naming a region the worker cannot serve (not pushed yet, or its object
replaced or unlinked since it was registered) is forwarded whole to the controller process.

The registry holds a file descriptor per region, never a mapping. Inputs are read with
`preadv` into the request's own buffer and outputs written with `pwrite`: a client that
truncates its object after registering makes a read come up short (a 400), where a mapping
would raise SIGBUS and kill the daemon. Reading copies, which is also what keeps a client that
overwrites the region while its request waits from changing a batch already formed.

Unregistering a region that requests are using (an output still to be written) is deferred, not
refused: the name goes at once (new requests naming it get a 404, and it may be registered
again), and the descriptor is closed when the last of those requests is answered. A client's
clean-up (unregister all) thus never fails because a request it gave up on still runs. A worker's
replica does the same with its own descriptor when the push without the name arrives.

Pure bookkeeping and blocking-free syscalls on /dev/shm (memory): the loop's thread calls it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daemon.api.codec import tensor_bytes
from daemon.config import SharedMemorySettings
from daemon.errors import (
    BadRequest,
    Conflict,
    EscapementError,
    Forbidden,
    NotFound,
    NotImplementedByServer,
    PayloadTooLarge,
    Unavailable,
)

SHM_DIR = Path("/dev/shm")
# shm_open(3): one path component, "/" first or not; we also refuse names that are not plain
# files' names here ("." and "..", control characters), and cap it at NAME_MAX.
_KEY = re.compile(r"/?([A-Za-z0-9_.\-:+@=,]{1,255})")
MAX_NAME = 256  # a region's name (echoed in statuses and answers)


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A tensor in a region, as a request names it (`shared_memory_*` parameters)."""

    region: str
    offset: int
    byte_size: int


class Region:
    __slots__ = ("byte_size", "fd", "ident", "key", "name", "offset", "pins", "retired")

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int,
                 ident: tuple[int, int] = (0, 0)) -> None:
        self.name = name
        self.key = key
        self.offset = offset  # within the object
        self.byte_size = byte_size
        self.fd = fd
        self.ident = ident  # the object's (st_dev, st_ino): a replica opens the very same object
        self.pins = 0  # requests that will still write into it
        self.retired = False  # unregistered: closed when the last pin goes

    def entry(self) -> list[Any]:
        """What a replica needs to open and check it (`SharedMemoryRegions.snapshot`)."""
        return [self.name, self.key, self.offset, self.byte_size, *self.ident]

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


# the parameters that place an input or output in a region
SHM_PARAMS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


def shm_ref(params: Mapping[str, Any], what: str) -> ShmRef | None:
    """The region an input or output names in its parameters, checked; None when it names none."""
    region = params.get("shared_memory_region")
    if region is None:
        for k in SHM_PARAMS[1:]:
            if k in params:
                raise BadRequest(f"{what}: {k} is given without shared_memory_region")
        return None
    if not isinstance(region, str) or not region:
        raise BadRequest(f"{what}: shared_memory_region must be a region's name (a non-empty string)")
    size = params.get("shared_memory_byte_size")
    if size is None:
        raise BadRequest(f"{what}: shared_memory_byte_size is required with shared_memory_region")
    offset = params.get("shared_memory_offset", 0)
    for k, v in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise BadRequest(f"{what}: {k} must be a non-negative integer, got {v!r}")
    return ShmRef(region, offset, size)


def ref_parameters(ref: ShmRef, written: int) -> dict[str, Any]:
    """An output's parameters in an answer: where it was written and how many bytes it took."""
    out: dict[str, Any] = {"shared_memory_region": ref.region, "shared_memory_byte_size": written}
    if ref.offset:
        out["shared_memory_offset"] = ref.offset
    return out


class SharedMemoryRegions:
    """The registered regions, bounded in count and bytes (settings [shared_memory])."""

    def __init__(self, settings: SharedMemorySettings, directory: Path = SHM_DIR) -> None:
        self.settings = settings
        self.directory = directory
        self.regions: dict[str, Region] = {}
        self.retired: list[Region] = []  # unregistered while in use, not yet closed
        self.bytes = 0
        self.generation = 0  # changes with every register and unregister: when to push a snapshot

    def snapshot(self) -> list[list[Any]]:
        """The registry as frontend workers' replicas take it (RegionReplica.apply)."""
        return [r.entry() for r in self.regions.values()]

    def serves(self, names: list[Any]) -> bool:
        """Whether requests naming these regions are answered here: always where the registry lives
        (an unknown name gets its 404 here); a replica says (RegionReplica)."""
        return True

    # ---------------------------------------------------------------- the extension's calls

    def register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        s = self._enabled()
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise BadRequest(f"a region's name must be a string of 1..{MAX_NAME} characters, got {name!r}")
        for k, v in (("offset", offset), ("byte_size", byte_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BadRequest(f"register {name}: {k} must be a non-negative integer, got {v!r}")
        if byte_size == 0:
            raise BadRequest(f"register {name}: byte_size must be at least 1")
        if name in self.regions:
            raise Conflict(f"a shared-memory region named {name!r} is already registered; unregister it first")
        if len(self.regions) >= s.max_regions:
            raise PayloadTooLarge(f"{len(self.regions)} shared-memory regions are registered, the limit "
                                  "(shared_memory.max_regions); unregister one first")
        if self.bytes + byte_size > s.max_bytes:
            raise PayloadTooLarge(f"registering {byte_size} bytes would pass the limit of {s.max_bytes} bytes of "
                                  f"shared memory ({self.bytes} registered; shared_memory.max_bytes)")
        fd = self._open(name, key)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"register {name}: key {key!r} is not a shared-memory object")
            if s.same_owner and st.st_uid != os.geteuid():
                raise Forbidden(f"register {name}: the object {key!r} belongs to another user "
                                "(shared_memory.same_owner)")
            if offset + byte_size > st.st_size:
                raise BadRequest(f"register {name}: offset {offset} + byte_size {byte_size} runs past the end of "
                                 f"the object {key!r} ({st.st_size} bytes)")
        except BaseException:
            os.close(fd)
            raise
        self.regions[name] = Region(name, key, offset, byte_size, fd, (st.st_dev, st.st_ino))
        self.bytes += byte_size
        self.generation += 1

    def unregister(self, name: str | None) -> None:
        """Unregister one region (NotFound if unknown) or, with None or "", all of them."""
        self._enabled()
        if name:
            if name not in self.regions:
                raise NotFound(f"no shared-memory region named {name!r} is registered")
            names = [name]
        else:
            names = list(self.regions)
        for n in names:
            r = self.regions.pop(n)
            self.bytes -= r.byte_size
            self._retire(r)
        self.generation += 1

    def _retire(self, r: Region) -> None:
        r.retired = True
        if r.pins:
            self.retired.append(r)  # closed by the last unpin
        else:
            os.close(r.fd)

    def status(self, name: str | None) -> list[dict[str, Any]]:
        self._enabled()
        if name:
            return [self._get(name).status()]
        return [r.status() for r in self.regions.values()]

    def close(self) -> None:
        """The daemon stops: every descriptor goes, in use or not."""
        for r in [*self.regions.values(), *self.retired]:
            os.close(r.fd)
        self.regions.clear()
        self.retired.clear()
        self.bytes = 0

    # ---------------------------------------------------------------- requests

    def read(self, ref: ShmRef, what: str) -> np.ndarray:
        """A copy of the bytes `ref` names (uint8), into the request's own memory."""
        r = self._get(ref.region)
        self._check_range(r, ref, what)
        buf = np.empty(ref.byte_size, np.uint8)
        got = os.preadv(r.fd, [buf.data], r.offset + ref.offset) if ref.byte_size else 0
        if got != ref.byte_size:
            raise BadRequest(f"{what}: the object behind region {ref.region!r} ({r.key}) is shorter than when it "
                             f"was registered: {got} of {ref.byte_size} bytes read")
        return buf

    def pin(self, ref: ShmRef, what: str) -> Region:
        """The region an output will be written into, held (its descriptor stays open) until `unpin`."""
        r = self._get(ref.region)
        self._check_range(r, ref, what)
        r.pins += 1
        return r

    def unpin(self, r: Region) -> None:
        r.pins -= 1
        if r.pins == 0 and r.retired:
            self.retired.remove(r)
            os.close(r.fd)

    def write(self, r: Region, ref: ShmRef, data: Any, what: str) -> int:
        """Write an output's bytes where `ref` says (the region pinned); BadRequest if they do not fit."""
        if len(data) > ref.byte_size:
            raise BadRequest(f"{what}: {len(data)} bytes do not fit the {ref.byte_size} bytes given in region "
                             f"{ref.region!r} (shared_memory_byte_size)")
        pos = r.offset + ref.offset
        # pwrite past the end would grow the object: one the client shrank is refused instead.
        if os.fstat(r.fd).st_size < pos + len(data):
            raise BadRequest(f"{what}: the object behind region {ref.region!r} ({r.key}) is shorter than when it "
                             "was registered")
        written = os.pwrite(r.fd, data, pos) if len(data) else 0
        if written != len(data):
            raise BadRequest(f"{what}: only {written} of {len(data)} bytes were written to region {ref.region!r}")
        return written

    # ---------------------------------------------------------------- checks

    def _enabled(self) -> SharedMemorySettings:
        if not self.settings.enabled:
            raise NotImplementedByServer("shared-memory tensors are off on this daemon (shared_memory.enabled)")
        return self.settings

    def _get(self, name: str) -> Region:
        self._enabled()
        r = self.regions.get(name)
        if r is None:
            raise NotFound(f"no shared-memory region named {name!r} is registered")
        return r

    @staticmethod
    def _check_range(r: Region, ref: ShmRef, what: str) -> None:
        if ref.offset + ref.byte_size > r.byte_size:
            raise BadRequest(f"{what}: shared_memory_offset {ref.offset} + shared_memory_byte_size {ref.byte_size} "
                             f"runs past the end of region {r.name!r} ({r.byte_size} bytes registered)")

    def _open(self, name: str, key: Any) -> int:
        if not isinstance(key, str):
            raise BadRequest(f"register {name}: key must be a string, got {key!r}")
        m = _KEY.fullmatch(key)
        if m is None or m.group(1) in (".", ".."):
            raise BadRequest(f"register {name}: key {key!r} is not a POSIX shared-memory name (\"/name\": one "
                             "component of letters, digits and ._-:+@=, at most 255 of them)")
        path = self.directory / m.group(1)
        try:
            # O_NOFOLLOW: a symlink planted in /dev/shm cannot point the daemon at another file.
            return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"register {name}: no shared-memory object with key {key!r} ({path})") from None
        except PermissionError:
            raise Forbidden(f"register {name}: the daemon may not read and write the object {key!r}") from None
        except OSError as e:
            raise BadRequest(f"register {name}: cannot open the object {key!r}: {e.strerror}") from None


class RegionReplica(SharedMemoryRegions):
    """A frontend worker's copy of the controller's registry: the regions it serves itself.

    It never registers or unregisters (those calls are forwarded); `apply` takes each snapshot the
    controller pushes. A region's object is opened here by its key when a request first names it,
    and kept only if it is the object the controller registered (same device and inode: the
    controller checked its owner and size). One that cannot be (unlinked or replaced since, not
    readable here) is left to the controller process, which holds the descriptor it registered
    with: `serves` says False and the worker forwards the request."""

    def __init__(self, settings: SharedMemorySettings, directory: Path = SHM_DIR) -> None:
        super().__init__(settings, directory)
        self.entries: dict[str, list[Any]] = {}  # name -> [name, key, offset, byte_size, st_dev, st_ino]
        self.elsewhere: set[str] = set()  # names whose object this worker could not open as registered

    def apply(self, snapshot: list[list[Any]]) -> None:
        wanted = {e[0]: e for e in snapshot}
        for name, r in list(self.regions.items()):
            if wanted.get(name) != r.entry():
                del self.regions[name]  # unregistered (or registered again, perhaps as another object)
                self._retire(r)
        self.elsewhere = {n for n in self.elsewhere if wanted.get(n) == self.entries.get(n)}
        self.entries = wanted
        self.generation += 1

    def serves(self, names: list[Any]) -> bool:
        regions = self.regions  # (a name that is not a string: the controller process answers its 400)
        return all(isinstance(n, str) and (n in regions or self._open_here(n)) for n in names)

    def _open_here(self, name: str) -> bool:
        e = self.entries.get(name)
        if e is None or name in self.elsewhere:
            return False
        _, key, offset, byte_size, dev, ino = e
        try:
            fd = self._open(name, key)
        except EscapementError:
            self.elsewhere.add(name)
            return False
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino) or offset + byte_size > st.st_size:
            os.close(fd)
            self.elsewhere.add(name)
            return False
        self.regions[name] = Region(name, key, offset, byte_size, fd, (dev, ino))
        return True

    def register(self, name: Any, key: Any, offset: Any, byte_size: Any) -> None:
        raise Unavailable("shared-memory regions are registered in the controller process")

    def unregister(self, name: str | None) -> None:
        raise Unavailable("shared-memory regions are unregistered in the controller process")

    def status(self, name: str | None) -> list[dict[str, Any]]:
        raise Unavailable("the shared-memory registry is the controller process's")


def region_names(items: Any) -> list[Any]:
    """The regions the inputs or outputs of a decoded request (JSON or msgpack) name."""
    out: list[Any] = []
    if isinstance(items, list):
        for t in items:
            p = t.get("parameters") if isinstance(t, dict) else None
            if isinstance(p, dict) and "shared_memory_region" in p:
                out.append(p["shared_memory_region"])
    return out


class OutputTargets:
    """The outputs one request writes into regions: pinned when the request is read (so the regions
    stay open until it is answered), released once, whatever the outcome."""

    __slots__ = ("items", "regions")

    def __init__(self, regions: SharedMemoryRegions) -> None:
        self.regions = regions
        self.items: dict[int, tuple[ShmRef, Region]] = {}  # output index -> where it goes

    def __bool__(self) -> bool:
        return bool(self.items)

    def add(self, index: int, ref: ShmRef, what: str) -> None:
        self.items[index] = (ref, self.regions.pin(ref, what))

    def write(self, index: int, arr: np.ndarray, what: str) -> dict[str, Any] | None:
        """Write output `index` if it goes to a region; its answer's parameters (None: it does not)."""
        item = self.items.get(index)
        if item is None:
            return None
        ref, region = item
        if arr.dtype == object:
            data: Any = tensor_bytes(arr)
        else:  # the array's own bytes, not a copy of them
            a = np.ascontiguousarray(arr)
            if a.dtype.byteorder == ">":
                a = a.astype(a.dtype.newbyteorder("<"))
            data = a.reshape(-1).view(np.uint8)
        return ref_parameters(ref, self.regions.write(region, ref, data, what))

    def release(self) -> None:
        items, self.items = self.items, {}
        for _, region in items.values():
            self.regions.unpin(region)
