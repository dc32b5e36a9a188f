"""The weight arena's extent allocator: properties under random sequences (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.runtime.arena import ALIGN, Arena, aligned

SIZE = 64 * ALIGN

ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "compact"]), st.integers(1, 24 * ALIGN),
                         st.integers(0, 1000)), max_size=60)


@settings(max_examples=300, deadline=None, derandomize=True)  # the same examples every run (CI is deterministic)
@given(ops)
def test_extents_tile_the_arena_and_never_overlap(seq: list[tuple[str, int, int]]) -> None:
    a = Arena(SIZE)
    live = []
    for op, n, pick in seq:
        if op == "alloc":
            before = a.largest_free
            e = a.alloc(n)
            if e is None:
                assert aligned(n) > before  # refused only when no free extent is large enough
            else:
                assert e.offset % ALIGN == 0 and e.nbytes == aligned(n)
                live.append(e)
        elif op == "free" and live:
            a.free(live.pop(pick % len(live)))
        elif op == "compact":
            movable = {e.id for i, e in enumerate(live) if (i + pick) % 2}
            moves = a.plan_compaction(movable, n)
            if moves is not None:
                assert all(m.extent.id in movable and m.new < m.old for m in moves)
                a.apply(moves)
                assert a.largest_free >= aligned(n)  # the plan delivers what it promised
            else:
                assert aligned(n) > a.largest_free
        a.check()
        spans = sorted((e.offset, e.end) for e in live)
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))
        assert a.used == sum(e.nbytes for e in live)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 8 * ALIGN), min_size=1, max_size=30))
def test_freeing_everything_merges_back_into_one_extent(sizes: list[int]) -> None:
    a = Arena(SIZE)
    live = [e for n in sizes if (e := a.alloc(n)) is not None]
    for e in reversed(live[::2]):
        a.free(e)
    for e in live[1::2]:
        a.free(e)
    a.check()
    assert a.used == 0 and a.largest_free == a.size


def test_compaction_moves_only_movable_extents_down_and_in_order() -> None:
    a = Arena(10 * ALIGN)
    x, y, z = a.alloc(2 * ALIGN, "x"), a.alloc(3 * ALIGN, "y"), a.alloc(2 * ALIGN, "z")
    assert x and y and z
    a.free(y)  # [x][ 3 free ][z][3 free]
    assert a.alloc(4 * ALIGN) is None
    assert a.plan_compaction({x.id}, 4 * ALIGN) is None  # z is pinned where it is: no 4 in a row
    moves = a.plan_compaction({x.id, z.id}, 4 * ALIGN)
    assert moves is not None and [m.extent.owner for m in moves] == ["z"]  # x is at the start already
    a.apply(moves)
    assert (z.offset, a.largest_free) == (2 * ALIGN, 6 * ALIGN)
    a.check()


def test_bad_uses_are_refused() -> None:
    a = Arena(4 * ALIGN)
    e = a.alloc(1)
    assert e is not None
    a.free(e)
    with pytest.raises(ValueError, match="not live"):
        a.free(e)
    with pytest.raises(ValueError, match="power-of-two"):
        Arena(1000, align=3)


def test_compaction_sees_a_large_enough_gap_before_the_first_extent() -> None:
    """Found by the property test: room at the start of the arena, before a pinned extent, is
    room; no move is needed (it used to say that no plan could make room)."""
    a = Arena(3 * ALIGN)
    first, pinned, last = a.alloc(ALIGN), a.alloc(ALIGN), a.alloc(ALIGN)
    assert first is not None and pinned is not None and last is not None
    a.free(first)
    assert a.plan_compaction(set(), ALIGN) == []
