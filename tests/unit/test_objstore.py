"""Parameters stored once: variants of one backbone share its tensors in host memory and on a
CPU device, and compute exactly what each computes alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from daemon import variants
from daemon.demo import save_model
from daemon.model import ModelSpec
from daemon.repository import scan
from daemon.runtime.backend import CpuBackend
from daemon.runtime.devices import Device
from daemon.runtime.objstore import ObjectStore, content_id
from daemon.runtime.program import Program, load_program


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> list[ModelSpec]:
    out = tmp_path_factory.mktemp("variants")
    variants.build(out, 3)
    return sorted(scan(out).models, key=lambda s: s.name)


def _x(n: int = 5) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).uniform(0, 16, (n, 64)).astype(np.float32))


def test_content_ids_name_bytes_dtype_and_shape() -> None:
    a = torch.arange(6, dtype=torch.float32)
    assert content_id(a) == content_id(a.clone())
    assert content_id(a) != content_id(a.reshape(2, 3))
    assert content_id(a) != content_id(a.to(torch.int32).view(torch.float32))  # same shape, other bytes
    assert content_id(a.view(torch.int32)) != content_id(a)  # same bytes, other dtype
    assert content_id(a.reshape(2, 3).T) == content_id(a.reshape(2, 3).T.contiguous())


def test_variants_hold_one_copy_of_the_backbone(family: list[ModelSpec]) -> None:
    store = ObjectStore()
    progs = [load_program(s, store) for s in family]
    backbone = [set(c for c, e in zip(p.cids, p.layout.entries, strict=True) if e.name.startswith("backbone"))
                for p in progs]
    assert backbone[0] and backbone[0] == backbone[1] == backbone[2]
    heads = [set(p.cids) - backbone[0] for p in progs]
    assert not heads[0] & heads[1] and not heads[1] & heads[2]
    # the same tensor objects, not equal copies
    first = dict(zip(progs[0].cids, progs[0].host_tensors, strict=True))
    for p in progs[1:]:
        for c, t in zip(p.cids, p.host_tensors, strict=True):
            if c in backbone[0]:
                assert t is first[c]
    held = sum(n for p in progs for c, n in p.blocks if c not in backbone[0]) + sum(
        n for c, n in progs[0].blocks if c in backbone[0])
    assert store.nbytes <= held < sum(p.block_bytes for p in progs) / 2
    # each computes exactly what it computes alone
    x = _x()
    for s, p in zip(family, progs, strict=True):
        alone = load_program(s, ObjectStore())
        assert torch.equal(p.host_runner([x])[0], alone.host_runner([x])[0])


def test_a_tensor_lives_while_a_program_uses_it(family: list[ModelSpec]) -> None:
    import gc

    store = ObjectStore()
    progs = [load_program(s, store) for s in family]
    held = len(store)
    progs.pop()
    gc.collect()
    assert len(store) == held - 2  # its head's weight and bias went; the backbone is still used
    progs.clear()
    gc.collect()
    assert len(store) == 0


def test_a_new_version_shares_its_unchanged_tensors(family: list[ModelSpec], tmp_path: Path) -> None:
    spec = family[0]
    store = ObjectStore()
    old = load_program(spec, store)
    state = torch.export.load(str(spec.path)).state_dict
    model = variants.Variant(variants.Backbone(), torch.nn.Linear(variants.HIDDEN[-1], spec.outputs[0].sample_shape[0]))
    model.load_state_dict(state)
    with torch.no_grad():
        model.head.bias.add_(1.0)  # version 2: the head's bias changed
    repo = tmp_path / "repo"
    (repo / spec.name).mkdir(parents=True)
    (repo / spec.name / "config.toml").write_text((spec.path.parent.parent / "config.toml").read_text())
    save_model(model, "pt2", torch.zeros((2, 64)), spec.max_batch_size, repo / spec.name / "2" / "model.pt2")
    new = load_program(scan(repo).models[0], store)
    changed = set(new.cids) - set(old.cids)
    assert len(changed) == 1 and len(store) == len(set(old.cids)) + 1


def _rig(budget: int) -> CpuBackend:
    return CpuBackend(Device("cpu:0", "cpu", 0, budget))


def test_a_cpu_device_loads_only_the_blocks_it_lacks(family: list[ModelSpec]) -> None:
    store = ObjectStore()
    a, b, c = (load_program(s, store) for s in family)
    head_b = sum(n for cid, n in b.blocks if cid not in set(a.cids))
    be = _rig(a.block_bytes + head_b)  # room for a and b's head, not for a second backbone
    ra, _ = be.load("a", a, float("inf"))
    assert ra.charged == a.block_bytes == be.used
    rb, _ = be.load("b", b, float("inf"))
    assert rb.charged == head_b and be.used == a.block_bytes + head_b
    x = _x()
    for res, spec in ((ra, family[0]), (rb, family[1])):
        got = res.runner([x])[0]
        assert torch.equal(got, load_program(spec, ObjectStore()).host_runner([x])[0])
    be.unload(ra)
    assert ra.charged == a.block_bytes - sum(n for cid, n in a.blocks if cid in set(b.cids))  # a's head only
    assert torch.equal(rb.runner([x])[0], load_program(family[1], ObjectStore()).host_runner([x])[0])
    rc, _ = be.load("c", c, float("inf"))  # fits where a's head was
    be.unload(rb)
    be.unload(rc)
    assert be.used == 0 and not be.blocks


def _program(family: list[ModelSpec]) -> Program:
    return load_program(family[0], ObjectStore())


def test_the_packed_block_for_cuda_is_made_only_when_asked(family: list[ModelSpec]) -> None:
    p = _program(family)
    assert p.packed is None
    block = p.host_block
    assert p.packed is block and block.numel() == p.weight_bytes
    views = p.layout.views(block)
    assert all(torch.equal(v, t) for v, t in zip(views, p.host_tensors, strict=True))
