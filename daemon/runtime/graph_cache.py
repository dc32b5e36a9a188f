"""CUDA graphs kept after an UNLOAD, for the next LOAD of the same structure into the same place.

A CUDA graph replays fixed kernels on fixed addresses. A model's graphs read its weights and its
static inputs and outputs from its extent of the arena (runtime/cuda.py), so the graphs captured
for one model serve every model with the same structure (code, weight layout, shapes: `Program.
structure`) that is loaded at the same offset: that LOAD is the weight copy alone, as Clockwork's
is, not warm-up runs and one capture per batch size (tens of ms for a ResNet on an H100, against
about one for its weights). First-fit placement of equal-sized models lands them on the offsets
their predecessors left, so a working set that cycles through a few extents finds its graphs.

Pure bookkeeping, no device calls: the backend closes what `park` and `clear` hand back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from daemon.runtime.devapi import Event, Graph


class Retargetable:
    """The kernel a graph is captured from, re-pointed at the eager step of each model that reuses
    it. A CUDA replay never calls it (its kernels are baked into the graph); the CPU stand-in replays
    by calling it, so it must run the current holder's step, over the same addresses."""

    __slots__ = ("__name__", "target")

    def __init__(self, target: Callable[[], None]) -> None:
        self.target = target
        self.__name__ = getattr(target, "__name__", "kernel")

    def __call__(self) -> None:
        self.target()


def _parked() -> None:
    raise RuntimeError("a parked graph's kernel ran before a model took it")


StageKey = tuple[int, int]  # (0: the shared first stage, 1: the stages after it; batch size)


@dataclass
class GraphSet:
    """One model's graphs, by batch size, with their timing events and retargetable kernels; and
    for a plan whose first stage is shared, a graph per stage part and batch size (cross-model
    batches replay the first stage's of one member and each member's rest)."""

    graphs: dict[int, Graph] = field(default_factory=dict)
    timing: dict[int, tuple[Event, Event]] = field(default_factory=dict)
    kernels: dict[int, Retargetable] = field(default_factory=dict)
    stages: dict[StageKey, Graph] = field(default_factory=dict)
    stage_kernels: dict[StageKey, Retargetable] = field(default_factory=dict)

    def retarget(self, steps: dict[int, Callable[[], None]],
                 stage_steps: dict[StageKey, Callable[[], None]] | None = None) -> None:
        for b, k in self.kernels.items():
            k.target = steps[b]
        for sk, k in self.stage_kernels.items():
            k.target = (stage_steps or {})[sk]

    def detach(self) -> None:
        """Drop the last holder's steps (and through them its runner and views) while parked."""
        for k in (*self.kernels.values(), *self.stage_kernels.values()):
            k.target = _parked

    def close(self) -> None:
        for g in (*self.graphs.values(), *self.stages.values()):
            g.close()
        self.graphs.clear()
        self.timing.clear()
        self.kernels.clear()
        self.stages.clear()
        self.stage_kernels.clear()


Key = tuple[str, int, int]  # (structure, extent offset, extent bytes)


class GraphCache:
    """Parked graph sets by (structure, offset, bytes), least recently parked evicted past `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._sets: OrderedDict[Key, GraphSet] = OrderedDict()
        self.hits = 0  # LOADs that took parked graphs
        self.misses = 0  # LOADs of a cacheable structure that captured their own
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sets)

    def take(self, structure: str, offset: int, nbytes: int) -> GraphSet | None:
        if not structure:
            return None
        found = self._sets.pop((structure, offset, nbytes), None)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def park(self, structure: str, offset: int, nbytes: int, graphs: GraphSet) -> list[GraphSet]:
        """Keep `graphs`; what no longer fits (or was parked for the same place before) comes back
        to be closed."""
        if not structure or self.capacity <= 0 or not graphs.graphs:
            return [graphs]
        graphs.detach()
        out: list[GraphSet] = []
        old = self._sets.pop((structure, offset, nbytes), None)
        if old is not None:
            out.append(old)
        self._sets[(structure, offset, nbytes)] = graphs
        while len(self._sets) > self.capacity:
            out.append(self._sets.popitem(last=False)[1])
            self.evicted += 1
        return out

    def clear(self) -> list[GraphSet]:
        out = list(self._sets.values())
        self._sets.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return {"parked": len(self._sets), "hits": self.hits, "misses": self.misses, "evicted": self.evicted}


def structure_of(codes: Sequence[str], layout: object, spec_shapes: object) -> str:
    """A digest naming what a graph's kernels depend on, beside addresses: equal means interchangeable."""
    h = hashlib.sha256()
    for c in codes:
        h.update(c.encode())
        h.update(b"\0")
    h.update(repr(layout).encode())
    h.update(repr(spec_shapes).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()
