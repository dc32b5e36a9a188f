"""Cross-model batches on the CUDA backend (stand-in in every interleaving mode, CUDA when present):
the first member's extent takes every member's rows, the shared first stage runs once, each
member's other stages run over its own weights on its own rows; the answers are each model's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from daemon.demo import save_model
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.backend import Resident
from daemon.runtime.cuda import CudaBackend
from daemon.runtime.objstore import ObjectStore
from daemon.runtime.prefixcache import PrefixCache
from daemon.runtime.program import Program, load_program, prefix_key, tail_key
from daemon.runtime.shared_prefix import PrefixIndex
from tests.device.test_backend import load
from tests.unit.test_stages import STAGES, Whole, config

Plans = tuple[dict[str, Program], dict[str, Program]]


@pytest.fixture(scope="module", params=["declared", "found"])
def plans(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Plans:
    """Two plans sharing a backbone stage (heads of 3 and 2), and the same models whole: declared
    as stages, or found in the whole programs (runtime/shared_prefix.py)."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU()).eval()
    mono, staged = tmp_path_factory.mktemp("mono"), tmp_path_factory.mktemp("staged")
    save_model(backbone, "pt2", torch.zeros(2, 6), 16, staged / ".stages" / "backbone.pt2")
    for name, out in (("a", 3), ("b", 2)):
        head = nn.Linear(12, out).eval()
        save_model(Whole(backbone, head), "pt2", torch.zeros(2, 6), 16, mono / name / "1" / "model.pt2")
        (mono / name / "config.toml").write_text(config(out))
        save_model(head, "pt2", torch.zeros(2, 12), 16, staged / name / "1" / "head.pt2")
        (staged / name / "config.toml").write_text(config(out, STAGES))

    def programs(repo: Path, index: PrefixIndex | None = None) -> dict[str, Program]:
        store = ObjectStore()
        specs = scan(repo).models
        if index is not None:
            index.read_ahead(specs, store)
        return {s.name: load_program(s, store, index) for s in specs}
    plans = programs(staged) if request.param == "declared" else programs(mono, PrefixIndex())
    assert all(p.prefix for p in plans.values())
    return plans, programs(mono)


def _requests(res: Resident, *sizes: int, seed: int = 0) -> list[InferenceRequest]:
    rng = np.random.default_rng(seed)
    spec = res.program.spec
    return [InferenceRequest(spec, (rng.uniform(0, 4, (n, 6)).astype(np.float32),), n, 0.0, 1.0) for n in sizes]


def test_a_cross_model_batch_runs_the_shared_stage_once_and_answers_each_model(
        backend: CudaBackend, plans: Plans) -> None:
    staged, whole = plans
    ra, rb = load(backend, staged["a"]), load(backend, staged["b"])
    assert staged["a"].prefix == staged["b"].prefix
    for rounds in range(3):  # (again: events, rings and locks are reused)
        qa, qb = _requests(ra, 3, 2, seed=rounds), _requests(rb, 6, seed=10 + rounds)
        rows = 11
        b = staged["a"].spec.batch_size_for(rows)
        parts, duration, runs = backend.infer_staged([(ra, qa), (rb, qb)], ra.io[b])
        assert duration > 0
        assert [(k, n) for k, n, _ in runs] == [(prefix_key(staged["a"].prefix), rows), (tail_key("a:1"), 5),
                                                (tail_key("b:1"), 6)]
        assert all(t >= 0 for _, _, t in runs)
        with torch.inference_mode():
            for name, reqs, got in (("a", qa, parts[0]), ("b", qb, parts[1])):
                x = torch.from_numpy(np.concatenate([r.inputs[0] for r in reqs]))
                want = whole[name].host_runner([x])[0].numpy()
                if backend.api.kind == "emucuda":  # the same torch ops on the CPU: bit for bit
                    np.testing.assert_array_equal(got[0], want)
                np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
                assert got[0].shape == (len(x), whole[name].spec.outputs[0].sample_shape[0])
    # as graphs: the first stage of a, then each member's rest (captured at LOAD, per batch size)
    assert {k[0] for k in ra.state.stage_graphs} == {0, 1} and backend.staged_replays == 3


def test_without_graphs_a_cross_model_batch_runs_eagerly_with_the_same_answers(plans: Plans) -> None:
    from daemon.runtime.emucuda import EmuCuda, EmuSettings
    from tests.device.conftest import backend_on

    staged, whole = plans
    api = EmuCuda(0, EmuSettings(capacity=256 << 20))
    be = backend_on(api, graphs=False)
    try:
        ra, rb = load(be, staged["a"]), load(be, staged["b"])
        assert not ra.state.stage_graphs
        qa, qb = _requests(ra, 4, seed=1), _requests(rb, 2, 3, seed=2)
        parts, _, _ = be.infer_staged([(ra, qa), (rb, qb)], ra.io[staged["a"].spec.batch_size_for(9)])
        assert be.staged_replays == 0
        np.testing.assert_array_equal(parts[0][0], _want(whole, "a", qa))
        np.testing.assert_array_equal(parts[1][0], _want(whole, "b", qb))
    finally:
        be.close()
        be.host.close()
        api.release()


