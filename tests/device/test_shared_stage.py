"""A plan's shared leading stage on the CUDA backend (stand-in in every interleaving mode, CUDA when
present): plans of one backbone hold its weights once in the arena, a LOAD copies and charges only
what the device lacks, an UNLOAD frees the stage with its last holder, and every plan still answers
as it does alone, through graphs, reloads and compaction."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from daemon.demo import save_model
from daemon.repository import scan
from daemon.runtime.arena import aligned
from daemon.runtime.backend import Resident
from daemon.runtime.cuda import CudaBackend, extent_layout, input_block, prefix_bytes, shared_block, stage_key
from daemon.runtime.devapi import DeviceFault
from daemon.runtime.emucuda import EmuCuda, EmuSettings
from daemon.runtime.objstore import ObjectStore
from daemon.runtime.program import Program, load_program
from daemon.runtime.shared_prefix import PrefixIndex
from tests.device.conftest import backend_on, make_api
from tests.device.test_backend import check, load, sample
from tests.device.test_cross_model import Plans, _requests, plans  # noqa: F401  (the fixture)
from tests.unit.test_stages import config


def _own(be: CudaBackend, p: Program) -> int:
    return aligned(extent_layout(p, prefix_bytes(p))[3], be.arena.align)


def _inputs(p: Program) -> int:
    """Bytes of the plan's input block (held apart with its stage)."""
    block = input_block(p)
    assert block is not None
    return block[1]


def _held(p: Program, holders: int) -> dict[str, tuple[int, int]]:
    """What `shared_stages` says when `holders` plans like `p` are resident: its stage and input block."""
    block = input_block(p)
    assert block is not None
    return {stage_key(p): (aligned(prefix_bytes(p)), holders), block[0]: (block[1], holders)}


def _within_its_extent(res: Resident) -> bool:
    """Every static buffer and its own weights lie in its extent (its shared stage's and its inputs
    in their blocks)."""
    st = res.state
    ext, ins = st.extent, st.shared_inputs
    assert ins is not None
    return all(ext.offset <= r.offset and r.offset + r.nbytes <= ext.end
               for r in (st.weights, *st.outputs, *st.mids)) and \
        all(ins.offset <= r.offset and r.offset + r.nbytes <= ins.offset + ins.nbytes for r in st.inputs)


def test_plans_of_one_backbone_hold_it_once(backend: CudaBackend, plans: Plans) -> None:  # noqa: F811
    staged, whole = plans
    a, b = staged["a"], staged["b"]
    stage = prefix_bytes(a)
    assert stage and stage == prefix_bytes(b) and shared_block(a) == shared_block(b)
    assert input_block(a) == input_block(b)
    assert backend.footprint(a) == _own(backend, a) + aligned(stage) + _inputs(a)
    ra = load(backend, a)
    assert ra.charged == backend.footprint(a)
    rb = load(backend, b)
    assert rb.charged == _own(backend, b)  # the backbone and inputs are there: only b's own extent
    assert backend.arena.used == backend.footprint(a) + _own(backend, b)
    assert backend.shared_stages() == _held(a, 2)
    assert ra.state.shared.offset == rb.state.shared.offset  # one copy, read by both
    assert [r.offset for r in ra.state.inputs] == [r.offset for r in rb.state.inputs]  # one input buffer
    for name, res in (("a", ra), ("b", rb)):
        check(backend, res, 3)
        got = check(backend, res, 16, seed=1)  # the graph of the largest batch too
        with torch.inference_mode():  # and each answers as the same model whole, loaded alone
            ref = whole[name].host_runner([torch.from_numpy(x) for x in sample(res.program.spec, 16, 1)])
        np.testing.assert_allclose(got[0], ref[0].numpy(), rtol=1e-5, atol=1e-6)
    backend.unload(ra)
    assert ra.charged == _own(backend, a)  # the backbone stays for b
    check(backend, rb, 5, seed=2)
    backend.unload(rb)
    assert rb.charged == _own(backend, b) + aligned(stage) + _inputs(b)
    assert backend.arena.used == 0 and backend.shared_stages() == {}
    backend.arena.check()


