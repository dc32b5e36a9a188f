"""The device seam itself: what the backend relies on, on the stand-in in every mode (and CUDA)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from daemon.runtime.devapi import CaptureError, DeviceApi, DeviceFault, DeviceHang, Where
from daemon.runtime.emucuda import POISON, EmuCuda, EmuSettings
from daemon.runtime.hostmem import page_aligned
from daemon.runtime.racecheck import RaceError

SOON = 5.0


def deadline() -> float:
    return time.monotonic() + SOON


def test_copies_round_trip_after_their_event(api: DeviceApi) -> None:
    h2d, d2h = api.stream("t-h2d"), api.stream("t-d2h")
    src, out = api.alloc_pinned(4096, "src"), api.alloc_pinned(4096, "out")
    dev = api.alloc(4096, "dev")
    api.host_write(src.region())
    src.tensor.copy_(torch.arange(4096) % 251)
    api.copy(dev.region(), src.region(), h2d)
    done = api.event()
    api.record(done, h2d)
    api.wait_event(d2h, done)
    api.copy(out.region(), dev.region(), d2h)
    back = api.event()
    api.record(back, d2h)
    back.wait(deadline())
    api.host_read(out.region())
    assert torch.equal(out.tensor, src.tensor)
    api.free(dev)
    api.unpin(src)
    api.unpin(out)


def test_pinned_memory_sharing_a_page_cannot_be_registered_twice() -> None:
    """CUDA locks whole pages, each once: two small tensors on one page cannot both be pinned."""
    emu = EmuCuda(0, EmuSettings(capacity=1 << 20))
    raw = page_aligned(8192)
    emu.pin(raw[:100])
    with pytest.raises(RuntimeError, match="AlreadyRegistered"):
        emu.pin(raw[200:300])
    emu.pin(raw[4096:4196])  # the next page is free


def test_pinned_memory_is_counted_exactly_page_rounded(api: DeviceApi) -> None:
    before = api.pinned_bytes
    a = api.alloc_pinned(10_000)
    b = api.pin(page_aligned(5000))
    assert api.pinned_bytes - before == 12288 + 8192  # pages, never a power of two (16384 + 8192)
    assert a.where == Where.PINNED
    api.unpin(a)
    api.unpin(b)
    assert api.pinned_bytes == before


@pytest.fixture(params=["eager", "lazy", "random"])
def standin(request: pytest.FixtureRequest) -> EmuCuda:
    return EmuCuda(0, EmuSettings(capacity=1 << 20, mode=request.param, seed=3))


def test_a_host_read_before_the_copy_finished_is_a_race(standin: EmuCuda) -> None:
    s = standin.stream("s")
    dev, out = standin.alloc(256), standin.alloc_pinned(256)
    standin.copy(out.region(), dev.region(), s)
    with pytest.raises(RaceError, match="host read"):
        standin.host_read(out.region())  # no event waited for


def test_two_streams_writing_unordered_is_a_race_and_an_event_orders_them(standin: EmuCuda) -> None:
    a, b = standin.stream("a"), standin.stream("b")
    buf, src = standin.alloc(256), standin.alloc_pinned(256)
    standin.copy(buf.region(), src.region(), a)
    ev = standin.event()
    standin.record(ev, a)
    standin.wait_event(b, ev)
    standin.launch(b, lambda: None, [buf.region()], [buf.region()])  # ordered by the event: fine
    with pytest.raises(RaceError, match="races"):
        standin.copy(buf.region(), src.region(), a)  # a writes again while b's kernel may still run


def test_reused_events_keep_what_was_waited_for(standin: EmuCuda) -> None:
    """A wait captures the event's record at the time of the wait, as cudaStreamWaitEvent does."""
    a, b = standin.stream("a"), standin.stream("b")
    buf, src = standin.alloc(256), standin.alloc_pinned(256)
    standin.host_write(src.region())
    src.tensor.fill_(7)
    ev = standin.event()
    standin.copy(buf.region(), src.region(), a)
    standin.record(ev, a)
    standin.wait_event(b, ev)
    standin.record(ev, b)  # recorded again before b's wait ran (lazy): must not deadlock
    out = standin.alloc_pinned(256)
    standin.copy(out.region(), buf.region(), b)
    done = standin.event()
    standin.record(done, b)
    done.wait(deadline())
    standin.host_read(out.region())
    assert int(out.tensor[0]) == 7


def test_lazy_mode_shows_what_was_not_waited_for() -> None:
    """Reading device results without waiting gives poison on the stand-in (it would be stale on a GPU)."""
    emu = EmuCuda(0, EmuSettings(capacity=1 << 20, mode="lazy", strict=False))
    s = emu.stream("s")
    dev, src, out = emu.alloc(64), emu.alloc_pinned(64), emu.alloc_pinned(64)
    src.tensor.fill_(1)
    emu.copy(dev.region(), src.region(), s)
    emu.copy(out.region(), dev.region(), s)
    emu.host_read(out.region())  # recorded as a race (strict=False), and the bytes are not there yet
    assert emu.races.races
    assert int(out.tensor[0]) == POISON
    emu.synchronize(deadline())
    assert int(out.tensor[0]) == 1


