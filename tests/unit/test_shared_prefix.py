"""A shared prefix found inside single-program models (runtime/shared_prefix.py): plain models
that begin with the same ops over the same weights are split at load into a shared leading stage
and the rest, and compute exactly what the whole program does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from daemon.demo import save_model
from daemon.model import ModelSpec
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.backend import CpuBackend
from daemon.runtime.devices import Device
from daemon.runtime.objstore import ObjectStore
from daemon.runtime.program import Chain, Program, load_program, prefix_key
from daemon.runtime.shared_prefix import PrefixIndex
from tests.unit.test_stages import Whole, config


class Residual(nn.Module):
    """x -> relu(W x) + x -> head: no single tensor carries the prefix until after the add."""

    def __init__(self, inner: nn.Linear, head: nn.Module) -> None:
        super().__init__()
        self.inner, self.head = inner, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.inner(x)) + x)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """a, b: one backbone, own heads; c: a backbone of the same shape, other weights; r1, r2: one
    residual block (skip from the input), own heads."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("plain")
    backbone = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU()).eval()
    other = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU()).eval()
    inner = nn.Linear(6, 6).eval()
    models: list[tuple[str, nn.Module, int]] = [
        ("a", Whole(backbone, nn.Linear(12, 3)), 3), ("b", Whole(backbone, nn.Linear(12, 2)), 2),
        ("c", Whole(other, nn.Linear(12, 3)), 3),
        ("r1", Residual(inner, nn.Linear(6, 4)), 4), ("r2", Residual(inner, nn.Linear(6, 5)), 5)]
    for name, model, out in models:
        save_model(model.eval(), "pt2", torch.zeros(2, 6), 16, root / name / "1" / "model.pt2")
        (root / name / "config.toml").write_text(config(out))
    return root


def specs(root: Path, names: str | list[str]) -> list[ModelSpec]:
    by = {s.name: s for s in scan(root).models}
    return [by[n] for n in names]


def load(root: Path, names: list[str]) -> dict[str, Program]:
    """The models read ahead together, then each loaded (as the model manager does)."""
    index, store = PrefixIndex(), ObjectStore()
    todo = specs(root, names)
    assert index.read_ahead(todo, store) == len(todo)
    return {s.name: load_program(s, store, index) for s in todo}


def alone(root: Path, name: str) -> Program:
    (spec,) = specs(root, [name])
    return load_program(spec, ObjectStore())


def test_plain_models_that_begin_alike_are_split_where_they_part_and_compute_the_same(repo: Path) -> None:
    p = load(repo, ["a", "b", "c"])
    a, b, c = p["a"], p["b"], p["c"]
    assert a.prefix and a.prefix == b.prefix  # found in both, whichever loaded first
    assert len(a.stages) == 2 and isinstance(a.host_runner, Chain)
    assert [t.sample_shape for t in a.stages[0].program.spec.outputs] == [(12,)]  # after the backbone's last relu
    assert {cid for cid, _ in a.stages[0].program.blocks} == {cid for cid, _ in b.stages[0].program.blocks}
    assert c.prefix == "" and not c.stages  # other weights: nothing in common, served whole
    g = torch.Generator().manual_seed(1)
    for name in ("a", "b"):
        whole = alone(repo, name)
        assert whole.prefix == "" and not whole.stages  # (loaded without reading ahead: not split)
        graph = p[name].bind(list(p[name].host_tensors), native=False)
        for rows in (1, 3, 16):
            x = torch.rand((rows, 6), generator=g) * 4
            with torch.inference_mode():
                want = whole.host_runner([x])[0]
                assert torch.equal(p[name].host_runner([x])[0], want)  # native runners, bit for bit
                assert torch.equal(graph([x])[0], want)  # graph runners too
    assert a.stage_timings and set(a.stage_timings) == {1, 2, 16}  # seeds the controller's stage estimates


