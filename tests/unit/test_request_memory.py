"""Request memory: the byte budget every frontend charges (daemon/api/budget.py)."""

from __future__ import annotations

import pytest

from daemon.api.budget import SMALL_REQUEST, RequestMemory
from daemon.errors import Overloaded

MiB = 1 << 20


def test_large_requests_fill_all_but_the_reserve_and_small_ones_still_fit() -> None:
    mem = RequestMemory(64 * MiB, 8 * MiB)
    leases = []
    for _ in range(100):  # many connections, each with a body of 4 MiB
        lease = mem.share().lease()
        if not lease.take(4 * MiB):
            break
        leases.append(lease)
    assert mem.held == 60 * MiB == len(leases) * 4 * MiB  # 64 MiB less a sixteenth
    small = [mem.share().lease() for _ in range(64)]
    assert all(s.take(60 << 10) for s in small)  # ordinary requests: served beside the flood
    assert mem.held <= mem.limit
    assert not mem.share().lease().take(2 * SMALL_REQUEST)  # not small: refused
    # a small request cannot grow into a large one through the reserve
    growing = small[0]
    assert not growing.take(SMALL_REQUEST)
    for lease in leases + small:
        lease.release()
    assert mem.held == 0 and mem.peak <= mem.limit


def test_a_share_fills_and_a_release_is_counted_once() -> None:
    mem = RequestMemory(64 * MiB, 8 * MiB)
    share = mem.share()
    a, b = share.lease(), share.lease()
    assert a.take(5 * MiB) and b.take(3 * MiB)
    assert share.full and share.held == 8 * MiB
    a.release()
    a.release()  # idempotent
    assert not share.full and share.held == 3 * MiB and mem.held == 3 * MiB
    b.force(1 * MiB)  # decoded tensors: counted even when it passes the limit
    assert mem.held == 4 * MiB
    b.release()
    assert mem.held == 0


def test_a_refusal_says_why_and_asks_for_a_retry() -> None:
    mem = RequestMemory(2 * MiB, MiB)
    err = mem.refusal(3 * MiB)
    assert isinstance(err, Overloaded) and err.retry_after_s == 1.0
    assert "server.request_memory_bytes" in str(err) and mem.refused == 1


def test_paused_readers_are_woken_when_memory_is_released() -> None:
    mem = RequestMemory(2 * MiB, 2 * MiB)
    lease = mem.share().lease()
    assert lease.take(MiB + MiB // 2)
    woken: list[str] = []
    mem.wait("conn", lambda: woken.append("conn"))
    mem.wait("gone", lambda: woken.append("gone"))
    mem.forget("gone")
    lease.release()
    assert woken == ["conn"]


def test_a_share_larger_than_the_total_is_refused() -> None:
    with pytest.raises(ValueError, match="share"):
        RequestMemory(MiB, 2 * MiB)
