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

    def release(self, key: str) -> int:
        _, nbytes = self._models.pop(key)
        self.used -= nbytes
        return nbytes

    def retire(self) -> None:
        """The device is lost: it holds nothing and has room for nothing from now on."""
        self._models.clear()
        self.used = 0
        self.budget = 0

    def touch(self, key: str) -> None:
        if key in self._models:
            self._models.move_to_end(key)

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
        # In LRU order, lazily: the first idle model that frees enough alone ends the search
        # (usually after a few models, however many the device holds).
        idle: list[str] = []
        in_demand: list[str] = []
        for k, (s, n) in self._models.items():
            if s != Residency.READY or not evictable(k):
                continue
            if wanted(k):
                in_demand.append(k)
            elif n >= need:
                return [k]
            else:
                idle.append(k)
        chosen: list[str] = []
        for k in idle + in_demand:
            chosen.append(k)
            need -= self._models[k][1]
            if need <= 0:
                return chosen
        return None