def test_a_reload_over_a_held_stage_replays_its_parked_graphs(backend: CudaBackend, plans: Plans) -> None:  # noqa: F811
    staged, _ = plans
    ra, rb = load(backend, staged["a"]), load(backend, staged["b"])
    hits = backend.graph_cache.hits
    backend.unload(rb)
    rb = load(backend, staged["b"])  # same place, same stage's place: its graphs come back
    assert backend.graph_cache.hits == hits + 1
    check(backend, rb, 4)
    backend.unload(ra)  # the stage stays: b's graphs still read it
    check(backend, rb, 7, seed=3)
    backend.unload(rb)
    ra = load(backend, staged["a"])  # the stage made again
    check(backend, ra, 2)
    backend.unload(ra)
    assert backend.arena.used == 0


def test_sharing_off_holds_every_plan_whole(kind: tuple[str, str, int], plans: Plans) -> None:  # noqa: F811
    k, mode, seed = kind
    api = make_api(k, mode, seed=seed) if k != "cuda" else make_api(k, mode)
    be = backend_on(api)
    be.shares = False
    staged, _ = plans
    ra, rb = load(be, staged["a"]), load(be, staged["b"])
    assert be.footprint(staged["a"]) == aligned(extent_layout(staged["a"])[3], be.arena.align)
    assert be.arena.used == ra.charged + rb.charged == be.footprint(staged["a"]) + be.footprint(staged["b"])
    assert be.shared_stages() == {} and ra.state.shared is None
    check(be, ra, 3)
    check(be, rb, 3)
    be.unload(ra)
    be.unload(rb)
    be.close()
    be.host.close()
    if isinstance(api, EmuCuda):
        api.release()
        assert not api.races.races


def test_compaction_moves_plans_around_their_stage_and_they_still_serve(kind: tuple[str, str, int],
                                                                        plans: Plans) -> None:  # noqa: F811
    k, mode, seed = kind
    if k == "cuda":
        pytest.skip("sized for the stand-in")
    staged, whole = plans
    a = staged["a"]
    probe = backend_on(EmuCuda(0, EmuSettings(capacity=64 << 20)))
    own, stage = _own(probe, a), aligned(prefix_bytes(a)) + _inputs(a)
    probe.close()
    probe.host.close()
    api = make_api(k, mode, seed=seed)
    # room for the stage and its inputs, three plans and half of one
    be = backend_on(api, budget=(1 << 20) + stage + 3 * own + own // 2, workspace=1 << 20)
    r1, r2, r3 = (load(be, a, key) for key in ("a1", "a2", "a3"))
    where = r1.state.shared.offset
    be.unload(r2)  # a hole of one plan in the middle, half a plan at the end
    filler = be.arena.alloc(be.arena.align, "filler")  # something that never moves takes the hole's start
    assert filler is not None and be.arena.largest_free < own
    r4 = load(be, a, "a4")  # fits only once a3 slides down
    be.arena.check()
    assert be.compactions == 1
    assert r3.state.shared.offset == r4.state.shared.offset == where  # (at the start: nothing to slide it to)
    assert all(_within_its_extent(r) for r in (r1, r3, r4))  # the moved plan's buffers moved with it
    for res in (r1, r3, r4):
        check(be, res, 3)
    # a cross-model batch led by the plan that moved: its first stage's outputs moved with it
    qa, qb = _requests(r3, 3, seed=5), _requests(r4, 4, seed=6)
    parts, _, _ = be.infer_staged([(r3, qa), (r4, qb)], r3.io[a.spec.batch_size_for(7)])
    with torch.inference_mode():
        for reqs, got in ((qa, parts[0]), (qb, parts[1])):
            ref = whole["a"].host_runner([torch.from_numpy(np.concatenate([r.inputs[0] for r in reqs]))])[0]
            np.testing.assert_allclose(got[0], ref.numpy(), rtol=1e-5, atol=1e-6)
    for res in (r1, r3, r4):
        be.unload(res)
    be.arena.free(filler)
    assert be.arena.used == 0 and be.shared_stages() == {}
    be.arena.check()
    be.close()
    be.host.close()
    api.release()
    assert not api.races.races


def test_a_failed_load_lets_go_of_the_stage_it_made(plans: Plans) -> None:  # noqa: F811
    staged, _ = plans
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=32 << 20, workspace=8 << 20)
    for after in range(0, 4):  # an allocation failing at each step of the LOAD
        api.fail_allocation(after=after)
        with pytest.raises(Exception):  # noqa: B017  (NoMemory or the allocator's error)
            load(be, staged["a"], f"broken{after}")
        assert be.arena.used == 0 and be.shared_stages() == {}
    held = load(be, staged["a"])
    api.fail_allocation(after=0)
    with pytest.raises(Exception):  # noqa: B017
        load(be, staged["b"])
    assert be.shared_stages() == _held(staged["a"], 1)
    check(be, held, 3)
    be.unload(held)
    assert be.arena.used == 0
    be.close()
    be.host.close()
    api.release()


