"""Models as plans of stages: the config, the program (a staged plan computes exactly what the
monolithic model does), stage identities, a CPU device running a shared stage once for several
models, and the cache of its outputs by input."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from daemon.demo import save_model
from daemon.errors import ProgramError
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.backend import CpuBackend
from daemon.runtime.devices import Device
from daemon.runtime.objstore import ObjectStore
from daemon.runtime.prefixcache import PrefixCache, plan_prefix
from daemon.runtime.program import Chain, load_program, prefix_key, tail_key


class Whole(nn.Module):
    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def config(out: int, stages: str = "") -> str:
    return (f"max_batch_size = 16\nslo_ms = 100\n{stages}\n"
            '[[inputs]]\nname = "INPUT__0"\ndatatype = "FP32"\nshape = [-1, 6]\n'
            f'[[outputs]]\nname = "OUTPUT__0"\ndatatype = "FP32"\nshape = [-1, {out}]\n')


STAGES = 'stages = ["../../.stages/backbone.pt2", "head.pt2"]'


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two variants (heads of 3 and 2 classes on one backbone), monolithic and staged."""
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
    return mono, staged


def programs(repo: Path, store: ObjectStore | None = None) -> dict[str, object]:
    result = scan(repo)
    assert not result.broken, result.broken
    store = store or ObjectStore()
    return {s.name: load_program(s, store) for s in result.models}


def test_a_staged_plan_computes_exactly_what_the_monolithic_model_does(family: tuple[Path, Path]) -> None:
    mono, staged = (programs(r) for r in family)
    g = torch.Generator().manual_seed(3)
    for name in ("a", "b"):
        plan = staged[name]
        assert isinstance(plan.host_runner, Chain) and len(plan.stages) == 2  # type: ignore[attr-defined]
        for rows in (1, 3, 16):
            x = torch.rand((rows, 6), generator=g) * 4
            with torch.inference_mode():
                want = mono[name].host_runner([x])[0]  # type: ignore[attr-defined]
                got = plan.host_runner([x])[0]  # type: ignore[attr-defined]
            assert torch.equal(got, want)


def test_identical_leading_stages_are_one_prefix_and_weights_are_stored_once(family: tuple[Path, Path]) -> None:
    store = ObjectStore()
    p = programs(family[1], store)
    a, b = p["a"], p["b"]
    assert a.prefix and a.prefix == b.prefix  # type: ignore[attr-defined]
    assert a.stages[1].sid != b.stages[1].sid  # type: ignore[attr-defined]
    shared = {c for c, _ in a.blocks} & {c for c, _ in b.blocks}  # type: ignore[attr-defined]
    assert len(shared) == 4  # the backbone's two weights and two biases
    assert a.stage_timings and set(a.stage_timings) == {1, 2, 16}  # type: ignore[attr-defined]


def test_variants_of_one_backbone_file_read_it_once_and_check_it_once(family: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """Variants listing one backbone file share its stage program (read once, not once per variant),
    and their load-time checks run the backbone on the probe batches once for all of them; each
    still computes exactly what its monolithic model does. A changed file is read again."""
    store = ObjectStore()
    specs = {s.name: s for s in scan(family[1]).models}
    calls = {"n": 0}
    a = load_program(specs["a"], store)
    first = a.stages[0].program
    real = first.bind_graph
    assert real is not None

    def counting(*args: object, **kw: object) -> object:
        run = real(*args, **kw)  # type: ignore[arg-type]

        def counted(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            calls["n"] += 1
            return run(xs)
        return counted
    first.bind_graph = counting  # type: ignore[assignment]
    try:
        b = load_program(specs["b"], store)
    finally:
        first.bind_graph = real
    assert b.stages[0].program is first  # one program for the backbone file
    assert calls["n"] == 0  # b's checks took the backbone's probe runs from a's
    assert b.stage_timings[16][0] == a.stage_timings[16][0] > 0  # and their time
    mono = programs(family[0])
    g = torch.Generator().manual_seed(5)
    for name, plan in (("a", a), ("b", b)):
        x = torch.rand((7, 6), generator=g) * 4
        with torch.inference_mode():
            assert torch.equal(plan.host_runner([x])[0], mono[name].host_runner([x])[0])  # type: ignore[attr-defined]
    # another backbone written over the file: read again, and checked on its own outputs
    repo = tmp_path / "changed"
    shutil.copytree(family[1], repo)
    torch.manual_seed(9)
    save_model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU()).eval(), "pt2",
               torch.zeros(2, 6), 16, repo / ".stages" / "backbone.pt2")
    c = load_program(next(s for s in scan(repo).models if s.name == "a"), store)
    assert c.stages[0].program is not first and c.prefix != a.prefix


