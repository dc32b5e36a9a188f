"""The device weight arena's bookkeeping: extents of one fixed allocation. Pure code.

A CUDA device allocates its arena once, at start-up; models' weights and IO buffers are
extents of it. The allocator is first-fit over an address-ordered free list whose neighbours
are merged on free, so the largest free extent is what the controller's eviction must make
room for. Compaction plans moves of idle extents towards the start, which merges the free
space behind them; the backend carries the moves out (device-to-device copies) and re-binds
what the moved extents held.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

ALIGN = 256


def aligned(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class Extent:
    offset: int
    nbytes: int
    owner: str = ""
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def __repr__(self) -> str:
        return f"<extent {self.owner} [{self.offset}, {self.end})>"


@dataclass(frozen=True, slots=True)
class Move:
    extent: Extent
    old: int
    new: int


class Arena:
    def __init__(self, size: int, align: int = ALIGN) -> None:
        if size <= 0 or align <= 0 or align & (align - 1):
            raise ValueError("the arena needs a positive size and a power-of-two alignment")
        self.size = size - size % align
        self.align = align
        self._free: list[tuple[int, int]] = [(0, self.size)] if self.size else []  # (offset, nbytes), by offset
        self.live: dict[int, Extent] = {}
        self.used = 0

    @property
    def free_bytes(self) -> int:
        return self.size - self.used

    @property
    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)

    def alloc(self, nbytes: int, owner: str = "") -> Extent | None:
        """First fit; None when no free extent is large enough (even if enough bytes are free)."""
        n = aligned(max(nbytes, 1), self.align)
        for i, (off, size) in enumerate(self._free):
            if size >= n:
                if size == n:
                    del self._free[i]
                else:
                    self._free[i] = (off + n, size - n)
                ext = Extent(off, n, owner)
                self.live[ext.id] = ext
                self.used += n
                return ext
        return None

    def free(self, ext: Extent) -> None:
        if self.live.pop(ext.id, None) is None:
            raise ValueError(f"{ext!r} is not live in this arena")
        self.used -= ext.nbytes
        self._insert(ext.offset, ext.nbytes)

    def _insert(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self._free, (off, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # merge with the one before
            i -= 1
            off, n = self._free[i][0], self._free[i][1] + n
            del self._free[i]
        if i < len(self._free) and off + n == self._free[i][0]:  # and with the one after
            n += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (off, n))

    def plan_compaction(self, movable: set[int], need: int) -> list[Move] | None:
        """Moves of movable extents (by id) towards the start that leave a free extent of `need`
        bytes, fewest bytes moved first; None if moving every movable extent would not do it."""
        need = aligned(max(need, 1), self.align)
        if need > self.free_bytes:
            return None
        # Slide extents down in address order; stop as soon as a gap of `need` appears.
        moves: list[Move] = []
        cursor = 0  # where the next slid extent would land
        exts = sorted(self.live.values(), key=lambda e: e.offset)
        for k, e in enumerate(exts):
            if e.offset - cursor >= need:
                return moves  # the gap before it is large enough already (the start, or before a pinned one)
            nxt = exts[k + 1].offset if k + 1 < len(exts) else self.size
            if e.id in movable:
                if e.offset != cursor:
                    moves.append(Move(e, e.offset, cursor))
                cursor += e.nbytes
            else:
                cursor = e.end
            if nxt - cursor >= need:
                return moves
        if self.size - cursor >= need:
            return moves
        return None

    def apply(self, moves: list[Move]) -> None:
        """Record planned moves (the bytes were copied): the extents live at their new offsets."""
        for m in moves:
            ext = self.live[m.extent.id]
            assert ext.offset == m.old
            self.live.pop(ext.id)
            self.used -= ext.nbytes
            self._insert(ext.offset, ext.nbytes)
            # take [new, new + nbytes) out of the free list (it is free: the move slid it down)
            i = bisect.bisect_right(self._free, (m.new, float("inf"))) - 1
            off, size = self._free[i]
            assert off <= m.new and m.new + ext.nbytes <= off + size, "a move onto live memory"
            del self._free[i]
            if m.new > off:
                self._free.insert(i, (off, m.new - off))
                i += 1
            if m.new + ext.nbytes < off + size:
                self._free.insert(i, (m.new + ext.nbytes, off + size - m.new - ext.nbytes))
            ext.offset = m.new
            self.live[ext.id] = ext
            self.used += ext.nbytes

    def check(self) -> None:
        """Invariants (tests): free and live extents tile the arena exactly, free ones merged."""
        spans = sorted([(o, n, "free") for o, n in self._free] + [(e.offset, e.nbytes, "live")
                                                                   for e in self.live.values()])
        pos = 0
        prev = ""
        for off, n, kind in spans:
            assert off == pos, f"gap or overlap at {pos}: next span starts at {off}"
            assert n > 0 and off % self.align == 0
            assert not (kind == prev == "free"), "two free extents not merged"
            pos, prev = off + n, kind
        assert pos == self.size, f"spans end at {pos}, the arena at {self.size}"
        assert self.used == sum(e.nbytes for e in self.live.values())
