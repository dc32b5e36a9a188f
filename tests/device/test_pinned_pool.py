"""An UNLOAD pools its model's pinned IO buffers (runtime/hostmem.py PinnedPool) for the next LOAD of
the same sizes, so that LOAD pins nothing; a response still reading an output slot keeps it out of
the pool; the pool gives way to the pinned budget; and everything pooled is charged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from daemon.model import ModelSpec
from daemon.runtime.devapi import Buffer, Where
from daemon.runtime.emucuda import EmuCuda, EmuSettings
from daemon.runtime.hostmem import PinnedPool, pages
from daemon.runtime.program import Program, load_program
from tests.device.conftest import backend_on
from tests.device.test_backend import check, infer, load, sample


@pytest.fixture(scope="module")
def twins(specs: dict[str, ModelSpec]) -> dict[str, Program]:
    return {k: load_program(specs[k]) for k in ("wide:1", "wide_other:1", "tiny_pt2:1")}


def test_a_twin_load_pins_nothing_and_every_pooled_byte_is_charged(twins: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=256 << 20))
    be = backend_on(api)
    try:
        ra = load(be, twins["wide:1"])
        check(be, ra, 2)
        pinned = api.pinned_bytes
        be.unload(ra)
        assert len(be.pinned_pool) > 0
        assert api.pinned_bytes == pinned == be.host.used  # still pinned, still charged
        allocations = api.allocations
        rb = load(be, twins["wide_other:1"])
        # one pin, its weights' host block (pinned once, for as long as it is served); no IO buffer
        # pinned, nothing captured
        assert api.allocations == allocations + 1
        assert len(be.pinned_pool) == 0 and be.pinned_pool.reused > 0
        for n in (1, 5, 8):
            check(be, rb, n, seed=n)  # staging reused: padding rows are zeros again, answers right
        be.unload(rb)
        allocations = api.allocations
        check(be, load(be, twins["wide:1"]), 3)  # back again: the weight copy alone
        assert api.allocations == allocations
    finally:
        be.close()
        be.host.close()
    assert api.pinned_bytes == 0 and be.host.used == 0  # close unpinned the pool
    api.release()


def test_reused_staging_pads_a_short_batch_with_zeros_not_the_last_model_inputs(
        twins: dict[str, Program]) -> None:
    """A LOAD does not zero its staging buffers (a pooled one holds an earlier model's inputs): the
    first batch at each size zeroes its padding rows, so what the device reads past a short
    batch's rows is zeros, on the host and in the static inputs."""
    api = EmuCuda(0, EmuSettings(capacity=256 << 20))
    be = backend_on(api)
    try:
        ra = load(be, twins["wide:1"])
        b = ra.program.spec.max_batch_size
        infer(be, ra, tuple(x + 7.0 for x in sample(ra.program.spec, b)))  # every row non-zero
        be.unload(ra)
        rb = load(be, twins["wide_other:1"])
        assert be.pinned_pool.reused > 0  # its staging is the one ra filled
        n = b - 3
        infer(be, rb, sample(rb.program.spec, n))
        io = rb.io[b]
        assert io.filled == n
        for host in io.host:
            assert np.all(host[n:] == 0)
        api.synchronize(None)
        for dev in io.device:
            assert torch.all(dev[n:] == 0)
        be.unload(rb)
    finally:
        be.close()
        be.host.close()
    api.release()


def test_an_output_slot_a_response_still_reads_is_never_handed_on(twins: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=256 << 20))
    be = backend_on(api)
    try:
        ra = load(be, twins["wide:1"])
        held = infer(be, ra, sample(ra.program.spec, 4, seed=1))  # a response not yet written
        kept = [a.copy() for a in held]
        be.unload(ra)
        rb = load(be, twins["wide_other:1"])
        for seed in range(6):  # every ring slot of the twin used, more than once
            infer(be, rb, sample(rb.program.spec, 4, seed=seed + 10))
        for a, k in zip(held, kept, strict=True):
            np.testing.assert_array_equal(a, k)
        be.unload(rb)
        del held
    finally:
        be.close()
        be.host.close()
        api.release()


def test_the_pool_gives_way_to_the_pinned_budget(twins: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=256 << 20))
    # room for the staging ring and about one model's IO buffers
    be = backend_on(api, pinned=(8 << 20) + (256 << 10))
    try:
        be.unload(load(be, twins["tiny_pt2:1"]))
        assert len(be.pinned_pool) > 0
        # another structure, other sizes: the pool is evicted to pin them (the weights stay pageable)
        r = load(be, twins["wide:1"])
        assert be.host.used <= be.host.budget and api.pinned_bytes == be.host.used
        check(be, r, 3)
        be.unload(r)
    finally:
        be.close()
        be.host.close()
        api.release()


def test_a_failed_load_pools_nothing(twins: dict[str, Program]) -> None:
    api = EmuCuda(0, EmuSettings(capacity=256 << 20))
    be = backend_on(api)
    try:
        api.fail_allocation(after=3)  # inside the IO buffers' pins
        with pytest.raises((torch.OutOfMemoryError, Exception)):
            load(be, twins["wide:1"])
        assert len(be.pinned_pool) == 0 and len(be.graph_cache) == 0
        assert api.pinned_bytes == be.host.used
    finally:
        be.close()
        be.host.close()
        api.release()


# ------------------------------------------------------------------ the bookkeeping alone


def _buf(n: int) -> Buffer:
    return Buffer(torch.empty(n, dtype=torch.uint8), Where.PINNED, f"b{n}")


def test_the_pool_matches_exact_sizes_warmest_first() -> None:
    pool = PinnedPool(8)
    a, b, c = _buf(100), _buf(100), _buf(200)
    for n, x in ((100, a), (100, b), (200, c)):
        assert pool.give(n, x) == []
    assert pool.take(150) is None
    assert pool.take(100) is b and pool.take(100) is a and pool.take(100) is None
    assert pool.take(200) is c and len(pool) == 0 and pool.reused == 3


def test_the_pool_evicts_oldest_first_by_count_and_by_bytes() -> None:
    pool = PinnedPool(2)
    a, b, c = _buf(10), _buf(20), _buf(30)
    pool.give(10, a)
    pool.give(20, b)
    assert pool.give(30, c) == [(10, a)]
    assert pool.nbytes == pages(20) + pages(30)
    assert pool.evict(1) == [(20, b)]  # one page asked: the oldest buffer goes
    assert pool.clear() == [(30, c)] and len(pool) == 0