def test_fresh_and_freed_memory_is_poison(standin: EmuCuda) -> None:
    buf = standin.alloc(16)
    assert torch.all(buf.tensor == POISON)
    assert torch.isnan(buf.tensor.view(torch.float32)).all()
    t = buf.tensor
    standin.free(buf)
    assert torch.all(t == POISON)


def test_capacity_and_injected_out_of_memory(standin: EmuCuda) -> None:
    with pytest.raises(torch.OutOfMemoryError):
        standin.alloc(2 << 20)
    standin.fail_allocation(after=1)
    standin.alloc(16)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        standin.alloc(16)
    standin.alloc(16)  # only the one


def test_capture_refuses_syncs_allocations_and_host_reads(standin: EmuCuda) -> None:
    s = standin.stream("cap")
    buf = standin.alloc(64)
    x = buf.view(0, torch.float32, (4, 4))

    def sync_inside() -> None:
        float(x.sum())  # .item(): a host sync

    with pytest.raises(CaptureError, match="host sync"):
        standin.capture(s, lambda: standin.launch(s, sync_inside, [buf.region()], []))
    with pytest.raises(CaptureError, match="allocate"):
        standin.capture(s, lambda: standin.alloc(16))
    pinned = standin.alloc_pinned(64)
    with pytest.raises(CaptureError, match="pinned memory on the host"):
        standin.capture(s, lambda: standin.host_read(pinned.region()))
    ev = standin.event()
    with pytest.raises(CaptureError, match="synchronize"):
        standin.capture(s, lambda: ev.wait(deadline()))


def test_capture_computes_nothing_and_replay_does(standin: EmuCuda) -> None:
    s = standin.stream("cap")
    inp, out = standin.alloc(64), standin.alloc(64)
    x, y = inp.view(0, torch.float32, (16,)), out.view(0, torch.float32, (16,))
    src = standin.alloc_pinned(64)
    src.tensor.view(torch.float32).copy_(torch.arange(16, dtype=torch.float32))
    standin.copy(inp.region(), src.region(), s)

    def double() -> None:
        y.copy_(x * 2)

    g = standin.capture(s, lambda: standin.launch(s, double, [inp.region()], [out.region()]))
    standin.synchronize(deadline())
    assert torch.isnan(y).all()  # capture recorded the kernel; nothing ran
    g.replay(s)
    standin.synchronize(deadline())
    assert torch.equal(y, torch.arange(16, dtype=torch.float32) * 2)
    g.close()


def test_a_sticky_error_fails_every_later_call(standin: EmuCuda) -> None:
    s = standin.stream("s")
    buf = standin.alloc(64)
    standin.fail_next_kernel("device-side assert triggered")
    standin.launch(s, lambda: None, [buf.region()], [])
    with pytest.raises(DeviceFault, match="device-side assert"):
        standin.synchronize(deadline())  # the error surfaces at the next sync (or any later call)
    with pytest.raises(DeviceFault):
        standin.alloc(16)


@pytest.mark.slow  # asserts in wall-clock time
def test_a_hung_kernel_is_reported_by_the_deadline(standin: EmuCuda) -> None:
    s = standin.stream("s")
    standin.hang_next_kernel()
    standin.launch(s, lambda: None, [], [])
    ev = standin.event()
    standin.record(ev, s)
    t0 = time.monotonic()
    with pytest.raises(DeviceHang):
        ev.wait(t0 + 0.05)
    assert time.monotonic() - t0 < 2.0
    standin.release()
    ev.wait(deadline())


@pytest.mark.slow  # asserts elapsed wall-clock time
def test_a_copy_queued_behind_a_long_copy_waits_for_it_on_its_engine() -> None:
    emu = EmuCuda(0, EmuSettings(capacity=64 << 20, timed=True, h2d_gbps=1.0))
    big_s, small_s = emu.stream("load"), emu.stream("io", priority=-1)
    big, big_src = emu.alloc(16 << 20), emu.alloc_pinned(16 << 20)  # 16.8 ms at 1 GB/s
    small, small_src = emu.alloc(4096), emu.alloc_pinned(4096)
    t0 = time.monotonic()  # before the big copy starts: the small one cannot end before it does
    emu.copy(big.region(), big_src.region(), big_s)
    emu.copy(small.region(), small_src.region(), small_s)  # another stream, a higher priority: still waits
    ev = emu.event()
    emu.record(ev, small_s)
    ev.wait(t0 + SOON)
    assert time.monotonic() - t0 > 0.016


@pytest.mark.slow  # the modelled time plus wall-clock gaps between launches
def test_elapsed_time_is_the_modelled_device_time() -> None:
    emu = EmuCuda(0, EmuSettings(capacity=64 << 20, kernel_s=0.004))
    s = emu.stream("s")
    a, b = emu.event(), emu.event()
    emu.record(a, s)
    emu.launch(s, lambda: None, [], [])
    emu.record(b, s)
    b.wait(deadline())
    assert a.elapsed_s(b) == pytest.approx(0.004, abs=1e-3)  # plus the gap between launches


def test_kernel_errors_raise_at_launch_in_eager_mode() -> None:
    emu = EmuCuda(0, EmuSettings(capacity=1 << 20))
    s = emu.stream("s")

    def bad() -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        emu.launch(s, bad, [], [])
    emu.check()  # not sticky: the device still works
    assert np.isfinite(1.0)
