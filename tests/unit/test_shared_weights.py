"""Weights shared between models: the memory map counts a shared block once, LOADs copy (and
are charged) only what a device lacks, evictions free only what nobody else holds."""

from __future__ import annotations

import random

import pytest

from daemon.actions import ActionKind
from daemon.config import ControllerSettings
from daemon.controller.memory import CallableRules, DeviceMemory, Residency
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.scheduler import Scheduler
from daemon.runtime.devices import Device
from tests.unit.harness import MS, Harness, make_spec

BACKBONE = ("bb", 600)


def variant(head: str, n: int = 50) -> tuple[tuple[str, int], ...]:
    return (BACKBONE, (head, n))


def test_a_shared_block_is_charged_once_and_freed_with_its_last_holder() -> None:
    m = DeviceMemory(1000)
    assert m.reserve("a", 650, variant("ha")) == 650
    assert m.missing(650, variant("hb")) == 50
    assert m.reserve("b", 650, variant("hb")) == 50
    assert m.used == 700
    m.loaded("a")
    m.loaded("b")
    assert m.own("a") == 50 and m.own("b") == 50
    assert m.release("a") == 50  # the backbone stays: b holds it
    assert m.own("b") == 650
    assert m.release("b") == 650
    assert m.used == 0


def test_private_bytes_beside_blocks_are_the_models_own() -> None:
    m = DeviceMemory(1000)
    assert m.reserve("a", 700, variant("ha")) == 700  # 50 bytes of IO buffers beside its blocks
    assert m.reserve("b", 700, variant("hb")) == 100
    assert m.release("b") == 100


def test_a_device_that_does_not_share_charges_every_model_in_full() -> None:
    m = DeviceMemory(2000, shares=False)
    m.reserve("a", 650, variant("ha"))
    assert m.missing(650, variant("hb")) == 650
    assert m.reserve("b", 650, variant("hb")) == 650
    assert m.release("a") == 650


def test_eviction_counts_what_a_victim_really_frees() -> None:
    m = DeviceMemory(850)
    for k in ("a", "b"):
        m.reserve(k, 650, variant(f"h{k}"))
        m.loaded(k)
    m.reserve("x", 50)
    m.loaded("x")
    # 100 free; loading 200 unshared bytes needs 100 more. a alone frees only its head (50), so
    # the least recently used walk takes a, then b (whose release frees b's head and the backbone).
    assert m.victims(200, CallableRules(lambda k: k != "x", lambda k: False)) == ["a", "b"]
    # x frees 50 alone; a and x together free 100
    assert m.victims(200, CallableRules(lambda k: k != "b", lambda k: False)) == ["a", "x"]


def test_blocks_the_newcomer_reuses_are_not_counted_as_freed() -> None:
    m = DeviceMemory(700)
    m.reserve("a", 650, variant("ha"))
    m.loaded("a")
    new = variant("hc", 100)
    need = m.missing(700, new)
    assert need == 100  # the backbone is there
    # evicting a frees its head only: the backbone stays for the newcomer
    assert m.victims(need, CallableRules(lambda k: True, lambda k: False), keep=m.present(new)) == ["a"]
    assert m.victims(need + 1, CallableRules(lambda k: True, lambda k: False), keep=m.present(new)) is None


def _frees(m: DeviceMemory, chosen: list[str], keep: frozenset[str]) -> int:
    """What releasing `chosen` together frees, less the blocks in `keep`: released on a copy (its
    models placed again from what `m` says of each; residency does not change what they hold)."""
    c = DeviceMemory(m.budget)
    for k in m.models():
        c.reserve(k, m.size(k), m.blocks_of(k))
    assert c.used == m.used
    for k in chosen:
        c.release(k)
    size = {b: n for k in chosen for b, n in m.blocks_of(k)}
    kept = sum(n for b, n in size.items() if b in keep and b not in c.present(tuple(size.items())))
    return m.used - c.used - kept


def _walk(m: DeviceMemory, nbytes: int, evictable, wanted, keep: frozenset[str]) -> list[str] | None:  # noqa: ANN001
    """The eviction rule as a plain walk in LRU order, each candidate set measured by releasing it."""
    if nbytes > m.budget:
        return None
    need = nbytes - m.free
    if need <= 0:
        return []
    idle, in_demand = [], []
    for k in m.models():
        if not m.is_ready(k) or not evictable(k):
            continue
        if wanted(k):
            in_demand.append(k)
        else:
            idle.append(k)
    for k in idle:
        if _frees(m, [k], keep) >= need:
            return [k]
    chosen: list[str] = []
    for k in idle + in_demand:
        chosen.append(k)
        if _frees(m, chosen, keep) >= need:
            return chosen
    return None


