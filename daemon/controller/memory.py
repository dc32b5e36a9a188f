"""Which weights are where: each device's weight budget as an LRU cache the controller accounts.

Bytes are reserved when a LOAD is issued and released when an UNLOAD is issued, so the
controller never plans past a budget; executors check the same budget and refuse a LOAD that
would exceed it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from enum import IntEnum


class Residency(IntEnum):
    LOADING = 1
    READY = 2


class DeviceMemory:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._models: OrderedDict[str, tuple[Residency, int]] = OrderedDict()  # LRU first
        # Ready models by size class (bit length of their bytes), each in LRU order, and when each
        # was last used: the least recently used model that frees enough alone is found by looking
        # at the head of a few classes, not by walking hundreds of smaller models.
        self._by_size: dict[int, OrderedDict[str, None]] = {}
        self._used_at: dict[str, int] = {}
        self._clock = 0

    @property
    def free(self) -> int:
        return self.budget - self.used

    def state(self, key: str) -> Residency | None:
        entry = self._models.get(key)
        return entry[0] if entry else None

    def is_ready(self, key: str) -> bool:
        entry = self._models.get(key)
        return entry is not None and entry[0] == Residency.READY

    def models(self) -> list[str]:
        return list(self._models)

    def ready_models(self) -> list[str]:
        return [k for k, (s, _) in self._models.items() if s == Residency.READY]

    def reserve(self, key: str, nbytes: int) -> None:
        if key in self._models:
            raise ValueError(f"{key} is already placed")
        if nbytes > self.free:
            raise ValueError(f"{key} needs {nbytes} bytes, {self.free} free")
        self._models[key] = (Residency.LOADING, nbytes)
        self.used += nbytes

    def loaded(self, key: str) -> None:
        _, nbytes = self._models[key]
        self._models[key] = (Residency.READY, nbytes)
        self._models.move_to_end(key)
        self._by_size.setdefault(nbytes.bit_length(), OrderedDict())[key] = None
        self._used(key)

    def _used(self, key: str) -> None:
        self._clock += 1
        self._used_at[key] = self._clock

    def release(self, key: str) -> int:
        state, nbytes = self._models.pop(key)
        self.used -= nbytes
        if state == Residency.READY:
            cls = self._by_size[nbytes.bit_length()]
            del cls[key]
            if not cls:
                del self._by_size[nbytes.bit_length()]
            del self._used_at[key]
        return nbytes

    def retire(self) -> None:
        """The device is lost: it holds nothing and has room for nothing from now on."""
        self._models.clear()
        self._by_size.clear()
        self._used_at.clear()
        self.used = 0
        self.budget = 0

    def touch(self, key: str) -> None:
        entry = self._models.get(key)
        if entry is not None:
            self._models.move_to_end(key)
            if entry[0] == Residency.READY:
                self._by_size[entry[1].bit_length()].move_to_end(key)
                self._used(key)

    def victims(self, nbytes: int, evictable: Callable[[str], bool],
                wanted: Callable[[str], bool]) -> list[str] | None:
        """Ready models to unload so that `nbytes` fit, or None if they cannot fit.

        Least recently used among those nobody wants (nothing queued) first, then least recently
        used among the rest. When one model nobody wants frees enough on its own, the least
        recently used such model goes alone, rather than many small models as collateral.
        """
        if nbytes > self.budget:
            return None
        need = nbytes - self.free
        if need <= 0:
            return []
        alone = self._alone(need, evictable, wanted)
        if alone is not None:
            return [alone]
        # Else the least recently used idle models until enough is free, then those in demand.
        chosen: list[str] = []
        in_demand: list[str] = []
        for k, (s, n) in self._models.items():
            if s != Residency.READY or not evictable(k):
                continue
            if wanted(k):
                in_demand.append(k)
                continue
            chosen.append(k)
            need -= n
            if need <= 0:
                return chosen
        for k in in_demand:
            chosen.append(k)
            need -= self._models[k][1]
            if need <= 0:
                return chosen
        return None

    def _alone(self, need: int, evictable: Callable[[str], bool], wanted: Callable[[str], bool]) -> str | None:
        """The least recently used ready model nobody wants that frees `need` bytes on its own."""
        best: str | None = None
        best_at = 0
        for bits, cls in self._by_size.items():
            if (1 << bits) <= need:
                continue  # every model of this class is smaller than 2**bits
            for k in cls:  # least recently used first: its first fit is the class's answer
                if self._models[k][1] >= need and evictable(k) and not wanted(k):
                    at = self._used_at[k]
                    if best is None or at < best_at:
                        best, best_at = k, at
                    break
        return best