def test_an_unload_that_raises_still_lets_go_of_its_extent_and_stage(plans: Plans,  # noqa: F811
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of the UNLOAD failing (here parking its graphs) must not leave the stage held: it
    would stay in the arena and in the budget for the daemon's life."""
    staged, _ = plans
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=32 << 20, workspace=8 << 20)
    ra, rb = load(be, staged["a"]), load(be, staged["b"])

    def broken(*_: object) -> list[object]:
        raise RuntimeError("parking failed")
    monkeypatch.setattr(be.graph_cache, "park", broken)
    with pytest.raises(RuntimeError, match="parking failed"):
        be.unload(ra)
    assert ra.charged == _own(be, staged["a"])
    assert be.shared_stages() == _held(staged["a"], 1)
    assert not be.failed  # (the device was done with the memory: it stays usable)
    check(be, rb, 3)
    with pytest.raises(RuntimeError, match="parking failed"):
        be.unload(rb)
    assert be.arena.used == 0 and be.shared_stages() == {}
    monkeypatch.undo()
    again = load(be, staged["a"])  # the room is there again
    check(be, again, 2)
    be.unload(again)
    be.arena.check()
    be.close()
    be.host.close()
    api.release()


@pytest.mark.expect_errors("emucuda:0 failed: releasing")  # (the backend's CRITICAL line, on purpose)
def test_an_unknown_error_while_fencing_an_unload_gives_the_device_up_and_says_so(
        plans: Plans, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Whether the device is done with the memory is then unknown: the backend refuses it from
    then on, and the UNLOAD raises a DeviceFault, so the executor reports the device lost."""
    staged, _ = plans
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=32 << 20, workspace=8 << 20)
    ra = load(be, staged["a"])

    def broken(*_: object) -> None:
        raise RuntimeError("discard failed")
    monkeypatch.setattr(be.api, "discard", broken)
    with pytest.raises(DeviceFault, match="discard failed"):
        be.unload(ra)
    assert be.failed and be.arena.used == 0 and be.shared_stages() == {}
    with pytest.raises(DeviceFault):
        load(be, staged["b"])
    monkeypatch.undo()
    be.close()
    be.host.close()
    api.release()


class _InOrder(nn.Module):
    def __init__(self, l1: nn.Module, l2: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.l1, self.l2, self.head = l1, l2, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.l2(torch.relu(self.l1(x)))))


class _OtherOrder(_InOrder):
    """The same computation, its layers registered in another order: its weights pack differently."""

    def __init__(self, l1: nn.Module, l2: nn.Module, head: nn.Module) -> None:
        nn.Module.__init__(self)
        self.head, self.l2, self.l1 = head, l2, l1


def test_plans_of_one_stage_laid_out_differently_do_not_share_its_bytes(tmp_path: Path) -> None:
    """A prefix found in two whole models is one stage (one computation over the same weights), but
    each packs those weights in its own order: each must read its own bytes."""
    torch.manual_seed(0)
    l1, l2 = nn.Linear(6, 16).eval(), nn.Linear(16, 16).eval()
    for name, cls, out in (("a", _InOrder, 3), ("b", _OtherOrder, 2)):
        save_model(cls(l1, l2, nn.Linear(16, out)).eval(), "pt2", torch.zeros(2, 6), 16,
                   tmp_path / name / "1" / "model.pt2")
        (tmp_path / name / "config.toml").write_text(config(out))
    specs = sorted(scan(tmp_path).models, key=lambda s: s.name)
    index, store = PrefixIndex(), ObjectStore()
    index.read_ahead(specs, store)
    a, b = (load_program(s, store, index) for s in specs)
    assert a.prefix and a.prefix == b.prefix and prefix_bytes(a) == prefix_bytes(b)
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api)
    ra, rb = load(be, a), load(be, b)
    for res in (ra, rb):
        check(be, res, 4)  # (b over a's bytes answered wrongly, every output)
    assert len(be.shared_stages()) == 4  # (each stage and its plan's input block)
    for res in (ra, rb):
        be.unload(res)
    assert be.arena.used == 0
    be.close()
    be.host.close()
    api.release()


def test_compaction_moves_a_stage_whose_plans_are_idle(tmp_path: Path) -> None:
    """A stage left between two holes moves with its idle plans: the room a LOAD needs is made, as
    it was when every model was one extent (a stage that never moved pinned the fragments)."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU()).eval()
    models = {"pa": nn.Sequential(backbone, nn.Linear(12, 3)), "pb": nn.Sequential(backbone, nn.Linear(12, 2)),
              "x": nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 3)),
              "y": nn.Sequential(nn.Linear(6, 96), nn.ReLU(), nn.Linear(96, 3))}
    for name, m in models.items():
        save_model(m.eval(), "pt2", torch.zeros(2, 6), 16, tmp_path / name / "1" / "model.pt2")
        (tmp_path / name / "config.toml").write_text(config(2 if name == "pb" else 3))
    specs = scan(tmp_path).models
    index, store = PrefixIndex(), ObjectStore()
    index.read_ahead(specs, store)
    p = {s.name: load_program(s, store, index) for s in specs}
    assert p["pa"].prefix and not p["x"].prefix
    probe = backend_on(EmuCuda(0, EmuSettings(capacity=64 << 20)))
    fx, fy, fp = (probe.footprint(p[k]) for k in ("x", "y", "pa"))
    probe.close()
    probe.host.close()
    ws = 1 << 20
    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = backend_on(api, budget=ws + fx + fp + (fy - fx) + 256, workspace=ws)  # y fits once x is gone
    rx, rp = load(be, p["x"]), load(be, p["pa"])
    where = rp.state.shared.offset
    be.unload(rx)  # x's hole before the stage, the rest after the plan
    assert be.device.weight_budget - be.charged >= fy > be.arena.largest_free
    ry = load(be, p["y"])  # fits only once the stage and its plan slide down
    be.arena.check()
    assert be.compactions == 1 and rp.state.shared.offset < where
    assert _within_its_extent(rp)
    check(be, rp, 5)
    check(be, ry, 3)
    be.unload(ry)
    rb = load(be, p["pb"])  # a second plan over the moved stage
    assert rb.state.shared.offset == rp.state.shared.offset
    check(be, rb, 4)
    for res in (rp, rb):
        be.unload(res)
    assert be.arena.used == 0 and be.shared_stages() == {}
    be.close()
    be.host.close()
    api.release()
    assert not api.races.races


