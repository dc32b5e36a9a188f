"""Which weights are where: each device's weight budget as an LRU cache the controller accounts.

Bytes are reserved when a LOAD is issued and released when an UNLOAD is issued, so the
controller never plans past a budget; executors check the same budget and refuse a LOAD that
would exceed it.

A model may name its weights as content-addressed blocks (`Blocks`: one per distinct tensor,
runtime/objstore.py). On a device that shares blocks, a block held by several models is
counted once: a LOAD charges only the blocks the device lacks, and an UNLOAD or eviction frees
only the blocks no other placed model holds. Bytes of a model outside its blocks (IO buffers)
are its own. A model placed without blocks is one private block, as before sharing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from enum import IntEnum
from typing import Final

Blocks = tuple[tuple[str, int], ...]  # a model's distinct weight blocks: (content id, bytes)
_NONE: Final[frozenset[str]] = frozenset()


class Residency(IntEnum):
    LOADING = 1
    READY = 2


class EvictionRules:
    """The rules of one victim search: which placed models have work (`wanted`) and which it may
    unload (`evictable`). A policy passes a subclass of its own: compiled, each is a direct call,
    where a closure passed as a callable was a generic call with its arguments boxed for every
    model a search looked at (~1,000 instructions each, ~20 per search at 10,000 models)."""

    def wanted(self, key: str) -> bool:
        return False

    def evictable(self, key: str) -> bool:
        return True

    def evictable_idle(self, key: str) -> bool:
        """`evictable` for a model `wanted` said no to (a search asks `wanted` first: a policy may
        skip asking again)."""
        return self.evictable(key)

    def idle_victim(self, key: str) -> bool:
        """Whether `key` is wanted by nobody and `evictable_idle`: one call, so that a policy can ask
        first whichever test refuses more (under copy pressure most models a search meets are
        refused for their cold cost, not for their work)."""
        return not self.wanted(key) and self.evictable_idle(key)


class CallableRules(EvictionRules):
    """Rules from two callables (tests, and searches too rare to need their own class)."""

    def __init__(self, evictable: Callable[[str], bool], wanted: Callable[[str], bool]) -> None:
        self._evictable = evictable
        self._wanted = wanted

    def wanted(self, key: str) -> bool:
        return self._wanted(key)

    def evictable(self, key: str) -> bool:
        return self._evictable(key)


class _Placed:
    """A model placed on a device: its state, whole footprint, when it was last placed, loaded or
    used (a tick of the device's clock: the LRU order), and its size class once ready. One record
    a model, read and updated in place: an INFER's touch is one look-up, where keeping a dict in
    LRU order was a delete and an insert in it (two look-ups of a model used seconds ago, each a
    cache miss at 10,000 models)."""

    __slots__ = ("cls", "nbytes", "state", "tick")

    def __init__(self, state: Residency, nbytes: int, tick: int) -> None:
        self.state = state
        self.nbytes = nbytes
        self.tick = tick
        self.cls: dict[str, int] | None = None


class DeviceMemory:
    def __init__(self, budget: int, shares: bool = True) -> None:
        self.budget = budget
        self.used = 0
        # Whether this device's backend keeps a block shared by several models once (the CPU
        # backend keeps each tensor's once; the CUDA arena a plan's shared leading stage, the one
        # block its models name there: ModelEntry.blocks_on).
        self.shares = shares
        self._blocks_of: dict[str, Blocks] = {}  # placed models that have shared blocks
        self._private: dict[str, int] = {}  # their bytes outside blocks
        self._refs: dict[str, int] = {}  # block -> placed models holding it
        # Placed models, in no useful order: the LRU order is their ticks' (`_lru`).
        self._models: dict[str, _Placed] = {}
        # Ready models by size class (bit length of their bytes), each in LRU order, with when each
        # was last used (a tick of `_clock`): the least recently used model that frees enough alone
        # is found by looking at the head of a few classes, not by walking hundreds of smaller
        # models. (The tick is the class's value, not a dict of its own: a victim search reads it
        # for every model it meets, and every INFER sets it.)
        self._by_size: dict[int, dict[str, int]] = {}
        # per class, a bound of its footprints (its largest so far, not lowered when that one
        # leaves): a class none of whose models frees enough is passed over without a look at each
        self._class_max: dict[int, int] = {}
        self._clock = 0
        # models with shared blocks placed or released so far: what a model lacks here, and what a
        # victim frees, may have changed (a policy's remembered search reads it)
        self.shared_changes = 0

    @property
    def free(self) -> int:
        return self.budget - self.used

    def state(self, key: str) -> Residency | None:
        rec = self._models.get(key)
        return rec.state if rec is not None else None

    def is_ready(self, key: str) -> bool:
        rec = self._models.get(key)
        return rec is not None and rec.state == Residency.READY

    def _lru(self) -> list[tuple[str, _Placed]]:
        """Placed models, least recently used first (sorted: asked on rare paths, not per request)."""
        return sorted(self._models.items(), key=_tick_of)

    def _ready_by_age(self) -> Iterator[str]:
        """Ready models, least recently used first: the size classes (each in LRU order) merged,
        lazily, since a victim walk stops at the first models that free enough (sorting every
        placed model for it cost ~100k instructions a walk at 1,250 models a device)."""
        iters: list[Iterator[tuple[str, int]]] = []
        keys: list[str] = []
        ticks: list[int] = []
        for cls in self._by_size.values():
            it = iter(cls.items())
            first = next(it, None)
            if first is not None:
                iters.append(it)
                keys.append(first[0])
                ticks.append(first[1])
        while iters:
            i = 0
            oldest = ticks[0]
            for j in range(1, len(ticks)):
                if ticks[j] < oldest:
                    oldest, i = ticks[j], j
            yield keys[i]
            nxt = next(iters[i], None)
            if nxt is None:
                del iters[i], keys[i], ticks[i]
            else:
                keys[i], ticks[i] = nxt

    def models(self) -> list[str]:
        """Placed models, least recently used first."""
        return [k for k, _ in self._lru()]

    def ready_models(self) -> list[str]:
        """Ready models, least recently used first."""
        return [k for k, rec in self._lru() if rec.state == Residency.READY]

    def missing(self, nbytes: int, blocks: Blocks = ()) -> int:
        """Bytes a model of `nbytes` with `blocks` would add here now: what the device lacks."""
        if not blocks or not self.shares:
            return nbytes
        refs = self._refs
        return nbytes - sum(n for b, n in blocks if b in refs)

    def present(self, blocks: Blocks) -> frozenset[str]:
        """Those of `blocks` the device holds now (a LOAD of their model reuses them)."""
        if not blocks or not self.shares:
            return _NONE  # (one empty set, not a new one: asked per device each time a LOAD is planned)
        return frozenset(b for b, _ in blocks if b in self._refs)

    def reserve(self, key: str, nbytes: int, blocks: Blocks = ()) -> int:
        """Place `key` (LOADING); returns the bytes charged (only the blocks the device lacked)."""
        if key in self._models:
            raise ValueError(f"{key} is already placed")
        charge = self.missing(nbytes, blocks)
        if charge > self.free:
            raise ValueError(f"{key} needs {charge} bytes, {self.free} free")
        self._clock += 1
        self._models[key] = _Placed(Residency.LOADING, nbytes, self._clock)
        if blocks and self.shares:
            self.shared_changes += 1
            self._blocks_of[key] = blocks
            self._private[key] = nbytes - sum(n for _, n in blocks)
            for b, _ in blocks:
                self._refs[b] = self._refs.get(b, 0) + 1
        self.used += charge
        return charge

    def loaded(self, key: str) -> None:
        rec = self._models[key]
        nbytes = rec.nbytes
        bits = nbytes.bit_length()
        cls = self._by_size.get(bits)
        if cls is None:
            cls = self._by_size[bits] = {}
        self._clock += 1
        rec.state, rec.tick, rec.cls = Residency.READY, self._clock, cls  # (most recently used)
        cls[key] = self._clock
        if nbytes > self._class_max.get(bits, 0):
            self._class_max[bits] = nbytes

    def size(self, key: str) -> int:
        """A placed model's whole footprint, its shared blocks included."""
        return self._models[key].nbytes

    def blocks_of(self, key: str) -> Blocks:
        """A placed model's shared weight blocks (none if it shares nothing)."""
        return self._blocks_of.get(key, ())

    def own(self, key: str) -> int:
        """Bytes an UNLOAD of `key` alone would free: its blocks no other placed model holds."""
        blocks = self._blocks_of.get(key)
        if blocks is None:
            return self._models[key].nbytes
        refs = self._refs
        return self._private[key] + sum(n for b, n in blocks if refs[b] == 1)

    def release(self, key: str) -> int:
        """Unplace `key`; returns the bytes freed."""
        rec = self._models.pop(key)
        nbytes = rec.nbytes
        blocks = self._blocks_of.pop(key, None)
        if blocks is not None:
            self.shared_changes += 1
            freed = self._private.pop(key)
            refs = self._refs
            for b, n in blocks:
                if refs[b] == 1:
                    del refs[b]
                    freed += n
                else:
                    refs[b] -= 1
        else:
            freed = nbytes
        self.used -= freed
        cls = rec.cls
        if cls is not None:  # (ready)
            del cls[key]
            if not cls:
                del self._by_size[nbytes.bit_length()]
                self._class_max.pop(nbytes.bit_length(), None)  # (a class of 0-byte models has no max)
        return freed

    def retire(self) -> None:
        """The device is lost: it holds nothing and has room for nothing from now on."""
        self._models.clear()
        self._blocks_of.clear()
        self._private.clear()
        self._refs.clear()
        self._by_size.clear()
        self._class_max.clear()
        self.used = 0
        self.budget = 0

    def touch(self, key: str) -> None:
        rec = self._models.get(key)
        if rec is not None:
            self._clock += 1
            rec.tick = self._clock  # (most recently used)
            cls = rec.cls
            if cls is not None:  # (ready: to the end of its class, which is kept in LRU order)
                del cls[key]
                cls[key] = self._clock

    def victims(self, nbytes: int, rules: EvictionRules, keep: Collection[str] = (),
                among: Collection[str] | None = None) -> list[str] | None:
        """Ready models to unload so that `nbytes` fit, or None if they cannot fit.

        Least recently used among those nobody wants (nothing queued) first, then least recently
        used among the rest. When one model nobody wants frees enough on its own, the least
        recently used such model goes alone, rather than many small models as collateral.
        A victim frees only its blocks no other placed model holds, nor any in `keep` (the
        blocks the model to be loaded reuses: `nbytes` counts them as present). `among`: the
        only models `rules.evictable` may accept, if the caller knows them (the answer is the same,
        found without asking every model on the device).
        """
        if nbytes > self.budget:
            return None
        need = nbytes - self.free
        if need <= 0:
            return []
        if among is not None:
            return self._victims_among(need, among, rules, keep)
        alone = self._alone(need, rules, keep)
        if alone is not None:
            return [alone]
        # Else the least recently used idle models until enough is free, then those in demand.
        # (`wanted` first: the cheaper test, and a policy's `evictable` may weigh each one's
        # demand; a model in demand is asked only when one is needed)
        dropped: dict[str, int] = {}
        chosen: list[str] = []
        in_demand: list[str] = []
        for k in self._ready_by_age():
            if rules.wanted(k):
                in_demand.append(k)
            elif rules.evictable_idle(k):
                chosen.append(k)
                need -= self._frees(k, dropped, keep)
                if need <= 0:
                    return chosen
        return self._then_in_demand(chosen, in_demand, need, dropped, rules, keep)

    def _victims_among(self, need: int, among: Collection[str], rules: EvictionRules,
                       keep: Collection[str]) -> list[str] | None:
        """`victims` when every model `rules.evictable` accepts is in `among`: the same choice."""
        models = self._models
        order = sorted([(rec.tick, k) for k in among if (rec := models.get(k)) is not None
                        and rec.cls is not None])  # the ready ones, LRU first
        idle: list[str] = []
        in_demand: list[str] = []
        for _, k in order:
            if rules.wanted(k):
                in_demand.append(k)
            elif rules.evictable_idle(k):
                if self._frees(k, {}, keep) >= need:
                    return [k]  # (the least recently used that frees enough alone, as _alone)
                idle.append(k)
        dropped: dict[str, int] = {}
        chosen: list[str] = []
        for k in idle:
            chosen.append(k)
            need -= self._frees(k, dropped, keep)
            if need <= 0:
                return chosen
        return self._then_in_demand(chosen, in_demand, need, dropped, rules, keep)

    def _then_in_demand(self, chosen: list[str], in_demand: list[str], need: int, dropped: dict[str, int],
                        rules: EvictionRules, keep: Collection[str]) -> list[str] | None:
        """Models in demand, least recently used first, after the idle `chosen` freed too little."""
        for k in in_demand:
            if rules.evictable(k):
                chosen.append(k)
                need -= self._frees(k, dropped, keep)
                if need <= 0:
                    return chosen
        return None

    def _frees(self, key: str, dropped: dict[str, int], keep: Collection[str]) -> int:
        return self._models[key].nbytes if key not in self._blocks_of else self._frees_with(key, dropped, keep)

    def _frees_with(self, key: str, dropped: dict[str, int], keep: Collection[str]) -> int:
        """Bytes unloading `key` frees beside the models already counted in `dropped` (block ->
        its holders chosen so far, updated)."""
        freed = self._private[key]
        refs = self._refs
        for b, n in self._blocks_of[key]:
            c = dropped.get(b, 0) + 1
            dropped[b] = c
            if c == refs[b] and b not in keep:
                freed += n
        return freed

    def _alone(self, need: int, rules: EvictionRules, keep: Collection[str]) -> str | None:
        """The least recently used ready model nobody wants that frees `need` bytes on its own."""
        best: str | None = None
        best_at = 0
        class_max = self._class_max
        blocks_of = self._blocks_of
        models = self._models
        by_size = self._by_size
        # Classes whose models may free enough, by when their least recently used model was used,
        # oldest first: once a class has an answer, a class whose every model was used later is
        # passed over, and a walk stops at the first model used later (each class is in LRU order).
        # Under copy pressure most models a walk meets are refused, so this is most of its work.
        heads: list[int] = []
        classes: list[int] = []
        for bits, cls in by_size.items():
            if (1 << bits) <= need or class_max[bits] < need:
                continue  # every model of this class is smaller than need (and frees at most its size)
            for at in cls.values():
                i = len(heads)
                heads.append(at)
                classes.append(bits)
                while i > 0 and heads[i - 1] > at:  # (insertion: a handful of classes)
                    heads[i], classes[i] = heads[i - 1], classes[i - 1]
                    i -= 1
                heads[i], classes[i] = at, bits
                break
        for bits in classes:
            # Every model of a class holds at least 2**(bits - 1) bytes: where that is enough, one
            # that shares nothing frees enough without a look at its size (a search meets ~30
            # models, most in such classes).
            fits = bits > 0 and (1 << (bits - 1)) >= need
            for k, at in by_size[bits].items():  # least recently used first: its first fit is the class's answer
                if best is not None and at >= best_at:
                    break  # (the rest of the class was used later still: none can be the answer)
                if blocks_of and k in blocks_of:
                    if self._frees_with(k, {}, keep) < need:
                        continue
                elif not fits and models[k].nbytes < need:
                    continue
                if rules.idle_victim(k):
                    best, best_at = k, at
                    break
        return best


def _tick_of(item: tuple[str, _Placed]) -> int:
    return item[1].tick
