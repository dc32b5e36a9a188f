"""Shared-memory slots: where a frontend worker puts a request's tensors for the controller process.

Each worker has one region (a memfd both processes map; docs/frontend-workers.md) cut into
preallocated slots of three size classes: small (16 KiB: a few thousand floats, a 3x32x32 image),
medium (1 MiB: a batch-1 3x224x224 float32 image, ~602 KB) and one the size of the largest body.
The worker allocates a slot per request, writes the decoded inputs into it and names it in the
request's record; the controller reads the inputs in place (numpy views) and the worker frees the
slot when the request's answer (DONE) comes back. Counts are fixed at start-up: when every slot
that fits is taken, the request is refused (503), never queued.

Pure bookkeeping, no I/O; one event loop uses it, so no locks.
"""

from __future__ import annotations

from collections.abc import Sequence

SMALL_SLOT = 16 << 10
MEDIUM_SLOT = 1 << 20
ALIGN = 64  # each input starts on a cache line (numpy and torch copies are fastest aligned)


def pool_classes(slots: int, max_bytes: int) -> list[tuple[int, int]]:
    """(slot bytes, count) per class for `slots` small slots: a quarter as many medium ones and a
    hundred-and-twenty-eighth as many of the largest body's size (at least one of each). A quarter:
    image models send a medium slot's worth per request, and a sixteenth (16 per worker by default)
    held a worker to 18 such requests in flight (the many-models GPU bench: 503s at light load)."""
    classes = [(SMALL_SLOT, slots), (MEDIUM_SLOT, max(1, slots // 4))]
    if max_bytes > MEDIUM_SLOT:
        classes.append((_align(max_bytes), max(1, slots // 128)))
    return classes


def pool_bytes(classes: Sequence[tuple[int, int]]) -> int:
    return sum(size * count for size, count in classes)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def packed_size(nbytes: Sequence[int]) -> int:
    """The slot bytes that tensors of these sizes take, each aligned."""
    return sum(_align(n) for n in nbytes)


class SlotPool:
    """Slots of fixed size classes laid out one after another in a region of `pool_bytes(classes)`."""

    def __init__(self, classes: Sequence[tuple[int, int]]) -> None:
        self.sizes: list[int] = []
        self.offsets: list[int] = []  # by slot id
        self._class_of: list[int] = []
        self._free: list[list[int]] = []  # per class: free slot ids (a stack: the warmest slot first)
        self._taken: set[int] = set()
        offset = 0
        for c, (size, count) in enumerate(classes):
            ids = list(range(len(self.offsets), len(self.offsets) + count))
            for _ in range(count):
                self.offsets.append(offset)
                self.sizes.append(size)
                self._class_of.append(c)
                offset += size
            self._free.append(ids[::-1])
        self.class_sizes = [size for size, _ in classes]
        self.total = offset
        self.refused = 0  # allocations refused: every slot that fits was taken

    @property
    def taken(self) -> int:
        return len(self._taken)

    def alloc(self, nbytes: int) -> int | None:
        """A free slot of at least `nbytes` (the smallest class that has one), or None."""
        for c, size in enumerate(self.class_sizes):
            if size >= nbytes and self._free[c]:
                slot = self._free[c].pop()
                self._taken.add(slot)
                return slot
        self.refused += 1
        return None

    def free(self, slot: int) -> None:
        """Give a slot back; a slot freed twice or never taken is a bug (ValueError)."""
        if slot not in self._taken:
            raise ValueError(f"slot {slot} is not taken")
        self._taken.discard(slot)
        self._free[self._class_of[slot]].append(slot)

    def fits(self, nbytes: int) -> bool:
        """Whether any slot is large enough (free or not): a request larger than all is refused 413."""
        return nbytes <= self.class_sizes[-1]
