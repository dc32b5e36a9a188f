"""Shared-memory regions: Triton's system shared-memory extension, for clients on this host.

A client creates a POSIX shared-memory object (`shm_open`, a file in /dev/shm), registers a
range of it under a name, then names the region in requests instead of sending tensor bytes:
inputs are read from it, and outputs asked for that way are written into it (the answer carries
the region's parameters, not the bytes). Every frontend uses this one registry, which lives in
the controller process; with frontend workers on, a worker forwards requests that name a region
to the controller process (their bodies are small: no tensor bytes), so there is one owner of
the regions and of the counts that say which are in use.

The registry holds a file descriptor per region, never a mapping. Inputs are read with
`preadv` into the request's own buffer and outputs written with `pwrite`: a client that
truncates its object after registering makes a read come up short (a 400), where a mapping
would raise SIGBUS and kill the daemon. Reading copies, which is also what keeps a client that
overwrites the region while its request waits from changing a batch already formed.

Unregistering a region that requests are using (an output still to be written) is deferred, not
refused: the name goes at once (new requests naming it get a 404, and it may be registered
again), and the descriptor is closed when the last of those requests is answered. A client's
clean-up (unregister all) thus never fails because a request it gave up on still runs.

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
from daemon.errors import BadRequest, Conflict, Forbidden, NotFound, NotImplementedByServer, PayloadTooLarge

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
    __slots__ = ("byte_size", "fd", "key", "name", "offset", "pins", "retired")

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int) -> None:
        self.name = name
        self.key = key
        self.offset = offset  # within the object
        self.byte_size = byte_size
        self.fd = fd
        self.pins = 0  # requests that will still write into it
        self.retired = False  # unregistered: closed when the last pin goes

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
        self.regions[name] = Region(name, key, offset, byte_size, fd)
        self.bytes += byte_size

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


def names_region(items: Any) -> bool:
    """Whether any input or output of a decoded request (JSON or msgpack) names a region."""
    if not isinstance(items, list):
        return False
    for t in items:
        p = t.get("parameters") if isinstance(t, dict) else None
        if isinstance(p, dict) and "shared_memory_region" in p:
            return True
    return False


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