def test_heads_exported_alike_share_one_graph_and_trace_and_each_computes_its_own(tmp_path: Path) -> None:
    """Variants whose heads are exported alike (graph code, weights' names, dtypes and shapes) share
    one graph module and one weightless traced CPU runner (read and traced once, not per variant),
    and each binds its own weights: the same answers as each head alone, by both runners."""
    torch.manual_seed(3)
    backbone = nn.Sequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 7), nn.ReLU()).eval()
    save_model(backbone, "pt2", torch.zeros(2, 5), 16, tmp_path / ".stages" / "backbone.pt2")
    heads = {name: nn.Linear(7, 4).eval() for name in ("p", "q")}
    cfg = config(4).replace("shape = [-1, 6]", "shape = [-1, 5]")
    for name, head in heads.items():
        save_model(head, "pt2", torch.zeros(2, 7), 16, tmp_path / name / "1" / "head.pt2")
        (tmp_path / name / "config.toml").write_text(cfg.replace("max_batch_size", STAGES + "\nmax_batch_size", 1))
    specs = {sp.name: sp for sp in scan(tmp_path).models}
    store = ObjectStore()
    plans = {name: load_program(specs[name], store) for name in heads}
    p, q = (plans[n].stages[1].program for n in ("p", "q"))
    assert p.graph is q.graph  # exported alike: one graph module, one trace
    assert p.bind_native is not None and q.bind_native is not None
    assert p.bind_native.keep is q.bind_native.keep  # type: ignore[attr-defined]
    x = torch.rand((6, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for name, plan in plans.items():
            native = plan.bind(list(plan.host_tensors), native=True)
            graph = plan.bind(list(plan.host_tensors), native=False)
            want = heads[name](backbone(x))
            assert torch.allclose(native([x])[0], want, rtol=1e-5, atol=1e-6)
            assert torch.equal(native([x])[0], graph([x])[0])


def test_stages_in_config(family: tuple[Path, Path], tmp_path: Path) -> None:
    staged = family[1]
    spec = next(s for s in scan(staged).models if s.name == "a")
    assert spec.stages == ((staged / ".stages" / "backbone.pt2").resolve(), (staged / "a" / "1" / "head.pt2").resolve())
    for bad, why in [('stages = "head.pt2"', "a list of 2 to 8"), ('stages = ["head.pt2"]', "a list of 2 to 8"),
                     ('stages = ["/abs/backbone.pt2", "head.pt2"]', "relative path"),
                     ('stages = ["backbone.onnx", "head.pt2"]', "relative path of a .pt2"),
                     ('stages = ["../../../../outside.pt2", "head.pt2"]', "outside the model repository"),
                     ('stages = ["missing.pt2", "head.pt2"]', "stage 'missing.pt2'")]:
        repo = tmp_path / f"r{abs(hash(bad))}"
        (repo / "m" / "1").mkdir(parents=True)
        (repo / "m" / "1" / "head.pt2").write_bytes((staged / "a" / "1" / "head.pt2").read_bytes())
        (repo / "m" / "config.toml").write_text(config(3, bad))
        result = scan(repo)
        assert "m" in result.broken and why in result.broken["m"], (bad, result.broken)


def test_a_stage_that_does_not_take_what_the_one_before_returns_is_refused(family: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    save_model(nn.Linear(5, 3).eval(), "pt2", torch.zeros(2, 5), 16, tmp_path / "m" / "1" / "head.pt2")
    (tmp_path / ".stages").mkdir()
    (tmp_path / ".stages" / "backbone.pt2").write_bytes((family[1] / ".stages" / "backbone.pt2").read_bytes())
    (tmp_path / "m" / "config.toml").write_text(config(3, STAGES))
    spec = scan(tmp_path).models[0]
    with pytest.raises(ProgramError, match=r"stage 1 .* takes"):
        load_program(spec, ObjectStore())


def _request(spec: object, x: np.ndarray) -> InferenceRequest:
    return InferenceRequest(spec, (x,), len(x), 0.0, 1.0)  # type: ignore[arg-type]


def test_a_cpu_device_runs_a_shared_stage_once_for_several_models(family: tuple[Path, Path]) -> None:
    mono = programs(family[0])
    p = programs(family[1])
    backend = CpuBackend(Device("cpu:0", "cpu", 0, 1 << 30), prefix_cache=PrefixCache(16, 1 << 20))
    ra = backend.load("a:1", p["a"], float("inf"))[0]  # type: ignore[arg-type]
    rb = backend.load("b:1", p["b"], float("inf"))[0]  # type: ignore[arg-type]
    assert backend.used == p["a"].block_bytes + sum(  # type: ignore[attr-defined]
        n for c, n in p["b"].blocks if c not in set(p["a"].cids))  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    # (5 and 6 rows: a BLAS kernel computes 1-3 rows otherwise than more, shared or not)
    xa, xb = (rng.uniform(0, 4, (n, 6)).astype(np.float32) for n in (5, 6))
    reqs_a, reqs_b = [_request(ra.program.spec, xa)], [_request(rb.program.spec, xb)]
    outs, _, runs = backend.infer_staged([(ra, reqs_a), (rb, reqs_b)], ra.io[16])
    assert [(k, n) for k, n, _ in runs] == [(prefix_key(p["a"].prefix), 11), (tail_key("a:1"), 5),  # type: ignore[attr-defined]
                                            (tail_key("b:1"), 6)]
    with torch.inference_mode():
        for name, x, got in (("a", xa, outs[0][0]), ("b", xb, outs[1][0])):
            want = mono[name].host_runner([torch.from_numpy(x)])[0].numpy()  # type: ignore[attr-defined]
            np.testing.assert_array_equal(got, want)
    # the same input sent to both again: the prefix comes from the cache, computed for neither
    same = [(ra, [_request(ra.program.spec, xa)]), (rb, [_request(rb.program.spec, xa)])]
    again, _, runs = backend.infer_staged(same, ra.io[16])
    assert runs[0][1] == 0 and backend.prefix_cache.hits == 2
    np.testing.assert_array_equal(again[0][0], outs[0][0])
    with torch.inference_mode():
        np.testing.assert_array_equal(again[1][0], mono["b"].host_runner([torch.from_numpy(xa)])[0].numpy())  # type: ignore[attr-defined]


def test_one_input_sent_to_several_models_in_one_batch_runs_the_prefix_once(family: tuple[Path, Path]) -> None:
    p = programs(family[1])
    backend = CpuBackend(Device("cpu:0", "cpu", 0, 1 << 30), prefix_cache=PrefixCache(16, 1 << 20))
    ra = backend.load("a:1", p["a"], float("inf"))[0]  # type: ignore[arg-type]
    rb = backend.load("b:1", p["b"], float("inf"))[0]  # type: ignore[arg-type]
    x = np.ones((4, 6), np.float32)
    _, _, runs = backend.infer_staged([(ra, [_request(ra.program.spec, x)]), (rb, [_request(rb.program.spec, x)])],
                                      ra.io[8])
    assert runs[0][1] == 4  # one request's rows, not both


def test_without_sharing_every_model_holds_its_own_blocks(family: tuple[Path, Path]) -> None:
    p = programs(family[1])
    backend = CpuBackend(Device("cpu:0", "cpu", 0, 1 << 30), shares=False)
    ra = backend.load("a:1", p["a"], float("inf"))[0]  # type: ignore[arg-type]
    rb = backend.load("b:1", p["b"], float("inf"))[0]  # type: ignore[arg-type]
    assert backend.used == p["a"].block_bytes + p["b"].block_bytes  # type: ignore[attr-defined]
    backend.unload(rb)
    assert backend.used == p["a"].block_bytes  # type: ignore[attr-defined]
    backend.unload(ra)
    assert backend.used == 0


def test_the_prefix_cache_is_bounded_in_count_and_bytes() -> None:
    cache = PrefixCache(max_entries=3, max_bytes=100)
    t = torch.zeros(5)  # 20 bytes
    for i in range(5):
        cache.put(bytes([i]), (t.clone(),))
    assert len(cache) == 3 and cache.get(bytes([0])) is None and cache.get(bytes([4])) is not None
    cache.put(b"big", (torch.zeros(20),))  # 80 bytes: the oldest go until it fits
    assert cache.nbytes <= 100 and cache.get(b"big") is not None and len(cache) == 2
    cache.put(b"huge", (torch.zeros(30),))  # more than the whole cache: not kept
    assert cache.get(b"huge") is None
    assert PrefixCache.key("s", [np.ones((1, 2), np.float32)]) != PrefixCache.key("s", [np.ones((2, 1), np.float32)])
    assert PrefixCache.key("s", [np.ones((1, 2))]) != PrefixCache.key("t", [np.ones((1, 2))])


class CountingCache(PrefixCache):
    """A prefix cache that counts whole-input hashes (what the sketch exists to save)."""

    wholes = 0

    @staticmethod
    def key(sid: str, inputs: Sequence[np.ndarray]) -> bytes:
        CountingCache.wholes += 1
        return PrefixCache.key(sid, inputs)


class _Spec:
    key = "m:1"


def _req(x: np.ndarray) -> InferenceRequest:
    return InferenceRequest(_Spec(), (x,), len(x), 0.0, 1.0)  # type: ignore[arg-type]


def _image(seed: int) -> InferenceRequest:
    return _req(np.random.default_rng(seed).standard_normal((1, 3, 64, 64)).astype(np.float32))  # 48 KiB


def test_large_inputs_are_hashed_whole_only_once_seen_before() -> None:
    cache = CountingCache(16, 1 << 30)
    CountingCache.wholes = 0
    distinct = [_image(i) for i in range(8)]
    plan = plan_prefix(cache, "s", distinct)
    assert CountingCache.wholes == 0 and plan.keys == [None] * 8 and len(plan.run) == 8
    assert cache.stats().unseen == 8 and cache.stats().misses == 0
    # seen before: hashed whole, missed, kept; the next sighting is served from the cache
    again = plan_prefix(cache, "s", [_image(3)])
    assert CountingCache.wholes == 1 and again.keys[0] is not None and cache.stats().misses == 1
    again.keep(cache, (torch.ones(1, 4),))
    third = plan_prefix(cache, "s", [_image(3)])
    assert third.run == [] and cache.stats().hits == 1
    # twice in one batch, never seen before: both hashed, computed once
    twice = plan_prefix(cache, "s", [_image(100), _image(100), _image(101)])
    assert len(twice.run) == 2 and [j for j, _ in twice.sources] == [0, 0, 1]


def test_a_sketch_that_matches_by_chance_never_serves_another_inputs_output() -> None:
    cache = PrefixCache(16, 1 << 30)
    a = _image(0)
    b_input = a.inputs[0].copy()
    b_input.reshape(-1).view(np.uint8)[1000] ^= 0xFF  # a byte between the sketch's windows
    b = _req(b_input)
    assert PrefixCache.sketch("s", a.inputs) == PrefixCache.sketch("s", b.inputs)
    for _ in range(2):  # a kept from its second sighting
        plan = plan_prefix(cache, "s", [a])
    plan.keep(cache, (torch.zeros(1, 4),))
    assert plan_prefix(cache, "s", [a]).run == []
    other = plan_prefix(cache, "s", [b])  # its sketch is known: hashed whole, and not a's key
    assert len(other.run) == 1 and other.keys[0] is not None and other.sources == [(0, None)]


def test_small_inputs_are_hashed_whole_at_once() -> None:
    cache = CountingCache(16, 1 << 30)
    CountingCache.wholes = 0
    small = _req(np.ones((4, 6), np.float32))
    plan = plan_prefix(cache, "s", [small])
    assert CountingCache.wholes == 1 and plan.keys[0] is not None and cache.stats().unseen == 0


def test_the_cache_knows_which_stages_it_holds_outputs_of() -> None:
    cache = PrefixCache(max_entries=2, max_bytes=1 << 20)
    assert not cache.holds("s")
    cache.put(b"1", (torch.zeros(2),), "s")
    cache.put(b"2", (torch.zeros(2),), "t")
    assert cache.holds("s") and cache.holds("t")
    cache.put(b"3", (torch.zeros(2),), "t")  # s's only entry is the oldest: pushed out
    assert not cache.holds("s") and cache.holds("t")
    # without `look` a batch is planned with no lookups: every request runs, none is kept
    plan = plan_prefix(cache, "t", [_image(1), _image(1)], look=False)
    assert len(plan.run) == 2 and plan.keys == [None, None] and cache.stats().misses == 0


def test_object_inputs_are_never_looked_up() -> None:
    cache = CountingCache(16, 1 << 30)
    CountingCache.wholes = 0
    words = np.array([["a" * 10] * 4000], dtype=object)  # > 16 KiB of pointers, not of content
    plan = plan_prefix(cache, "s", [_req(words), _req(words.copy())])
    assert CountingCache.wholes == 0 and plan.keys == [None, None] and len(plan.run) == 2