def test_a_model_alone_or_with_no_partner_is_not_split(repo: Path) -> None:
    assert not load(repo, ["a"])["a"].stages
    assert not load(repo, ["a", "c"])["a"].stages


def test_a_model_read_ahead_and_served_whole_keeps_its_native_runner(repo: Path) -> None:
    # its read-ahead weights went into the store; the trace (one GIL-free call per batch on a CPU
    # device, not one Python op call per layer) must still be made from them
    for p in (load(repo, ["a", "c"])["a"], load(repo, ["c"])["c"]):
        assert not p.stages and p.bind_native is not None
        x = torch.rand((3, 6)) * 4
        with torch.inference_mode():
            graph = p.bind(list(p.host_tensors), native=False)
            assert torch.equal(p.host_runner([x])[0], graph([x])[0])


def test_a_prefix_ends_only_at_a_single_tensor(repo: Path) -> None:
    p = load(repo, ["r1", "r2"])
    r1, r2 = p["r1"], p["r2"]
    assert r1.prefix and r1.prefix == r2.prefix
    # the input is still needed after the inner relu: the first cut is after the add
    ops = [n.target.__name__ for n in r1.stages[0].program.graph.graph.nodes  # type: ignore[union-attr]
           if n.op == "call_function"]
    assert ops[-1].startswith("add")
    x = torch.rand((5, 6)) * 4
    with torch.inference_mode():
        assert torch.equal(r2.host_runner([x])[0], alone(repo, "r2").host_runner([x])[0])


def test_a_model_read_ahead_later_finds_the_prefix_of_those_loaded_before(repo: Path) -> None:
    index, store = PrefixIndex(), ObjectStore()
    (a,) = specs(repo, ["a"])
    index.read_ahead([a], store)
    assert not load_program(a, store, index).stages  # no partner yet
    (b,) = specs(repo, ["b"])
    index.read_ahead([b], store)
    assert load_program(b, store, index).prefix  # a's cut is known: b is split (a joins at its next load)


def _request(spec: ModelSpec, x: np.ndarray) -> InferenceRequest:
    return InferenceRequest(spec, (x,), len(x), 0.0, 1.0)


def test_split_models_share_their_leading_stage_on_a_cpu_device(repo: Path) -> None:
    p = load(repo, ["a", "b"])
    backend = CpuBackend(Device("cpu:0", "cpu", 0, 1 << 30))
    ra = backend.load("a:1", p["a"], float("inf"))[0]
    rb = backend.load("b:1", p["b"], float("inf"))[0]
    # the backbone's blocks once: b adds only its head
    assert backend.used == p["a"].block_bytes + p["b"].stages[1].program.block_bytes
    rng = np.random.default_rng(0)
    xa, xb = (rng.uniform(0, 4, (n, 6)).astype(np.float32) for n in (5, 6))
    outs, _, runs = backend.infer_staged([(ra, [_request(p["a"].spec, xa)]), (rb, [_request(p["b"].spec, xb)])],
                                         ra.io[16])
    assert runs[0][:2] == (prefix_key(p["a"].prefix), 11)  # one run of the shared stage for both
    with torch.inference_mode():
        for name, x, got in (("a", xa, outs[0][0]), ("b", xb, outs[1][0])):
            np.testing.assert_array_equal(got, alone(repo, name).host_runner([torch.from_numpy(x)])[0].numpy())


def test_programs_read_ahead_past_the_bound_are_read_again_at_load(repo: Path) -> None:
    index, store = PrefixIndex(max_reads=1), ObjectStore()
    todo = specs(repo, ["a", "b", "c"])
    index.read_ahead(todo, store)  # only c's program is kept; a's and b's cuts are
    p = {s.name: load_program(s, store, index) for s in todo}
    assert p["a"].prefix and p["a"].prefix == p["b"].prefix and not p["c"].stages
    x = torch.rand((4, 6)) * 4
    with torch.inference_mode():
        assert torch.equal(p["a"].host_runner([x])[0], alone(repo, "a").host_runner([x])[0])
