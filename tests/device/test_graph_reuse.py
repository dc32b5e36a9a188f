"""A LOAD of a model with the structure of one unloaded from the same extent replays that model's
parked CUDA graphs (runtime/graph_cache.py): it copies weights and captures nothing, and its
answers are its own weights' (the graph reads the extent's addresses), never its predecessor's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from daemon.model import ModelSpec
from daemon.runtime.cuda import CudaBackend
from daemon.runtime.emucuda import EmuCuda
from daemon.runtime.graph_cache import GraphCache, GraphSet, Retargetable
from daemon.runtime.program import Program, load_program
from tests.device.conftest import backend_on, make_api, want
from tests.device.test_backend import check, infer, load, sample


@pytest.fixture(scope="module")
def twins(specs: dict[str, ModelSpec]) -> dict[str, Program]:
    return {k: load_program(specs[k]) for k in ("wide:1", "wide_other:1", "tiny_pt2:1")}


@pytest.fixture
def be(backend: CudaBackend) -> CudaBackend:
    return backend


def test_twins_share_a_structure_and_other_models_do_not(twins: dict[str, Program]) -> None:
    a, b, c = twins["wide:1"], twins["wide_other:1"], twins["tiny_pt2:1"]
    assert a.structure and a.structure == b.structure
    assert c.structure and c.structure != a.structure
    assert not all(torch.equal(x, y) for x, y in zip(a.host_tensors, b.host_tensors, strict=True))


def test_a_twin_loaded_where_its_twin_was_replays_its_graphs_with_its_own_weights(
        be: CudaBackend, twins: dict[str, Program]) -> None:
    a, b = twins["wide:1"], twins["wide_other:1"]
    ra = load(be, a)
    assert ra.state.graphs, ra.notes
    assert ra.set_up  # warmed up and captured: the controller keeps this LOAD's time apart
    where = (ra.state.extent.offset, ra.state.extent.nbytes)
    out_a = check(be, ra, 3)
    be.unload(ra)
    assert len(be.graph_cache) == 1
    graphs = be.api.graphs if isinstance(be.api, EmuCuda) else None
    rb = load(be, b)
    assert (rb.state.extent.offset, rb.state.extent.nbytes) == where
    assert be.graph_cache.hits == 1 and len(be.graph_cache) == 0 and not rb.set_up
    assert sorted(rb.state.graphs) == sorted(b.spec.batch_sizes)
    if graphs is not None:
        assert be.api.graphs == graphs  # nothing captured for this LOAD
    for n in (1, 3, 8):  # every batch size's graph, each answering with b's weights
        check(be, rb, n, seed=n)
    xs = sample(a.spec, 3)
    assert not np.allclose(infer(be, rb, xs)[0], out_a[0])
    be.unload(rb)
    ra2 = load(be, a)  # and back: b's set was parked in its place
    assert be.graph_cache.hits == 2
    check(be, ra2, 5)
    be.unload(ra2)


def test_another_structure_at_the_same_offset_captures_its_own(be: CudaBackend, twins: dict[str, Program]) -> None:
    a, c = twins["wide:1"], twins["tiny_pt2:1"]
    be.unload(load(be, a))
    rc = load(be, c)
    assert be.graph_cache.hits == 0 and be.graph_cache.misses == 2
    check(be, rc, 2)
    be.unload(rc)
    assert len(be.graph_cache) == 2  # both parked, each for its own structure


def test_the_cache_keeps_at_most_its_capacity_and_closes_what_it_drops(twins: dict[str, Program]) -> None:
    api = make_api("emucuda", "eager")
    assert isinstance(api, EmuCuda)
    be = backend_on(api)
    be.graph_cache.capacity = 1
    try:
        be.unload(load(be, twins["wide:1"]))
        live = api.graphs
        be.unload(load(be, twins["tiny_pt2:1"]))  # parks its own set, drops wide's
        assert len(be.graph_cache) == 1 and be.graph_cache.evicted == 1
        assert api.graphs < live + len(twins["tiny_pt2:1"].spec.batch_sizes)
        rb = load(be, twins["wide_other:1"])  # wide's set is gone: captured again
        assert be.graph_cache.hits == 0 and rb.state.graphs
        check(be, rb, 4)
        be.unload(rb)
    finally:
        be.close()
        be.host.close()
    assert not api.graphs  # close closed the parked sets too
    api.release()


def test_with_graphs_off_nothing_is_parked(twins: dict[str, Program]) -> None:
    api = make_api("emucuda", "eager")
    be = backend_on(api, graphs=False)
    try:
        be.unload(load(be, twins["wide:1"]))
        assert len(be.graph_cache) == 0
        r = load(be, twins["wide_other:1"])
        assert not r.state.graphs
        check(be, r, 2)
        be.unload(r)
    finally:
        be.close()
        be.host.close()
        if isinstance(api, EmuCuda):
            api.release()


# ------------------------------------------------------------------ the bookkeeping alone


class _FakeGraph:
    def __init__(self) -> None:
        self.closed = False

    def replay(self, stream: object) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _set() -> GraphSet:
    return GraphSet({1: _FakeGraph()}, {}, {1: Retargetable(lambda: None)})  # type: ignore[dict-item]


def test_parking_is_least_recently_parked_first_out_and_keyed_by_place() -> None:
    cache = GraphCache(2)
    s1, s2, s3 = _set(), _set(), _set()
    assert cache.park("x", 0, 100, s1) == []
    assert cache.park("x", 100, 100, s2) == []
    assert cache.take("x", 0, 99) is None  # another size is another place
    assert cache.park("y", 0, 100, s3) == [s1]  # over capacity: the oldest
    assert cache.take("x", 100, 100) is s2 and cache.take("y", 0, 100) is s3
    assert (cache.hits, cache.misses, cache.evicted) == (2, 1, 1)


def test_a_parked_kernel_refuses_to_run_until_retargeted() -> None:
    cache = GraphCache(4)
    s = _set()
    ran: list[int] = []
    cache.park("x", 0, 1, s)
    with pytest.raises(RuntimeError, match="parked"):
        s.kernels[1]()
    taken = cache.take("x", 0, 1)
    assert taken is s
    taken.retarget({1: lambda: ran.append(1)})
    s.kernels[1]()
    assert ran == [1]


def test_what_cannot_be_parked_comes_back_to_be_closed() -> None:
    cache = GraphCache(4)
    s = _set()
    assert cache.park("", 0, 1, s) == [s]  # no structure: nothing to match it by
    assert cache.take("", 0, 1) is None and cache.misses == 0
    empty = GraphSet()
    assert cache.park("x", 0, 1, empty) == [empty]
    assert GraphCache(0).park("x", 0, 1, s) == [s]


def test_want_is_the_reference() -> None:  # the helper these tests compare against
    assert callable(want)