def test_parked_stage_graphs_serve_the_next_load_of_the_plan(backend: CudaBackend, plans: Plans) -> None:
    staged, whole = plans
    ra, rb = load(backend, staged["a"]), load(backend, staged["b"])
    backend.unload(rb)
    rb = load(backend, staged["b"])  # where it was: its whole and stage graphs replayed, none captured
    assert backend.graph_cache.hits == 1 and rb.state.stage_graphs
    qa, qb = _requests(ra, 2, seed=4), _requests(rb, 5, seed=5)
    parts, _, _ = backend.infer_staged([(ra, qa), (rb, qb)], ra.io[staged["a"].spec.batch_size_for(7)])
    assert backend.staged_replays == 1
    np.testing.assert_allclose(parts[1][0], _want(whole, "b", qb), rtol=1e-5, atol=1e-5)


def test_a_lone_plan_runs_as_one_program_with_its_graphs(
        backend: CudaBackend, plans: Plans) -> None:
    staged, whole = plans
    ra = load(backend, staged["a"])
    (q,) = _requests(ra, 4)
    parts, _, runs = backend.infer_staged([(ra, [q])], ra.io[4])
    assert runs == ()  # (no stage timings: the plan ran whole, as a graph where it was captured)
    with torch.inference_mode():
        want = whole["a"].host_runner([torch.from_numpy(q.inputs[0])])[0].numpy()
    np.testing.assert_allclose(parts[0][0], want, rtol=1e-5, atol=1e-5)


def _want(whole: dict[str, Program], name: str, reqs: list[InferenceRequest]) -> np.ndarray:
    with torch.inference_mode():
        x = torch.from_numpy(np.concatenate([r.inputs[0] for r in reqs]))
        return whole[name].host_runner([x])[0].numpy()  # type: ignore[no-any-return]


def test_the_prefix_cache_serves_repeated_inputs_without_running_the_shared_stage(
        backend: CudaBackend, plans: Plans) -> None:
    staged, whole = plans
    backend.prefix_cache = PrefixCache(8, 1 << 20)
    ra, rb = load(backend, staged["a"]), load(backend, staged["b"])
    sid = staged["a"].prefix
    x = _requests(ra, 3, seed=7)[0].inputs
    qa = [InferenceRequest(ra.program.spec, x, 3, 0.0, 1.0)]
    qb = [InferenceRequest(rb.program.spec, x, 3, 0.0, 1.0)]  # one input to both: its prefix once
    b = staged["a"].spec.batch_size_for(6)
    parts, _, runs = backend.infer_staged([(ra, qa), (rb, qb)], ra.io[b])
    assert runs[0][:2] == (prefix_key(sid), 3)
    np.testing.assert_allclose(parts[0][0], _want(whole, "a", qa), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(parts[1][0], _want(whole, "b", qb), rtol=1e-5, atol=1e-5)
    st = backend.prefix_cache.stats()
    assert (st.misses, st.hits, st.entries) == (1, 0, 1)
    # later, the same input alone: only its head runs, on the held output
    again = [InferenceRequest(rb.program.spec, x, 3, 0.0, 1.0)]
    parts, _, runs = backend.infer_staged([(rb, again)], rb.io[staged["b"].spec.batch_size_for(3)])
    assert [(k, n) for k, n, _ in runs] == [(prefix_key(sid), 0), (tail_key("b:1"), 3)]
    np.testing.assert_allclose(parts[0][0], _want(whole, "b", again), rtol=1e-5, atol=1e-5)
    assert backend.prefix_cache.stats().hits == 1
    # a held input beside a new one: only the new rows run through the shared stage
    new = _requests(ra, 2, seed=8)[0]
    mixed = [InferenceRequest(ra.program.spec, x, 3, 0.0, 1.0), new]
    parts, _, runs = backend.infer_staged([(ra, mixed), (rb, _requests(rb, 1, seed=9))], ra.io[b])
    assert runs[0][:2] == (prefix_key(sid), 3)  # new's 2 rows and b's 1
    np.testing.assert_allclose(parts[0][0], _want(whole, "a", mixed), rtol=1e-5, atol=1e-5)


def test_a_lone_plan_without_held_output_still_runs_whole(backend: CudaBackend, plans: Plans) -> None:
    staged, _ = plans
    backend.prefix_cache = PrefixCache(8, 1 << 20)
    ra = load(backend, staged["a"])
    (q,) = _requests(ra, 4, seed=3)
    _, _, runs = backend.infer_staged([(ra, [q])], ra.io[4])
    # nothing of its prefix is kept, so it is not even looked up (its input is not hashed)
    assert runs == () and backend.prefix_cache.stats().misses == 0


def test_the_cuda_prefix_cache_stays_within_a_quarter_of_the_workspace() -> None:
    from daemon.runtime.devices import Device
    from daemon.runtime.emucuda import EmuCuda, EmuSettings
    from daemon.runtime.hostmem import HostPins

    api = EmuCuda(0, EmuSettings(capacity=64 << 20))
    be = CudaBackend(Device("emucuda:0", "emucuda", 0, 32 << 20, 8 << 20), api, HostPins(1 << 30),
                     prefix_cache=PrefixCache(100, 1 << 30))
    try:
        assert be.prefix_cache.max_bytes == 2 << 20 and be.prefix_cache.max_entries == 100
    finally:
        be.close()
        be.host.close()
        api.release()
