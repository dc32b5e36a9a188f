"""The frontend-worker link's parts without processes: slot pools, records, rebuilt errors."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import msgpack
import pytest

from daemon.api.link import ANSWER, DONE, SUBMIT, Link
from daemon.api.remote import error_from
from daemon.api.slots import MEDIUM_SLOT, SMALL_SLOT, SlotPool, packed_size, pool_bytes, pool_classes
from daemon.errors import DeadlineExceeded, Overloaded, Unavailable


def test_slots_come_from_the_smallest_class_that_has_one_free() -> None:
    classes = pool_classes(2, 4 << 20)
    assert classes == [(SMALL_SLOT, 2), (MEDIUM_SLOT, 1), (4 << 20, 1)]  # at least one of each
    # the default: a quarter as many medium slots (a 224x224 image each) and a 128th as many large
    assert pool_classes(256, 4 << 20) == [(SMALL_SLOT, 256), (MEDIUM_SLOT, 64), (4 << 20, 2)]
    pool = SlotPool(classes)
    assert pool.total == pool_bytes(classes)
    a, b = pool.alloc(100), pool.alloc(SMALL_SLOT)
    assert a is not None and b is not None and pool.sizes[a] == pool.sizes[b] == SMALL_SLOT
    c = pool.alloc(10)  # the small ones are taken: a larger slot serves it
    assert c is not None and pool.sizes[c] == MEDIUM_SLOT
    d = pool.alloc(10)
    assert d is not None and pool.sizes[d] == 4 << 20
    assert pool.alloc(10) is None and pool.refused == 1  # full: the caller refuses (503)
    assert not pool.fits((4 << 20) + 1)  # larger than any slot: 413, not 503
    offsets = sorted(pool.offsets[s] for s in (a, b, c, d))
    assert len(set(offsets)) == 4 and offsets[-1] + (4 << 20) <= pool.total  # disjoint, inside the region
    pool.free(a)
    assert pool.alloc(1) == a
    pool.free(c)
    with pytest.raises(ValueError, match="not taken"):
        pool.free(c)  # freed twice: a bug, never a silent double use
    assert pool.taken == 3


def test_inputs_are_packed_aligned() -> None:
    assert packed_size([1, 64, 65]) == 64 + 64 + 128


def test_errors_keep_their_status_and_retry_after_across_the_link() -> None:
    e = error_from(503, "full", 1.0)
    assert isinstance(e, Overloaded) and e.retry_after_s == 1.0
    assert type(error_from(503, "draining", None)) is Unavailable
    assert isinstance(error_from(504, "late", None), DeadlineExceeded)
    odd = error_from(418, "teapot", None)
    assert odd.status == 418 and odd.message == "teapot"


@pytest.mark.expect_errors("link: a bad record")
def test_records_cross_a_socketpair_in_order_and_a_bad_record_closes_the_link() -> None:
    async def main() -> bool:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        got: list[Any] = []
        lost = asyncio.Event()
        records = [[SUBMIT, i, "m", 1, [[64 * i, [1, 4]]]] for i in range(100)] + [[DONE, 7, 200, b"\0" * 1000]]
        all_read = asyncio.Event()

        def on_record(r: list[Any]) -> None:
            got.append(r)
            if len(got) == len(records):
                all_read.set()

        _, tx = await loop.connect_accepted_socket(lambda: Link(got.append, lambda: None, max_record=1 << 16), sock=a)
        _, rx = await loop.connect_accepted_socket(lambda: Link(on_record, lost.set, max_record=1 << 16), sock=b)
        for r in records:
            tx.send(r)
        await asyncio.wait_for(all_read.wait(), 5)
        assert got == records
        tx.transport.write(b"\xc1")  # never valid msgpack
        await asyncio.wait_for(lost.wait(), 5)
        tx.close()
        return rx.closed

    assert asyncio.run(main())


def test_held_records_go_out_in_one_write_when_flushed_and_not_before() -> None:
    class Recorder(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[bytes] = []

        def write(self, data: Any) -> None:
            self.writes.append(bytes(data))

        def get_write_buffer_size(self) -> int:
            return 0

    async def main() -> None:
        link = Link(lambda r: None, lambda: None, max_record=1 << 16)
        t = Recorder()
        link.connection_made(t)
        assert link.hold([ANSWER, 1, [[(1, 2), b"ab"]]])  # the first held: the caller flushes
        assert not link.hold([DONE, 2, 504, "late", None, False, []])  # already arranged
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert t.writes == []  # held: no write arranged on the loop
        link.flush()
        unpacker = msgpack.Unpacker(raw=False)
        assert len(t.writes) == 1
        unpacker.feed(t.writes[0])
        assert list(unpacker) == [[ANSWER, 1, [[[1, 2], b"ab"]]], [DONE, 2, 504, "late", None, False, []]]
        link.send([DONE, 3, 499, "", None, False, []])  # sent, not held: written after this turn
        assert link.hold([ANSWER, 4, []]) is False  # a write is already arranged; it takes this too
        await asyncio.sleep(0)
        assert len(t.writes) == 2
        unpacker.feed(t.writes[1])
        assert [r[1] for r in unpacker] == [3, 4]

    asyncio.run(main())