def test_victims_with_shared_blocks_match_releasing_each_candidate_set() -> None:
    """Random histories of models sharing a few blocks: the victims found incrementally free what
    releasing them really frees, chosen by the same least-recently-used rule."""
    for seed in range(30):
        rng = random.Random(seed)
        m = DeviceMemory(5000)
        blocks = [(f"b{i}", rng.choice([100, 400, 900])) for i in range(6)]
        keys = [f"m{i}" for i in range(25)]
        shapes = {k: tuple(rng.sample(blocks, rng.randint(0, 3))) for k in keys}
        for _ in range(200):
            op = rng.random()
            placed = m.models()
            if op < 0.4:
                k = rng.choice(keys)
                private = rng.choice([0, 30, 250])
                total = private + sum(n for _, n in shapes[k])
                if m.state(k) is None and m.missing(total, shapes[k]) <= m.free:
                    m.reserve(k, total, shapes[k])
                    if rng.random() < 0.9:
                        m.loaded(k)
            elif op < 0.5 and placed:
                k = rng.choice(placed)
                if m.state(k) == Residency.LOADING:
                    m.loaded(k)
            elif op < 0.7 and placed:
                m.touch(rng.choice(placed))
            elif op < 0.8 and placed:
                m.release(rng.choice(placed))
            else:
                busy = set(rng.sample(keys, 4))
                hot = set(rng.sample(keys, 6))
                keep = m.present(tuple(rng.sample(blocks, rng.randint(0, 2))))
                nbytes = rng.randint(1, 3000)
                got = m.victims(nbytes, CallableRules(lambda k, b=busy: k not in b, lambda k, h=hot: k in h),
                                keep=keep)
                want = _walk(m, nbytes, lambda k, b=busy: k not in b, lambda k, h=hot: k in h, keep)
                assert got == want, (seed, nbytes)
                among = [k for k in keys if k not in busy or rng.random() < 0.3]
                assert m.victims(nbytes, CallableRules(lambda k, b=busy: k not in b, lambda k, h=hot: k in h),
                                 keep=keep, among=rng.sample(among, len(among))) == want, (seed, nbytes)
                if got:
                    assert _frees(m, got, keep) >= nbytes - m.free
        # every block placed counts once, and each model's bytes outside its blocks once
        assert m.used == sum(n for b, n in blocks if b in m.present(tuple(blocks))) + sum(
            m.size(k) - sum(n for _, n in m.blocks_of(k)) for k in m.models())


@pytest.mark.parametrize("policy", ["dynamic", "clockwork"])
def test_a_variant_whose_backbone_is_resident_loads_only_its_head(policy: str) -> None:
    h = Harness(budget=1000, policy=ClockworkPolicy() if policy == "clockwork" else None)
    a, b = make_spec("a"), make_spec("b")
    for spec in (a, b):
        h.sched.add_model(spec, 650, {1: 1 * MS, 8: 8 * MS}, "cpu", blocks=variant(f"h{spec.name}"))
        h.sched.estimator.observe_load(spec.key, "cpu", 0.013)  # a full LOAD: 650 bytes in 13 ms
    h.use(a)
    dev = h.sched.devices["cpu:0"]
    assert dev.memory.used == 650
    h.request(b, timeout=1.0)
    loads = [x for x in h.step() if x.kind == ActionKind.LOAD]
    assert [x.model.key for x in loads] == [b.key]
    assert dev.memory.used == 700  # its head only
    assert loads[0].expected_duration == pytest.approx(0.013 * 50 / 650)  # the copy scales with the bytes


def test_eviction_of_a_variant_keeps_the_backbone_its_successor_shares() -> None:
    """Room for a third variant is made by evicting one head, not by reloading the backbone."""
    h = Harness(budget=720)
    specs = [make_spec(n) for n in ("a", "b", "c")]
    for s in specs:
        h.sched.add_model(s, 650, {1: 1 * MS, 8: 8 * MS}, "cpu", blocks=variant(f"h{s.name}"))
    h.use(specs[0])
    h.use(specs[1])
    dev = h.sched.devices["cpu:0"]
    assert dev.memory.used == 700
    h.request(specs[2], timeout=1.0)
    acts = h.step()
    assert [(x.kind, x.model.name) for x in acts] == [(ActionKind.UNLOAD, "a"), (ActionKind.LOAD, "c")]
    assert dev.memory.used == 700  # the backbone stayed; c's head replaced a's


@pytest.mark.parametrize("kind", ["cpu", "emucuda"])
def test_a_device_counts_shared_weights_as_its_backend_holds_them(kind: str) -> None:
    """A CPU device holds each shared tensor block once; a CUDA device holds a plan's shared leading
    stage once, as one block (runtime/cuda.py), and a model without one in full."""
    sched = Scheduler([Device(f"{kind}:0", kind, 0, 5000)], DynamicBatchingPolicy(0.0), ControllerSettings())
    stage = (("stage:bb", 640),)
    for name in ("a", "b"):
        sched.add_model(make_spec(name), 700, {1: 1 * MS}, kind, blocks=variant(f"h{name}"), prefix="bb",
                        stage_blocks=stage)
    sched.add_model(make_spec("c"), 700, {1: 1 * MS}, kind, blocks=variant("hc"))  # no shared stage
    dev = sched.devices[f"{kind}:0"]
    entry = sched.models["a:1"]
    assert entry.blocks_on(kind) == (variant("ha") if kind == "cpu" else stage)
    for key in ("a:1", "b:1", "c:1"):
        assert sched.preload(key, 1, 0.0) == [f"{kind}:0"]
    # cpu: the backbone block (600) once, every head and private byte per model; CUDA: the stage
    # (640) once, each plan's 60 bytes of its own, c (whose stage is unknown there) whole
    assert dev.memory.used == (700 + 100 + 100 if kind == "cpu" else 700 + 60 + 700)