def test_loads_over_a_held_input_block_never_race_another_plans_infers(kind: tuple[str, str, int],
                                                                       plans: Plans) -> None:  # noqa: F811
    """Plans of one backbone share their static inputs (input_block): a LOAD's first runs read that
    block while another plan's INFERs copy their rows into it, from another thread. The block's
    lock orders them (the stand-in's race check sees every access), and every answer stays right."""
    k, mode, seed = kind
    api = make_api(k, mode, seed=seed) if k != "cuda" else make_api(k, mode)
    be = backend_on(api)
    staged, _ = plans
    ra = load(be, staged["a"])
    done = threading.Event()
    failures: list[BaseException] = []

    def serve() -> None:
        i = 0
        try:
            while not done.is_set() or i < 8:
                check(be, ra, 1 + i % 16, seed=i)
                i += 1
        except BaseException as e:  # (the test's thread reports it)
            failures.append(e)

    t = threading.Thread(target=serve)
    t.start()
    try:
        for i in range(3):  # (new keys: each LOAD runs its first runs, none finds parked graphs)
            rb = load(be, staged["b"], f"b{i}")
            assert rb.state.shared_inputs is not None and rb.state.inputs[0].offset == ra.state.inputs[0].offset
            check(be, rb, 3, seed=i)
            be.unload(rb)
    finally:
        done.set()
        t.join()
    assert not failures, failures
    be.unload(ra)
    assert be.arena.used == 0 and be.shared_stages() == {}
    be.close()
    be.host.close()
    if isinstance(api, EmuCuda):
        api.release()
        assert not api.races.races, api.races.races[:3]
