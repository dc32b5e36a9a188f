"""Page-locked host memory, under a budget of its own.

A LOAD copies a model's host block to a device; the copy is asynchronous (and fast) only
from page-locked memory. Pinning every model would lock as much host memory as all models
hold, invisibly (torch's pinned allocator also rounds each block up to a power of two and
keeps it). Here a process pins model blocks by registering them in place, exactly their
size, while `runtime.host_pinned_budget` allows; the rest stay pageable, and their LOADs go
through a small pinned staging ring (slower, but bounded). IO buffers of loaded models are
charged to the same budget.
"""

from __future__ import annotations

import logging
import threading

import torch

from daemon.runtime.devapi import Buffer, DeviceApi, Where

log = logging.getLogger("escapement.runtime")

PAGE = 4096  # page-locking locks whole pages: what is charged is what is locked


def pages(nbytes: int) -> int:
    return -(-max(nbytes, 1) // PAGE) * PAGE


def page_aligned(nbytes: int) -> torch.Tensor:
    """Flat uint8 host memory starting on a page and owning its last page alone: it can be
    page-locked in place without sharing a page with anything else (CUDA locks a page once)."""
    raw = torch.empty(pages(nbytes) + PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % PAGE
    return raw[off : off + nbytes]


class HostPins:
    """The process's pinned host memory: model blocks pinned once, shared by every device."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._blocks: dict[int, tuple[Buffer, DeviceApi]] = {}  # id(host block) -> its pinned buffer
        self._lock = threading.Lock()

    def charge(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + pages(nbytes) > self.budget:
                return False
            self.used += pages(nbytes)
            return True

    def release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            self.used -= pages(nbytes)

    def block(self, host_block: torch.Tensor, api: DeviceApi, label: str) -> Buffer:
        """The block as a Buffer: pinned (once, by whichever device asks first) while the budget
        allows, else pageable."""
        with self._lock:
            entry = self._blocks.get(id(host_block))
            if entry is not None and entry[0].tensor is host_block:
                return entry[0]
            n = pages(host_block.numel())
            if self.used + n > self.budget:
                return Buffer(host_block, Where.PAGEABLE, label)
            try:
                buf = api.pin(host_block, label)
            except ValueError as e:  # overlaps memory pinned by someone else: load through staging
                log.warning("%s stays pageable: %s", label, e)
                return Buffer(host_block, Where.PAGEABLE, label)
            self.used += n
            self._blocks[id(host_block)] = (buf, api)
            return buf

    def forget(self, host_block: torch.Tensor) -> None:
        """Unpin a block no device will load again (its model version is gone)."""
        with self._lock:
            entry = self._blocks.pop(id(host_block), None)
            if entry is None:
                return
            buf, api = entry
            self.used -= pages(buf.nbytes)
        try:
            api.unpin(buf)
        except Exception as e:  # a failed device cannot unregister; the memory is the process's anyway
            log.warning("unpinning %s failed: %s", buf.label, e)

    def close(self) -> None:
        """Unpin every block (the owner is done with every device)."""
        with self._lock:
            blocks = [b for b, _ in self._blocks.values()]
        for b in blocks:
            self.forget(b.tensor)

    @property
    def blocks(self) -> int:
        return len(self._blocks)


class PinnedPool:
    """Pinned IO buffers an UNLOAD gave back, by size, for the next LOAD that asks for that size.

    Page-locking is a system call per buffer that touches every page, milliseconds for a model's
    input staging and output ring, where its LOAD's weight copy is one or two; models of one
    structure ask for the same sizes, so keeping the buffers pinned makes a LOAD the weight copy.
    Pooled buffers stay charged to the process's HostPins: the owner evicts them (`evict`) when a
    new pin would pass its budget. Bookkeeping only: the owner unpins what comes back."""

    def __init__(self, max_buffers: int) -> None:
        self.max_buffers = max_buffers
        self._free: dict[int, list[Buffer]] = {}  # requested bytes -> buffers (warmest last)
        self._order: list[tuple[int, Buffer]] = []  # oldest first: what `evict` gives up first
        self.reused = 0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def nbytes(self) -> int:
        return sum(pages(n) for n, _ in self._order)

    def take(self, nbytes: int) -> Buffer | None:
        bufs = self._free.get(nbytes)
        if not bufs:
            return None
        buf = bufs.pop()
        self._order.remove((nbytes, buf))
        self.reused += 1
        return buf

    def give(self, nbytes: int, buf: Buffer) -> list[tuple[int, Buffer]]:
        """Keep `buf` (pinned for `nbytes`); what no longer fits comes back, oldest first."""
        self._free.setdefault(nbytes, []).append(buf)
        self._order.append((nbytes, buf))
        out = []
        while len(self._order) > self.max_buffers:
            out.append(self._evict_one())
        return out

    def evict(self, nbytes: int) -> list[tuple[int, Buffer]]:
        """Give up the oldest buffers until at least `nbytes` of pages are freed (or none are left)."""
        out: list[tuple[int, Buffer]] = []
        freed = 0
        while self._order and freed < nbytes:
            n, buf = self._evict_one()
            out.append((n, buf))
            freed += pages(n)
        return out

    def clear(self) -> list[tuple[int, Buffer]]:
        out = list(self._order)
        self._order.clear()
        self._free.clear()
        return out

    def _evict_one(self) -> tuple[int, Buffer]:
        n, buf = self._order.pop(0)
        self._free[n].remove(buf)
        return n, buf
